// Work shared by an FFI handler's calling thread and helpers it schedules on XLA's intra-op thread pool: each takes
// chunks of [0, units) until none are left. The caller never waits for a chunk nobody has started (a helper that
// starts late finds none), so a busy pool only slows the work; the job lives as long as its last helper.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

struct PoolJob {
  std::function<void(int64_t, int64_t)> work;  // units [first, last)
  int64_t units, chunk, threads;  // chunk: the smallest
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};

  // guided: chunks of what is left / (2 x threads), at least `chunk`: large first, small last, so that the threads
  // finish within a small chunk of each other (a product of 8 rows of the expanded stories260K in chunks of an
  // eighth: the caller waited 8-15 us a call for the helper's last one, 5% of a pass)
  void run() {
    for (int64_t first = next.load(); first < units;) {
      const int64_t size = std::max(chunk, (units - first) / (2 * threads));
      if (next.compare_exchange_weak(first, first + size)) {
        work(first, std::min(first + size, units));
        first = next.load();
      }
    }
  }
};

// Runs work(first, last) over [0, units) in guided chunks no smaller than units / (chunks_per_thread x threads),
// returning when all are done.
static inline void run_shared(xla::ffi::ThreadPool& pool, int64_t units, int64_t chunks_per_thread,
                              std::function<void(int64_t, int64_t)> work) {
  auto job = std::make_shared<PoolJob>();
  job->work = std::move(work);
  job->units = units;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->chunk = std::max<int64_t>(1, units / (chunks_per_thread * threads));
  job->threads = threads;
  for (int64_t i = 1; i < threads && i * job->chunk < units; ++i) {
    pool.Schedule([job] {
      job->active.fetch_add(1);
      job->run();
      job->active.fetch_sub(1);
    });
  }
  job->run();
  while (job->active.load() > 0) {
  }
}
