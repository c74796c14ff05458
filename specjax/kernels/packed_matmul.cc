// y[M, P * N] = x[M, K] @ W, W packed as P panels [K, N] (N = kPanel output columns each, k-major): a matrix product
// of few rows that streams each weight once, for XLA CPU (specjax/kernels/__init__.py builds and calls it).
//
// A block of rows and one panel at a time: every weight vector loaded feeds one fused multiply-add per row, into
// accumulators held in registers (as many rows as the host's vector registers hold: vec.h); the panels are shared
// with XLA's intra-op threads (pool.h).
#include <array>
#include <cstdint>
#include <utility>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Two vectors per panel row (32 columns with AVX-512, 16 with AVX2): rows whose accumulators fit in registers, beside
// a row's value and a weight, 15 and 7. (With 32 columns an AVX2 host held 3 rows, and 8 rows took 3 passes over each
// panel: on a Zen 1 EPYC the expanded stories260K's 128 products chained took 25.4 / 34.3 ms at 4 / 8 rows, against
// 18.8 / 29.7 with 16 columns; docs/benchmarks.md.)
constexpr int kVecs = 2;
constexpr int kPanel = kVecs * kLanes;
constexpr int kMaxRows = (kRegisters - 2) / kVecs;

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
  const int64_t m = xd[0], k_len = xd[1], n = wd[0] * kPanel, blocks = (m + kMaxRows - 1) / kMaxRows;
  run_shared(pool, wd[0], 32, [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      for (int64_t b = 0, t0 = 0; b < blocks; ++b) {  // rows in blocks of equal size, at most kMaxRows
        const int64_t r = m / blocks + (b < m % blocks);
        kRowsByPanel[r](xs + t0 * k_len, k_len, ws + p * k_len * kPanel, ys + t0 * n + p * kPanel, n);
        t0 += r;
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
