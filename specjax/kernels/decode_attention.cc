// Attention of a few new tokens over a static KV cache, for XLA CPU (specjax/kernels/__init__.py builds and calls
// it): out[x, r] = softmax(scale * q[x, r] . k[x, s] over the visible slots s) . v[x, :, s], where x is a (row,
// kv head) pair and r a (query head, token) pair of that kv head. XLA reads the whole static cache for every pass;
// this reads each (row, kv head)'s keys and values once and only up to its last visible slot (a half-full cache:
// half the bytes), on XLA's intra-op threads (pool.h). A token that sees no slot gets the uniform average of all S
// values, as XLA's softmax over scores that are all the float minimum does.
//
// Two layouts of the work for one (row, kv head) x. With at least half a vector of query rows, the rows are the
// vector lanes (`rows_in_lanes`): every row's scores, softmax and sums run in its own lane in slot order, so a
// row's result depends neither on the other rows of the pass nor on its masked slots (exact zeros, even where a
// masked key is not finite), and no dot product ends in a sum of lanes (the kernel alone, the 32 layers of a pass
// of the expanded stories260K, 8 kv heads over 97-112 of 192 slots, on a Zen 1 EPYC, in turns with `row_by_row`
// and a scalar exp: 8 tokens, 16 rows a kv head, 4.0 ms against 6.0; 16 tokens 8.3 against 11.5). With fewer, each
// row's dot products run along the head dimension and the slots (`row_by_row`: 2 rows in 8 lanes would leave 6
// idle). Both take exp a vector at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr int kSlots = 8;  // slots (scores) or head dimensions (sums over the slots) per group of accumulators

// exp(x) for x <= 0 in every lane (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r, times
// 2^n; at most 1.02 units in the last place from exp over 10^8 points of [-87.3, 0]); 0 where exp(x) is below the
// smallest normal float, x = -inf included
static inline vec exp_nonpositive(vec x) {
  typedef int ivec __attribute__((vector_size(kLanes * sizeof(int))));
  const vec lowest = vec{} - 87.33654f;  // exp(lowest) = the smallest normal float
  const vec y = x < lowest ? lowest : x;
  const vec n = __builtin_convertvector(__builtin_convertvector(y * 1.44269504f - 0.5f, ivec), vec);  // round
  const vec r = y - n * 0.693359375f + n * 2.12194440e-4f;  // y - n ln 2, ln 2 in two parts
  vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23;
  const vec e = (p * r * r + r + 1.0f) * reinterpret_cast<const vec&>(two_n);
  return x < lowest ? vec{} : e;
}

// The problem's sizes and x's slices of q, k, v, the mask and the output.
struct Slice {
  const float *q, *k, *v;  // [rows, d], [slots, d], [d, slots]
  const bool* mask;        // [t_len, slots]: row r is token r % t_len
  const float* bias;       // rows_in_lanes: [slots, width] 0 (visible) or -inf per slot and lane
  float* out;              // [rows, d]
  int64_t rows, d, slots, t_len, end;  // end: past the last slot any token sees
};

// a token that sees no slot: the mean of every slot's value (XLA's softmax over scores all at the float minimum)
static void blind(const Slice& x, float* out_r) {
  for (int64_t i = 0; i < x.d; ++i) {
    float sum = 0.0f;
    for (int64_t s = 0; s < x.slots; ++s) sum += x.v[i * x.slots + s];
    out_r[i] = sum / x.slots;
  }
}

// sum_i a[i] * b[i]: a vector at a time, then the tail
static inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float sum = sum_lanes(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// p: scratch of the slots rounded up to whole vectors
static void row_by_row(const Slice& x, float scale, float* p) {
  for (int64_t r = 0; r < x.rows; ++r) {
    const bool* m = x.mask + (r % x.t_len) * x.slots;
    const float* qr = x.q + r * x.d;
    float top = -INFINITY;
    for (int64_t s = 0; s < x.end; ++s) {
      p[s] = m[s] ? scale * dot(qr, x.k + s * x.d, x.d) : -INFINITY;
      top = p[s] > top ? p[s] : top;
    }
    if (top == -INFINITY) {
      blind(x, x.out + r * x.d);
      continue;
    }
    for (int64_t s = x.end; s % kLanes; ++s) p[s] = -INFINITY;  // whole vectors: exp 0 past the end
    float total = 0.0f;
    for (int64_t s = 0; s < x.end; s += kLanes) {
      const vec e = exp_nonpositive(load(p + s) - top);
      store(p + s, e);
      total += sum_lanes(e);
    }
    for (int64_t i = 0; i < x.d; ++i) x.out[r * x.d + i] = dot(p, x.v + i * x.slots, x.end) / total;
  }
}

// acc[j] += sum over t < n of a[t * width, a vector of lanes] * b[j][t], for kSlots rows b[j] (the scores: a = the
// queries by head dimension, b = kSlots slots' keys; the sums: a = the weights by slot, b = kSlots dimensions' values)
static inline void lane_dots(const float* a, int64_t width, const float* const* b, int64_t n, vec* acc) {
  for (int64_t t = 0; t < n; ++t) {
    const vec at = load(a + t * width);
    for (int j = 0; j < kSlots; ++j) acc[j] += at * b[j][t];
  }
}

// qt: scratch [d, width], p [slots, width], o [d, width] (width: the rows rounded up to whole vectors)
static void rows_in_lanes(const Slice& x, float scale, int64_t width, float* qt, float* p, float* o) {
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t i = 0; i < x.d; ++i) qt[i * width + r] = x.q[r * x.d + i];
  }
  for (int64_t lane0 = 0; lane0 < x.rows; lane0 += kLanes) {
    for (int64_t s0 = 0; s0 < x.end; s0 += kSlots) {  // scores of kSlots slots (past `end`: the last slot's)
      const float* kj[kSlots];
      for (int j = 0; j < kSlots; ++j) kj[j] = x.k + std::min(s0 + j, x.slots - 1) * x.d;
      vec acc[kSlots] = {};
      lane_dots(qt + lane0, width, kj, x.d, acc);
      for (int j = 0; j < kSlots && s0 + j < x.end; ++j) {
        const int64_t at = (s0 + j) * width + lane0;
        const vec bias = load(x.bias + at);  // a masked slot's score is -inf, whatever its key holds (NaN)
        store(p + at, bias == -INFINITY ? bias : acc[j] * scale + bias);
      }
    }
    vec top = vec{} - INFINITY, total = {};
    for (int64_t s = 0; s < x.end; ++s) {
      const vec ps = load(p + s * width + lane0);
      top = ps > top ? ps : top;
    }
    const vec safe = top == -INFINITY ? vec{} : top;  // a lane that sees nothing: zeros, its row `blind`
    for (int64_t s = 0; s < x.end; ++s) {
      const vec e = exp_nonpositive(load(p + s * width + lane0) - safe);
      store(p + s * width + lane0, e);
      total += e;
    }
    for (int64_t i0 = 0; i0 < x.d; i0 += kSlots) {  // sums over the slots, kSlots head dimensions at a time
      const float* vi[kSlots];
      for (int j = 0; j < kSlots; ++j) vi[j] = x.v + std::min(i0 + j, x.d - 1) * x.slots;
      vec acc[kSlots] = {};
      lane_dots(p + lane0, width, vi, x.end, acc);
      for (int j = 0; j < kSlots && i0 + j < x.d; ++j) store(o + (i0 + j) * width + lane0, acc[j] / total);
    }
    for (int64_t r = lane0; r < std::min(lane0 + kLanes, x.rows); ++r) {
      if (top[r - lane0] == -INFINITY) {
        blind(x, x.out + r * x.d);
      } else {
        for (int64_t i = 0; i < x.d; ++i) x.out[r * x.d + i] = o[i * width + r];
      }
    }
  }
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
  const int64_t width = (rows + kLanes - 1) / kLanes * kLanes, padded = (slots + kLanes - 1) / kLanes * kLanes;
  const bool lanes = 2 * rows >= kLanes;
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const bool* ms = visible.typed_data();
  float* os = out->typed_data();
  std::vector<float> bias(lanes ? md[0] * slots * width : 0, -INFINITY);  // rows_in_lanes' masks, per row
  for (int64_t b = 0; b < (lanes ? md[0] : 0); ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      const bool* m = ms + (b * t_len + r % t_len) * slots;
      for (int64_t s = 0; s < slots; ++s) bias[(b * slots + s) * width + r] = m[s] ? 0.0f : -INFINITY;
    }
  }
  const float* biases = bias.data();
  run_shared(pool, xs, 2, [=](int64_t first, int64_t last) {
    std::vector<float> scratch(lanes ? (2 * d + slots) * width : padded);
    for (int64_t x = first; x < last; ++x) {
      const bool* mask = ms + (x / heads) * t_len * slots;
      int64_t end = slots;
      while (end > 0) {
        bool seen = false;
        for (int64_t t = 0; t < t_len; ++t) seen |= mask[t * slots + end - 1];
        if (seen) break;
        --end;
      }
      const Slice slice{qs + x * rows * d, ks + x * slots * d, vs + x * d * slots, mask,
                        biases + (x / heads) * slots * width, os + x * rows * d, rows, d, slots, t_len, end};
      float* scratch0 = scratch.data();
      if (lanes) {
        rows_in_lanes(slice, scale, width, scratch0, scratch0 + d * width, scratch0 + (d + slots) * width);
      } else {
        row_by_row(slice, scale, scratch0);
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
