"""fp8 (e4m3) on CPU: the variant scope (pruning), the reference and its tolerance rule, and the
argument checks that need no GPU. The kernels themselves: tests/gpu/test_fp8.py."""
import pytest
import torch

from fa3gen import fp8, ops
from fa3gen.contract import Variant
from fa3gen.errors import InvalidInputError
from fa3gen.reference import attention_reference, compare_fp8_to_reference, fp8_attention_reference
from generator.variants import fp8_scope


def _v(**kw):
    base = dict(direction="fwd", dtype="e4m3", head_dim=128, causal=False, local=False,
                softcap=False, varlen=False, tile_m=128, tile_n=128, stages=2,
                warp_specialized=True, pingpong=True, intra_wg_overlap=True)
    return Variant(**{**base, **kw})


def test_fp8_scope_names_what_is_not_realized():
    assert fp8_scope(_v()) is None
    assert "forward only" in fp8_scope(_v(direction="bwd"))
    assert "not realized yet" in fp8_scope(_v(softcap=True))
    assert "warp_specialized" in fp8_scope(_v(warp_specialized=False, pingpong=False))
    assert "multiple of 32" in fp8_scope(_v(tile_n=80))
    assert fp8_scope(_v(tile_n=96)) is None
    assert fp8_scope(_v(dtype="bf16", tile_n=80)) is None


def _inputs(b=2, sq=129, sk=200, hq=4, hkv=2, d=64):
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(b, s, h, d, generator=g) * 2).to(torch.float8_e4m3fn)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    ds = {n: torch.rand(b, hkv, generator=g) + 0.5 for n in fp8.DESCALE_NAMES}
    return q, k, v, ds


def test_fp8_reference_takes_3d_descales_with_dims_of_one_as_the_kernels_do():
    """(1, 1, 1) is one value and (b, h, 1) one per head, whatever the blocks (the kernels
    read a dim of 1 with stride 0); the reference read them as blocks of rows and failed."""
    q, k, v, ds = _inputs()
    want, _ = fp8_attention_reference(q, k, v, q_descale=torch.tensor(2.0),
                                      k_descale=ds["k_descale"], v_descale=ds["v_descale"])
    for block_q in (None, 64):
        got, _ = fp8_attention_reference(q, k, v, q_descale=torch.full((1, 1, 1), 2.0),
                                         k_descale=ds["k_descale"][..., None],
                                         v_descale=ds["v_descale"][..., None], block_q=block_q,
                                         block_k=block_q)
        assert torch.equal(got, want)


def test_fp8_reference_exact_matches_attention_on_dequantized_inputs():
    q, k, v, ds = _inputs()
    out, lse = fp8_attention_reference(q, k, v, **ds, causal=True)
    group = q.shape[2] // k.shape[2]
    deq = [t.double() * d.double().repeat_interleave(g, 1)[:, None, :, None]
           for t, d, g in ((q, ds["q_descale"], group), (k, ds["k_descale"], 1),
                           (v, ds["v_descale"], 1))]
    ref, ref_lse = attention_reference(*deq, causal=True, upcast=True)
    assert torch.allclose(out, ref.double(), atol=1e-5) and torch.allclose(lse, ref_lse.double(), atol=1e-5)


def test_fp8_tolerance_rule_accepts_the_kernel_arithmetic_and_rejects_errors():
    q, k, v, ds = _inputs()
    emu, lse = fp8_attention_reference(q, k, v, **ds, causal=True, key_block=128)
    good = compare_fp8_to_reference(emu.to(torch.bfloat16), lse.float(), q, k, v, ds, True, 128)
    assert good["ok"], good["why"]
    bad = compare_fp8_to_reference((emu * 1.05).to(torch.bfloat16), lse.float(), q, k, v, ds,
                                   True, 128)
    assert not bad["ok"] and "RMSE" in bad["why"]
    nan = emu.to(torch.bfloat16).clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "NaN" in compare_fp8_to_reference(nan, lse.float(), q, k, v, ds, True, 128)["why"]
    off = compare_fp8_to_reference(emu.to(torch.bfloat16), lse.float() + 0.05, q, k, v, ds, True, 128)
    assert not off["ok"] and "lse" in off["why"]


def test_fp8_tolerance_rule_takes_the_calls_scale():
    """The e4m3 checks run at a scale that is not the default (0.8 / sqrt(d), as the 16-bit
    ones): a kernel that kept 1 / sqrt(d) fails them."""
    q, k, v, ds = _inputs()
    scale = 0.8 * q.shape[-1] ** -0.5
    emu, lse = fp8_attention_reference(q, k, v, **ds, causal=True, softmax_scale=scale,
                                       key_block=128)
    good = compare_fp8_to_reference(emu.to(torch.bfloat16), lse.float(), q, k, v, ds, True, 128,
                                    softmax_scale=scale)
    assert good["ok"], good["why"]
    default, default_lse = fp8_attention_reference(q, k, v, **ds, causal=True, key_block=128)
    ignored = compare_fp8_to_reference(default.to(torch.bfloat16), default_lse.float(), q, k, v,
                                       ds, True, 128, softmax_scale=scale)
    assert not ignored["ok"] and "RMSE" in ignored["why"] and "lse" in ignored["why"]


def test_descales_belong_to_fp8_inputs():
    t = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match="float8_e4m3fn q, k, v only"):
        fp8.check_descale_use(t, t, t, {"q_descale": torch.ones(1)}, None)
    with pytest.raises(InvalidInputError, match="out_dtype"):
        fp8.check_descale_use(t, t, t, {}, torch.float16)
    fp8.check_descale_use(t.to(torch.float8_e4m3fn), t, t, {"q_descale": torch.ones(1)}, None)


def test_descale_views():
    dims = ops.Dims(2, 300, 200, 4, 2, 64, "e4m3")
    cpu = torch.device("cpu")
    assert fp8._descale_view("q_descale", None, dims, cpu, 3, 128) is None
    one = torch.tensor([2.0])
    assert fp8._descale_view("q_descale", one, dims, cpu, 3, 128) == (one, (0, 0, 0), 1)
    per_kv = torch.rand(2, 2)
    # FA3's (batch, heads_kv) q_descale: query head h reads kv head h // 2
    assert fp8._descale_view("q_descale", per_kv, dims, cpu, 3, 128) == (per_kv, (2, 1, 0), 2)
    assert fp8._descale_view("k_descale", per_kv, dims, cpu, 2, 128)[1:] == ((2, 1, 0), 1)
    blocks = torch.rand(2, 4, 3)
    assert fp8._descale_view("q_descale", blocks, dims, cpu, 3, 128)[1:] == ((12, 3, 1), 1)
    with pytest.raises(InvalidInputError, match=r"\(2, 2, 2\) \(batch, heads, blocks of 128 rows\)"):
        fp8._descale_view("k_descale", torch.rand(2, 2, 3), dims, cpu, 2, 128)
    with pytest.raises(InvalidInputError, match="float32"):
        fp8._descale_view("v_descale", torch.rand(2, 2).half(), dims, cpu, 2, 128)
    with pytest.raises(InvalidInputError, match="must be a float32 tensor"):
        fp8._descale_view("v_descale", 2.0, dims, cpu, 2, 128)
    with pytest.raises(InvalidInputError, match="must be a dense .* got torch.sparse_coo"):
        fp8._descale_view("k_descale", torch.ones(2, 2).to_sparse(), dims, cpu, 2, 128)
    with pytest.raises(InvalidInputError, match="must be on meta like q"):
        fp8._descale_view("q_descale", one, dims, torch.device("meta"), 3, 128)
    with pytest.raises(InvalidInputError, match=r"got shape \(0,\)"):  # not one value
        fp8._descale_view("k_descale", torch.ones(0), dims, cpu, 2, 128)


def test_quantize_per_tensor_and_blocks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 300, 3, 64, generator=g)
    x[0, 5:9, 1] *= 50  # one loud block
    vals, scale = fp8.quantize(x)
    assert vals.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert vals.float().abs().max() == 448
    vals_b, scale_b = fp8.quantize(x, 128)
    assert scale_b.shape == (2, 3, 3)  # (batch, heads, ceil(300 / 128))
    rows = scale_b.permute(0, 2, 1).repeat_interleave(128, 1)[:, :300, :, None]
    back = vals_b.float() * rows
    # e4m3: 3 mantissa bits (half a step: 1/16 relative), subnormal steps of 2^-9 scale
    assert ((back - x).abs() <= x.abs() / 16 + 2.0**-10 * rows + 1e-7).all()
    assert scale_b[0, 1, 0] > 20 * scale_b[0, 0, 0]


def test_fp8_reference_with_block_descales_equals_dequantized_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, s, h, 64, generator=g) for s, h in ((200, 4), (300, 2), (300, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, 64) for t in (q, k, v))
    out, _ = fp8_attention_reference(q8, k8, v8, qd, kd, vd, causal=True, block_q=64, block_k=64)
    deq = [t8.double() * d.double().permute(0, 2, 1).repeat_interleave(64, 1)[:, :t8.shape[1], :, None]
           for t8, d in ((q8, qd), (k8, kd), (v8, vd))]
    ref, _ = attention_reference(*deq, causal=True, upcast=True)
    assert torch.allclose(out, ref.double(), atol=1e-5)
    assert (out - attention_reference(q, k, v, causal=True)[0].double()).abs().max() < 0.1


def test_quantize_fp8_per_tensor_with_incoherent_processing_keeps_scores():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 100, 2, 64, generator=g) for _ in range(3))
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)
    for hadamard in (False, True):
        q8, k8, v8, ds = fp8.quantize_fp8(q, k, v, block=False, hadamard=hadamard, seed=5)
        assert all(t.dtype == torch.float8_e4m3fn for t in (q8, k8, v8))
        assert all(ds[n].shape == (1,) for n in fp8.DESCALE_NAMES)
        deq = [(t.float() * ds[n]).transpose(1, 2) for t, n in ((q8, "q_descale"), (k8, "k_descale"))]
        err = deq[0] @ deq[1].transpose(-1, -2) - scores  # the rotation leaves q k^T as it was
        assert err.pow(2).mean().sqrt() < 0.05 * scores.pow(2).mean().sqrt()
        assert torch.equal(v8.float() * ds["v_descale"], fp8.quantize(v)[0].float() * fp8.quantize(v)[1])
    assert not torch.equal(q8.float(), fp8.quantize(q)[0].float())  # the transform was applied


def test_fp8_call_fills_the_descale_fields(fake_launches):
    b, sq, sk, hq, hkv = 2, 300, 200, 4, 2
    q = torch.zeros(b, sq, hq, 128, dtype=torch.float8_e4m3fn)
    k = v = torch.zeros(b, sk, hkv, 128, dtype=torch.float8_e4m3fn)
    qd = torch.ones(b, hkv)                # FA3's (batch, heads_kv)
    kd = torch.ones(b, hkv, 2)             # blocks of 128 keys
    vd = torch.tensor([0.5])               # one value
    out, lse = ops.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                            out_dtype=torch.float16, return_lse=True)
    assert out.dtype == torch.float16 and out.shape == q.shape and lse.shape == (b, hq, sq)
    ((name, p),) = fake_launches
    assert name == "fwd_e4m3_d128_causal_m128n128_s2_ws1_pp1_ov1" and p.o_fp16 == 1
    assert p.q_descale == qd.data_ptr() and p.q_descale_head_div == hq // hkv
    assert (p.q_descale_batch_stride, p.q_descale_head_stride, p.q_descale_block_stride) == (2, 1, 0)
    assert (p.k_descale_batch_stride, p.k_descale_head_stride, p.k_descale_block_stride) == (4, 2, 1)
    assert (p.v_descale_batch_stride, p.v_descale_head_stride, p.v_descale_block_stride) == (0, 0, 0)
    ops.flash_attn_func(q, k, v, causal=True)  # no descales: null pointers (the kernel reads 1)
    p2 = fake_launches[1][1]
    assert not p2.q_descale and not p2.k_descale and not p2.v_descale and p2.o_fp16 == 0
    assert p2.q_descale_head_div == 1
    with pytest.raises(InvalidInputError, match="blocks of 128 rows"):
        ops.flash_attn_func(q, k, v, causal=True, k_descale=torch.ones(b, hkv, 3))
    with pytest.raises(InvalidInputError, match="window_size or softcap"):
        ops.flash_attn_func(q, k, v, causal=True, softcap=5.0)


def test_fp8_under_torch_compile_on_cpu(fake_launches):
    """torch.compile(fullgraph=True) traces fp8 calls through the fa3gen::fwd_fp8 custom op
    (launch stubbed), block descales and the fp16 output included."""
    f = torch.compile(lambda q, k, v, kd: ops.flash_attn_func(
        q, k, v, causal=True, k_descale=kd, out_dtype=torch.float16), fullgraph=True,
        backend="eager")
    for seqlen in (200, 300):
        q = torch.zeros(1, seqlen, 2, 128, dtype=torch.float8_e4m3fn)
        kd = torch.ones(1, 2, -(-seqlen // 128))
        out = f(q, q, q, kd)
        assert out.dtype == torch.float16 and out.shape == q.shape
    assert [n for n, _ in fake_launches] == ["fwd_e4m3_d128_causal_m128n128_s2_ws1_pp1_ov1"] * 2
    assert fake_launches[1][1].seqlen_q == 300 and fake_launches[1][1].k_descale_block_stride == 1


def test_compiled_calls_with_block_descales_take_the_tiles_their_blocks_were_made_for(
        fake_launches, monkeypatch):
    """A key whose spec has a seqlen_k range default (h100.yaml: e4m3 d128 128x128 below 2k
    keys, 128x192 above): quantize_fp8 makes blocks of the by-length variant's tiles, and a
    compiled call launches that variant too (its op resolves a default call when it runs, by
    length, with or without block descales), not the key default reading 96-row blocks as
    128-row ones."""
    import dataclasses

    from fa3gen import runtime
    from fa3gen.contract import make_key

    lib = runtime.get_library()
    default = lib.find("fwd", "e4m3", 128, True)
    short = dataclasses.replace(default, tile_n=96)
    monkeypatch.setitem(lib._by_name, short.name, short)
    monkeypatch.setattr(lib, "seqlen_dispatch", {make_key("fwd", "e4m3", 128, True): [(0, 2047, short)]})
    x = torch.zeros(1, 150, 2, 128, dtype=torch.float8_e4m3fn)
    descales = dict(k_descale=torch.ones(1, 2, 2), v_descale=torch.ones(1, 2, 2))  # 96-key blocks
    assert fp8.block_sizes(x, x, causal=True) == (128, 96)
    ops.flash_attn_func(x, x, x, causal=True, **descales)
    monkeypatch.setattr(ops, "_captured", lambda *a: True)  # as under torch.compile
    ops.flash_attn_func(x, x, x, causal=True, **descales)
    ops.flash_attn_func(x, x, x, causal=True)  # no block descales: by length too
    assert [name for name, _ in fake_launches] == [short.name] * 3
    ops.flash_attn_func(x, x, x, causal=True, variant=default.name)  # a named one is kept
    assert fake_launches[-1][0] == default.name
    assert fake_launches[1][1].k_descale_block_stride == 1


def test_cudnn_fp8_column_is_optional():
    """fa3gen bench's cuDNN fp8 column: None (no column) where cudnn-frontend does not import."""
    from fa3gen import bench

    try:
        import cudnn  # noqa: F401
    except Exception:
        assert bench._cudnn_fp8_forward(None, None, None, False) is None
    else:
        pytest.skip("cudnn-frontend is installed: the column is built on the GPU")


def test_quantizing_inputs_that_require_grad_gives_plain_fp8_tensors():
    x = torch.randn(1, 10, 2, 64, requires_grad=True)
    vals, scale = fp8.quantize(x, 4)
    assert not vals.requires_grad and not scale.requires_grad
    q8, _, _, ds = fp8.quantize_fp8(x, x, x, block=False)
    assert not q8.requires_grad and not ds["q_descale"].requires_grad


def test_apply_rotary_matches_complex_rotation():
    """apply_rotary rotates each pair (x1, x2) by angle theta as the complex product
    (x1 + i x2) e^{i theta}, for the halves layout and the interleaved one; the rest of the
    head dim passes through."""
    from fa3gen.reference import apply_rotary
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g)
    theta = torch.rand(7, 4, generator=g) * 6  # rotary_dim 8 of 16, 7 >= seqlen positions
    cos, sin = theta.cos(), theta.sin()
    e = torch.polar(torch.ones(5, 1, 4), theta[:5, None, :])
    halves = apply_rotary(x, cos, sin)
    want = torch.complex(x[..., :4], x[..., 4:8]) * e
    assert torch.allclose(halves[..., :4], want.real, atol=1e-6) and torch.allclose(halves[..., 4:8], want.imag, atol=1e-6)
    assert torch.equal(halves[..., 8:], x[..., 8:])
    inter = apply_rotary(x, cos, sin, interleaved=True)
    want = torch.complex(x[..., 0:8:2], x[..., 1:8:2]) * e
    assert torch.allclose(inter[..., 0:8:2], want.real, atol=1e-6) and torch.allclose(inter[..., 1:8:2], want.imag, atol=1e-6)


def test_quantize_fp8_with_rotary():
    """rotary=(cos, sin) embeds q and k (not v) before the transform and the rounding."""
    from fa3gen.reference import apply_rotary
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    theta = torch.arange(64.)[:, None] * torch.rand(1, 32, generator=g)
    rot = (theta.cos(), theta.sin())
    q8, k8, v8, ds = fp8.quantize_fp8(q, k, v, block=False, rotary=rot)
    for got, d, x in ((q8, ds["q_descale"], q), (k8, ds["k_descale"], k)):
        want, want_d = fp8.quantize(apply_rotary(x, *rot), None)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(d, want_d)
    want, _ = fp8.quantize(v, None)
    assert torch.equal(v8.view(torch.uint8), want.view(torch.uint8))
    # the scores of the embedded q, k survive as with plain quantization
    s_ref = torch.einsum("bshd,bthd->bhst", apply_rotary(q, *rot), apply_rotary(k, *rot))
    s8 = torch.einsum("bshd,bthd->bhst", q8.float() * ds["q_descale"], k8.float() * ds["k_descale"])
    assert (s8 - s_ref).abs().max() <= 0.1 * s_ref.abs().max()
    with pytest.raises(InvalidInputError, match="rotary cos must be"):
        fp8.quantize_fp8(q, k, v, block=False, rotary=(theta[:10].cos(), theta[:10].sin()))
    with pytest.raises(InvalidInputError, match="pair"):
        fp8.quantize_fp8(q, k, v, block=False, rotary=theta)


def test_fp8_calls_are_planned_once_per_signature(fake_launches, monkeypatch):
    """A repeated fp8 call reuses its plan (descale strides included) and sets only pointers;
    another descale layout plans again; grad mode is still checked on every call."""
    planned = []
    real = ops._fwd_plan
    monkeypatch.setattr(ops, "_fwd_plan", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    fp8._plans.clear()
    b, s, h = 1, 256, 2
    q = k = v = torch.zeros(b, s, h, 128, dtype=torch.float8_e4m3fn)
    kds = [torch.ones(b, h, 2) for _ in range(2)]  # alive: two addresses
    for kd in kds:
        ops.flash_attn_func(q, k, v, causal=True, k_descale=kd)
    assert len(planned) == 1
    (_, p1), (_, p2) = fake_launches
    assert (p1.k_descale, p2.k_descale) == (kds[0].data_ptr(), kds[1].data_ptr())
    assert (p2.k_descale_batch_stride, p2.k_descale_head_stride, p2.k_descale_block_stride) == (4, 2, 1)
    assert not p2.q_descale and not p2.v_descale
    ops.flash_attn_func(q, k, v, causal=True, k_descale=torch.ones(b, h))  # (batch, heads_kv)
    assert len(planned) == 2 and fake_launches[-1][1].k_descale_block_stride == 0
    ops.flash_attn_func(q, k, v, causal=True, k_descale=kds[0], out_dtype=torch.float16)
    assert len(planned) == 3 and fake_launches[-1][1].o_fp16 == 1
    ops.flash_attn_func(q, k, v, causal=True, k_descale=kds[1])
    assert len(planned) == 3 and fake_launches[-1][1].o_fp16 == 0
    with pytest.raises(InvalidInputError, match="forward only"):  # checked on a planned signature
        _grad_call(q, k, v, kds[0])
    assert len(planned) == 3


def test_a_descale_that_requires_grad_is_refused(fake_launches):
    """fp8 attention has no backward: a descale that needs a gradient (kd from a tensor that
    requires grad) ran eagerly with its gradient dropped, and compiled it failed inside
    torch's backend ("no autograd formula"). Refused like q, k, v, planned or not, eager or
    traced; under no_grad it runs."""
    b, s, h = 1, 256, 2
    q = torch.zeros(b, s, h, 128, dtype=torch.float8_e4m3fn)
    kd = torch.ones(b, h, requires_grad=True) * 2  # (batch, heads_kv), needs grad
    with torch.no_grad():
        ops.flash_attn_func(q, q, q, causal=True, k_descale=kd)  # planned
    for _ in range(2):
        with pytest.raises(InvalidInputError, match="q, k, v and the descales must not require "
                                                    "grad"):
            ops.flash_attn_func(q, q, q, causal=True, k_descale=kd)
    torch._dynamo.reset()
    call = torch.compile(lambda q, kd: ops.flash_attn_func(q, q, q, causal=True, k_descale=kd),
                         fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="the descales must not require grad"):
        call(q, kd)
    assert len(fake_launches) == 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # a prototype
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")  # beta
def test_sparse_and_nested_descales_are_one_error(fake_launches):
    """A CSR or nested descale raised inside torch while the plan key was built."""
    q = torch.zeros(1, 256, 2, 128, dtype=torch.float8_e4m3fn)
    for kd, says in ((torch.ones(1, 2).to_sparse_csr(), "must be a dense \\(strided\\) tensor"),
                     (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                      "is a nested tensor; pass a dense one")):
        with pytest.raises(InvalidInputError, match=f"k_descale {says}"):
            ops.flash_attn_func(q, q, q, causal=True, k_descale=kd)
    assert not fake_launches


def _grad_call(q, k, v, kd):
    """An fp8 call whose inputs claim to need grad (fp8 tensors cannot require grad in
    PyTorch, so a stand-in that says it does)."""
    class Needy(torch.Tensor):
        @property
        def requires_grad(self):
            return True
    return fp8.fp8_forward(q.as_subclass(Needy), k, v, ops.masking(True), None, None,
                           {"k_descale": kd}, None)


def test_fp8_emulation_keeps_the_running_maximum_as_the_kernels_do():
    """The emulation's rescale rule is the e4m3 kernels' (rescale_threshold.cuh's cap), and it
    matters: on flat scores (randn inputs, maxima growing slowly block after block) rows keep
    their maximum, P exceeds 1 and rounds to other e4m3 neighbours than with a rescale on
    every block; both stay within the exact-softmax tolerance."""
    import re

    from fa3gen.reference import FP8_RESCALE_THRESHOLD
    from generator.paths import KERNELS_DIR

    header = (KERNELS_DIR / "rescale_threshold.cuh").read_text()
    cap = re.search(r"kRescaleThresholdFp8P = .*: ([0-9.]+)f;", header)
    assert cap and float(cap.group(1)) == FP8_RESCALE_THRESHOLD
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 333, 2, 128, generator=g).to(torch.float8_e4m3fn) for _ in range(3))
    kept, lse = fp8_attention_reference(q, k, v, key_block=128)
    every, lse_every = fp8_attention_reference(q, k, v, key_block=128, rescale_threshold=-1.0)
    exact, _ = fp8_attention_reference(q, k, v)
    assert not torch.equal(kept, every) and torch.allclose(lse, lse_every, atol=1e-9)
    for emu in (kept, every):
        assert (emu - exact).pow(2).mean().sqrt() <= 4e-2 * exact.pow(2).mean().sqrt()


def test_fp8_p_scale_is_the_kernels():
    """reference.FP8_P_SCALE (the emulation's and the numerics study's factor on P) is the e4m3
    forward's 2^kPLog2Fp8."""
    import re

    from fa3gen.reference import FP8_P_SCALE
    from generator.paths import KERNELS_DIR

    found = re.search(r"kPLog2Fp8 = (\d+);", (KERNELS_DIR / "fwd_mainloop.cuh").read_text())
    assert found and 2.0 ** int(found.group(1)) == FP8_P_SCALE


def test_quantize_fp8_plans_once_per_signature(quantizer, monkeypatch):
    """A repeated quantize_fp8 signature launches from its plan: the same params as the first
    (unplanned) call but for the pointers, without re-checking or re-resolving the tiles; a
    misaligned tensor or another library takes the unplanned path again."""
    from tests.conftest import FakeQuantizerLibrary

    launched, lib = quantizer, fp8._quantizer_library(None)
    monkeypatch.setattr(fp8, "_kernel_serves", lambda x: True)
    resolved = []
    real_block_sizes = fp8.block_sizes
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: resolved.append(1) or real_block_sizes(*a))
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 300, 3, 4, 128, generator=g).to(torch.bfloat16)
    q, k, v = qkv.unbind(2)  # strided views, 16-byte aligned
    theta = torch.rand(300, 64, generator=g)
    kw = dict(causal=True, hadamard=True, rotary=(theta.cos(), theta.sin()))
    pointers = ("x", "out", "descale", "signs", "rotary_cos", "rotary_sin", "amax_workspace")
    for repeat in range(2):
        launched.clear()
        q8, k8, v8, ds = fp8.quantize_fp8(q, k, v, **kw)
        if repeat == 0:
            first = [{n: x for n, x in p.items() if n not in pointers} for p in launched]
        else:
            assert [{n: x for n, x in p.items() if n not in pointers} for p in launched] == first
        assert [p["x"] for p in launched] == [t.data_ptr() for t in (q, k, v)]
        assert [bool(p["signs"]) for p in launched] == [True, True, False]
        assert [bool(p["rotary_cos"]) for p in launched] == [True, True, False]
        assert ds["q_descale"].shape == (2, 4, 3) and q8.shape == q.shape
    assert len(resolved) == 1 and first[0]["block_rows"] == 128 and first[0]["rotary_half"] == 64
    assert first[0]["x_row_stride"] == 3 * 4 * 128
    # q's signature (shape, strides) 8 bytes off the 16-byte alignment: the unplanned path
    misaligned = torch.as_strided(qkv, q.shape, q.stride(), storage_offset=4)
    launched.clear()
    fp8.quantize_fp8(misaligned, k, v, **kw)
    assert len(resolved) == 2 and launched[0]["x"] != misaligned.data_ptr()  # a contiguous copy
    other = FakeQuantizerLibrary(lib.quantize_fp8)
    monkeypatch.setattr(fp8, "_quantizer_library", lambda x: other)
    fp8.quantize_fp8(q, k, v, **kw)
    assert len(resolved) == 3  # another library: planned again


def test_kernel_block_values_is_the_quantizer_kernels():
    """fp8.KERNEL_BLOCK_VALUES (which blocks the fused kernel rotates) is the staged kernel's
    largest block, kStagedBlockValues in quantize_fp8.cuh (a static_assert there ties that
    constant to the kernel's layout at every head dim)."""
    import re

    from generator.paths import KERNELS_DIR

    header = (KERNELS_DIR / "quantize_fp8.cuh").read_text()
    found = re.search(r"constexpr int kStagedBlockValues = (\d+);", header)
    assert found and int(found.group(1)) == fp8.KERNEL_BLOCK_VALUES


def test_debug_checks_catch_bad_descales(fake_launches, monkeypatch):
    """FA3GEN_DEBUG_CHECKS=1 reads the descales on the host: NaN, inf or negative values raise
    (naming the entry), 0 passes everywhere; without the switch nothing is read (the kernels
    propagate a NaN instead)."""
    b, s, h = 1, 256, 2
    q = k = v = torch.zeros(b, s, h, 128, dtype=torch.float8_e4m3fn)
    good = torch.ones(b, h, 2)
    good[0, 1, 1] = 0
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    ops.flash_attn_func(q, k, v, causal=True, k_descale=good)
    for value in (float("nan"), float("inf"), -1.0):
        bad = good.clone()
        bad[0, 1, 0] = value
        for _ in range(2):  # the planned signature is checked too
            with pytest.raises(InvalidInputError, match=r"k_descale\[0, 1, 0\] is .*finite"):
                ops.flash_attn_func(q, k, v, causal=True, k_descale=bad)
    with pytest.raises(InvalidInputError, match=r"v_descale\[0\] is -2.0"):
        ops.flash_attn_func(q, k, v, causal=True, v_descale=torch.tensor([-2.0]))
    # 0 anywhere: the attention of zeros on that side (tests/gpu/test_fp8.py runs them)
    for name, zero in (("q_descale", torch.zeros(1)), ("k_descale", torch.zeros(b, h)),
                       ("v_descale", good.clone()),
                       ("k_descale", torch.zeros(b, h, 1).expand(b, h, 2))):
        ops.flash_attn_func(q, k, v, causal=True, **{name: zero})
    # a descale of the wrong dtype: the eager calls' message, not torch's from the read
    with pytest.raises(InvalidInputError, match="float32"):
        ops.flash_attn_func(q, k, v, causal=True, k_descale=good.to(torch.float8_e4m3fn))
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "0")
    launched = len(fake_launches)
    ops.flash_attn_func(q, k, v, causal=True, k_descale=bad)
    assert len(fake_launches) == launched + 1


def test_a_nan_does_not_reset_its_scopes_scale():
    """The PyTorch path's amax skips NaN, as the fused kernel's fmaxf: one NaN once made the
    scale 1 and flushed the rest of its tensor or block."""
    x = 1e-3 * torch.randn(1, 64, 2, 64)
    clean_vals, clean_scale = fp8.quantize(x)
    x[0, 63, 1, 0] = float("nan")
    vals, scale = fp8.quantize(x)
    assert torch.equal(scale, clean_scale)
    same = torch.ones_like(x, dtype=torch.bool)
    same[0, 63, 1, 0] = False
    assert torch.equal(vals.float()[same], clean_vals.float()[same])
    _, block_scale = fp8.quantize(x, 16)
    assert torch.equal(block_scale, fp8.quantize(x.nan_to_num(0.0), 16)[1])


@pytest.mark.parametrize("change, message", [
    (dict(k=torch.zeros(1, 8, 2, 32), v=torch.zeros(1, 8, 2, 32)), "same batch and head dim"),
    (dict(v=torch.zeros(1, 8, 1, 64)), "k .* and v .* differ"),
    (dict(q=torch.zeros(1, 8, 3, 64)), "not a multiple"),
    (dict(q=torch.zeros(8, 2, 64)), r"\(batch, seqlen, heads, d\)"),
    (dict(hadamard=True, q=torch.zeros(1, 8, 2, 96), k=torch.zeros(1, 8, 2, 96),
          v=torch.zeros(1, 8, 2, 96)), "power-of-two head dim"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(seed=True), "seed must be an int"),
    (dict(seed=2**64, hadamard=True), r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),
    (dict(v=torch.zeros(1, 8, 2, 64, device="meta")), "q, k, v must be on one device"),
    (dict(q=torch.zeros(1, 8, 2, 64, dtype=torch.float8_e4m3fn)), "16 bits or more"),
    (dict(q=torch.zeros(2, 8, 2, 64)), "same batch and head dim"),
    (dict(k=torch.zeros(1, 8, 0, 64), v=torch.zeros(1, 8, 0, 64)), "not a multiple"),
    # the tables must cover k's rows too, match each other, and rotate at most d / 2 pairs
    (dict(k=torch.zeros(1, 16, 2, 64), v=torch.zeros(1, 16, 2, 64),
          rotary=(torch.ones(8, 4), torch.ones(8, 4))), "rotary cos must be"),
    (dict(rotary=(torch.ones(8, 4), torch.ones(9, 4))), "rotary sin must be"),
    (dict(rotary=(torch.ones(8, 64), torch.ones(8, 64))), r"rotary cos must be .*in \[1, 32\]"),
])
def test_quantize_fp8_arguments_are_checked_first(change, message):
    args = dict(q=torch.zeros(1, 8, 2, 64), k=torch.zeros(1, 8, 2, 64), v=torch.zeros(1, 8, 2, 64),
                block=False)
    args.update(change)
    with pytest.raises(InvalidInputError, match=message):
        fp8.quantize_fp8(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_all_zero_scopes_get_scale_one():
    """A tensor or block of zeros: descale 1 and zero values, not 0 and NaN (0 / 0)."""
    x = torch.zeros(1, 40, 2, 64)
    x[0, 20:, 1] = 3.0  # head 1's second block is not zero
    vals, scale = fp8.quantize(torch.zeros_like(x))
    assert torch.equal(scale, torch.ones(1)) and not vals.float().any()
    vals, scale = fp8.quantize(x, 20)
    three = (torch.tensor([3.0]) * fp8.INV_E4M3_MAX).item()  # 3 x float32(1/448), as the code
    assert torch.equal(scale, torch.tensor([[[1.0, 1.0], [1.0, three]]]))
    assert not vals.float().isnan().any()


def test_block_descales_follow_each_operands_tile(fake_launches, monkeypatch):
    """q's blocks are the variant's tile_m rows, k's and v's its tile_n keys: 200 keys in blocks
    of 96 are 3 (in blocks of 128, 2); a window is refused for fp8 like softcap; a single block's
    stride is 0."""
    import dataclasses

    from fa3gen import runtime

    lib = runtime.get_library()
    default = lib.find("fwd", "e4m3", 128, True)
    short = dataclasses.replace(default, tile_n=96)
    monkeypatch.setitem(lib._by_name, short.name, short)
    x = torch.zeros(1, 200, 2, 128, dtype=torch.float8_e4m3fn)
    ops.flash_attn_func(x, x, x, causal=True, variant=short.name, k_descale=torch.ones(1, 2, 3),
                        q_descale=torch.ones(1, 2, 2))
    with pytest.raises(InvalidInputError, match="blocks of 96 rows"):
        ops.flash_attn_func(x, x, x, causal=True, variant=short.name, k_descale=torch.ones(1, 2, 2))
    with pytest.raises(InvalidInputError, match="window_size or softcap"):
        ops.flash_attn_func(x, x, x, window_size=(10, 0))
    y = torch.zeros(1, 100, 2, 128, dtype=torch.float8_e4m3fn)
    ops.flash_attn_func(y, y, y, causal=True, k_descale=torch.ones(1, 2, 1))
    assert fake_launches[-1][1].k_descale_block_stride == 0


def test_block_descales_made_for_other_tiles_are_refused(fake_launches, monkeypatch):
    """A block descale from fa3gen's quantizers carries its block rows: one made for 192-row
    blocks is refused by a call whose variant reads 128-row ones even where both give 2 blocks
    (200 rows), and a copy (which drops the tag) or one made for 128 rows is taken."""
    from fa3gen import fp8
    x = torch.randn(1, 200, 2, 128)
    q8, qd = fp8.quantize(x, 192)
    _, kd = fp8.quantize(x, 128)
    assert qd.shape == kd.shape == (1, 2, 2)
    with pytest.raises(InvalidInputError, match="blocks of 192 rows.*reads blocks of 128"):
        ops.flash_attn_func(q8, q8, q8, causal=True, q_descale=qd)
    ops.flash_attn_func(q8, q8, q8, causal=True, q_descale=kd, k_descale=kd)
    ops.flash_attn_func(q8, q8, q8, causal=True, q_descale=qd.clone())  # untagged: the caller's word
    assert len(fake_launches) == 2
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")  # a non-tensor descale: the same clear error
    with pytest.raises(InvalidInputError, match="q_descale must be a float32 tensor"):
        ops.flash_attn_func(q8, q8, q8, causal=True, q_descale=2.0)


def test_a_non_tensor_descale_under_compile_is_the_eager_error(fake_launches):
    """The custom op's schema takes tensors: a float descale in a compiled call is refused while
    tracing with the eager call's message (it failed in dynamo on the schema)."""
    q8 = torch.zeros(1, 64, 2, 128, dtype=torch.float8_e4m3fn)
    torch._dynamo.reset()
    call = torch.compile(lambda q: ops.flash_attn_func(q, q, q, causal=True, k_descale=2.0),
                         fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="k_descale must be a float32 tensor or None, got float"):
        call(q8)
