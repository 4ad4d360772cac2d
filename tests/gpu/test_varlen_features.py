"""Variable-length batches with a sliding window or softcap on the GPU (flash_attn_varlen_func
with window_size / softcap: packed training of Mistral-, Gemma- and gpt-oss-style layers). Each
default varlen variant with a feature is checked per sequence against the fp32 reference under
the usual tolerance rule: window shapes, sequences shorter than the window and empty ones,
GQA, a max_seqlen below the longest sequence, both grids, gradients and the deterministic
backward. Outputs are NaN-poisoned."""

import pytest
import torch

from fa3gen import ops, varlen
from fa3gen.reference import compare_varlen_grads_to_reference, compare_varlen_to_reference
from fa3gen.varlen import flash_attn_varlen_func

from test_features import _call_args, _ids, repeated_grads
from test_forward import DTYPES
from test_varlen_kernels import LENGTHS, packed

pytestmark = pytest.mark.gpu

# (left, right); a causal key only uses left (right is 0). 5000 is wider than every sequence.
WINDOWS = [(0, 0), (0, 37), (37, 0), (130, 61), (-1, 50), (50, -1), (5000, 5000)]


def _check_forward(key, q, k, v, cu_q, cu_k, mq, mk, kw, what=""):
    """The call's plan (what flash_attn_varlen_func runs for these arguments), launched into
    NaN-filled outputs, against the reference per sequence."""
    out, lse = varlen._empty_outputs(q)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    plan = varlen._eager_plan(q, k, v, cu_q, cu_k, mq, mk, ops.masking(**kw), None, None)
    assert lib_key(plan.info) == key, f"served by {plan.info.name}, a variant of another key"
    varlen._fwd_run(plan, q, k, v, cu_q, cu_k, out, lse)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, kw["causal"],
                                      window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{key} {what} {kw}: {res['why'][:2000]}"
    seen_by_none = torch.isneginf(lse).transpose(0, 1)  # (total_q, heads)
    assert (out[seen_by_none] == 0).all(), "a row that sees no key must give 0"
    # The public call gives the same bits.
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)
    assert torch.equal(got, out), f"{key} {what}: flash_attn_varlen_func differs from its plan"


def lib_key(info):
    """(dtype, head_dim, causal, local, softcap) of a variant."""
    return info.key[1:6]


@pytest.mark.parametrize("window", WINDOWS, ids=_ids)
@pytest.mark.parametrize("case", list(LENGTHS))
@pytest.mark.parametrize("heads", [(8, 2), (2, 2)], ids=["gqa", "mha"])
def test_forward_windows(lib, fwd_varlen_feature_key, case, heads, window):
    dtype, d, _, local, _ = fwd_varlen_feature_key
    if not local and window != WINDOWS[0]:
        pytest.skip("no window: one window is enough")
    kw = _call_args(fwd_varlen_feature_key, window, 4.0)
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS[case], *heads, d, DTYPES[dtype], seed=41)
    _check_forward(fwd_varlen_feature_key, q, k, v, cu_q, cu_k, mq, mk, kw, case)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0, 60.0])
def test_forward_softcap_values(lib, fwd_varlen_feature_key, softcap):
    dtype, d, _, _, has_cap = fwd_varlen_feature_key
    if not has_cap:
        pytest.skip("no softcap")
    kw = _call_args(fwd_varlen_feature_key, (96, 0), softcap)
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=42)
    q = q * 3  # larger scores: the cap saturates
    _check_forward(fwd_varlen_feature_key, q, k, v, cu_q, cu_k, mq, mk, kw)


@pytest.mark.parametrize("window", [(-1, 3), (40, 0)], ids=_ids)
def test_understated_max_seqlen(lib, fwd_varlen_feature_key, window):
    """max_seqlen below the longest sequence (a caller's mistake FA3GEN_DEBUG_CHECKS reports):
    an unbounded side of the window still reaches every key of a sequence."""
    dtype, d, _, local, _ = fwd_varlen_feature_key
    kw = _call_args(fwd_varlen_feature_key, window, 4.0)
    q, k, v, cu_q, cu_k, _, _ = packed(LENGTHS["long"], 8, 2, d, DTYPES[dtype], seed=43)
    _check_forward(fwd_varlen_feature_key, q, k, v, cu_q, cu_k, 64, 64, kw)


@pytest.mark.parametrize("grid", ["persistent", "tiles"])
def test_forward_grids(lib, fwd_varlen_feature_key, grid, monkeypatch):
    """Both schedules over the tile list: one CTA per multiprocessor walking it, and one CTA
    per tile; more sequences than the list sorts (1024) in batch order."""
    monkeypatch.setenv("FA3GEN_GRID", grid)
    dtype, d, _, _, _ = fwd_varlen_feature_key
    kw = _call_args(fwd_varlen_feature_key, (130, 61), 4.0)
    lengths = LENGTHS["mixed"] * 40 + [(i % 9, (i * 7) % 11) for i in range(1100)]
    q, k, v, cu_q, cu_k, mq, mk = packed(lengths, 8, 2, d, DTYPES[dtype], seed=44)
    _check_forward(fwd_varlen_feature_key, q, k, v, cu_q, cu_k, mq, mk, kw, grid)


@pytest.mark.parametrize("window", [(37, 0), (130, 61), (5000, 5000)], ids=_ids)
@pytest.mark.parametrize("case", ["mixed", "long"])
def test_backward_windows(lib, bwd_varlen_feature_key, case, window):
    dtype, d, _, local, _ = bwd_varlen_feature_key
    if not local and window != (37, 0):
        pytest.skip("no window: one window is enough")
    kw = _call_args(bwd_varlen_feature_key, window, 3.0)
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS[case], 8, 2, d, DTYPES[dtype], seed=45,
                                         grad=True)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    res = compare_varlen_grads_to_reference(grads, q.detach(), k.detach(), v.detach(), dout,
                                            cu_q, cu_k, kw["causal"],
                                            window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{bwd_varlen_feature_key} {case} {kw}: {res['why'][:2000]}"


def test_backward_deterministic(lib, bwd_varlen_feature_key):
    """deterministic=True is bitwise repeatable and right with a band of key blocks per query
    block (the dQ semaphore turn counts from the band's first block)."""
    dtype, d, _, _, _ = bwd_varlen_feature_key
    kw = _call_args(bwd_varlen_feature_key, (300, 200), 3.0)
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["long"], 8, 2, d, DTYPES[dtype], seed=46)
    dout = torch.randn_like(q)
    grads = repeated_grads(lambda *qkv: flash_attn_varlen_func(
        *qkv, cu_q, cu_k, mq, mk, deterministic=True, **kw), (q, k, v), dout, bwd_varlen_feature_key)
    torch.cuda.synchronize()
    res = compare_varlen_grads_to_reference(grads, q, k, v, dout, cu_q, cu_k, kw["causal"],
                                            window_size=kw["window_size"], softcap=kw["softcap"])
    assert res["ok"], f"{bwd_varlen_feature_key}: {res['why'][:2000]}"


def test_opcheck(lib, bwd_varlen_feature_key):
    """The varlen custom op with window and softcap arguments passes torch.library.opcheck."""
    dtype, d, _, _, _ = bwd_varlen_feature_key
    kw = _call_args(bwd_varlen_feature_key, (50, 20), 3.0)
    mask = ops.masking(**kw)
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=47,
                                         grad=True)
    name = lib.find("fwd", dtype, d, variant=None, varlen=True, **mask.key()).name
    torch.library.opcheck(torch.ops.fa3gen.varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, mq, mk, mask.causal, d**-0.5, name, False,
                           mask.window_left, mask.window_right, mask.softcap))
