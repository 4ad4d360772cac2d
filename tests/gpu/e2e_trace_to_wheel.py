"""Shipping a trimmed build, end to end on the GPU (issue 18, part 3): a small transformer block
is trained for a few steps under `fa3gen.trace` with the full library; the trace becomes a spec
(`fa3gen spec --from-trace`), which is built, packaged as a wheel (`fa3gen package`) and
installed into a fresh target directory; the same steps then run in a separate process that
imports only the installed wheel (`python -S`: not even the checkout is importable). The
losses must be identical. Prints the variant count, build time, wheel size and install time.

    python3 tests/gpu/e2e_trace_to_wheel.py --work /tmp/e2e [--steps 5] [-j 16] [--json out.json]

Not a pytest module (it builds and installs). Deterministic by construction: attention with
deterministic=True (ordered dQ accumulation), cuBLAS with a fixed workspace config, the same
seeds in both processes.
"""

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

SPEC_NAME = "e2e_block"
REPO = Path(__file__).resolve().parents[2]


def train(attention, steps: int) -> list[float]:
    """Losses of `steps` AdamW steps of one pre-norm transformer block (causal self-attention
    with GQA through `attention`, then an MLP), bf16, on fixed random data."""
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dim, heads, kv_heads, head_dim, seqlen, batch = 1024, 8, 2, 128, 1024, 2
    dev, dt = "cuda", torch.bfloat16
    norm1, norm2 = torch.nn.LayerNorm(dim).to(dev, dt), torch.nn.LayerNorm(dim).to(dev, dt)
    wq = torch.nn.Linear(dim, heads * head_dim, bias=False).to(dev, dt)
    wkv = torch.nn.Linear(dim, 2 * kv_heads * head_dim, bias=False).to(dev, dt)
    wo = torch.nn.Linear(heads * head_dim, dim, bias=False).to(dev, dt)
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                              torch.nn.Linear(4 * dim, dim)).to(dev, dt)
    params = [p for m in (norm1, norm2, wq, wkv, wo, mlp) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(batch, seqlen, dim, device=dev, dtype=dt, generator=g)
    target = torch.randn(batch, seqlen, dim, device=dev, dtype=dt, generator=g)
    losses = []
    for _ in range(steps):
        h = norm1(x)
        q = wq(h).view(batch, seqlen, heads, head_dim)
        k, v = wkv(h).view(batch, seqlen, 2, kv_heads, head_dim).unbind(2)
        a = attention(q, k, v, causal=True, deterministic=True)
        y = x + wo(a.reshape(batch, seqlen, heads * head_dim))
        y = y + mlp(norm2(y))
        loss = torch.nn.functional.mse_loss(y.float(), target.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def child(module: str, steps: int) -> int:
    """The run on the installed wheel: import only `module` (a packaged fa3gen runtime)."""
    import importlib

    mod = importlib.import_module(module)
    assert "fa3gen" not in sys.modules, "the packaged runtime imported the tool"
    losses = train(mod.flash_attn_func, steps)
    print(json.dumps({"losses": losses, "library": str(mod.runtime.get_library().path)}))
    return 0


def run(cmd: list[str], **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("-j", "--jobs", type=int, default=16)
    p.add_argument("--json")
    p.add_argument("--child", metavar="MODULE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.steps)

    import fa3gen
    from fa3gen import cli, contract

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    trace_file, spec_file = work / "used.yaml", work / f"{SPEC_NAME}.yaml"
    with fa3gen.trace(trace_file):
        losses_full = train(fa3gen.flash_attn_func, args.steps)
    assert cli.main(["spec", "--from-trace", str(trace_file), "-o", str(spec_file)]) == 0
    env = {**os.environ, "FA3GEN_GENERATED": str(work / "generated"), "PYTHONPATH": str(REPO)}
    build_s = run([sys.executable, str(REPO / "build.py"), "--spec", str(spec_file), "-j",
                   str(args.jobs)], env=env)
    variants = json.loads((work / "generated" / SPEC_NAME / contract.MANIFEST_NAME)
                          .read_text())["variants"]
    package_s = run([sys.executable, "-m", "fa3gen.cli", "package", "--spec", str(spec_file),
                     "--out", str(work / "dist")], env=env)
    wheel = next((work / "dist").glob(f"fa3gen_{SPEC_NAME}-*.whl"))
    site = work / "site"
    install_s = run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                     "--target", str(site), str(wheel)])
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("FA3GEN_GENERATED", "FA3GEN_LIB", "PYTHONPATH")}
    child_env["PYTHONPATH"] = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    out = subprocess.run([sys.executable, "-S", str(Path(__file__).resolve()), "--work",
                          str(work), "--steps", str(args.steps), "--child", f"fa3gen_{SPEC_NAME}"],
                         env=child_env, cwd=str(site), capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    trimmed = json.loads(out.stdout.strip().splitlines()[-1])
    report = {
        "steps": args.steps, "losses_full_library": losses_full,
        "losses_installed_wheel": trimmed["losses"],
        "identical": losses_full == trimmed["losses"],
        "variants_built": [v["name"] for v in variants], "build_s": round(build_s, 1),
        "package_s": round(package_s, 1), "wheel_mb": round(wheel.stat().st_size / 2**20, 2),
        "install_s": round(install_s, 1), "wheel_library": trimmed["library"],
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
