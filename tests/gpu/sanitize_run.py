"""One small launch per forward variant the dispatch reaches (key and seqlen_k range
defaults), and one forward + backward (deterministic and not) per such backward variant,
meant to run under compute-sanitizer:

    compute-sanitizer --tool memcheck  python3 tests/gpu/sanitize_run.py
    compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_run.py

Not a pytest module (the sanitizer wraps the whole process). Shapes are small and not tile
multiples, with GQA, so masked tails and partial tiles are exercised. Arguments: head dims to
keep, `--batch B` (default 1): B = 40 gives more query tiles than SMs, so the forward's
persistent CTAs walk several tiles (Q slices reloaded, GEMM turns carried across tiles), and
more key tiles than SMs for the backward (one CTA each, in several waves), and
`--features`: only the local/softcap variants (run with fa3gen.checks.probe_masking's window
and cap, as every variant is); `--varlen`: only the varlen variants, on fa3gen.checks'
packed problem (unequal lengths, empty sequences), forward and backward, and the paged ones
on its paged cache (shuffled pages of fa3gen.checks.PAGED_CHECK_PAGE rows). `--all`: every built
forward variant instead of the defaults (a candidate spec such as specs/peel.yaml, FA3GEN_LIB).
"""

import argparse
import sys

import torch

from fa3gen import checks, runtime
from fa3gen.checks import probe_masking
from fa3gen.ops import TORCH_DTYPES, flash_attn_func


def main() -> int:
    parser = argparse.ArgumentParser(description="small fa3gen launches to run under compute-sanitizer")
    parser.add_argument("head_dims", nargs="*", help="keep only these head dims")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--features", action="store_true", help="only local/softcap variants")
    parser.add_argument("--varlen", action="store_true", help="only varlen variants")
    parser.add_argument("--fp8", action="store_true", help="only e4m3 variants")
    parser.add_argument("--all", action="store_true",
                        help="every built forward variant, not only the dispatch defaults")
    args = parser.parse_args()
    lib = runtime.get_library()
    batch, only = args.batch, args.head_dims

    def forwards():
        return [v for v in lib.variants if v.direction == "fwd"] if args.all else lib.dispatched("fwd")

    def skip(info):
        return (only and str(info.head_dim) not in only) or (
            args.features and not (info.local or info.softcap)) or info.varlen != args.varlen or (
            (info.dtype == "e4m3") != args.fp8)

    ran = 0
    if args.varlen or args.fp8:
        gen = torch.Generator(device="cuda").manual_seed(0)
        failed = 0
        for direction, check in (("fwd", checks.check_forward), ("bwd", checks.check_backward)):
            for info in forwards() if direction == "fwd" else lib.dispatched(direction):
                if not skip(info):
                    res = check(lib, info, checks.QUICK_PROBLEM, gen)
                    ran += 1
                    failed += not res["ok"]
                    print(f"{info.name}: {'ok' if res['ok'] else 'FAIL ' + res['why']}", flush=True)
        return 1 if failed else _ran_any(ran, lib, args)  # a wrong result fails the run too

    for info in forwards():
        if skip(info):
            continue
        ran += 1
        dtype = TORCH_DTYPES[info.dtype]
        g = torch.Generator(device="cuda").manual_seed(0)
        # More keys than queries, then more queries than keys (causal: rows that see no key).
        for seqlen_q, seqlen_k in ((150, 200), (257, 113)):
            q = torch.randn(batch, seqlen_q, 4, info.head_dim, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(batch, seqlen_k, 2, info.head_dim, device="cuda", dtype=dtype, generator=g)
            v = torch.randn(batch, seqlen_k, 2, info.head_dim, device="cuda", dtype=dtype, generator=g)
            out = flash_attn_func(q, k, v, causal=info.causal, variant=info.name, **probe_masking(info))
            torch.cuda.synchronize()
            print(f"{info.name} {seqlen_q}x{seqlen_k}: ok, |out|max={out.abs().max().item():.3f}",
                  flush=True)
    for info in lib.dispatched("bwd"):
        if skip(info):
            continue
        ran += 1
        dtype = TORCH_DTYPES[info.dtype]
        g = torch.Generator(device="cuda").manual_seed(1)
        shapes = ((batch, 150, 4, info.head_dim), (batch, 200, 2, info.head_dim), (batch, 200, 2, info.head_dim))
        q, k, v = (torch.randn(*s, device="cuda", dtype=dtype, generator=g).requires_grad_()
                   for s in shapes)
        for deterministic in (False, True):
            out = flash_attn_func(q, k, v, causal=info.causal, deterministic=deterministic,
                                  **probe_masking(info))
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            torch.cuda.synchronize()
            print(f"{info.name} deterministic={deterministic}: ok, "
                  f"|dq|max={dq.abs().max().item():.3f}", flush=True)
    return _ran_any(ran, lib, args)


def _ran_any(ran: int, lib, args) -> int:
    """1, with a message, when the filters left nothing to launch (the sanitizer would only say
    the process ended before its first CUDA call): e.g. a candidate spec without dispatch
    defaults needs --all."""
    if ran:
        return 0
    print(f"sanitize_run: no variant of {lib.path} matched (head dims {args.head_dims or 'any'}; "
          "a library without dispatch defaults needs --all)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
