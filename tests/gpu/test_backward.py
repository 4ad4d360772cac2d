"""Backward kernels on the GPU: every built backward variant against the fp32 gradient
reference (fa3gen.reference.attention_grad_reference), with the forward's tolerance rule:
max error <= 2 x plain PyTorch in the same low precision + GRAD_ATOL.

dq, dk, dv are poisoned with NaN before each launch and followed by a NaN guard region.
"""

import pytest
import torch

from fa3gen import ops
from fa3gen.checks import CHECK_SCALE_FACTOR, probe_masking
from fa3gen.errors import InvalidInputError, VariantNotBuiltError
from fa3gen.ops import flash_attn_func
from fa3gen.reference import compare_grads_to_reference

from test_forward import DTYPES, GUARD, make_qkv, poisoned

pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 7, 7, 4, 4),
    (1, 113, 257, 8, 2),   # GQA, seqlen_q < seqlen_k
    (2, 257, 113, 8, 2),   # seqlen_q > seqlen_k: causal rows with no visible key
    (1, 1000, 1000, 4, 1),  # MQA, not a tile multiple
    (3, 128, 256, 2, 2),   # tile multiples
    (1, 1, 777, 8, 8),     # one query
    (2, 600, 7, 3, 1),     # few keys
    (10, 700, 850, 8, 2),  # more key-block tiles than SMs (7 blocks x 2 x 10 = 140 at 128 keys):
                           # CTAs in several waves (and a walk's several tiles a CTA, if one returns)
]


@pytest.fixture(autouse=True)
def poisoned_workspace(poison_bwd_workspace):
    """Every test here hands the backward a poisoned workspace (conftest.py)."""
    poison_bwd_workspace()


def _sid(s):
    return "b{}_sq{}_sk{}_h{}x{}".format(*s)


def forward_for(q, k, v, causal, scale, window_size=(-1, -1), softcap=0.0):
    """out and lse from the forward kernel (the backward consumes what the forward saved)."""
    mask = ops.masking(causal, window_size, softcap)
    name = ops.resolve_variant(ops.check_inputs(q, k, v), mask)
    return torch.ops.fa3gen.fwd(q, k, v, mask.causal, scale, name, False, mask.window_left,
                                mask.window_right, mask.softcap)


def run_bwd_poisoned(dout, q, k, v, out, lse, causal, scale, name, deterministic=False,
                     **masking):
    bufs, grads = [], []
    for like in (q, k, v):
        buf, view = poisoned(tuple(like.shape), like.dtype)
        bufs.append(buf)
        grads.append(view)
    ops._bwd_into(dout, q, k, v, out, lse, *grads, causal, scale, name, deterministic, **masking)
    torch.cuda.synchronize()
    for what, buf in zip(("dq", "dk", "dv"), bufs):
        assert torch.isnan(buf[-GUARD:]).all(), f"kernel wrote past the end of {what}"
    return grads


def check_grads(grads, q, k, v, dout, causal, scale, what, **masking):
    res = compare_grads_to_reference(grads, q, k, v, dout, causal, scale, **masking)
    errs = {k_: f"{res[k_]:.3g}" for k_ in res if k_.endswith(("_err", "_tol"))}
    assert res["ok"], f"{what}: {res['why']} {errs}"
    return res


@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_bwd_variant_matches_reference(lib, bwd_variant, shape):
    info = lib.get(bwd_variant)
    b, sq, sk, hq, hkv = shape
    q, k, v = make_qkv(b, sq, sk, hq, hkv, info.head_dim, DTYPES[info.dtype], seed=10)
    dout = torch.randn_like(q)
    scale, extra = CHECK_SCALE_FACTOR * info.head_dim**-0.5, probe_masking(info)  # not the default
    out, lse = forward_for(q, k, v, info.causal, scale, **extra)
    grads = run_bwd_poisoned(dout, q, k, v, out, lse, info.causal, scale, info.name, **extra)
    check_grads(grads, q, k, v, dout, info.causal, scale, f"{info.name} {_sid(shape)}", **extra)
    if info.causal and sq > sk:  # queries that see no key get no gradient
        assert (grads[0][:, : sq - sk] == 0).all()


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_bwd_unaligned_tensors_through_c_abi(lib, bwd_variant, deterministic):
    """The C ABI takes o, dq, dk and dv that are only 4-byte aligned (Python asks 16 bytes):
    the preprocess then reads o one element at a time, and dq, dk, dv are stored without
    16-byte vectors. Driven through the library directly, the way a C caller would."""
    info = lib.get(bwd_variant)
    d, dtype = info.head_dim, DTYPES[info.dtype]
    q, k, v = make_qkv(2, 300, 250, 4, 2, d, dtype, seed=7)
    dout = torch.randn_like(q)
    scale, extra = d**-0.5, probe_masking(info)
    out_aligned, lse = forward_for(q, k, v, info.causal, scale, **extra)
    obuf, out = poisoned(tuple(q.shape), dtype, offset=2)  # 4 bytes past a 16-byte boundary
    out.copy_(out_aligned)
    bufs, grads = zip(*(poisoned(tuple(t.shape), dtype, offset=2) for t in (q, k, v)))
    assert all(t.data_ptr() % 16 == 4 for t in (out, *grads))
    dims = ops.check_inputs(q, k, v)
    layout = ops._bwd_layout(dims, info.tile_m, deterministic)
    workspace = ops._bwd_workspace(layout, q.device)
    params = ops._make_bwd_params(q, k, v, out, dout, lse, *grads, layout.pointers(workspace), dims,
                                  scale, deterministic, ops.masking(info.causal, **extra))
    lib.launch(info, params, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for what, buf in zip(("dq", "dk", "dv"), bufs):
        assert torch.isnan(buf[:2]).all() and torch.isnan(buf[-GUARD:]).all(), f"wrote outside {what}"
    check_grads(list(grads), q, k, v, dout, info.causal, scale, f"{info.name} 4-byte aligned",
                **extra)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_bwd_repeatable(lib, bwd_variant, deterministic):
    """Deterministic mode: bitwise equal gradients run to run (several key blocks per query
    block, so the order of dq additions matters). Atomic mode: dk, dv still bitwise equal."""
    info = lib.get(bwd_variant)
    q, k, v = make_qkv(2, 700, 900, 4, 2, info.head_dim, DTYPES[info.dtype], seed=11)
    dout = torch.randn_like(q)
    scale, extra = CHECK_SCALE_FACTOR * info.head_dim**-0.5, probe_masking(info)  # not the default
    out, lse = forward_for(q, k, v, info.causal, scale, **extra)
    runs = [run_bwd_poisoned(dout, q, k, v, out, lse, info.causal, scale, info.name, deterministic,
                             **extra) for _ in range(3)]
    check_grads(runs[0], q, k, v, dout, info.causal, scale, f"{info.name} det={deterministic}",
                **extra)
    first = 0 if deterministic else 1
    for other in runs[1:]:
        for i, what in enumerate(("dq", "dk", "dv")[first:], start=first):
            assert torch.equal(runs[0][i], other[i]), f"{info.name}: {what} differs between runs"


def test_autograd_default(lib, bwd_default_key):
    """flash_attn_func is differentiable: .backward() gives the reference gradients, also for
    packed qkv views and a non-contiguous incoming gradient."""
    dtype_name, d, causal = bwd_default_key
    dtype = DTYPES[dtype_name]
    qkv = torch.randn(2, 333, 3, 6, d, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = flash_attn_func(q, k, v, causal=causal)
    dout_full = torch.randn(2, 333, 6, 2 * d, device="cuda", dtype=dtype)
    dout = dout_full[..., ::2]  # head_dim stride 2: the op must copy it before TMA
    out.backward(dout)
    grads = qkv.grad[:, :, 0], qkv.grad[:, :, 1], qkv.grad[:, :, 2]
    qd, kd, vd = (x.detach() for x in (q, k, v))
    check_grads(grads, qd, kd, vd, dout.contiguous(), causal, d**-0.5, f"autograd {bwd_default_key}")


def test_autograd_gqa_and_scale(lib, bwd_default_key):
    dtype_name, d, causal = bwd_default_key
    q, k, v = make_qkv(1, 300, 500, 8, 2, d, DTYPES[dtype_name], seed=12)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3, return_lse=True)
    assert not lse.requires_grad  # lse carries no gradient
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dk.shape == k.shape and dv.shape == v.shape
    check_grads((dq, dk, dv), q.detach(), k.detach(), v.detach(), dout, causal, 0.3,
                f"gqa {bwd_default_key}")


def test_torch_deterministic_algorithms_give_repeatable_gradients(lib, bwd_default_key, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) a call that passes no deterministic=
    runs the ordered dq additions: the launched params say so, and dq is bitwise equal run
    to run (several key blocks per query block), against the reference."""
    dtype_name, d, causal = bwd_default_key
    q, k, v = make_qkv(2, 700, 900, 4, 2, d, DTYPES[dtype_name], seed=13)
    for t in (q, k, v):
        t.requires_grad_(True)
    dout = torch.randn_like(q)
    modes = []
    real_launch = ops._launch
    monkeypatch.setattr(ops, "_launch", lambda lib_, info, device, make: modes.append(
        (info.name, make())) or real_launch(lib_, info, device, lambda: modes[-1][1]))
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
                for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert [p.deterministic for name, p in modes if name.startswith("bwd")] == [1, 1, 1]
    check_grads(runs[0], q.detach(), k.detach(), v.detach(), dout, causal, d**-0.5,
                f"torch deterministic {bwd_default_key}")
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other)), bwd_default_key


@pytest.mark.parametrize("expanded", ["kv_batch", "kv_heads", "q_batch"])
def test_expanded_inputs_with_zero_strides(lib, bwd_default_key, expanded):
    """expand()ed inputs (stride 0 along batch or heads) pass the layout checks and reach the
    kernels' TMA descriptors as they are: forward and gradients against the reference on the
    same views. (A first probe cloned its inputs, which made them contiguous.)"""
    from fa3gen.reference import compare_to_reference

    dtype_name, d, causal = bwd_default_key
    b, s, h = 2, 300, 4
    g = torch.Generator(device="cuda").manual_seed(21)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPES[dtype_name], generator=g,
                           requires_grad=True)

    if expanded == "kv_batch":
        q, k, v = randn(b, s, h, d), randn(1, s, h, d).expand(b, s, h, d), \
            randn(1, s, h, d).expand(b, s, h, d)
    elif expanded == "kv_heads":
        q, k, v = randn(b, s, h, d), randn(b, s, 1, d).expand(b, s, h, d), \
            randn(b, s, 1, d).expand(b, s, h, d)
    else:
        q, k, v = randn(1, s, h, d).expand(b, s, h, d), randn(b, s, h, d), randn(b, s, h, d)
    assert 0 in q.stride() + k.stride() + v.stride()
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    res = compare_to_reference(out.detach(), lse.detach(), qd, kd, vd, causal)
    assert res["ok"], f"{expanded} {bwd_default_key}: {res.get('why')}"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)  # the expanded views': the kernel's
    check_grads(grads, qd, kd, vd, dout, causal, d**-0.5, f"{expanded} {bwd_default_key}")


def test_torch_func_transforms(lib, bwd_default_key):
    """torch.func on the kernels: grad's gradients and vmap(grad)'s per-sample gradients (one
    launch a direction over the folded batch) against the reference, vmap's output against
    calls on each entry."""
    dtype_name, d, causal = bwd_default_key
    q, k, v = make_qkv(3, 200, 300, 4, 2, d, DTYPES[dtype_name], seed=22)
    dout = torch.randn_like(q)

    def loss(q, k, v):
        return (flash_attn_func(q, k, v, causal=causal).float() * dout.float()).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    check_grads(grads, q, k, v, dout, causal, d**-0.5, f"torch.func.grad {bwd_default_key}")
    per_sample = torch.func.vmap(torch.func.grad(
        lambda q, k, v, dout: (flash_attn_func(q, k, v, causal=causal).float()
                               * dout.float()).sum(), argnums=(0, 1, 2)))(
        q[:, None], k[:, None], v[:, None], dout[:, None])
    for i in range(3):
        check_grads([g[i] for g in per_sample], q[i:i + 1], k[i:i + 1], v[i:i + 1],
                    dout[i:i + 1], causal, d**-0.5, f"vmap(grad) entry {i} {bwd_default_key}")
    out = torch.func.vmap(lambda q, k, v: flash_attn_func(q, k, v, causal=causal))(
        q[:, None], k[:, None], v[:, None])
    for i in range(3):
        alone = flash_attn_func(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=causal)
        assert torch.equal(out[i], alone), f"vmap entry {i} {bwd_default_key}"


def test_bwd_opcheck(lib, bwd_default_key):
    dtype_name, d, causal = bwd_default_key
    if d != max(v.head_dim for v in lib.defaults("bwd")):
        pytest.skip("opcheck once per dtype/causal (largest head_dim) keeps the suite short")
    q, k, v = make_qkv(1, 129, 200, 4, 2, d, DTYPES[dtype_name], seed=13)
    scale = d**-0.5
    fwd_name = ops.resolve_variant(ops.check_inputs(q, k, v), causal)
    out, lse = torch.ops.fa3gen.fwd(q, k, v, causal, scale, fwd_name)
    dout = torch.randn_like(q)
    bwd_name = lib.find("bwd", dtype_name, d, causal).name
    torch.library.opcheck(torch.ops.fa3gen.bwd.default,
                          (dout, q, k, v, out, lse, causal, scale, bwd_name, False))
    # The forward op with inputs that need gradients: checks the autograd registration too.
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.fa3gen.fwd.default, (qg, kg, vg, causal, scale, fwd_name, False))


def test_torch_compile_fullgraph(lib, bwd_default_key):
    """A small attention block using fa3gen compiles with fullgraph=True, and its output and
    gradients match eager mode."""
    dtype_name, d, causal = bwd_default_key
    dtype = DTYPES[dtype_name]
    try:  # tracing checks that the forward key's default is built
        lib.find("fwd", dtype_name, d, causal)
    except VariantNotBuiltError:
        pytest.skip("the forward key's default is not in this (subset) library")
    # `block` below is one code object for every parametrization: without a reset, dynamo's
    # recompile limit (8) is hit after 8 keys, which says nothing about fa3gen.
    torch._dynamo.reset()
    torch.manual_seed(14)
    heads = 4
    proj = torch.nn.Linear(heads * d, 3 * heads * d, device="cuda", dtype=dtype)

    def block(x):
        b, s, _ = x.shape
        qkv = proj(x).view(b, s, 3, heads, d)
        out = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal)
        return out.reshape(b, s, heads * d)

    x = torch.randn(2, 200, heads * d, device="cuda", dtype=dtype)
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        xi = x.clone().requires_grad_(True)
        proj.zero_grad()
        y = fn(xi)
        y.float().square().mean().backward()
        results.append((y.detach(), xi.grad, proj.weight.grad.clone()))
    for a, b_ in zip(*results):
        assert torch.allclose(a.float(), b_.float(), atol=2e-2, rtol=2e-2), (a - b_).abs().max()


def test_bwd_input_errors(lib, bwd_default_key):
    dtype_name, d, causal = bwd_default_key
    q, k, v = make_qkv(1, 64, 64, 2, 2, d, DTYPES[dtype_name], seed=15)
    out, lse = forward_for(q, k, v, causal, d**-0.5)
    name = lib.find("bwd", dtype_name, d, causal).name
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    with pytest.raises(InvalidInputError, match="dout must be"):
        ops._bwd_into(out[:, :32], q, k, v, out, lse, dq, dk, dv, causal, 0.1, name)
    with pytest.raises(InvalidInputError, match="lse must be"):
        ops._bwd_into(out, q, k, v, out, lse.half(), dq, dk, dv, causal, 0.1, name)


def test_bwd_empty_keys(lib, bwd_default_key):
    dtype_name, d, causal = bwd_default_key
    q, k, v = make_qkv(1, 5, 0, 2, 2, d, DTYPES[dtype_name])
    out, lse = torch.zeros_like(q), torch.full((1, 2, 5), float("-inf"), device="cuda")
    name = lib.find("bwd", dtype_name, d, causal).name
    dq = torch.full_like(q, float("nan"))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    ops._bwd_into(torch.randn_like(q), q, k, v, out, lse, dq, dk, dv, causal, 0.1, name)
    assert (dq == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("expanded", ["batch", "heads", "rows"])
def test_expanded_kv_gives_the_contiguous_calls_answer(lib, causal, expanded):
    """k and v expanded along one dim (stride 0, which check_layout takes: TMA reads the same
    rows again) give the forward of .contiguous() copies bit for bit, and the same gradient
    of the expanded source (autograd sums the expanded dk, dv). First run as a script on an
    H100 (2026-12-07, fortieth)."""
    b, s, hq, hkv, d = 2, 300, 4, 2, 128
    shape = {"batch": (1, s, hkv, d), "heads": (b, s, 1, d), "rows": (b, 1, hkv, d)}[expanded]
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    src = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    results = []
    for make in (lambda t: t.expand(b, s, hkv, d), lambda t: t.expand(b, s, hkv, d).contiguous()):
        qq, ss = q.clone().requires_grad_(), src.clone().requires_grad_()
        kv = make(ss)
        out = flash_attn_func(qq, kv, kv, causal=causal, deterministic=True)
        results.append((out, *torch.autograd.grad(out, (qq, ss), dout)))
    (out, dq, dsrc), (want, want_dq, want_dsrc) = results
    assert torch.equal(out, want)
    assert torch.equal(dq, want_dq) and torch.equal(dsrc, want_dsrc)
