// The host's float multiply-add peak: independent fused multiply-adds on vectors held in registers, on several
// threads at once, touching no memory. No product on this CPU runs faster, so it is the compute roof of the
// memory-bound benchmark's curve (specjax/kernels/__init__.py: `fma_peak_gflops`); a compiled matrix product reaches
// less (XLA's [512, 2048] x [2048, 2048] product: 70 GFLOP/s on a Zen 1 EPYC whose peak is 80).
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "vec.h"

// Enough chains for every multiply-add unit to start one a cycle while the others' results are pending (two units
// with a latency of 4-5 cycles need 8-10), leaving registers for the two operands.
constexpr int kChains = kRegisters - 4;

// `iterations` multiply-adds on each chain, acc = acc * a + b; their lanes' sum (a, b and the starts unknown to the
// compiler, which would otherwise drop a chain that it sees stays where it starts)
static float chains(int64_t iterations, float a_value, float b_value) {
  const vec a = vec{} + a_value, b = vec{} + b_value;
  vec acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = b * static_cast<float>(i);
  for (int64_t n = 0; n < iterations; ++n) {
    // unrolled, so that the chains stay in registers (GCC left AVX-512's 28 in memory: 119 GFLOP/s on a Zen 4 EPYC
    // whose matrix products reach 186)
#pragma GCC unroll 32
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * a + b;
  }
  float sum = 0.0f;
  for (int i = 0; i < kChains; ++i) sum += sum_lanes(acc[i]);
  return sum;
}

// GFLOP/s of `threads` threads each running `iterations` multiply-adds on every chain, over the wall time of all
extern "C" double SpecjaxFmaGflops(int threads, int64_t iterations) {
  std::vector<std::thread> pool;
  std::vector<float> sums(threads);
  volatile float a = 0.999f, b = 1e-3f;
  const float a_value = a, b_value = b;
  const auto begin = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([=, &sums] { sums[t] = chains(iterations, a_value, b_value); });
  for (auto& thread : pool) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  volatile float sink = 0.0f;
  for (float s : sums) sink = sink + s;
  return 2.0 * kChains * kLanes * static_cast<double>(iterations) * threads / seconds / 1e9;
}
