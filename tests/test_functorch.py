"""flash_attn_func and flash_attn_varlen_func under torch.func's transforms (grad, vjp, vmap
and their compositions), on CPU: the fake library answers the dispatch, and the bodies of the
custom ops (fa3gen::fwd / bwd, fa3gen::varlen_fwd / varlen_bwd) compute fa3gen.reference's
attention and gradients instead of launching kernels, so what is checked is the plumbing
(which op runs, on what, how often), against the same reference called directly."""
import pytest
import torch

from fa3gen import Fa3genError, ops, packed, varlen
from fa3gen.reference import attention_grad_reference, attention_reference, sequences


@pytest.fixture
def reference_ops(fake_launches, monkeypatch):
    """The ops' bodies as the reference; returns the (direction, batch) of each body call."""
    calls = []

    def masked(mask):  # the reference's mask arguments for a Masking
        return dict(window_size=(mask.window_left, mask.window_right), softcap=mask.softcap)

    def forward(q, k, v, mask, softmax_scale, variant):
        assert type(q) is torch.Tensor  # the body never sees a transform's wrapper
        calls.append(("fwd", q.shape[0]))
        out, lse = attention_reference(q, k, v, mask.causal, softmax_scale, **masked(mask))
        return out.to(q.dtype), lse

    def backward(dout, q, k, v, out, lse, mask, softmax_scale, variant, deterministic):
        assert type(dout) is torch.Tensor
        calls.append(("bwd", q.shape[0]))
        # out and lse arrive as the forward gave them for these q, k, v (a vmap fold that
        # mixed up their rows would show here: the reference gradients do not read them)
        want_out, want_lse = attention_reference(q, k, v, mask.causal, softmax_scale,
                                                 **masked(mask))
        assert torch.equal(out, want_out.to(q.dtype)) and torch.equal(lse, want_lse)
        grads = attention_grad_reference(q, k, v, dout, mask.causal, softmax_scale,
                                         **masked(mask))
        return tuple(g.to(q.dtype) for g in grads)  # the kernels' gradients are in q's dtype

    def per_sequence(fn, cu_q, cu_k, *tensors):
        """fn on each sequence (a batch of one), its outputs concatenated along the rows."""
        parts = []
        for rows_q, rows_k in sequences(cu_q, cu_k):
            dout, q, k, v = (t[rows][None] if t is not None else None for t, rows in
                             zip(tensors, (rows_q, rows_q, rows_k, rows_k)))
            parts.append(fn(dout, q, k, v))
        return parts

    def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, mask, softmax_scale, variant,
                       seqused_k):
        calls.append(("varlen_fwd", len(cu_q) - 1))
        parts = per_sequence(lambda _, q, k, v: attention_reference(
            q, k, v, mask.causal, softmax_scale, **masked(mask)), cu_q, cu_k, None, q, k, v)
        return (torch.cat([o[0] for o, _ in parts]).to(q.dtype),
                torch.cat([lse[0] for _, lse in parts], dim=-1))

    def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, mask,
                        softmax_scale, variant, deterministic, seqused_k):
        calls.append(("varlen_bwd", len(cu_q) - 1))
        parts = per_sequence(lambda dout, q, k, v: attention_grad_reference(
            q, k, v, dout, mask.causal, softmax_scale, **masked(mask)), cu_q, cu_k, dout, q, k, v)
        return tuple(torch.cat([p[i][0] for p in parts]).to(q.dtype) for i in range(3))

    monkeypatch.setattr(ops, "_forward", forward)
    monkeypatch.setattr(ops, "_backward", backward)
    monkeypatch.setattr(varlen, "_forward", varlen_forward)
    monkeypatch.setattr(varlen, "_backward", varlen_backward)
    return calls


def _grads(q, k, v, dout):
    return [g.to(q.dtype) for g in attention_grad_reference(q, k, v, dout)]


def _inputs(*batch, seqlen=16, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, seqlen, heads, 128, generator=g).to(torch.bfloat16)
            for _ in range(3)]


def _loss(q, k, v):
    return ops.flash_attn_func(q, k, v).float().sum()


def test_grad_runs_the_backward_op(reference_ops):
    q, k, v = _inputs(2)
    grads = torch.func.grad(_loss, argnums=(0, 1, 2))(q, k, v)
    want = _grads(q, k, v, torch.ones_like(q))
    for got, w in zip(grads, want):
        assert got.dtype == q.dtype and torch.equal(got, w)
    assert reference_ops == [("fwd", 2), ("bwd", 2)]


def test_grad_of_the_packed_function(reference_ops):
    q, k, v = _inputs(1)
    qkv = torch.stack([q, k, v], dim=2)
    grad = torch.func.grad(lambda t: packed.flash_attn_qkvpacked_func(t).float().sum())(qkv)
    for got, w in zip(grad.unbind(2), _grads(q, k, v, torch.ones_like(q))):
        assert torch.equal(got, w)


def test_vjp_takes_any_cotangent(reference_ops):
    q, k, v = _inputs(1)
    out, pullback = torch.func.vjp(lambda q, k, v: ops.flash_attn_func(q, k, v), q, k, v)
    assert torch.equal(out, attention_reference(q, k, v)[0].to(q.dtype))
    dout = _inputs(1, seed=1)[0]
    for got, w in zip(pullback(dout), _grads(q, k, v, dout)):
        assert torch.equal(got, w)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (1, None, None)])
def test_vmap_is_one_call_over_the_folded_batch(reference_ops, in_dims):
    """A vmapped dimension (at any position; inputs without one are shared) joins the batch:
    one launch, and each entry's output is what a call on that entry alone gives."""
    batched = _inputs(3, 2)
    args = [t.movedim(0, d) if d is not None else t[0] for t, d in zip(batched, in_dims)]
    out, lse = torch.func.vmap(lambda q, k, v: ops.flash_attn_func(q, k, v, return_lse=True),
                               in_dims=in_dims)(*args)
    assert reference_ops == [("fwd", 6)]
    assert out.shape == (3, 2, 16, 2, 128) and lse.shape == (3, 2, 2, 16)
    for i in range(3):
        q, k, v = (t[i] if d is not None else t[0] for t, d in zip(batched, in_dims))
        want_out, want_lse = attention_reference(q, k, v)
        torch.testing.assert_close(out[i], want_out.to(q.dtype), rtol=0, atol=0)
        torch.testing.assert_close(lse[i], want_lse, rtol=1e-6, atol=1e-6)


def test_the_ops_own_vmap_rules_fold_too(reference_ops):
    """vmap over the custom ops themselves (as a compiled graph may call them): one call each,
    and the backward's result is each entry's."""
    q, k, v = _inputs(3, 1)
    fwd = torch.func.vmap(lambda q, k, v: torch.ops.fa3gen.fwd(q, k, v, False, 0.5, ""))
    out, lse = fwd(q, k, v)
    dout = _inputs(3, 1, seed=1)[0]
    grads = torch.func.vmap(lambda *t: torch.ops.fa3gen.bwd(*t, False, 0.5, "", False))(
        dout, q, k, v, out, lse)
    assert reference_ops == [("fwd", 3), ("bwd", 3)]
    for i in range(3):
        want = attention_grad_reference(q[i], k[i], v[i], dout[i], False, 0.5)
        for got, w in zip(grads, want):
            assert torch.equal(got[i], w.to(q.dtype))


def test_per_sample_gradients_by_vmap_of_grad(reference_ops):
    """vmap(grad(loss)): each entry's gradients, from one forward and one backward launch."""
    batched = _inputs(3, 1)
    grads = torch.func.vmap(torch.func.grad(_loss, argnums=(0, 1, 2)))(*batched)
    assert reference_ops == [("fwd", 3), ("bwd", 3)]
    for i in range(3):
        q, k, v = (t[i] for t in batched)
        want = _grads(q, k, v, torch.ones_like(q))
        for got, w in zip(grads, want):
            assert torch.equal(got[i], w)


def test_jacrev(reference_ops):
    q, k, v = _inputs(1, seqlen=2, heads=1)
    jac = torch.func.jacrev(lambda q: ops.flash_attn_func(q, k, v).float())(q)
    assert jac.shape == q.shape + q.shape
    assert reference_ops == [("fwd", 1), ("bwd", 256)]  # one backward for every output entry
    dout = torch.zeros_like(q)
    dout[0, 1, 0, 5] = 1
    assert torch.equal(jac[0, 1, 0, 5].to(q.dtype), _grads(q, k, v, dout)[0])


def test_varlen_grad_and_vmap(reference_ops):
    """flash_attn_varlen_func (causal, two sequences of 5 and 11 rows) under grad: each
    sequence's reference gradients; under vmap: one call per vmapped entry."""
    q, k, v = (t[0] for t in _inputs(1))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)

    def loss(q, k, v):
        return varlen.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True).float().sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert reference_ops == [("varlen_fwd", 2), ("varlen_bwd", 2)]
    for rows in (slice(0, 5), slice(5, 16)):
        seq = [t[rows][None] for t in (q, k, v)]
        want = [g.to(q.dtype) for g in attention_grad_reference(*seq, torch.ones_like(seq[0]),
                                                                True)]
        for got, w in zip(grads, want):
            assert torch.equal(got[rows], w[0])
    batched = [torch.stack([t, t.flip(0)]) for t in (q, k, v)]
    out = torch.func.vmap(lambda q, k, v: varlen.flash_attn_varlen_func(
        q, k, v, cu, cu, 11, 11, causal=True))(*batched)
    assert out.shape == (2, 16, 2, 128) and reference_ops[2:] == [("varlen_fwd", 2)] * 2
    for rows in (slice(0, 5), slice(5, 16)):  # the second entry: each sequence's reference
        want = attention_reference(*(t[1][rows][None] for t in batched), True)[0]
        assert torch.equal(out[1][rows], want[0].to(q.dtype))


# torch's forward-mode set-up scripts its decompositions with the deprecated torch.jit.script
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_second_derivatives_and_forward_mode_are_errors(reference_ops):
    q, k, v = _inputs(1)
    with pytest.raises(Fa3genError, match="no second derivative"):
        torch.func.grad(lambda q: torch.func.grad(_loss)(q, k, v).float().sum())(q)
    # dq differentiated with respect to v (a gradient penalty's pattern): an error too, not
    # the zeros of a guard tied to q alone
    with pytest.raises(Fa3genError, match="no second derivative"):
        torch.func.grad(lambda v: torch.func.grad(_loss)(q, k, v).float().sum())(v)
    with pytest.raises(Fa3genError, match="no forward-mode derivative"):
        torch.func.jvp(lambda q: ops.flash_attn_func(q, k, v), (q,), (q,))


def test_vmap_over_empty_sequences(reference_ops):
    """seqlen 0 (no rows to fold by -1): empty outputs of the vmapped shape."""
    q, k, v = _inputs(3, 1, seqlen=0)
    out, lse = torch.func.vmap(lambda q, k, v: ops.flash_attn_func(q, k, v, return_lse=True))(
        q, k, v)
    assert out.shape == (3, 1, 0, 2, 128) and lse.shape == (3, 1, 2, 0)


def test_vmap_over_no_entries(reference_ops):
    """A vmapped size of 0 (dense: 0 entries, the batch was divided by it; varlen: no entry
    to call): outputs with no entries, as torch's own ops give."""
    q, k, v = _inputs(0, 2)
    out, lse = torch.func.vmap(lambda q, k, v: ops.flash_attn_func(q, k, v, return_lse=True))(
        q, k, v)
    assert out.shape == (0, 2, 16, 2, 128) and lse.shape == (0, 2, 2, 16)
    grads = torch.func.vmap(torch.func.grad(_loss, argnums=(0, 1, 2)))(q, k, v)
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    out, lse = torch.func.vmap(lambda q, k, v: varlen.flash_attn_varlen_func(
        q, k, v, cu, cu, 11, 11, causal=True, return_lse=True))(q[:, 0], k[:, 0], v[:, 0])
    assert out.shape == (0, 16, 2, 128) and lse.shape == (0, 2, 16) and lse.dtype == torch.float32
    assert [name for name, _ in reference_ops] == ["fwd", "fwd", "bwd"]  # the dense ones only


def test_functionalize_keeps_the_custom_op(reference_ops):
    """functionalize has no rule for a Function: the call stays the custom op there."""
    q, k, v = _inputs(1)
    out = torch.func.functionalize(lambda q, k, v: ops.flash_attn_func(q, k, v))(q, k, v)
    assert torch.equal(out, attention_reference(q, k, v)[0].to(q.dtype))
    assert reference_ops == [("fwd", 1)]


def test_plain_autograd_keeps_the_eager_path(reference_ops, monkeypatch):
    """Outside a transform, nothing changes: the eager Function (its launches stubbed), not
    the custom ops."""
    monkeypatch.setattr(ops._TransformedAttention, "apply", None)  # would fail if called
    q, k, v = (t.requires_grad_() for t in _inputs(1))
    _loss(q, k, v).backward()
    assert reference_ops == [] and q.grad is not None


@pytest.fixture
def windowed_library(reference_ops, tmp_path, monkeypatch):
    """reference_ops on the fake library with the windowed backward and varlen rows added."""
    from tests.test_api import WINDOW_ROWS
    from tests.test_runtime_errors import FAKE_LIB_C, build_fake_lib

    source = FAKE_LIB_C.replace("\n};\n#define COUNT", WINDOW_ROWS + "};\n#define COUNT", 1)
    monkeypatch.setenv("FA3GEN_LIB", str(build_fake_lib(tmp_path, source=source, name="win")))
    return reference_ops


def test_gqa_window_and_softcap_reach_the_ops(windowed_library):
    """GQA (4 query heads on 2 kv heads), a sliding window, softcap and a scale under
    vmap(grad), and GQA with a window under varlen grad: each entry's gradients are the
    reference's for the same arguments (a transform that dropped one would change them)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 1, 16, h, 128, generator=g).to(torch.bfloat16)
               for h in (4, 2, 2))

    def loss(q, k, v):
        return ops.flash_attn_func(q, k, v, softmax_scale=0.3, window_size=(3, 2),
                                   softcap=5.0).float().sum()

    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert windowed_library == [("fwd", 3), ("bwd", 3)]
    for i in range(3):
        want = attention_grad_reference(q[i], k[i], v[i], torch.ones_like(q[i]), False, 0.3,
                                        window_size=(3, 2), softcap=5.0)
        for got, w in zip(grads, want):
            assert got[i].shape == w.shape and torch.equal(got[i], w.to(q.dtype))

    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, k, v = (t[0, 0] for t in (q, k, v))
    grads = torch.func.grad(lambda q, k, v: varlen.flash_attn_varlen_func(
        q, k, v, cu, cu, 11, 11, softmax_scale=0.3, window_size=(3, 2)).float().sum(),
        argnums=(0, 1, 2))(q, k, v)
    assert windowed_library[2:] == [("varlen_fwd", 2), ("varlen_bwd", 2)]
    for rows in (slice(0, 5), slice(5, 16)):
        seq = [t[rows][None] for t in (q, k, v)]
        want = attention_grad_reference(*seq, torch.ones_like(seq[0]), False, 0.3,
                                        window_size=(3, 2))
        for got, w in zip(grads, want):
            assert torch.equal(got[rows], w[0].to(q.dtype))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's forward-mode set-up
def test_forward_mode_and_the_double_backward_trick_are_errors_on_the_eager_path(fake_launches):
    """Outside torch.func: a dual input (torch.autograd.forward_ad) would lose its tangent, and
    autograd.functional.jvp (vjp with create_graph, then a derivative with respect to the
    cotangent) would give zeros; both raise instead, for the dense, packed and varlen calls."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = _inputs(1)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    calls = {"dense": lambda q: ops.flash_attn_func(q, k, v),
             "packed": lambda q: packed.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2)),
             "varlen": lambda q: varlen.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16,
                                                               causal=True)}
    for name, call in calls.items():
        with fwAD.dual_level(), pytest.raises(Fa3genError, match="no forward-mode derivative"):
            call(fwAD.make_dual(q, torch.ones_like(q)))
        with pytest.raises(Fa3genError, match="no second derivative"):
            torch.autograd.functional.jvp(lambda q: call(q).float(), q, torch.ones_like(q))
    with fwAD.dual_level():  # a dual level alone, no dual input: the call runs
        assert calls["dense"](q).shape == q.shape


def test_grad_of_a_chunked_prefill(reference_ops, monkeypatch):
    """flash_attn_with_kvcache's chunked prefill is differentiable in q (eagerly, and now under
    torch.func.grad, where its alignment check had read q's data pointer: a wrapper without
    storage, a RuntimeError)."""
    from fa3gen import contract, kvcache
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib=None: None)
    cache = _inputs(2, seqlen=96)[0]
    q = _inputs(2, seqlen=32, seed=1)[0]

    def loss(q):
        return kvcache.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=80).float().sum()

    got = torch.func.grad(loss)(q)
    keys = cache[:, :80]  # non-causal: every query sees the 80 keys
    want = attention_grad_reference(q, keys, keys, torch.ones_like(q), False)[0].to(q.dtype)
    assert got.abs().sum() > 0 and torch.equal(got, want)


def test_batched_gradients_through_an_eager_call_are_one_clear_error(fake_launches):
    """autograd.grad(..., is_grads_batched=True) (jacobian / hessian with vectorize=True) hands
    the eager backward a dout without storage: it had failed in torch's data_ptr."""
    q, k, v = (t.requires_grad_() for t in _inputs(1))
    out = ops.flash_attn_func(q, k, v)
    douts = torch.ones(3, *out.shape, dtype=out.dtype)
    with pytest.raises(Fa3genError, match="batched gradients through an eager fa3gen call"):
        torch.autograd.grad(out, q, douts, is_grads_batched=True)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    out = varlen.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 11, 11, causal=True)
    with pytest.raises(Fa3genError, match="batched gradients through an eager fa3gen call"):
        torch.autograd.grad(out, q, douts[:, 0], is_grads_batched=True)
    assert [name[:3] for name, _ in fake_launches] == ["fwd", "fwd"]
