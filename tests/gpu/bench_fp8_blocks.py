"""Block-quantized fp8 descales against per-tensor ones, sustained (docs/BENCHMARKS.md, FP8):
    python3 tests/gpu/bench_fp8_blocks.py
batch 1, seqlen 16384, 16 heads, d128; descales from fa3gen.fp8.quantize at the serving
variant's tiles. Not a pytest module."""
import argparse

import torch

from fa3gen import fp8, ops, timing


def main():
    b, s, h, d = 1, 16384, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        bq, bk = fp8.block_sizes(q, k, causal=causal)
        (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, bq), fp8.quantize(k, bk), fp8.quantize(v, bk)
        one = torch.ones(1, device="cuda")
        fns = [lambda: ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=one, k_descale=one,
                                           v_descale=one),
               lambda: ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                           v_descale=one),
               lambda: ops.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                           v_descale=vd)]
        ms = timing.sustained_ms(fns, 3, 100)
        fl = 4 * b * h * s * s * d / (2 if causal else 1)
        print(f"causal={causal}: per-tensor {fl / ms[0] / 1e9:.0f} TFLOP/s, q and k block "
              f"descales {fl / ms[1] / 1e9:.0f}, q, k and v block descales {fl / ms[2] / 1e9:.0f}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
