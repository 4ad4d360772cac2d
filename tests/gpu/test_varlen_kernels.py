"""Variable-length batches on the GPU (flash_attn_varlen_func and the varlen variants):
sequences of unequal lengths packed along the rows, empty sequences, GQA, gradients,
deterministic backward, batches past the tile list's sorted limit, and every varlen variant
through fa3gen.checks. Each sequence is checked against the fp32 reference under the usual
tolerance rule; outputs are NaN-poisoned."""

import itertools
import random

import pytest
import torch

from fa3gen import checks, varlen
from fa3gen.reference import compare_varlen_grads_to_reference, compare_varlen_to_reference
from fa3gen.varlen import flash_attn_varlen_func

from test_forward import DTYPES

pytestmark = pytest.mark.gpu

# (q, k) lengths per sequence. Odd lengths, a sequence longer than several tiles, empty query
# and key sequences, one query against many keys and the reverse.
LENGTHS = {
    "mixed": [(200, 333), (0, 40), (77, 0), (1, 150), (333, 200), (129, 129)],
    "long": [(1500, 1500), (3, 3), (700, 1100)],
    "ones": [(1, 1)] * 7,
    # max_seqlen_k past 1500: specs/h100.yaml's varlen seqlen_k ranges give these other tiles
    "longer": [(1800, 2100), (5, 1601), (1700, 3)],
}


def packed(lengths, hq, hkv, d, dtype, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lq, lk = zip(*lengths)

    def rows(n, h):
        t = torch.randn(n, h, d, device="cuda", dtype=dtype, generator=g)
        return t.requires_grad_() if grad else t

    q, k, v = rows(sum(lq), hq), rows(sum(lk), hkv), rows(sum(lk), hkv)
    cu = [torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32, device="cuda")
          for x in (lq, lk)]
    return q, k, v, cu[0], cu[1], max(lq), max(lk)


def used_keys(cu_k, caps=(150, 40, 5, 7, 1000, 64)):
    """seqused_k for LENGTHS["mixed"]'s keys (each sequence's first min(length, cap)), and what
    packing only those keys takes: (seqused_k, their rows' indices, their cu_seqlens_k)."""
    starts, lengths = cu_k[:-1].tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    used = [min(n, cap) for n, cap in zip(lengths, caps)]
    keep = torch.cat([torch.arange(s, s + n, device="cuda") for s, n in zip(starts, used)])
    cu_used = torch.tensor([0, *itertools.accumulate(used)], dtype=torch.int32, device="cuda")
    return torch.tensor(used, dtype=torch.int32, device="cuda"), keep, cu_used


@pytest.fixture(autouse=True)
def poisoned_workspace(poison_bwd_workspace):
    """Every test here hands the varlen backward a poisoned workspace (conftest.py); its
    preprocess writes every padded row, as the dense one does."""
    poison_bwd_workspace()


def assert_grads_match(key, grads, q, k, v, dout, cu_q, cu_k, causal):
    torch.cuda.synchronize()
    res = compare_varlen_grads_to_reference(grads, q.detach(), k.detach(), v.detach(), dout,
                                            cu_q, cu_k, causal)
    assert res["ok"], f"{key}: {res['why']}"


@pytest.mark.parametrize("case", list(LENGTHS))
@pytest.mark.parametrize("heads", [(8, 2), (2, 2)], ids=["gqa", "mha"])
def test_forward(lib, fwd_varlen_key, case, heads):
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS[case], *heads, d, DTYPES[dtype], seed=31)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                      return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], f"{fwd_varlen_key} {case}: {res['why']}"


def test_forward_seqused_k(lib, fwd_varlen_key):
    """seqused_k (FA3's): sequence b uses the first seqused_k[b] keys of its cu_seqlens_k range
    (causal aligned to that length): the same as packing only those keys."""
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=33)
    seqused, keep, cu_used = used_keys(cu_k)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True,
                                      seqused_k=seqused)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k[keep], v[keep], cu_q, cu_used, causal)
    assert res["ok"], f"{fwd_varlen_key}: {res['why']}"


def _nan_rows(x, rows):
    """x with `rows` NaN rows appended (padding past the last sequence)."""
    return torch.cat([x.detach(), x.new_full((rows, *x.shape[1:]), float("nan"))]).requires_grad_(x.requires_grad)


def test_forward_ignores_unused_rows(lib, fwd_varlen_key):
    """Rows no sequence uses may hold anything, NaN included (an uninitialized cache): rows past
    seqused_k inside a sequence's range, padding after cu_seqlens_q[-1] and cu_seqlens_k[-1].
    The output does not depend on them (their P is 0, but 0 * NaN is NaN in P V unless the
    kernel zeroes them; FA3 and FA4 propagate it)."""
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=35)
    q, k, v = _nan_rows(q, 19), _nan_rows(k, 45), _nan_rows(v, 45)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], f"{fwd_varlen_key} padding: {res['why']}"

    seqused, keep, cu_used = used_keys(cu_k)
    unused = torch.ones(k.shape[0] - 45, dtype=torch.bool, device="cuda")  # padding: NaN already
    unused[keep] = False
    k[:-45][unused] = float("nan")
    v[:-45][unused] = float("nan")
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True,
                                      seqused_k=seqused)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k[keep], v[keep], cu_q, cu_used, causal)
    assert res["ok"], f"{fwd_varlen_key} seqused_k: {res['why']}"


def test_forward_into_poisoned_outputs_and_scale(lib, fwd_varlen_key):
    """Every row of every sequence written (NaN-filled buffers), a key-less sequence gives 0
    and lse -inf, and softmax_scale reaches the kernel."""
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=32)
    out, lse = varlen._empty_outputs(q)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    from fa3gen import ops, runtime
    mask = ops.masking(causal)
    plan = varlen._fwd_plan(q, k, v, cu_q, cu_k, mq, mk, out, lse, mask, 0.3, None,
                            runtime.get_library())
    varlen._fwd_run(plan, q, k, v, cu_q, cu_k, out, lse)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal, 0.3)
    assert res["ok"], res["why"]
    no_keys = slice(200, 277)  # sequence 2: 77 queries, 0 keys
    assert (out[no_keys] == 0).all() and torch.isneginf(lse[:, no_keys]).all()


def test_many_sequences_unsorted_list(lib, fwd_varlen_key):
    """More sequences than the tile list sorts (kVarlenSortedBatch = 1024): batch order."""
    dtype, d, causal = fwd_varlen_key
    rng = random.Random(5)
    lengths = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(1100)]
    q, k, v, cu_q, cu_k, mq, mk = packed(lengths, 2, 1, d, DTYPES[dtype], seed=33)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                      return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], res["why"][:2000]


@pytest.mark.parametrize("case", ["mixed", "long", "longer"])
def test_backward(lib, bwd_varlen_key, case):
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS[case], 8, 2, d, DTYPES[dtype], seed=34,
                                         grad=True)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_match(f"{bwd_varlen_key} {case}", grads, q, k, v, dout, cu_q, cu_k, causal)


def test_torch_func_grad(lib, bwd_varlen_key):
    """torch.func.grad's gradients against the reference (the custom ops under a transform)."""
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=35)
    dout = torch.randn_like(q)

    def loss(q, k, v):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
        return (out.float() * dout.float()).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_grads_match(f"{bwd_varlen_key} torch.func.grad", grads, q, k, v, dout, cu_q, cu_k,
                       causal)


@pytest.mark.parametrize("expanded", ["kv_heads", "q_heads"])
def test_expanded_heads_with_zero_strides(lib, bwd_varlen_key, expanded):
    """Packed rows expand()ed along heads (stride 0) reach the kernels as views: forward and
    gradients of the views against the reference (the dense test's varlen counterpart)."""
    dtype, d, causal = bwd_varlen_key
    heads = (4, 1) if expanded == "kv_heads" else (1, 2)
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], *heads, d, DTYPES[dtype], seed=37,
                                         grad=True)
    if expanded == "kv_heads":
        k, v = k.expand(-1, 4, -1), v.expand(-1, 4, -1)
    else:
        q = q.expand(-1, 4, -1)
    assert 0 in q.stride() + k.stride() + v.stride()
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out.detach(), lse.detach(), q.detach(), k.detach(),
                                      v.detach(), cu_q, cu_k, causal)
    assert res["ok"], f"{bwd_varlen_key} {expanded}: {res['why']}"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_match(f"{bwd_varlen_key} {expanded}", grads, q, k, v, dout, cu_q, cu_k, causal)


def test_backward_ignores_padding_rows(lib, bwd_varlen_key):
    """NaN rows of q, k, v and dout past the last sequence change no gradient of the sequences."""
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=36,
                                         grad=True)
    q, k, v = _nan_rows(q, 19), _nan_rows(k, 45), _nan_rows(v, 45)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    dout = _nan_rows(torch.randn_like(out[:-19]), 19)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_match(bwd_varlen_key, grads, q, k, v, dout, cu_q, cu_k, causal)


def test_padding_rows_are_zeroed(lib, bwd_varlen_key):
    """Into NaN-poisoned outputs, the rows past the last sequence come out 0 (out, dq, dk, dv)
    and their LSE -inf, and the sequences' rows are what they are without padding."""
    from fa3gen import ops, runtime
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=39)
    q, k, v = _nan_rows(q, 19), _nan_rows(k, 45), _nan_rows(v, 45)
    mask, scale, library = ops.masking(causal), d ** -0.5, runtime.get_library()
    out, lse = varlen._empty_outputs(q)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    plan = varlen._fwd_plan(q, k, v, cu_q, cu_k, mq, mk, out, lse, mask, scale, None, library)
    varlen._fwd_run(plan, q, k, v, cu_q, cu_k, out, lse)
    dout = _nan_rows(torch.randn_like(out[:-19]), 19)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    bplan = varlen._bwd_plan(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, dq, dk, dv, mask, scale,
                             None, False, library)
    varlen._bwd_run(bplan, dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv)
    torch.cuda.synchronize()
    assert (out[-19:] == 0).all() and torch.isneginf(lse[:, -19:]).all()
    assert (dq[-19:] == 0).all() and (dk[-45:] == 0).all() and (dv[-45:] == 0).all()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], res["why"]
    assert_grads_match(bwd_varlen_key, (dq, dk, dv), q, k, v, dout, cu_q, cu_k, causal)


def test_backward_seqused_k(lib, bwd_varlen_key):
    """seqused_k in training: the used keys' gradients are those of packing only them, the other
    keys' dk and dv are 0, and what those keys hold (NaN here) changes nothing."""
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=37,
                                         grad=True)
    seqused, keep, cu_used = used_keys(cu_k)
    drop = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    drop[keep] = False
    with torch.no_grad():
        k[drop] = float("nan")
        v[drop] = float("nan")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, seqused_k=seqused)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_match(bwd_varlen_key, (dq, dk[keep], dv[keep]), q, k[keep], v[keep], dout, cu_q,
                       cu_used, causal)
    assert (dk[drop] == 0).all() and (dv[drop] == 0).all()


def test_backward_deterministic_is_bitwise(lib, bwd_varlen_key):
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["long"], 8, 2, d, DTYPES[dtype], seed=35,
                                         grad=True)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    runs = []
    for _ in range(3):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                     deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)
    # Repeatable and right: the deterministic dQ hand-over against the reference too.
    assert_grads_match(bwd_varlen_key, runs[0], q, k, v, dout, cu_q, cu_k, causal)


def test_every_varlen_variant_through_checks(lib, fwd_varlen_variant):
    info = lib.get(fwd_varlen_variant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = checks.check_forward(lib, info, checks.QUICK_PROBLEM, gen)
    assert res["ok"], res["why"]


def test_every_varlen_bwd_variant_through_checks(lib, bwd_varlen_variant):
    info = lib.get(bwd_varlen_variant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = checks.check_backward(lib, info, checks.QUICK_PROBLEM, gen)
    assert res["ok"], res["why"]


def test_opcheck_and_compile(lib, bwd_varlen_key):
    dtype, d, causal = bwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype], seed=36,
                                         grad=True)
    name = lib.find("fwd", dtype, d, causal, varlen=True).name
    torch.library.opcheck(torch.ops.fa3gen.varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, mq, mk, causal, d**-0.5, name, False, -1, -1, 0.0))
    torch._dynamo.reset()  # each key compiles afresh (no automatic-dynamic head_dim)
    # deterministic: the gradients must then match bitwise (fp32 atomics would reorder dq)
    eager = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, deterministic=True)
    compiled = torch.compile(lambda *a: flash_attn_varlen_func(
        *a, mq, mk, causal=causal, deterministic=True), fullgraph=True)
    got = compiled(q, k, v, cu_q, cu_k)
    assert torch.equal(got, eager)
    for want, have in zip(torch.autograd.grad(eager.float().sum(), (q, k, v)),
                          torch.autograd.grad(got.float().sum(), (q, k, v))):
        assert torch.equal(want, have)  # dq, dk and dv


def test_gpu_input_errors(lib, fwd_varlen_key):
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["mixed"], 8, 2, d, DTYPES[dtype])
    with pytest.raises(varlen.InvalidInputError, match="cu_seqlens_q is on cpu"):
        flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k, mq, mk, causal=causal)
    with pytest.raises(varlen.InvalidInputError, match=r"k.stride\(-1\)"):
        flash_attn_varlen_func(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, cu_q, cu_k,
                               mq, mk, causal=causal)


def test_compile_with_lengths_that_change(lib, fwd_varlen_key):
    """One compiled function over batches whose total and max_seqlen change (dynamo makes
    them dynamic after the first recompile): same results as eager."""
    dtype, d, causal = fwd_varlen_key
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, cu, m: flash_attn_varlen_func(
        q, k, v, cu, cu, m, m, causal=causal), fullgraph=True)
    for lengths in ([100, 300, 7], [50, 900], [1000, 2, 3, 4], [64] * 9):
        q, k, v, cu, _, m, _ = packed([(n, n) for n in lengths], 8, 2, d, DTYPES[dtype])
        assert torch.equal(f(q, k, v, cu, m),
                           flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=causal))


@pytest.mark.parametrize("case", ["mixed", "long", "ones"])
def test_forward_persistent_grid(lib, fwd_varlen_key, case, monkeypatch):
    """FA3GEN_GRID=persistent: one CTA per multiprocessor walks the tile list."""
    monkeypatch.setenv("FA3GEN_GRID", "persistent")
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS[case] * 40, 8, 2, d, DTYPES[dtype], seed=37)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                      return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], f"{fwd_varlen_key} {case}: {res['why'][:1000]}"


def test_understated_max_seqlen_still_computes_every_tile(lib, fwd_varlen_key):
    """The tile list is sized from the totals, not from max_seqlen: a max_seqlen below the
    longest sequence (a caller's mistake that FA3GEN_DEBUG_CHECKS reports) still gives the
    right answer for causal and non-causal attention."""
    dtype, d, causal = fwd_varlen_key
    q, k, v, cu_q, cu_k, mq, mk = packed(LENGTHS["long"], 8, 2, d, DTYPES[dtype], seed=38)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=causal,
                                      return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], res["why"][:1000]


def test_generous_max_seqlen_over_many_sequences(lib, fwd_varlen_key):
    """The launch's tile bound counts the tile list (from total_q), not max_seqlen_q's tiles
    for every sequence: a max_seqlen_q of 3 * 2^20 over 2048 short sequences and 32 heads
    (2^30 tiles and more by that count) runs and gives the right answer."""
    dtype, d, causal = fwd_varlen_key
    rng = random.Random(7)
    lengths = [(rng.randint(1, 3), rng.randint(0, 3)) for _ in range(2048)]
    q, k, v, cu_q, cu_k, _, mk = packed(lengths, 32, 4, d, DTYPES[dtype], seed=39)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3 << 20, mk, causal=causal,
                                      return_lse=True)
    torch.cuda.synchronize()
    res = compare_varlen_to_reference(out, lse, q, k, v, cu_q, cu_k, causal)
    assert res["ok"], res["why"][:1000]
