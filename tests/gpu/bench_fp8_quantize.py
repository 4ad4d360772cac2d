"""The fp8 quantizer's bandwidth against a device-to-device copy, sustained (issue 14: at least
70% of the copy's bandwidth):
    python3 tests/gpu/bench_fp8_quantize.py
Shapes of the bench grid's 16k tokens (batch x seqlen = 16384, heads x head_dim = 2048) and a
larger one; bytes counted: the bf16 input read once and the e4m3 output written once. Also the
PyTorch path (fp8.quantize) and the attention it feeds, for the cost a user pays in all. Not a
pytest module."""
import torch

from fa3gen import fp8, runtime, timing


def main():
    lib = runtime.get_library()
    if not lib.has_quantizer:
        raise SystemExit("the library has no fp8 quantizer: build a spec with e4m3 variants")
    for b, s, h, d in ((1, 16384, 16, 128), (8, 8192, 16, 128), (1, 16384, 8, 256)):
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        src = torch.empty(x.numel() * 3 // 2, dtype=torch.uint8, device="cuda")  # 2 + 1 bytes
        dst = torch.empty_like(src)
        signs = torch.ones(d, device="cuda")
        fns = [lambda: dst.copy_(src),
               lambda: fp8._quantize_kernel(lib, x, 128, None),
               lambda: fp8._quantize_kernel(lib, x, 128, signs),
               lambda: fp8._quantize_kernel(lib, x, None, None),
               lambda: fp8.quantize(x, 128)]
        ms = timing.sustained_ms(fns, 3, 100)
        moved = x.numel() * 3  # bytes: bf16 in, e4m3 out
        gbs = [2 * src.numel() / ms[0] / 1e6] + [moved / m / 1e6 for m in ms[1:]]
        print(f"(b, s, h, d) = {(b, s, h, d)}: copy {gbs[0]:.0f} GB/s; quantizer blocks "
              f"{gbs[1]:.0f} ({gbs[1] / gbs[0]:.0%}), with Hadamard {gbs[2]:.0f} "
              f"({gbs[2] / gbs[0]:.0%}), per tensor {gbs[3]:.0f} ({gbs[3] / gbs[0]:.0%}); "
              f"PyTorch path {gbs[4]:.0f} GB/s; times {[f'{m * 1e3:.0f} us' for m in ms]}")


if __name__ == "__main__":
    main()
