// y[M, P * 32] = x[M, K] @ W, W packed as P panels [K, 32] (32 output columns each, k-major): a matrix product of
// few rows that streams each weight once, for XLA CPU (specjax/kernels/__init__.py builds and calls it).
//
// Up to eight rows and one panel (two vectors of 16 floats) at a time: every weight vector loaded feeds one fused
// multiply-add per row, into at most 16 accumulators held in registers; the panels are shared with XLA's intra-op
// threads. GCC vector extensions, which -march=native compiles to the host's widest vectors (AVX-512, or AVX2).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }
static inline void store(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }

// rows [0, R) of x times the panel `w` [K, 32]: y columns [0, 32) (R a constant: the accumulators stay in registers)
template <int R>
static void rows_by_panel(const float* x, int64_t k_len, const float* w, float* y, int64_t y_stride) {
  v16 lo[R] = {}, hi[R] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    const v16 w_lo = load(w + k * 32), w_hi = load(w + k * 32 + 16);
    __builtin_prefetch(w + (k + 32) * 32);  // both cache lines of the row 32 steps ahead: 4 KiB in flight
    __builtin_prefetch(w + (k + 32) * 32 + 16);
    for (int t = 0; t < R; ++t) {
      const float s = x[t * k_len + k];
      lo[t] += s * w_lo;
      hi[t] += s * w_hi;
    }
  }
  for (int t = 0; t < R; ++t) {
    store(y + t * y_stride, lo[t]);
    store(y + t * y_stride + 16, hi[t]);
  }
}

typedef void (*RowsByPanel)(const float*, int64_t, const float*, float*, int64_t);
static const RowsByPanel kRowsByPanel[9] = {nullptr,           rows_by_panel<1>, rows_by_panel<2>,
                                            rows_by_panel<3>, rows_by_panel<4>, rows_by_panel<5>,
                                            rows_by_panel<6>, rows_by_panel<7>, rows_by_panel<8>};

// The product's work, shared by the calling thread and the helpers it schedules on XLA's intra-op thread pool: each
// takes chunks of panels until none are left. The caller never waits for a chunk nobody has started (a helper that
// starts late finds none), so a busy pool only slows the product; the job lives as long as its last helper.
struct Job {
  const float *x, *w;
  float* y;
  int64_t m, k_len, panels, chunk;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};

  void run() {
    const int64_t n = panels * 32;
    for (int64_t first; (first = next.fetch_add(chunk)) < panels;) {
      const int64_t last = first + chunk < panels ? first + chunk : panels;
      for (int64_t p = first; p < last; ++p) {
        for (int64_t t0 = 0; t0 < m; t0 += 8) {
          const int64_t r = m - t0 < 8 ? m - t0 : 8;
          kRowsByPanel[r](x + t0 * k_len, k_len, w + p * k_len * 32, y + t0 * n + p * 32, n);
        }
      }
    }
  }
};

static ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 32 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("packed_matmul takes x [M, K] and w [P, K, 32]");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->m = xd[0];
  job->k_len = xd[1];
  job->panels = wd[0];
  const int64_t threads = pool.num_threads() > 1 ? pool.num_threads() : 1;
  job->chunk = std::max<int64_t>(1, job->panels / (4 * threads));
  for (int64_t i = 1; i < threads && i * job->chunk < job->panels; ++i) {
    pool.Schedule([job] {
      job->active.fetch_add(1);
      job->run();
      job->active.fetch_sub(1);
    });
  }
  job->run();
  while (job->active.load() > 0) {
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, packed_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
