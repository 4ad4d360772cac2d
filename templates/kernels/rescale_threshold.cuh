// The online softmax's rescale rule, shared by the forward (softmax.cuh) and the decode kernels
// (decode.cuh, which has no CuTe): a row keeps its running maximum while a new block raises
// it by at most this much (log2 units). Its probabilities then reach up to 2^threshold (256),
// which fp32 sums, 16-bit P and e4m3 P (max 448) all hold, and its output needs no rescale;
// the final LSE uses the maximum in use, so the result is the same softmax. A negative value
// rescales on every block (the A/B baseline: -DFA3GEN_RESCALE_THRESHOLD=-1).
#pragma once

#ifndef FA3GEN_RESCALE_THRESHOLD
#define FA3GEN_RESCALE_THRESHOLD 8.0f
#endif
