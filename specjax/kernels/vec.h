// The host's widest float vector, as GCC vector extensions (-march=native): 16 lanes with AVX-512 (32 registers), 8
// with AVX2 (16 registers). A 64-byte vector on an AVX2 host is emulated through memory: 4-30x slower.
#pragma once

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
#else
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
#endif

typedef float vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

static inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
static inline void store(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }

// the sum of a vector's lanes, halving it (a loop over the lanes is a chain of dependent scalar adds)
static inline float sum_lanes(vec v) {
  typedef float f8 __attribute__((vector_size(32)));
  typedef float f4 __attribute__((vector_size(16)));
  typedef float f2 __attribute__((vector_size(8)));
#if defined(__AVX512F__)
  const f8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f8 h = v;
#endif
  const f4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const f2 e = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return e[0] + e[1];
}
