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
