// The online softmax's rescale rule, shared by the forward (softmax.cuh) and the decode kernels
// (decode.cuh, which has no CuTe): a row keeps its running maximum while a new block raises
// it by at most this much (log2 units). Its probabilities then reach up to 2^threshold (256),
// which fp32 sums and 16-bit P hold, and its output needs no rescale; the final LSE uses the
// maximum in use, so the result is the same softmax. A negative value rescales on every block
// (the A/B baseline: -DFA3GEN_RESCALE_THRESHOLD=-1).
#pragma once

#ifndef FA3GEN_RESCALE_THRESHOLD
#define FA3GEN_RESCALE_THRESHOLD 8.0f
#endif

namespace fa3gen {
// The fp8 forward stores P times 256 in e4m3, whose largest value is kE4m3Max: P may reach only
// 448 / 256 = 2^0.807 there (the mainloop asserts the cap against its own factor).
constexpr float kE4m3Max = 448.f;
constexpr float kRescaleThresholdFp8P = FA3GEN_RESCALE_THRESHOLD < 0.8f ? FA3GEN_RESCALE_THRESHOLD : 0.8f;

// 2^x at compile time, for |x| <= 1 (Taylor series of e^(x ln 2), relative error below 1e-7).
constexpr float exp2_constexpr(float x) {
  float term = 1.f, sum = 1.f;
  for (int k = 1; k < 12; ++k) {
    term *= x * 0.693147181f / float(k);
    sum += term;
  }
  return sum;
}
}  // namespace fa3gen
