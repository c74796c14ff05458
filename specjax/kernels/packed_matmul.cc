// y[M, P * 32] = x[M, K] @ W, W packed as P panels [K, 32] (32 output columns each, k-major): a matrix product of
// few rows that streams each weight once, for XLA CPU (specjax/kernels/__init__.py builds and calls it).
//
// Up to eight rows and one panel (two vectors of 16 floats) at a time: every weight vector loaded feeds one fused
// multiply-add per row, into at most 16 accumulators held in registers; the panels are shared with XLA's intra-op
// threads (pool.h). GCC vector extensions, which -march=native compiles to the host's widest vectors (AVX-512, or AVX2).
#include <cstdint>

#include "pool.h"
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

static ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 32 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("packed_matmul takes x [M, K] and w [P, K, 32]");
  }
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* ys = y->typed_data();
  const int64_t m = xd[0], k_len = xd[1], n = wd[0] * 32;
  run_shared(pool, wd[0], 4, [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      for (int64_t t0 = 0; t0 < m; t0 += 8) {
        const int64_t r = m - t0 < 8 ? m - t0 : 8;
        kRowsByPanel[r](xs + t0 * k_len, k_len, ws + p * k_len * 32, ys + t0 * n + p * 32, n);
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
