// y[M, P * N] = x[M, K] @ W, W packed as P panels [K, N] (N = kPanel output columns each, k-major): a matrix product
// of few rows that streams each weight once, for XLA CPU (specjax/kernels/__init__.py builds and calls it).
//
// A block of rows and one panel at a time: every weight vector loaded feeds one fused multiply-add per row, into
// accumulators held in registers (as many rows as the host's vector registers hold: vec.h); the panels are shared
// with XLA's intra-op threads (pool.h).
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Two vectors per panel row (32 columns with AVX-512, 16 with AVX2). A block of kRegRows rows keeps its accumulators
// and the panel row's two weight vectors in registers, beside a row's value: 14 and 6 rows. One row more (kMaxRows)
// spills an accumulator, which beats a second pass for that one row. (With 32 columns an AVX2 host held 3 rows, and
// 8 rows took 3 passes over each panel: on a Zen 1 EPYC the expanded stories260K's 128 products chained took 25.4 /
// 34.3 ms at 4 / 8 rows, against 18.8 / 29.7 with 16 columns; docs/benchmarks.md.)
constexpr int kVecs = 2;
constexpr int kPanel = kVecs * kLanes;
constexpr int kRegRows = (kRegisters - 3) / kVecs;
constexpr int kMaxRows = kRegRows + 1;

extern "C" int SpecjaxPanel() { return kPanel; }  // the packed layout's panel width (specjax.kernels.pack)

// rows [0, R) of x times the panel `w` [K, kPanel]: y columns [0, kPanel) (R a constant: the accumulators stay in
// registers; the weights are the multiply-adds' memory operands)
template <int R>
static void rows_by_panel(const float* x, int64_t k_len, const float* w, float* y, int64_t y_stride) {
  vec acc[R][kVecs] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    const float* wk = w + k * kPanel;
    for (int line = 0; line < kPanel; line += 16) {  // the row's cache lines 4 KiB ahead
      __builtin_prefetch(wk + 1024 + line);
    }
    for (int t = 0; t < R; ++t) {
      const float s = x[t * k_len + k];
      for (int v = 0; v < kVecs; ++v) acc[t][v] += s * load(wk + v * kLanes);
    }
  }
  for (int t = 0; t < R; ++t) {
    for (int v = 0; v < kVecs; ++v) store(y + t * y_stride + v * kLanes, acc[t][v]);
  }
}

typedef void (*RowsByPanel)(const float*, int64_t, const float*, float*, int64_t);

template <int... R>
static constexpr std::array<RowsByPanel, sizeof...(R) + 1> table(std::integer_sequence<int, R...>) {
  return {nullptr, rows_by_panel<R + 1>...};
}
static constexpr auto kRowsByPanel = table(std::make_integer_sequence<int, kMaxRows>());

static ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("packed_matmul takes x [M, K] and w [P, K, SpecjaxPanel()]");
  }
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* ys = y->typed_data();
  const int64_t m = xd[0], k_len = xd[1], n = wd[0] * kPanel;
  // Rows in blocks of kRegRows, the last one what is left, a last one of one row joining the first. The first block
  // streams each panel from memory, the others find it in cache: the first is the largest, so that its multiply-adds
  // hide the most of the stream. (Zen 1, the products of a pass of the expanded stories260K at 8 rows: 6 + 2 took
  // 0.89-0.91 of equal blocks of 4, 7 + 1 0.95, 5 + 3 0.99; at 16 rows 6 + 6 + 4 took 0.96 of 6 + 5 + 5.)
  const int64_t lead = m > 1 && m % kRegRows == 1 ? kMaxRows : std::min<int64_t>(m, kRegRows);
  run_shared(pool, wd[0], 32, [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      for (int64_t t0 = 0, r = lead; t0 < m; t0 += r, r = std::min<int64_t>(kRegRows, m - t0)) {
        kRowsByPanel[r](xs + t0 * k_len, k_len, ws + p * k_len * kPanel, ys + t0 * n + p * kPanel, n);
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, packed_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
