"""What flash_attn_func and its backward hand the kernels, on the CPU: a fake library stands in
and the launch is captured, so each params field can be checked against the call (a mutation
audit found k and v swapped, windows swapped, a stale plan for another v and unzeroed gradients
all passing the CPU suite)."""
import pytest
import torch

from fa3gen import ops
from fa3gen.errors import InvalidInputError


def qkv(b=2, sq=40, sk=56, hq=4, hkv=2, d=128):
    return (torch.randn(b, sq, hq, d, dtype=torch.bfloat16), torch.randn(b, sk, hkv, d, dtype=torch.bfloat16),
            torch.randn(b, sk, hkv, d, dtype=torch.bfloat16))


def test_pointers_sizes_and_window_reach_the_params(fake_launches):
    q, k, v = qkv()
    out, lse = ops.flash_attn_func(q, k, v, window_size=(7, 3), softcap=5.0, return_lse=True)
    ((name, p),) = fake_launches
    assert name == "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1"
    assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                            lse.data_ptr())
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (2, 40, 56, 4, 2, 128)
    assert (p.window_left, p.window_right, p.softcap) == (7, 3, 5.0)
    assert (p.k_row_stride, p.k_head_stride, p.k_batch_stride) == (256, 128, 56 * 256)


@pytest.mark.parametrize("which", ["k", "v"])
def test_a_plan_is_per_signature_of_every_input(fake_launches, which):
    """The plan cache keys on k and v too: one with other strides gets its own params."""
    q, k, v = qkv()
    ops.flash_attn_func(q, k, v)
    wide = torch.randn(2, 56, 4, 128, dtype=torch.bfloat16)[:, :, :2]  # heads stride 128, rows 512
    ops.flash_attn_func(q, *((wide, v) if which == "k" else (k, wide)))
    strides = [getattr(p, f"{which}_row_stride") for _, p in fake_launches]
    assert strides == [256, 512]


def test_no_key_gives_zero_rows_and_lse_minus_inf_without_a_launch(fake_launches):
    q, k, v = qkv(sk=0)
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    assert fake_launches == []
    assert not out.float().any() and bool((lse == float("-inf")).all())


def test_no_query_or_no_key_gives_zero_gradients(fake_launches, monkeypatch):
    """The backward without a launch zeroes all three gradients (their buffers start as NaN
    here, as torch.empty may give anything)."""
    def poisoned(q, k, v):
        return (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")),
                torch.full_like(v, float("nan")))

    monkeypatch.setattr(ops, "_empty_grads", poisoned)
    for sq, sk in ((0, 56), (40, 0)):
        q, k, v = (t.requires_grad_() for t in qkv(sq=sq, sk=sk))
        out = ops.flash_attn_func(q, k, v)
        dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v), allow_unused=True)
        for g in (dq, dk, dv):
            assert g is None or not g.float().isnan().any() and not g.float().any()
    assert all(name.startswith("fwd") for name, _ in fake_launches)


def test_backward_checks_the_forwards_outputs(fake_launches):
    q, k, v = qkv()
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    with pytest.raises(InvalidInputError, match="lse must be float32"):
        torch.ops.fa3gen.bwd(out, q, k, v, out, lse[:, :, :-1], False, 0.1,
                             "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0", False)
    with pytest.raises(InvalidInputError, match="out must be torch.bfloat16"):
        torch.ops.fa3gen.bwd(out, q, k, v, out.half(), lse, False, 0.1,
                             "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0", False)
    # A strided lse (a graph may hand any layout) is copied, not refused nor read as contiguous.
    strided = lse.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    torch.ops.fa3gen.bwd(out, q, k, v, out, strided, False, 0.1,
                         "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0", False)
    name, p = fake_launches[-1]
    assert name == "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0" and p.lse != strided.data_ptr()


def test_heads_kv_zero_and_misaligned_batch_strides_are_refused(fake_launches):
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="multiple of heads_kv"):
        ops.flash_attn_func(q, k[:, :, :0], v[:, :, :0])
    # batch stride 40 * 4 * 128 + 4 elements: 8 bytes off the 16-byte TMA rule
    flat = torch.zeros(2 * (40 * 4 * 128 + 4), dtype=torch.bfloat16)
    odd = flat.as_strided((2, 40, 4, 128), (40 * 4 * 128 + 4, 512, 128, 1))
    with pytest.raises(InvalidInputError, match=r"q.stride\(0\) \(batch\)"):
        ops.check_layout(q=odd)


def test_backward_pointers_reach_the_params(fake_launches, monkeypatch):
    """Distinct q, k, v, dout and gradient buffers: each params pointer names its own tensor."""
    grads = []
    real = ops._empty_grads
    monkeypatch.setattr(ops, "_empty_grads", lambda q, k, v: grads.append(real(q, k, v)) or grads[-1])
    q, k, v = (t.requires_grad_() for t in qkv(hq=2))
    out = ops.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    (name, p) = fake_launches[-1]
    assert name.startswith("bwd_")
    dq, dk, dv = grads[-1]
    assert (p.q, p.k, p.v, p.o) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert (p.dq, p.dk, p.dv) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert p.dout == dout.data_ptr()


def _misaligned_like(t):
    """A contiguous copy of t starting 2 bytes past a 16-byte boundary (a view a backward such
    as torch.cat's can hand over): contiguous() returns it unchanged."""
    flat = torch.randn(t.numel() + 8, dtype=t.dtype)
    view = flat[1:1 + t.numel()].view(t.shape)
    assert view.is_contiguous() and view.data_ptr() % 16 and view.contiguous() is view
    return view


def test_backward_copies_a_misaligned_dout(fake_launches):
    """A misaligned dout is copied, on the first call and on a plan-cache hit alike (it raised an
    error telling the caller to make the tensor contiguous, which it already was)."""
    q, k, v = (t.requires_grad_() for t in qkv(hq=2))
    for _ in range(2):
        out = ops.flash_attn_func(q, k, v)
        dout = _misaligned_like(out)
        torch.autograd.grad(out, (q, k, v), dout)
        name, p = fake_launches[-1]
        assert name.startswith("bwd_") and p.dout % 16 == 0 and p.dout != dout.data_ptr()


def test_eager_backward_fills_no_gradient_for_lse(fake_launches):
    """lse carries no gradient: the eager backward gets None for it, not a zero-filled tensor
    (an allocation and a fill kernel per call, seen as a FillFunctor<float> kernel in every
    backward on the H200), for the padded and the varlen function alike."""
    from fa3gen.varlen import flash_attn_varlen_func

    padded = [t.requires_grad_() for t in qkv(hq=2)]
    packed = [t[0, :40].detach().requires_grad_() for t in padded]  # leaves: no slice's backward
    cu = torch.tensor([0, 40], dtype=torch.int32)
    calls = [(lambda q, k, v: ops.flash_attn_func(q, k, v, return_lse=True)[0], padded),
             (lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True), packed)]
    for call, (q, k, v) in calls:
        out = call(q, k, v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        ops_run = {e.name for e in prof.events()}
        assert not ops_run & {"aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_"}, ops_run
        assert fake_launches[-1][0].startswith("bwd_") and all(g is not None for g in grads)


def test_sizes_past_the_int32_params_are_refused_not_wrapped(fake_launches):
    """The params take sizes as int32: a stride-0 view 2^32 + 16 keys long was launched with
    seqlen_k 16. seqlen_q + seqlen_k past 2^30 - 1 is refused as masking_args refuses it."""
    big = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16).expand(1, 2**32 + 16, 1, 128)
    q = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match=r"seqlen_q \+ seqlen_k at most 2\^30 - 1; .*seqlen_k 4294967312"):
        ops.flash_attn_func(q, big, big)
    edge = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16).expand(1, 2**30 - 9, 1, 128)
    ops.flash_attn_func(q, edge, edge)  # 8 + 2^30 - 9 = 2^30 - 1: taken
    assert fake_launches[-1][1].seqlen_k == 2**30 - 9


def test_a_size_one_dims_stride_is_replaced_by_a_16_byte_multiple_in_e4m3_too(fake_launches):
    """_strides gives a size-1 dim a legal stride of its own: 16 bytes are 8 16-bit elements but
    16 e4m3 ones (a 1000-element stride reached an e4m3 launch)."""
    e4m3 = torch.float8_e4m3fn
    q = torch.zeros(4096).to(e4m3).as_strided((1, 1, 1, 128), (4096, 1000, 1000, 1))
    k = torch.zeros(1, 64, 1, 128).to(e4m3)
    ops.flash_attn_func(q, k, k, causal=True)
    p = fake_launches[-1][1]
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (1008, 1008, 128)  # not 1000
    assert ops._strides(torch.zeros(1, 1, 1, 72, dtype=torch.bfloat16)) == (72, 72, 72)
    assert ops._strides(torch.zeros(1, 1, 1, 72).to(e4m3)) == (80, 80, 80)


def test_each_forward_op_refuses_the_other_dtype_family(fake_launches):
    """The public function routes e4m3 to fa3gen::fwd_fp8 and 16-bit to fa3gen::fwd; called
    directly, fa3gen::fwd took e4m3 (allocating an e4m3 O the kernel writes as bf16: twice the
    bytes) and fa3gen::fwd_fp8 took bf16 (its O labelled fp16, holding bf16 bits)."""
    e4m3 = torch.zeros(2, 8, 4, 128).to(torch.float8_e4m3fn)
    k8 = torch.zeros(2, 9, 2, 128).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match="e4m3 q, k, v take the fp8 forward"):
        torch.ops.fa3gen.fwd(e4m3, k8, k8, True, 0.1, "", False, -1, -1, 0.0)
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="fa3gen::fwd_fp8 takes float8_e4m3fn q, k, v, got torch.bfloat16"):
        from fa3gen import fp8
        fp8.fp8_forward(q, k, v, ops.Masking(), None, None, {}, torch.float16)
    assert not fake_launches
    ops.flash_attn_func(e4m3, k8, k8, causal=True)  # the public function still routes both
    ops.flash_attn_func(q, k, v)
    assert [n.split("_")[1] for n, _ in fake_launches] == ["e4m3", "bf16"]
