"""Per-call overhead of Python custom-op registration styles (CPU, torch.compile).

Run (CPU torch, from the repository root): python3 docs/results/custom_op_registrations_probe.py
      [--reps N] [--layers] [--profile VARIANT]
The probe behind docs/BENCHMARKS.md "2026-12-07 (forty-fourth)" (the compiled path's
registration, measured and left alone); not part of the package or its tests.

Op: attn(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)
body: (q.new_empty(q.shape), q.new_empty(q.shape[:-1]))   [new_zeros while checking,
so that opcheck / grad comparisons see deterministic outputs]
backward (all variants): dq = go*scale, dk = go, dv = 2*go  (lse grad ignored)
"""
import gc
import statistics
import sys
import time
import warnings

import torch
import torch._inductor.config
import torch._functorch.config
from torch import Tensor
from torch._C import _AutoDispatchBelowAutograd, _after_autograd_keyset, DispatchKey

warnings.filterwarnings("ignore")
torch._dynamo.config.cache_size_limit = 64
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
torch._dynamo.config.accumulated_cache_size_limit = 1024

SCHEMA = "(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)"
CHECKING = False  # switch body to new_zeros for deterministic checks


def body(q, k, v, causal, scale):
    if CHECKING:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:-1])
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1])


def fake(q, k, v, causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1])


def setup_context(ctx, inputs, output):
    ctx.scale = inputs[4]


def backward(ctx, go, glse):
    return go * ctx.scale, go, go * 2, None, None


VARIANTS = {}
_libs = []


# ---- 1. baseline: torch.library.custom_op + register_fake + register_autograd
@torch.library.custom_op("ob1::attn", mutates_args=())
def attn1(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return body(q, k, v, causal, scale)


attn1.register_fake(fake)
attn1.register_autograd(backward, setup_context=setup_context)
VARIANTS["1 custom_op"] = torch.ops.ob1.attn.default


# ---- 2. Library.define + lib.impl(CompositeExplicitAutograd) + register_fake + register_autograd
def _lib(ns):
    lib = torch.library.Library(ns, "FRAGMENT")
    _libs.append(lib)
    lib.define("attn" + SCHEMA)
    return lib


lib2 = _lib("ob2")
lib2.impl("attn", body, "CompositeExplicitAutograd")  # raw PythonKernelHolder, no wrappers
torch.library.register_fake("ob2::attn", fake, lib=lib2)
torch.library.register_autograd("ob2::attn", backward, setup_context=setup_context, lib=lib2)
VARIANTS["2 lib.impl+reg_autograd"] = torch.ops.ob2.attn.default


# ---- 3. Library.define + backend impl + hand-written Autograd kernel
def make_manual_autograd(op, direct_backend):
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            with _AutoDispatchBelowAutograd():
                o, lse = op(q, k, v, causal, scale)
            ctx.scale = scale
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, go, glse):
            return go * ctx.scale, go, go * 2, None, None

    if not direct_backend:
        # 3a: re-enter the dispatcher below autograd (generic: works for fake/functional/etc.)
        def autograd_kernel(q, k, v, causal, scale):
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return Fn.apply(q, k, v, causal, scale)
            with _AutoDispatchBelowAutograd():
                return op(q, k, v, causal, scale)

        return autograd_kernel, False

    # 3b: if the call's keyset is exactly {CPU|CUDA, AutogradCPU|AutogradCUDA} (plain dense
    # tensors, no fake/functional/python mode/conj bits...), call the python body directly
    # (no second trip through the dispatcher); anything else redispatches below autograd.
    KS = torch._C.DispatchKeySet
    plain = {KS(DispatchKey.CPU).add(DispatchKey.AutogradCPU).raw_repr(),
             KS(DispatchKey.CUDA).add(DispatchKey.AutogradCUDA).raw_repr()}
    is_grad_enabled = torch._C.is_grad_enabled

    def autograd_kernel_ks(keyset, q, k, v, causal, scale):
        if is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return Fn.apply(q, k, v, causal, scale)
        if keyset.raw_repr() in plain:
            # no input needs grad here, so running the body "above" autograd records nothing
            return body(q, k, v, causal, scale)
        return op.redispatch(keyset & _after_autograd_keyset, q, k, v, causal, scale)

    return autograd_kernel_ks, True


for ns, direct in (("ob3", False), ("ob3b", True)):
    lib = _lib(ns)
    lib.impl("attn", body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{ns}::attn", fake, lib=lib)
    op = getattr(torch.ops, ns).attn.default
    kern, ks = make_manual_autograd(op, direct)
    lib.impl("attn", kern, "Autograd", with_keyset=ks)
    VARIANTS[f"3{'b' if direct else 'a'} manual Autograd key" + (" +direct" if direct else "")] = op


# ---- 4. keep the @custom_op decorator, but replace its backend_impl (aliasing check +
# 3 _disable_dynamo layers) with the raw function at CompositeExplicitAutograd.
@torch.library.custom_op("ob4::attn", mutates_args=())
def attn4(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return body(q, k, v, causal, scale)


attn4.register_fake(fake)
attn4.register_autograd(backward, setup_context=setup_context)
attn4._lib.impl("attn", body, "CompositeExplicitAutograd")  # override (allow_override=True)
VARIANTS["4 custom_op+raw CEA impl"] = torch.ops.ob4.attn.default


# ---- 5. op with NO autograd kernel (CEA + fake only); autograd via a Python
# autograd.Function wrapper outside the op (dynamo traces the Function).
lib5 = _lib("ob5")
lib5.impl("attn", body, "CompositeExplicitAutograd")
torch.library.register_fake("ob5::attn", fake, lib=lib5)
_op5 = torch.ops.ob5.attn.default


class Fn5(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _op5(q, k, v, causal, scale)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, go, glse):
        return go * ctx.scale, go, go * 2, None, None


def attn5(q, k, v, causal, scale):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return Fn5.apply(q, k, v, causal, scale)
    return _op5(q, k, v, causal, scale)


VARIANTS["5 no-autograd op+Function wrapper"] = attn5  # opcheck runs on _op5


def ref_newempty(q, k, v, causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1])


def ref_diff(q, k, v, causal, scale):  # differentiable ref: output depends on q
    return q * scale, q.new_empty(q.shape[:-1])


VARIANTS["0 ref: new_empty only (no op)"] = ref_newempty
VARIANTS["0b ref: q*scale (differentiable)"] = ref_diff
OPCHECK_TARGET = {"5 no-autograd op+Function wrapper": _op5}


# ----------------------------------------------------------------------------------
def inputs(rg):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 128, 4, 64, generator=g).requires_grad_(rg) for _ in range(3)]


def timeit(fn, args, n=2000, reps=5, warm=300):
    for _ in range(warm):
        fn(*args)
    res = []
    gc.collect()
    gc.disable()  # like timeit: keep cyclic-GC pauses (autograd ctx objects) out of the numbers
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(*args)
            res.append((time.perf_counter() - t0) / n * 1e6)
    finally:
        gc.enable()
    return statistics.median(res)


def make_compiled(op):
    # fresh code object per variant so dynamo caches don't interact
    ns = {"op": op}
    exec("def f(q, k, v):\n    return op(q, k, v, True, 0.125)\n", ns)
    return torch.compile(ns["f"], fullgraph=True)


MODES = ["a eager nograd", "a' eager req_grad", "b compiled no_grad", "c compiled req_grad",
         "d compiled inference_mode"]


def bench_all(variants, reps=5, n=2000):
    """Interleaved: for each mode and each repeat, every variant runs n calls in turn."""
    qn, qg = inputs(False), inputs(True)
    with torch.inference_mode():
        qi = inputs(False)
    calls = {}
    for name, op in variants.items():
        eager = (lambda op: lambda q, k, v: op(q, k, v, True, 0.125))(op)
        cf = make_compiled(op)
        calls[name] = {
            MODES[0]: (eager, qn, torch.no_grad), MODES[1]: (eager, qg, torch.enable_grad),
            MODES[2]: (cf, qn, torch.no_grad), MODES[3]: (cf, qg, torch.enable_grad),
            MODES[4]: (cf, qi, torch.inference_mode),
        }
    res = {name: {m: [] for m in MODES} for name in variants}
    for m in MODES:
        for name in variants:  # warm-up / compile
            fn, args, ctx = calls[name][m]
            with ctx():
                timeit(fn, args, n=300, reps=1, warm=0)
        for _ in range(reps):
            for name in variants:
                fn, args, ctx = calls[name][m]
                with ctx():
                    res[name][m].append(timeit(fn, args, n=n, reps=1, warm=20))
    return ({name: {m: statistics.median(v) for m, v in r.items()} for name, r in res.items()},
            {name: {m: min(v) for m, v in r.items()} for name, r in res.items()})


def layers(n=20000):
    """Micro-cost of individual wrapper layers (us/call)."""
    from torch._library.utils import _c_check_aliasing_constraint, is_out

    q, k, v = inputs(False)
    out = body(q, k, v, True, 0.125)
    f = lambda *a: None  # noqa: E731
    dis = torch._disable_dynamo(f)
    dis()
    op = torch.ops.ob1.attn.default
    ks = torch._C._dispatch_keys(q)

    def t(fn):
        for _ in range(200):
            fn()
        r = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            r.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(r)

    base = t(lambda: f(q, k, v, True, 0.125))
    rows = {
        "empty python lambda call (subtracted below)": base,
        "_disable_dynamo(fn) call (inner+DisableContext._fn)": t(lambda: dis(q, k, v, True, 0.125)) - base,
        "_c_check_aliasing_constraint": t(lambda: _c_check_aliasing_constraint("x", (q, k, v, True, 0.125), {}, out)) - base,
        "utils.is_out(op) (per autograd_impl call)": t(lambda: is_out(op)) - base,
        "_AutoDispatchBelowAutograd() enter/exit": t(lambda: _enter_below()) - base,
        "OpOverload.redispatch -> raw python kernel (ob5 CEA)": t(lambda: torch.ops.ob5.attn.default.redispatch(torch._C.DispatchKeySet(DispatchKey.CPU), q, k, v, True, 0.125)) - t(lambda: body(q, k, v, True, 0.125)),
        "dispatcher call -> raw CEA python kernel (ob5, no autograd kernel)": t(lambda: torch.ops.ob5.attn.default(q, k, v, True, 0.125)) - t(lambda: body(q, k, v, True, 0.125)),
    }
    for k_, v_ in rows.items():
        print(f"  {k_:66s} {v_:6.2f} us")


def _enter_below():
    with _AutoDispatchBelowAutograd():
        pass


def check(name, op, cf):
    global CHECKING
    CHECKING = True
    out = {}
    try:
        if not name.startswith("0"):
            tgt = OPCHECK_TARGET.get(name, op)
            r = torch.library.opcheck(tgt, (*inputs(True), True, 0.125), raise_exception=False)
            bad = [f"{k}:{str(v)[:120]}" for k, v in r.items() if v != "SUCCESS"]
            out["opcheck"] = "PASS" if not bad else "FAIL " + "; ".join(bad)
        if name.startswith("0"):
            out["compile+bwd"] = "n/a (ref)"
            return out
        # backward: eager vs compiled (fresh compile so CHECKING body is traced consistently)
        go = torch.randn(1, 128, 4, 64, generator=torch.Generator().manual_seed(1))
        res = []
        for f in (lambda q, k, v: op(q, k, v, True, 0.125), make_compiled(op)):
            q, k, v = inputs(True)
            o, lse = f(q, k, v)
            if not o.requires_grad:
                res.append(None)
                continue
            res.append(torch.autograd.grad(o, (q, k, v), go))
        if res[0] is None or res[1] is None:
            out["compile+bwd"] = "no grad_fn" if not name.startswith("0") else "n/a (ref)"
        else:
            if name.startswith("0"):
                out["compile+bwd"] = "n/a (ref)"
                return out
            exp = (go * 0.125, go, go * 2)
            ok = all(torch.equal(a, b) and torch.equal(a, e) for a, b, e in zip(res[0], res[1], exp))
            out["compile+bwd"] = "PASS" if ok else "MISMATCH"
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        CHECKING = False
    return out


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--profile":
        import cProfile
        import pstats

        name = next(n for n in VARIANTS if n.startswith(sys.argv[2]))
        op = VARIANTS[name]
        cf = make_compiled(op)
        q = inputs(False)
        with torch.no_grad():
            timeit(cf, q, n=10, reps=1)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                cf(*q)
            pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if "--layers" in sys.argv:
        layers()
        return
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 5
    med, mn = bench_all(VARIANTS, reps=reps)
    checks = {name: check(name, op, None) for name, op in VARIANTS.items()}
    cols = MODES
    for label, rows in ((f"median of {reps}x2000", med), (f"min of {reps}x2000", mn)):
        print(f"torch {torch.__version__}, threads={torch.get_num_threads()}  (us/call, {label})")
        print(f"{'variant':36s}" + "".join(f"{c:>13s}" for c in ["a:eager", "a':eager_rg", "b:cmp_nograd", "c:cmp_rg", "d:cmp_infer"]))
        for name, row in rows.items():
            print(f"{name:36s}" + "".join(f"{row[c]:13.2f}" for c in cols))
    print()
    for name, c in checks.items():
        print(f"{name:36s} " + "  ".join(f"{k}={v}" for k, v in c.items()))


if __name__ == "__main__":
    main()
