"""flash-attn's packed entry points on CPU (fake library, launches recorded): q, k, v are read
as views of the packed tensor (no copy), and an eager backward writes dq, dk, dv into one
gradient per packed tensor (its views), planned once per call signature. The kernels:
tests/gpu/test_packed_kernels.py."""
import pytest
import torch

import fa3gen
from fa3gen import ops, packed
from fa3gen.errors import InvalidInputError

BF = torch.bfloat16
B, S, H, D = 2, 40, 2, 128
ROW = 2 * D  # bytes of one head's row


def _launches(launched, direction):
    return [p for name, p in launched if name.startswith(direction)]


def test_qkvpacked_reads_the_views_and_writes_one_gradient(fake_launches):
    qkv = torch.zeros(B, S, 3, H, D, dtype=BF, requires_grad=True)
    out = packed.flash_attn_qkvpacked_func(qkv)
    (f,) = _launches(fake_launches, "fwd")
    base = qkv.data_ptr()
    assert (f.q, f.k, f.v) == (base, base + H * ROW, base + 2 * H * ROW)
    assert f.q_row_stride == f.k_row_stride == 3 * H * D and f.q_head_stride == D
    out.float().sum().backward()
    (b,) = _launches(fake_launches, "bwd")
    g = qkv.grad
    assert g.shape == qkv.shape and g.is_contiguous()
    assert (b.dq, b.dk, b.dv) == (g.data_ptr(), g.data_ptr() + H * ROW, g.data_ptr() + 2 * H * ROW)
    assert b.dq_row_stride == b.dk_row_stride == b.dv_row_stride == 3 * H * D


def test_the_packed_call_is_the_unpacked_one(fake_launches):
    """Same variant and params as flash_attn_func on the views (pointers, strides, scale,
    masking), with and without grad; return_lse and FA3's return_attn_probs."""
    qkv = torch.zeros(B, S, 3, H, D, dtype=BF)
    out, lse = packed.flash_attn_qkvpacked_func(qkv, 0.5, window_size=(7, 3), softcap=20.0,
                                                return_attn_probs=True)
    fa3gen.flash_attn_func(*qkv.unbind(2), 0.5, window_size=(7, 3), softcap=20.0)
    (n1, p1), (n2, p2) = fake_launches
    assert n1 == n2 and out.shape == (B, S, H, D) and lse.shape == (B, H, S)
    fields = [f for f, _ in p1._fields_ if f not in ("o", "lse")]
    assert [getattr(p1, f) for f in fields] == [getattr(p2, f) for f in fields]


def test_gqa_layout_with_num_heads_q(fake_launches):
    """FlashAttention-3's (batch, seqlen, heads_q + 2 * heads_kv, d) with num_heads_q: q's heads,
    then k's, then v's; the gradient in the same layout."""
    hq, hkv = 4, 2
    qkv = torch.zeros(B, S, hq + 2 * hkv, D, dtype=BF, requires_grad=True)
    packed.flash_attn_qkvpacked_func(qkv, num_heads_q=hq).float().sum().backward()
    (f,) = _launches(fake_launches, "fwd")
    (b,) = _launches(fake_launches, "bwd")
    base, g = qkv.data_ptr(), qkv.grad.data_ptr()
    assert (f.heads_q, f.heads_kv) == (hq, hkv)
    assert (f.q, f.k, f.v) == (base, base + hq * ROW, base + (hq + hkv) * ROW)
    assert (b.dq, b.dk, b.dv) == (g, g + hq * ROW, g + (hq + hkv) * ROW)


def test_kvpacked(fake_launches):
    q = torch.zeros(B, 30, 4, D, dtype=BF, requires_grad=True)
    kv = torch.zeros(B, S, 2, H, D, dtype=BF, requires_grad=True)
    packed.flash_attn_kvpacked_func(q, kv).float().sum().backward()
    (f,) = _launches(fake_launches, "fwd")
    (b,) = _launches(fake_launches, "bwd")
    assert (f.q, f.k, f.v) == (q.data_ptr(), kv.data_ptr(), kv.data_ptr() + H * ROW)
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    assert (b.dq, b.dk, b.dv) == (q.grad.data_ptr(), kv.grad.data_ptr(), kv.grad.data_ptr() + H * ROW)
    assert b.dk_row_stride == 2 * H * D and b.dq_row_stride == 4 * D


def test_a_repeated_call_plans_once(fake_launches, monkeypatch):
    checks = []
    for name in ("_fwd_plan", "_bwd_plan"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real: checks.append(1) or real(*a))
    for _ in range(3):
        qkv = torch.zeros(B, S, 3, H, D, dtype=BF, requires_grad=True)
        packed.flash_attn_qkvpacked_func(qkv).float().sum().backward()
    assert len(checks) == 2 and len(fake_launches) == 6


@pytest.mark.parametrize("kind", ["qkv", "kv"])
def test_varlen(fake_launches, kind):
    """The varlen forms (the fake library's varlen variants are causal): views and gradients
    as the dense forms, the call's boundaries and lengths."""
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    if kind == "qkv":
        qkv = torch.zeros(30, 3, H, D, dtype=BF, requires_grad=True)
        out = packed.flash_attn_varlen_qkvpacked_func(qkv, cu, 20, causal=True)
        inputs, base = (qkv,), qkv.data_ptr()
        want = (base, base + H * ROW, base + 2 * H * ROW)
    else:
        q = torch.zeros(30, H, D, dtype=BF, requires_grad=True)
        kv = torch.zeros(30, 2, H, D, dtype=BF, requires_grad=True)
        out = packed.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 20, 20, causal=True)
        inputs, want = (q, kv), (q.data_ptr(), kv.data_ptr(), kv.data_ptr() + H * ROW)
    out.float().sum().backward()
    (f,) = _launches(fake_launches, "fwd")
    (b,) = _launches(fake_launches, "bwd")
    assert (f.q, f.k, f.v) == want and f.cu_seqlens_q == cu.data_ptr() and f.seqlen_q == 20
    grads = [t.grad for t in inputs]
    assert all(g.shape == t.shape for g, t in zip(grads, inputs))
    if kind == "qkv":
        g = grads[0].data_ptr()
        assert (b.dq, b.dk, b.dv) == (g, g + H * ROW, g + 2 * H * ROW)
    else:
        assert (b.dq, b.dk, b.dv) == (grads[0].data_ptr(), grads[1].data_ptr(),
                                      grads[1].data_ptr() + H * ROW)


def test_varlen_boundaries_changed_before_the_backward_are_an_error(fake_launches):
    """cu_seqlens (and seqused_k) are saved as autograd saves tensors, as in the unpacked call:
    a buffer reused for the next batch before backward() is refused, not silently used."""
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    qkv = torch.zeros(30, 3, H, D, dtype=BF, requires_grad=True)
    out = packed.flash_attn_varlen_qkvpacked_func(qkv, cu, 20, causal=True)
    cu[1] = 5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


@pytest.mark.parametrize("call,match", [
    (lambda: packed.flash_attn_qkvpacked_func(torch.zeros(B, S, H, D, dtype=BF)), "3, heads"),
    (lambda: packed.flash_attn_qkvpacked_func(torch.zeros(B, S, 4, H, D, dtype=BF)), "3, heads"),
    (lambda: packed.flash_attn_qkvpacked_func(torch.zeros(B, S, 7, D, dtype=BF), num_heads_q=4),
     "heads_q \\+ 2 \\* heads_kv"),
    (lambda: packed.flash_attn_qkvpacked_func(torch.zeros(B, S, 6, D, dtype=BF), num_heads_q=6),
     "heads_kv >= 1"),
    (lambda: packed.flash_attn_kvpacked_func(torch.zeros(B, S, H, D, dtype=BF),
                                             torch.zeros(B, S, 3, H, D, dtype=BF)), "2, heads_kv"),
    (lambda: packed.flash_attn_varlen_qkvpacked_func(torch.zeros(B, S, 3, H, D, dtype=BF),
                                                     torch.tensor([0, 3], dtype=torch.int32), 3),
     "\\(total, 3"),
])
def test_bad_packing_is_one_clear_error(fake_launches, call, match):
    with pytest.raises(InvalidInputError, match=match):
        call()
    assert not fake_launches


def test_the_varlen_qkvpacked_layout_error_gives_no_num_heads_q_hint(fake_launches):
    """Only the padded form takes num_heads_q: the varlen form's error must not suggest it."""
    with pytest.raises(InvalidInputError) as e:
        packed.flash_attn_varlen_qkvpacked_func(torch.zeros(30, 6, D, dtype=BF),
                                                torch.tensor([0, 30], dtype=torch.int32), 30)
    assert "num_heads_q" not in str(e.value)


def test_flash_attention_3_keywords_as_the_unpacked_functions_take_them(fake_launches):
    """FA3's other keywords pass as flash_attn_func / flash_attn_varlen_func take them (hints at
    any value, qv and attention_chunk only at their defaults, no descales in varlen); other
    names stay Python's TypeError."""
    qkv = torch.zeros(B, S, 3, H, D, dtype=BF)
    q, kv = torch.zeros(B, S, H, D, dtype=BF), torch.zeros(B, S, 2, H, D, dtype=BF)
    cu = torch.tensor([0, 30, 40], dtype=torch.int32)
    hints = dict(num_splits=4, pack_gqa=True, sm_margin=8, attention_chunk=0, qv=None)
    calls = {
        "flash_attn_qkvpacked_func": lambda **kw: packed.flash_attn_qkvpacked_func(qkv, **kw),
        "flash_attn_kvpacked_func": lambda **kw: packed.flash_attn_kvpacked_func(q, kv, **kw),
        "flash_attn_varlen_qkvpacked_func": lambda **kw: packed.flash_attn_varlen_qkvpacked_func(
            qkv.flatten(0, 1), cu, 30, causal=True, **kw),
        "flash_attn_varlen_kvpacked_func": lambda **kw: packed.flash_attn_varlen_kvpacked_func(
            q.flatten(0, 1), kv.flatten(0, 1), cu, cu, 30, 30, causal=True, **kw),
    }
    for name, call in calls.items():
        call(**hints, q_descale=None)
        with pytest.raises(InvalidInputError, match="attention_chunk=64"):
            call(attention_chunk=64)
        with pytest.raises(InvalidInputError, match="qv"):
            call(qv=qkv)
        with pytest.raises(InvalidInputError, match="sm_margin must be an int >= 0"):
            call(sm_margin=-1)
        with pytest.raises(TypeError, match=f"{name}\\(\\) got an unexpected keyword argument 'dropout'"):
            call(dropout=0.0)
        call(dropout_p=0.0, alibi_slopes=None)  # flash-attn 2's, at their defaults
        with pytest.raises(InvalidInputError, match=r"dropout_p=0.1: attention dropout"):
            call(dropout_p=0.1)
        with pytest.raises(InvalidInputError, match=r"alibi_slopes \(ALiBi"):
            call(alibi_slopes=torch.ones(H))
        if "varlen" in name:
            with pytest.raises(InvalidInputError, match="descales are for fp8 inputs"):
                call(q_descale=torch.ones(2, H))
            with pytest.raises(TypeError, match="'out_dtype'"):
                call(out_dtype=torch.float16)
    assert len(fake_launches) == 8  # two calls each, the hints changing nothing


def test_non_tensors_and_bad_num_heads_q_are_type_errors():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        packed.flash_attn_qkvpacked_func([1, 2])
    with pytest.raises(TypeError, match="num_heads_q must be an int"):
        packed.flash_attn_qkvpacked_func(torch.zeros(B, S, 6, D, dtype=BF), num_heads_q=2.0)


def test_num_heads_q_takes_numpy_integers(fake_launches):
    np = pytest.importorskip("numpy")
    qkv = torch.zeros(B, S, 4 + 2 * 2, D, dtype=BF)
    packed.flash_attn_qkvpacked_func(qkv, num_heads_q=np.int64(4))
    (f,) = _launches(fake_launches, "fwd")
    assert (f.heads_q, f.heads_kv) == (4, 2)


def test_flash_attn_2_positional_dropout_is_refused(fake_launches):
    """flash-attn 2 passes dropout_p second: 0.0 there is a softmax_scale here, and refused."""
    with pytest.raises(InvalidInputError, match="softmax_scale.*positional argument after the tensors is dropout_p"):
        packed.flash_attn_qkvpacked_func(torch.zeros(B, S, 3, H, D, dtype=BF), 0.0, True)


def test_a_bad_varlen_scale_does_not_blame_a_dropout_position(fake_launches):
    """varlen's scale is keyword-only: its error names no positional dropout_p."""
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="softmax_scale") as e:
        packed.flash_attn_varlen_qkvpacked_func(torch.zeros(10, 3, H, D, dtype=BF), cu, 10, softmax_scale=0.0)
    assert "dropout" not in str(e.value)


def test_torch_compile_traces_the_packed_call(fake_launches):
    """Under torch.compile(fullgraph=True) the packed call is flash_attn_func's custom ops on
    the views, gradients through them (the same params as eager)."""
    torch._dynamo.reset()
    f = torch.compile(lambda qkv: packed.flash_attn_qkvpacked_func(qkv), fullgraph=True,
                      backend="aot_eager")
    qkv = torch.zeros(B, S, 3, H, D, dtype=BF, requires_grad=True)
    f(qkv).float().sum().backward()
    assert qkv.grad.shape == qkv.shape
    (fc,) = _launches(fake_launches, "fwd")
    assert fc.q_row_stride == 3 * H * D and fc.k - fc.q == H * ROW
    assert len(_launches(fake_launches, "bwd")) == 1


def test_exported_from_the_package():
    for name in ("flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert getattr(fa3gen, name) is getattr(packed, name) and name in fa3gen.__all__


def test_fp8_descales_reach_the_kernel_as_in_the_unpacked_call(fake_launches):
    """An e4m3 qkv with FlashAttention-3's descales: the same launch as flash_attn_func on the
    views with them (their pointers in the params)."""
    qkv = torch.zeros(B, S, 3, H, D, dtype=BF).to(torch.float8_e4m3fn)
    descales = {n: torch.full((B, H), 0.5) for n in ("q_descale", "k_descale", "v_descale")}
    packed.flash_attn_qkvpacked_func(qkv, causal=True, **descales)
    fa3gen.flash_attn_func(*qkv.unbind(2), causal=True, **descales)
    (n1, p1), (n2, p2) = fake_launches
    assert n1 == n2 and n1.startswith("fwd_e4m3")
    fields = [f for f, _ in p1._fields_ if f not in ("o", "lse")]
    assert [getattr(p1, f) for f in fields] == [getattr(p2, f) for f in fields]
    assert {descales[n].data_ptr() for n in descales} <= {getattr(p1, f) for f in fields}


def test_errors_about_the_views_say_what_they_are_in_the_packed_call(fake_launches):
    """The unpacked function's checks name q, k, v (and cu_seqlens_q, max_seqlen_q); the caller
    passed qkv or kv (and cu_seqlens, max_seqlen): the error says which is which, and only
    where it names them."""
    qkv = torch.zeros(B, S, 3, H, 2 * D, dtype=BF)[..., ::2]  # head_dim stride 2
    with pytest.raises(InvalidInputError, match=r"q.stride\(-1\) is 2.*\(here q, k, v are views of qkv\)$"):
        packed.flash_attn_qkvpacked_func(qkv)
    kv = torch.zeros(B, S, 2, H, 2 * D, dtype=BF)[..., ::2]
    with pytest.raises(InvalidInputError, match=r"k.stride\(-1\).*\(here k, v are views of kv\)$"):
        packed.flash_attn_kvpacked_func(torch.zeros(B, S, H, D, dtype=BF), kv)
    flat = torch.zeros(40, 3, H, D, dtype=BF)
    with pytest.raises(InvalidInputError, match=r"cu_seqlens_q must be int32.*\(here cu_seqlens_q and "
                                                r"cu_seqlens_k are cu_seqlens\)$"):
        packed.flash_attn_varlen_qkvpacked_func(flat, torch.tensor([0, 40]), 40)
    with pytest.raises(InvalidInputError, match=r"max_seqlen_q .*\(here max_seqlen_q and max_seqlen_k "
                                                r"are max_seqlen\)$"):
        packed.flash_attn_varlen_qkvpacked_func(flat, torch.tensor([0, 40], dtype=torch.int32), 0)
    with pytest.raises(InvalidInputError, match=r"softcap must be a finite number >= 0 \(0: none\), "
                                                r"got -1.0$"):  # names none of them: as it was
        packed.flash_attn_qkvpacked_func(torch.zeros(B, S, 3, H, D, dtype=BF), softcap=-1.0)
    assert not fake_launches


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # a prototype
def test_nested_tensors_are_one_error(fake_launches):
    nested = torch.nested.nested_tensor([torch.zeros(3, 3, H, D, dtype=BF), torch.zeros(7, 3, H, D, dtype=BF)])
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    for call, name in ((lambda: packed.flash_attn_varlen_qkvpacked_func(nested, cu, 7), "qkv"),
                       (lambda: packed.flash_attn_qkvpacked_func(nested), "qkv"),
                       (lambda: packed.flash_attn_kvpacked_func(nested, nested), "q")):
        with pytest.raises(InvalidInputError, match=f"{name} is a nested tensor"):
            call()
