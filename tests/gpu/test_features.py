"""Sliding-window (local) and softcap attention on the GPU, through flash_attn_func: window
shapes, seqlen_q != seqlen_k, rows that see no key, windows wider than the sequence, softcap
values, gradients, and deterministic backward (the dQ semaphores of a band of key blocks).
Each default variant with a feature is checked against the fp32 reference under the usual
tolerance rule (fa3gen.reference)."""

import pytest
import torch

from fa3gen import ops
from fa3gen.checks import CHECK_SCALE_FACTOR
from fa3gen.ops import flash_attn_func
from fa3gen.reference import compare_grads_to_reference, compare_to_reference

from test_forward import DTYPES, make_qkv

pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [(1, 300, 300, 8, 2), (2, 257, 513, 4, 4), (1, 513, 257, 2, 1), (1, 1, 700, 2, 2)]
# (left, right); a causal key only uses left (right is 0). 5000 is wider than every sequence.
WINDOWS = [(0, 0), (0, 37), (37, 0), (130, 61), (-1, 50), (50, -1), (5000, 5000), (1, 200)]
SOFTCAPS = [0.5, 5.0, 50.0, 60.0]  # 50 and 60: either side of a bound in softmax.cuh


def _call_args(key, window, softcap):
    """flash_attn_func keywords that reach `key`'s variant."""
    _, _, causal, local, has_cap = key
    if not local:
        window = (-1, -1)
    elif window == (-1, -1):
        window = (64, 64)
    return dict(causal=causal, window_size=window, softcap=softcap if has_cap else 0.0)


def _ids(x):
    return "x".join(map(str, x)) if isinstance(x, tuple) else str(x)


@pytest.mark.parametrize("window", WINDOWS, ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_windows(lib, fwd_feature_key, shape, window):
    dtype, d, causal, local, _ = fwd_feature_key
    if not local and window != WINDOWS[0]:
        pytest.skip("no window: one window is enough")
    kw = _call_args(fwd_feature_key, window, 4.0)
    b, sq, sk, hq, hkv = shape
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, DTYPES[dtype], seed=21)
    mask = ops.masking(kw["causal"], kw["window_size"], kw["softcap"])
    name = ops.resolve_variant(ops.check_inputs(q, k, v), mask)
    assert lib.get(name).key[1:6] == fwd_feature_key, "served by a variant of another key"
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    torch.cuda.synchronize()
    res = compare_to_reference(out, lse, q, k, v, kw["causal"], None,
                               window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{fwd_feature_key} {shape} {kw}: {res['why']}"
    seen_by_none = torch.isneginf(lse)
    assert (out.transpose(1, 2)[seen_by_none] == 0).all(), "a row that sees no key must give 0"


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_forward_softcap_values(lib, fwd_feature_key, softcap):
    dtype, d, _, _, has_cap = fwd_feature_key
    if not has_cap:
        pytest.skip("no softcap")
    kw = _call_args(fwd_feature_key, (96, 0), softcap)
    q, k, v = make_qkv(2, 400, 400, 8, 2, d, DTYPES[dtype], seed=22)
    q = q * 3  # larger scores: the cap saturates
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    torch.cuda.synchronize()
    res = compare_to_reference(out, lse, q, k, v, kw["causal"], None,
                               window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{fwd_feature_key} softcap={softcap}: {res['why']}"


@pytest.mark.parametrize("softcap", [5.0, 50.0, 60.0])
def test_forward_softcap_saturated_low(lib, fwd_feature_key, softcap):
    """Every score far below -cap: every capped score is -cap (tanh saturated at -1), so each row
    attends uniformly; no probability may underflow to an empty row."""
    dtype, d, _, _, has_cap = fwd_feature_key
    if not has_cap:
        pytest.skip("no softcap")
    kw = _call_args(fwd_feature_key, (96, 0), softcap)
    q, k, v = make_qkv(1, 300, 300, 2, 2, d, DTYPES[dtype], seed=23)
    q, k = q.abs() + 1, -(k.abs() + 1)  # every q . k <= -d
    out, lse = flash_attn_func(q, k, v, softmax_scale=8.0 * softcap / d, return_lse=True, **kw)
    torch.cuda.synchronize()
    res = compare_to_reference(out, lse, q, k, v, kw["causal"], 8.0 * softcap / d,
                               window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{fwd_feature_key} softcap={softcap}: {res['why']}"


@pytest.mark.parametrize("window", [(37, 0), (130, 61), (5000, 5000)], ids=_ids)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=_ids)
def test_backward_windows(lib, bwd_feature_key, shape, window):
    """Autograd through flash_attn_func: the backward variant of the key, with the same window
    and softcap as the forward."""
    dtype, d, _, local, _ = bwd_feature_key
    if not local and window != (37, 0):
        pytest.skip("no window: one window is enough")
    kw = _call_args(bwd_feature_key, window, 3.0)
    b, sq, sk, hq, hkv = shape
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, DTYPES[dtype], seed=23)
    for t in (q, k, v):
        t.requires_grad_(True)
    scale = CHECK_SCALE_FACTOR * d**-0.5  # not the default: a backward must use the one given
    out = flash_attn_func(q, k, v, scale, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    res = compare_grads_to_reference(grads, q.detach(), k.detach(), v.detach(), dout,
                                     kw["causal"], scale, window_size=kw["window_size"],
                                     softcap=kw["softcap"])
    assert res["ok"], f"{bwd_feature_key} {shape} {kw}: {res['why']}"


def repeated_grads(call, inputs, dout, what, times=3):
    """dq, dk, dv of call(q, k, v) on fresh leaf copies of `inputs`, `times` times; asserts the
    runs are bitwise equal and returns the first."""
    runs = []
    for _ in range(times):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        runs.append(torch.autograd.grad(call(*leaves), leaves, dout))
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{what}: {name} differs between runs"
    return runs[0]


def test_backward_deterministic(lib, bwd_feature_key):
    """Deterministic mode is bitwise repeatable: with a window, a query block's dQ comes from a
    band of key blocks that starts above 0 (the semaphore turn counts from the band's first)."""
    dtype, d, _, _, _ = bwd_feature_key
    kw = _call_args(bwd_feature_key, (300, 200), 3.0)
    q, k, v = make_qkv(2, 900, 1100, 8, 2, d, DTYPES[dtype], seed=24)
    dout = torch.randn_like(q)
    scale = CHECK_SCALE_FACTOR * d**-0.5
    grads = repeated_grads(lambda *qkv: flash_attn_func(*qkv, scale, deterministic=True, **kw),
                           (q, k, v), dout, bwd_feature_key)
    res = compare_grads_to_reference(grads, q, k, v, dout, kw["causal"], scale,
                                     window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{bwd_feature_key}: {res['why']}"


def test_feature_opcheck(lib, bwd_feature_key):
    """The custom ops with window and softcap arguments pass torch.library.opcheck (schema,
    fake implementation, autograd registration)."""
    dtype, d, _, _, _ = bwd_feature_key
    kw = _call_args(bwd_feature_key, (50, 20), 3.0)
    mask = ops.masking(kw["causal"], kw["window_size"], kw["softcap"])
    q, k, v = make_qkv(1, 129, 200, 8, 2, d, DTYPES[dtype], seed=25)
    fwd = ops.resolve_variant(ops.check_inputs(q, k, v), mask)
    args = (mask.causal, d**-0.5, fwd, False, mask.window_left, mask.window_right, mask.softcap)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.fa3gen.fwd.default, (qg, kg, vg, *args))
    out, lse = torch.ops.fa3gen.fwd(q, k, v, *args)
    bwd = ops.resolve_bwd_variant(q, d, mask)
    torch.library.opcheck(torch.ops.fa3gen.bwd.default,
                          (torch.randn_like(q), q, k, v, out, lse, mask.causal, d**-0.5, bwd, False,
                           mask.window_left, mask.window_right, mask.softcap))
