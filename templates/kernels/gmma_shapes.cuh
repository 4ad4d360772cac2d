// Which WGMMA N sizes a translation unit may use. CuTe's GMMA selectors know N = 8, 16, 32,
// 64, 96, 128, 192 and 256 unless CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED adds the other
// multiples of 8; those headers are 76k lines and cost about 35 s of every compile, so the
// generator defines the macro only in the variants that need it (generator/variants.py,
// wgmma_n_sizes), and only in the device pass. Without it an N of 80 would quietly run as
// five N = 16 instructions: the traits assert that every N they use is known. The host pass
// issues no WGMMA and uses no MMA type (launchers need only shared-memory and TMA layouts), so
// the check applies to the device pass alone.
#pragma once

namespace fa3gen {

constexpr bool gmma_n_available(int n) {
#if !defined(__CUDA_ARCH__)
  return true;
#elif defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
  return n % 8 == 0 && n >= 8 && n <= 256;
#else
  return n == 8 || n == 16 || n == 32 || n == 64 || n == 96 || n == 128 || n == 192 || n == 256;
#endif
}

}  // namespace fa3gen
