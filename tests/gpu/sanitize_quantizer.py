"""The fp8 quantizer's kernels under compute-sanitizer (issue 14: memcheck and racecheck clean
on one shape per head dim): every path of quantize_fp8.cuh's launcher (the 16 KB ring, one
and two passes of 512 threads, with and without rotary and the Hadamard transform), the
two-read kernel of larger blocks and the per-tensor pair.
    compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_quantizer.py
(also --tool memcheck, --tool synccheck). Not a pytest module."""
import argparse

import torch

from fa3gen import fp8, runtime
from fa3gen.reference import random_signs


def main():
    lib = runtime.get_library()
    if not lib.has_quantizer:
        raise SystemExit("the library has no fp8 quantizer: build a spec with e4m3 variants")
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in (64, 128, 256):
        x = torch.randn(2, 333, 3, d, device="cuda", generator=g, dtype=torch.bfloat16)
        angle = torch.rand(333, d // 2, device="cuda", generator=g)
        rot = (angle.cos(), angle.sin())
        signs = random_signs(d, 1, x.device)
        # Rows: 8192 / d fill the 16 KB ring; 128 and 32768 / d one and two passes of 512
        # threads (d64 and d128: 128 is one pass); 100 and 24576 / d passes that the rows fill
        # in part; 65536 / d the two-read kernel; None per tensor.
        for rows in (8192 // d, 128, 100, 24576 // d, 32768 // d, 65536 // d, None):
            fp8._quantize_kernel(lib, x, rows, signs)
            fp8._quantize_kernel(lib, x, rows, None)
            if rows is not None and fp8._kernel_rotates(x, rows, rot, False):
                fp8._quantize_kernel(lib, x, rows, signs, rot)
    torch.cuda.synchronize()
    print("quantizer kernels ran")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
