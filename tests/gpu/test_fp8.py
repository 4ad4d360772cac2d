"""The e4m3 forward variants on the GPU: every built fp8 variant against the fp64 reference of
the dequantized inputs and against the kernels' own arithmetic (fa3gen.reference
.fp8_attention_reference with key_block = tile_n: online softmax from the last key block down,
P * 256 rounded to e4m3), outputs poisoned with NaN before each run; the tolerance rule is
fa3gen.reference.compare_fp8_to_reference's.
"""
import pytest
import torch

import fa3gen
from fa3gen import fp8, ops, runtime
from fa3gen.errors import Fa3genError, InvalidInputError
from fa3gen.checks import CHECK_SCALE_FACTOR
from fa3gen.reference import attention_reference, compare_fp8_to_reference, fp8_attention_reference

pytestmark = pytest.mark.gpu


def _fp8_variants():
    try:
        lib = runtime.get_library()
    except Exception:  # no library: the conftest skips GPU tests without one
        return []
    return [v for v in lib.variants if v.dtype == "e4m3"]


VARIANTS = _fp8_variants()
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [(1, 1, 1, 1, 1), (2, 257, 257, 4, 4), (1, 300, 513, 8, 2), (2, 1000, 777, 2, 1),
          (1, 130, 64, 2, 2)]


def _inputs(b, sq, sk, hq, hkv, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) * 2
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    descales = {n: torch.rand(b, hkv, device="cuda", generator=g) + 0.5
                for n in fp8.DESCALE_NAMES}
    return [t.to(torch.float8_e4m3fn) for t in (q, k, v)], descales


def _run(q, k, v, descales, causal, variant, out_dtype=torch.bfloat16, poison=float("nan"),
         softmax_scale=None):
    b, sq, hq, d = q.shape
    out = torch.full((b, sq, hq, d), poison, dtype=out_dtype, device="cuda")
    lse = torch.full((b, hq, sq), poison, device="cuda")
    fp8.fp8_forward(q, k, v, ops.masking(causal), softmax_scale, variant, descales, out_dtype,
                    out, lse)
    torch.cuda.synchronize()
    return out, lse


def _check(out, lse, q, k, v, descales, causal, tile_n, softmax_scale=None):
    res = compare_fp8_to_reference(out, lse, q, k, v, descales, causal, tile_n,
                                   softmax_scale=softmax_scale)
    assert res["ok"], res["why"]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}x{}".format(*s))
@pytest.mark.parametrize("info", VARIANTS, ids=lambda v: v.name)
def test_fp8_variant_matches_reference(info, shape):
    b, sq, sk, hq, hkv = shape
    (q, k, v), descales = _inputs(b, sq, sk, hq, hkv, info.head_dim)
    scale = CHECK_SCALE_FACTOR * info.head_dim**-0.5  # not the default: a kernel must use it
    out, lse = _run(q, k, v, descales, info.causal, info.name, softmax_scale=scale)
    _check(out, lse, q, k, v, descales, info.causal, info.tile_n, softmax_scale=scale)


@pytest.mark.parametrize("info", [v for v in VARIANTS if v.is_default], ids=lambda v: v.name)
def test_fp8_public_api_fp16_output_and_no_descale(info):
    (q, k, v), descales = _inputs(2, 333, 333, 4, 2, info.head_dim, seed=1)
    out, lse = ops.flash_attn_func(q, k, v, causal=info.causal, out_dtype=torch.float16,
                                   return_lse=True, **descales)
    assert out.dtype == torch.float16
    tile_n = fp8.block_sizes(q, k, info.causal)[1]  # of the variant serving this length
    _check(out, lse, q, k, v, descales, info.causal, tile_n)
    # Without descales: factors of 1; a single value broadcasts.
    out1 = ops.flash_attn_func(q, k, v, causal=info.causal)
    ref, _ = fp8_attention_reference(q, k, v, causal=info.causal, key_block=tile_n)
    assert (out1.double() - ref).pow(2).mean().sqrt() <= 1e-2 * ref.pow(2).mean().sqrt()
    one = torch.tensor([0.5], device="cuda")
    out2 = ops.flash_attn_func(q, k, v, causal=info.causal, v_descale=one)
    assert torch.allclose(out2.float(), out1.float() * 0.5, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("info", [v for v in VARIANTS if v.is_default and v.head_dim == 128],
                         ids=lambda v: v.name)
def test_fp8_under_torch_compile(info):
    """torch.compile(fullgraph=True) runs fp8 calls through the fa3gen::fwd_fp8 custom op: the
    same kernel as eager, so the same bits (block descales and the fp16 output included), at
    two lengths (the second one a new shape for the compiled graph)."""
    f = torch.compile(lambda q, k, v, kd: ops.flash_attn_func(
        q, k, v, causal=info.causal, k_descale=kd, out_dtype=torch.float16, variant=info.name),
        fullgraph=True)
    for seqlen in (200, 333):
        (q, k, v), _ = _inputs(2, seqlen, seqlen, 4, 2, info.head_dim, seed=seqlen)
        kd = torch.rand(2, 2, -(-seqlen // info.tile_n), device="cuda") + 0.5
        compiled = f(q, k, v, kd)
        eager = ops.flash_attn_func(q, k, v, causal=info.causal, k_descale=kd,
                                    out_dtype=torch.float16, variant=info.name)
        assert compiled.dtype == torch.float16 and torch.equal(compiled, eager)


def test_fp8_no_keys_gives_zero_rows():
    if not VARIANTS:
        pytest.skip("no e4m3 variant built")
    (q, k, v), _ = _inputs(1, 5, 0, 2, 2, VARIANTS[0].head_dim)
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_fp8_errors():
    if not VARIANTS:
        pytest.skip("no e4m3 variant built")
    d = VARIANTS[0].head_dim
    (q, k, v), descales = _inputs(2, 64, 64, 4, 2, d)
    with pytest.raises(InvalidInputError, match="one dtype"):
        ops.flash_attn_func(q, k.to(torch.bfloat16), v)
    with pytest.raises(InvalidInputError, match=r"k_descale must have"):
        ops.flash_attn_func(q, k, v, k_descale=torch.ones(4, 2, device="cuda"))
    with pytest.raises(InvalidInputError, match="float32"):
        ops.flash_attn_func(q, k, v, q_descale=torch.ones(2, 2, device="cuda", dtype=torch.float16))
    with pytest.raises(InvalidInputError, match="forward only"):
        ops.flash_attn_func(q.requires_grad_(), k, v)
    q.requires_grad_(False)
    with pytest.raises(InvalidInputError, match="out_dtype"):
        ops.flash_attn_func(q, k, v, out_dtype=torch.float32)
    with pytest.raises(InvalidInputError, match="window_size or softcap"):
        ops.flash_attn_func(q, k, v, window_size=(16, 0))
    with pytest.raises(InvalidInputError, match="float8_e4m3fn q, k, v only"):
        ops.flash_attn_func(*(t.to(torch.bfloat16) for t in (q, k, v)), **descales)
    odd = torch.randn(2, 64, 4, 40, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(Fa3genError):
        ops.flash_attn_func(odd, odd, odd)


@pytest.mark.parametrize("info", [v for v in VARIANTS if v.is_default], ids=lambda v: v.name)
def test_fp8_block_quantization(info):
    """Descales per (batch, head, tile-aligned block), from fp8.quantize at fp8.block_sizes,
    on data whose magnitude changes from block to block; also mixed with a per-tensor one."""
    g = torch.Generator(device="cuda").manual_seed(3)
    b, sq, sk, hq, hkv, d = 2, 333, 517, 4, 2, info.head_dim

    def draw(s, h):
        x = torch.randn(b, s, h, d, device="cuda", generator=g)
        return x * torch.exp(2 * torch.rand(b, s, h, 1, device="cuda", generator=g))
    q, k, v = draw(sq, hq), draw(sk, hkv), draw(sk, hkv)
    block_q, block_k = fp8.block_sizes(q, k, causal=info.causal, variant=info.name)
    assert (block_q, block_k) == (info.tile_m, info.tile_n)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, block_q), fp8.quantize(k, block_k), \
        fp8.quantize(v, block_k)
    assert qd.shape == (b, hq, -(-sq // block_q)) and kd.shape == (b, hkv, -(-sk // block_k))
    for descales in ({"q_descale": qd, "k_descale": kd, "v_descale": vd},
                     {"q_descale": qd, "k_descale": kd.amax().reshape(1), "v_descale": vd}):
        if descales["k_descale"].numel() == 1:
            k8 = (k / descales["k_descale"]).to(torch.float8_e4m3fn)
        out, lse = _run(q8, k8, v8, descales, info.causal, info.name)
        res = compare_fp8_to_reference(out, lse, q8, k8, v8, descales, info.causal, info.tile_n,
                                       block_q=info.tile_m)
        assert res["ok"], res["why"]
    with pytest.raises(InvalidInputError, match="blocks of"):
        ops.flash_attn_func(q8, k8, v8, causal=info.causal, k_descale=kd[:, :, :-1])


@pytest.mark.parametrize("info", [v for v in VARIANTS if v.is_default], ids=lambda v: v.name)
def test_fp8_k_block_descale_zero_and_nan(info):
    """A K block of zeros described by descale 0 (legal for zeros; the quantizers give 1) stays
    finite, also where the causal mask covers it; a NaN descale turns the rows that see its
    block NaN instead of hiding it."""
    g = torch.Generator(device="cuda").manual_seed(5)
    b, s, hq, hkv, d = 1, 2 * info.tile_n, 2, 1, info.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    k[:, info.tile_n:] = 0
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, blk) for x, blk in
                                    ((q, info.tile_m), (k, info.tile_n), (v, info.tile_n)))
    kd[:, :, 1] = 0
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    out, lse = _run(q8, k8, v8, descales, info.causal, info.name)
    res = compare_fp8_to_reference(out, lse, q8, k8, v8, descales, info.causal, info.tile_n,
                                   block_q=info.tile_m)
    assert res["ok"], res["why"]
    kd = kd.clone()
    kd[:, :, 0] = float("nan")  # every row sees key block 0
    # A finite poison, not NaN: the NaN must be what the kernel writes.
    out, lse = _run(q8, k8, v8, dict(descales, k_descale=kd), info.causal, info.name, poison=7.0)
    assert out.isnan().all() and lse.isnan().all()


@pytest.mark.parametrize("case", ["q_zero", "k_tensor_zero", "k_head_zero", "q_and_k_block_zero",
                                  "tiny", "v_block_zero"])
@pytest.mark.parametrize("info", [v for v in VARIANTS if v.is_default], ids=lambda v: v.name)
def test_fp8_zero_descales_match_reference(info, case):
    """A descale of 0 is the attention of zeros on that side: a 0 q descale or k descale of one
    value or one head gives every score 0 (equal weights over the visible keys, LSE the log of
    their count), a 0 v block descale removes that block's values from the output (here over
    v values that are not zero; first, last, a run and all of a head's blocks), and a 0 q
    descale together with a 0 k block one, or q and k descales of 1e-20 (the tile's scale
    times a block's factor underflows fp32), stay finite. Checked against the fp64
    reference where the mask (causal, and the last block's rows past the keys) covers scores:
    before the kernels floored their scales these gave NaN."""
    g = torch.Generator(device="cuda").manual_seed(21)
    b, s, hq, hkv, d = 2, 2 * info.tile_n + 37, 4, 2, info.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, blk) for x, blk in
                                    ((q, info.tile_m), (k, info.tile_n), (v, info.tile_n)))
    if case == "q_zero":
        qd = torch.zeros(b, hkv, device="cuda")
    elif case == "k_tensor_zero":
        kd = torch.zeros(1, device="cuda")
    elif case == "k_head_zero":
        kd = torch.rand(b, hkv, device="cuda", generator=g) + 0.5
        kd[:, 1] = 0
    elif case == "q_and_k_block_zero":
        qd[:, :, 0] = 0
        kd[:, :, 0] = 0
    elif case == "tiny":
        qd, kd = torch.full_like(qd, 1e-20), torch.full_like(kd, 1e-20)
    else:  # key blocks are visited from the last down
        vd[:, 0, 2] = 0  # head 0: the first visited (O has no units yet) ...
        vd[:, 0, 0] = 0  # ... and the last (its negative units reach the epilogue)
        vd[0, 1, :2] = 0  # batch 0, head 1: a run of two
        vd[1, 1, :] = 0  # batch 1, head 1: every block (output 0)
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    out, lse = _run(q8, k8, v8, descales, info.causal, info.name, poison=7.0)
    res = compare_fp8_to_reference(out, lse, q8, k8, v8, descales, info.causal, info.tile_n,
                                   block_q=info.tile_m)
    assert res["ok"], res["why"]
    if case == "v_block_zero":  # the query heads of kv head 1 in batch 1 see only zero blocks
        # (their values add 2^-64 of themselves at units 1: at most 448 * 2^-64, about 2.4e-17)
        assert out[1, :, hq // hkv:].float().abs().max() < 1e-15


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_fp8_end_to_end(hadamard):
    """fa3gen.quantize_fp8 (block scales at the serving variant's tiles) into flash_attn_func,
    against the bf16 inputs' exact attention: relative RMSE within 8e-2 (e4m3 rounds each of q,
    k, v with about 3.6% RMS relative error, 3 mantissa bits; measured 4.6% here)."""
    d128 = [v for v in VARIANTS if v.is_default and v.head_dim == 128 and v.causal]
    if not d128:
        pytest.skip("no default e4m3 d128 causal variant")
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(2, 700, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (4, 2, 2))
    q8, k8, v8, descales = fa3gen.quantize_fp8(q, k, v, hadamard=hadamard, seed=1, causal=True)
    assert descales["q_descale"].shape == (2, 4, -(-700 // d128[0].tile_m))
    out = fa3gen.flash_attn_func(q8, k8, v8, causal=True, **descales)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (out.float() - ref).pow(2).mean().sqrt() <= 8e-2 * ref.pow(2).mean().sqrt()


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_quantize_fp8_and_attention_under_torch_compile(rotary):
    """quantize_fp8 (the fa3gen::quantize_fp8 op: the fused kernel) and the fp8 attention in one
    graph under torch.compile(fullgraph=True), inductor, at two lengths (the second dynamic):
    bytes, descales and output are the eager calls'."""
    _quantizer_lib()
    if not [v for v in VARIANTS if v.is_default and v.head_dim == 128 and v.causal]:
        pytest.skip("no default e4m3 d128 causal variant")
    g = torch.Generator(device="cuda").manual_seed(13)
    theta = torch.rand(2000, 64, device="cuda", generator=g) * 6.3
    tables = (theta.cos(), theta.sin()) if rotary else None  # eager's: inductor's cos may round apart

    def step(q, k, v):
        q8, k8, v8, ds = fa3gen.quantize_fp8(q, k, v, hadamard=True, seed=2, causal=True,
                                             rotary=tables)
        return q8, k8, v8, ds, fa3gen.flash_attn_func(q8, k8, v8, causal=True, **ds)
    torch._dynamo.reset()
    f = torch.compile(step, fullgraph=True)
    for s in (700, 1500):
        q, k, v = (torch.randn(2, s, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                   for h in (4, 2, 2))
        eager, compiled = step(q, k, v), f(q, k, v)
        for a, b in zip(eager[:3], compiled[:3]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert all(torch.equal(eager[3][n], compiled[3][n]) for n in eager[3])
        assert torch.equal(eager[4], compiled[4])


def _quantizer_lib():
    lib = runtime.get_library()
    if not lib.has_quantizer:
        pytest.skip("the library has no fp8 quantizer (its spec has no e4m3 variant)")
    return lib


# The tolerance rule of the quantizer's Hadamard transform on the tensor cores (block scales of
# at most 32768 values without rotary: quantize_fp8.cuh, hadamard_mma_tile). Its transform keeps
# about 16 bits where reference.hadamard_transform's fp32 butterflies keep 24, so a value within
# that distance of a rounding boundary of e4m3 (3 bits) may round the other way: each byte is the
# reference's or one e4m3 step away (same sign; +-0 and the smallest magnitudes may swap
# signs), at most 0.5% of them differ, and each descale is within 1e-4 of the reference's.
MMA_MISMATCH_FRACTION = 5e-3


def assert_e4m3_close(got: torch.Tensor, want: torch.Tensor, got_descale, want_descale):
    torch.testing.assert_close(got_descale, want_descale, rtol=1e-4, atol=0)
    a, b = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    mag_a, mag_b = a & 0x7F, b & 0x7F
    same_sign = (a & 0x80) == (b & 0x80)
    step = (mag_a - mag_b).abs()
    ok = (same_sign & (step <= 1)) | ((mag_a <= 1) & (mag_b <= 1))
    assert bool(ok.all()), f"{int((~ok).sum())} bytes more than one e4m3 step off"
    differ = float((a != b).float().mean())
    assert differ <= MMA_MISMATCH_FRACTION, f"{differ:.2%} of the bytes differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_rows", [128, 64, 96, 100, 160, 192, 256, 384, None],
                         ids=["b128", "b64", "b96", "b100", "b160", "b192", "b256", "b384", "tensor"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_quantize_kernel_matches_pytorch_bit_for_bit(dtype, d, block_rows, hadamard):
    """fa3gen_quantize_fp8 against fp8.quantize (and reference.hadamard_transform): the same
    fp32 operations in the same order, so the same bytes; on a strided view (a packed qkv).
    Except the Hadamard transform on the tensor cores: within assert_e4m3_close's rule."""
    from fa3gen.reference import hadamard_transform, random_signs

    lib = _quantizer_lib()
    g = torch.Generator(device="cuda").manual_seed(d)
    qkv = torch.randn(2, 301, 3, 5, d, device="cuda", generator=g, dtype=dtype) * 3
    x = qkv[:, :, 1]  # (2, 301, 5, d), row stride 3 * 5 * d
    signs = random_signs(d, 7, x.device).float() if hadamard else None
    got, got_descale = fp8._quantize_kernel(lib, x, block_rows, signs)
    xr = hadamard_transform(x.float() * signs) if hadamard else x
    want, want_descale = fp8.quantize(xr, block_rows)
    torch.cuda.synchronize()
    if hadamard and fp8.staged_blocks(d, block_rows):  # the tensor-core transform (no rotary)
        assert_e4m3_close(got, want, got_descale, want_descale)
        return
    assert torch.equal(got_descale, want_descale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rotary", ["halves", "half_dim", "pairs", "pairs_partial"])
@pytest.mark.parametrize("block_rows", [64, 96, 128], ids=["b64", "b96", "b128"])
def test_quantize_kernel_rotary_bit_for_bit(dtype, d, rotary, block_rows):
    """The fused kernel's rotary embedding (before the Hadamard transform) against
    reference.apply_rotary and the PyTorch quantizer: the same bytes. Rotary dims: d and d / 2
    as halves, d and d - 10 as adjacent pairs (a partial chunk); tables in bf16 (converted)."""
    from fa3gen.reference import apply_rotary, hadamard_transform, random_signs

    lib = _quantizer_lib()
    g = torch.Generator(device="cuda").manual_seed(d + 1)
    x = torch.randn(2, 301, 3, d, device="cuda", generator=g, dtype=dtype) * 3
    rot_dim = {"halves": d, "half_dim": d // 2, "pairs": d, "pairs_partial": d - 10}[rotary]
    interleaved = rotary.startswith("pairs")
    angle = torch.rand(400, rot_dim // 2, device="cuda", generator=g) * 6.3
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    assert fp8._kernel_rotates(x, block_rows, (cos, sin), interleaved)
    signs = random_signs(d, 3, x.device)
    got, got_descale = fp8._quantize_kernel(lib, x, block_rows, signs, (cos, sin), interleaved)
    want, want_descale = fp8.quantize(
        hadamard_transform(apply_rotary(x, cos, sin, interleaved=interleaved) * signs), block_rows)
    torch.cuda.synchronize()
    assert torch.equal(got_descale, want_descale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
def test_quantize_fp8_rotary_takes_the_fused_kernel(interleaved, monkeypatch):
    """fa3gen.quantize_fp8(rotary=...) with block scales: q and k embedded inside the fused
    kernel (no PyTorch rotary), v not; the bytes of the PyTorch pipeline."""
    from fa3gen import reference
    from fa3gen.reference import apply_rotary, hadamard_transform, random_signs

    _quantizer_lib()
    d = next((v.head_dim for v in VARIANTS if v.is_default and not v.causal), None)
    if d is None:
        pytest.skip("no default non-causal e4m3 variant")
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, 300, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (4, 2, 2))
    angle = torch.rand(512, d // 2, device="cuda", generator=g) * 6.3
    rot = (angle.cos(), angle.sin())
    block_q, block_k = fp8.block_sizes(q, k)
    want = [fp8.quantize(hadamard_transform(apply_rotary(x, *rot, interleaved=interleaved)
                                            * random_signs(d, 2, x.device)), rows)
            for x, rows in ((q, block_q), (k, block_k))] + [fp8.quantize(v, block_k)]
    monkeypatch.setattr(reference, "apply_rotary", None)  # the fused path must not need it
    q8, k8, v8, ds = fa3gen.quantize_fp8(q, k, v, hadamard=True, seed=2, rotary=rot,
                                         rotary_interleaved=interleaved)
    for got, scale, (w, w_scale) in zip((q8, k8, v8), ds.values(), want):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(scale, w_scale)


def test_quantize_fp8_planned_call_gives_the_first_calls_bytes():
    """A repeated quantize_fp8 signature launches from its plan (fp8._quantize_plans): the same
    bytes and scales as the first, unplanned call, on new data of the same layout too."""
    _quantizer_lib()
    d = next((v.head_dim for v in VARIANTS if v.is_default and not v.causal), None)
    if d is None:
        pytest.skip("no default non-causal e4m3 variant")
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(2, 333, 3, 4, d, device="cuda", generator=g, dtype=torch.bfloat16)
    fp8._quantize_plans.clear()
    first = fa3gen.quantize_fp8(*qkv.unbind(2), hadamard=True)
    assert len(fp8._quantize_plans) == 1
    again = fa3gen.quantize_fp8(*qkv.unbind(2), hadamard=True)
    other = torch.randn_like(qkv)
    planned = fa3gen.quantize_fp8(*other.unbind(2), hadamard=True)
    fp8._quantize_plans.clear()
    unplanned = fa3gen.quantize_fp8(*other.unbind(2), hadamard=True)
    for a, b in ((first, again), (planned, unplanned)):
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        assert all(torch.equal(a[3][n], b[3][n]) for n in a[3])


@pytest.mark.parametrize("magnitude", [1e-33, float("inf")], ids=["tiny", "inf"])
def test_quantize_kernel_divides_blocks_of_extreme_magnitude(magnitude):
    """Blocks whose descale is below 2^-100 or infinite take the kernel's exact division
    (div_by's reciprocal would over- or underflow): still the PyTorch path's bytes."""
    lib = _quantizer_lib()
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(1, 256, 2, 128, device="cuda", generator=g, dtype=torch.float32)
    x[:, :128, 0] *= 1e-33 if magnitude < 1 else 1.0  # block 0 of head 0: tiny values
    if magnitude == float("inf"):
        x[0, 5, 0, 7] = float("inf")  # block 0 of head 0: an infinite value
    x = x.to(torch.bfloat16)
    got, got_descale = fp8._quantize_kernel(lib, x, 128, None)
    want, want_descale = fp8.quantize(x, 128)
    torch.cuda.synchronize()
    assert torch.equal(got_descale, want_descale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
