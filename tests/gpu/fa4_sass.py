"""FA4's Hopper forward (or backward) compiled on a machine without a GPU, its steady-state loop
beside a fa3gen variant's (tests/gpu/sass_loops.py's counts: static instructions and overhead
opcodes, with --events the order of GEMMs, waits and exponentials):

    python3 tests/gpu/fa4_sass.py --head-dim 256 [--causal] [--softcap 30] [--window 1024]
        [--fa3gen fwd_bf16_d256_nocausal_m128n80_s2_ws1_pp0_ov1] [--events] [--keep DIR]
    python3 tests/gpu/fa4_sass.py --backward --head-dim 128 [--causal]
        [--fa3gen bwd_bf16_d128_nocausal_m80n128_s2_ws1_pp0_ov0] --events

Needs flash-attn-4 and the CuTe DSL (nvidia-cutlass-dsl with its libs for this Python) beside a
CPU torch, and a disassembler (NVDISASM=path or nvdisasm on PATH; the nvidia-cuda-nvdisasm wheel
has one). FA4 compiles for a device it does not see when FLASH_ATTENTION_ARCH and
FLASH_ATTENTION_NUM_SMS name one, and its interface picks the configuration and calls
cute.compile under torch's FakeTensorMode without launching; CUTE_DSL_KEEP keeps the cubin,
which the DSL's own ptxas produced. bf16, (batch 2, seqlen 4096, 16 heads), FA4's defaults for
everything else (the inference forward: no LSE). Without triton (a CPU torch) a no-op stands in for
quack's autotuner, which its package init imports. Not a pytest module.
"""

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_loops  # noqa: E402


def compile_fa4(head_dim: int, causal: bool, softcap: float, window: int, dump: Path,
                backward: bool = False) -> Path:
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132",
                      CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump),
                      FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0")
    import importlib.util
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if importlib.util.find_spec("triton") is None:
        # quack (FA4's dependency) imports its triton-based autotuner in its package init; a
        # CPU machine has no triton, and compiling for SASS never autotunes: a no-op stands in.
        stub = types.ModuleType("quack.autotuner")
        stub.autotune = lambda *a, **k: (lambda f: f)
        stub.AutotuneConfig = type("AutotuneConfig", (), {"__init__": lambda self, *a, **k: None})
        sys.modules.setdefault("quack.autotuner", stub)
    from flash_attn.cute import interface

    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4096, 16, head_dim, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        window_size = (window, 0) if window >= 0 else (None, None)
        if backward:  # its main kernel, between a preprocess and a postprocess
            out, dout = torch.empty_like(q), torch.empty_like(q)
            lse = torch.empty(2, 16, 4096, dtype=torch.float32, device="cuda")
            interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=causal, softcap=softcap,
                                      window_size_left=window_size[0], window_size_right=window_size[1])
        else:
            interface.flash_attn_func(q, k, v, causal=causal, softcap=softcap, window_size=window_size)
    cubins = sorted(dump.glob("*.cubin"), key=lambda p: p.stat().st_mtime)
    if backward:
        cubins = [c for c in cubins if "BackwardSm90" in c.name]
    if not cubins:
        raise SystemExit(f"fa4_sass: FA4 left no cubin in {dump} (a cached kernel?)")
    return cubins[-1]


def show(label: str, cubin: Path, events: bool, loops: int) -> None:
    """The `loops` shortest loops with 4+ warpgroup GEMMs (the steady step is usually the
    first; FA4's causal kernel has a shorter one around its masked blocks)."""
    found = sass_loops._loop_bodies(sass_loops.disassemble(cubin), 4)
    print(f"{label}: {len(found)} loops with 4+ warpgroup GEMMs")
    for ops, body in found[:loops]:
        shown = " ".join(f"{op} {ops[op]}" for op in sass_loops.SHOWN)
        print(f"  {len(body):5d} instructions; {shown}")
        print("        " + ", ".join(f"{op} {n}" for op, n in ops.most_common(13) if op != "GMMA"))
        if events:
            print("        order: " + sass_loops.events(body))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--window", type=int, default=-1, help="left window (right 0); -1: none")
    p.add_argument("--backward", action="store_true", help="FA4's backward main kernel instead")
    p.add_argument("--fa3gen", metavar="VARIANT", help="a fa3gen variant to compile and show beside")
    p.add_argument("--events", action="store_true")
    p.add_argument("--loops", type=int, default=2, help="loops shown per kernel (default 2)")
    p.add_argument("--keep", type=Path, help="keep FA4's cubin in this folder")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dump = args.keep or Path(tmp)
        dump.mkdir(parents=True, exist_ok=True)
        cubin = compile_fa4(args.head_dim, args.causal, args.softcap, args.window, dump, args.backward)
        show(f"FA4 {'backward' if args.backward else 'forward'} d{args.head_dim}"
             f"{' causal' if args.causal else ''}", cubin, args.events, args.loops)
        if args.fa3gen:
            show(args.fa3gen, sass_loops.compile_variant(args.fa3gen, Path(tmp)), args.events, args.loops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
