// Attention of a few new tokens over a static KV cache, for XLA CPU (specjax/kernels/__init__.py builds and calls
// it): out[x, r] = softmax(scale * q[x, r] . k[x, s] over the visible slots s) . v[x, :, s], where x is a (row,
// kv head) pair and r a (query head, token) pair of that kv head. XLA reads the whole static cache for every pass;
// this reads each (row, kv head)'s keys and values once and only up to its last visible slot (a half-full cache:
// half the bytes), on XLA's intra-op threads (pool.h). A token that sees no slot gets the uniform average of all S
// values, as XLA's softmax over scores that are all the float minimum does.
#include <cmath>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// sum_i a[i] * b[i]: a vector at a time, then the tail
static inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float sum = sum_lanes(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

static ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> visible, float scale,
                                   ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = visible.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || md.size() != 3 || kd[0] != qd[0] ||
      kd[2] != qd[2] || vd[0] != qd[0] || vd[1] != qd[2] || vd[2] != kd[1] || md[2] != kd[1] ||
      qd[0] % md[0] != 0 || qd[1] % md[1] != 0) {
    return ffi::Error::InvalidArgument(
        "decode_attention takes q [B*kv, G*T, D], k [B*kv, S, D], v [B*kv, D, S] and visible [B, T, S]");
  }
  const int64_t xs = qd[0], rows = qd[1], d = qd[2], slots = kd[1], t_len = md[1], heads = xs / md[0];
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const bool* ms = visible.typed_data();
  float* os = out->typed_data();
  run_shared(pool, xs, 2, [=](int64_t first, int64_t last) {
    std::vector<float> p(slots);
    for (int64_t x = first; x < last; ++x) {
      const bool* mask = ms + (x / heads) * t_len * slots;  // [T, S] of this x's row
      int64_t end = slots;  // past the last slot any token sees
      while (end > 0) {
        bool seen = false;
        for (int64_t t = 0; t < t_len; ++t) seen |= mask[t * slots + end - 1];
        if (seen) break;
        --end;
      }
      const float *kx = ks + x * slots * d, *vx = vs + x * d * slots;
      for (int64_t r = 0; r < rows; ++r) {
        const bool* m = mask + (r % t_len) * slots;
        const float* qr = qs + (x * rows + r) * d;
        float* o = os + (x * rows + r) * d;
        float top = -INFINITY;
        for (int64_t s = 0; s < end; ++s) {
          p[s] = m[s] ? scale * dot(qr, kx + s * d, d) : -INFINITY;
          top = p[s] > top ? p[s] : top;
        }
        int64_t n = end;
        if (top == -INFINITY) {  // sees nothing: every slot alike
          n = slots;
          for (int64_t s = 0; s < n; ++s) p[s] = 1.0f;
        } else {
          for (int64_t s = 0; s < n; ++s) p[s] = std::exp(p[s] - top);
        }
        float total = 0.0f;
        for (int64_t s = 0; s < n; ++s) total += p[s];
        for (int64_t i = 0; i < d; ++i) o[i] = dot(p.data(), vx + i * slots, n) / total;
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
