"""fa3gen.fp8's host side on the CPU: what quantize_fp8 hands the fused quantizer (the
`quantizer` fixture in conftest.py records each launch's params), which inputs go to it, and
the values of the PyTorch path it falls back to. A mutation audit found each of these unchecked; tests/gpu/test_fp8.py checks
the kernel's values."""
import types

import pytest
import torch

from fa3gen import fp8, ops
from fa3gen.reference import apply_rotary, hadamard_transform, random_signs


def tensors(d=128, s=100, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, s, 2, d, generator=g).to(dtype) for _ in range(3)]


def test_each_operand_gets_its_block_rows_and_the_dtype_flag(quantizer, monkeypatch):
    """q in blocks of tile_m rows, k and v of tile_n (here 64 and 32: 2 and 4 blocks of 100);
    x_fp16 says which 16-bit type the kernel reads."""
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 32))
    q, k, v = tensors()
    _, _, _, ds = fp8.quantize_fp8(q, k, v)
    assert [p["block_rows"] for p in quantizer] == [64, 32, 32]
    assert [ds[n].shape[-1] for n in fp8.DESCALE_NAMES] == [2, 4, 4]
    assert [p["x_fp16"] for p in quantizer] == [0, 0, 0]
    quantizer.clear()
    fp8.quantize_fp8(*tensors(dtype=torch.float16))
    assert [p["x_fp16"] for p in quantizer] == [1, 1, 1]


def test_per_tensor_scales_get_an_amax_workspace(quantizer):
    fp8.quantize_fp8(*tensors(), block=False)
    assert [p["block_rows"] for p in quantizer] == [0, 0, 0] and all(p["amax_workspace"] for p in quantizer)


def test_rotary_reaches_the_kernel_as_aligned_fp32_tables(quantizer, monkeypatch):
    """The layout flag, and the tables as 16-byte aligned fp32: a bf16 sin converted, an fp32
    cos that starts 4 bytes off the alignment copied."""
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 64))
    q, k, v = tensors()
    theta = torch.rand(100, 64)
    cos = torch.empty(100 * 64 + 1)[1:].view(100, 64)
    cos.copy_(theta.cos())
    sin = theta.sin().to(torch.bfloat16)
    assert cos.data_ptr() % 16 == 4
    fp8.quantize_fp8(q, k, v, rotary=(cos, sin), rotary_interleaved=True)
    assert [p["rotary_interleaved"] for p in quantizer] == [1, 1, 0]
    assert [p["rotary_half"] for p in quantizer] == [64, 64, 0]
    for p in quantizer[:2]:
        assert p["rotary_cos"] % 16 == 0 and p["rotary_sin"] % 16 == 0
        assert p["cos_values"] == cos[0, :4].tolist() and p["sin_values"] == sin[0, :4].float().tolist()


def test_a_planned_call_uses_its_seed(quantizer, monkeypatch):
    seeds, real = [], fp8._signs
    monkeypatch.setattr(fp8, "_signs", lambda d, seed, device: seeds.append(seed) or real(d, seed, device))
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 64))
    q, k, v = tensors()
    for _ in range(2):
        fp8.quantize_fp8(q, k, v, hadamard=True, seed=7)
    assert seeds == [7, 7] and len(fp8._quantize_plans) == 1


def test_tensors_the_kernel_reads_as_copies_are_never_planned(quantizer, monkeypatch):
    """q with a last stride of 2 reaches the kernel as a contiguous copy: no plan may keep the
    copy's template for q itself, so every call copies again (and a plan needs all three)."""
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 64))
    q, k, v = tensors()
    q = torch.stack([q, q], -1)[..., 0]  # q's values, strides (51200, 512, 256, 2)
    for _ in range(2):
        quantizer.clear()
        fp8.quantize_fp8(q, k, v)
        assert [p["x"] == t.data_ptr() for p, t in zip(quantizer, (q, k, v))] == [False, True, True]
        assert quantizer[0]["x_row_stride"] == 256
    assert fp8._quantize_plans == {}


@pytest.mark.parametrize("strides", [(2048, 256, 128, 2), (1056, 132, 64, 1)])
def test_layouts_the_kernel_cannot_read_are_copied(strides):
    """A last stride other than 1, or rows not 16 bytes apart (132 elements), go to the kernel
    as contiguous copies (it reads 16-byte vectors)."""
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    x = torch.as_strided(buf, (1, 8, 2, 64), strides)
    got, p = fp8._quantize_params(x, 64)
    assert got.is_contiguous() and (p.x_row_stride, p.x_head_stride) == (128, 64)


def test_what_the_kernel_serves_and_rotates():
    bf16 = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert fp8._kernel_serves(bf16) and not fp8._kernel_serves(bf16.float())
    assert not fp8._kernel_serves(bf16[:, :0]) and not fp8._kernel_serves(bf16[..., :96])
    # the kernel refuses batch or heads past 65535 (its grid): PyTorch serves those, not an error
    from generator.paths import KERNELS_DIR
    header = (KERNELS_DIR / "quantize_fp8.cuh").read_text()
    limit = fp8.MAX_QUANTIZER_GRID
    assert f"p.batch > {limit} || p.heads > {limit}" in header
    for shape in ((limit + 1, 1, 1, 128), (1, 1, limit + 1, 128)):
        assert not fp8._kernel_serves(torch.zeros(1, dtype=torch.bfloat16).expand(*shape))
    assert fp8._kernel_serves(torch.zeros(1, dtype=torch.bfloat16).expand(limit, 1, limit, 128))
    table = lambda half: (torch.ones(8, half), torch.ones(8, half))  # noqa: E731
    assert fp8._kernel_rotates(bf16, 256, table(64), False)          # 256 x 128: the largest block
    assert not fp8._kernel_rotates(bf16, 257, table(64), False)
    assert fp8._kernel_rotates(bf16, 64, table(32), False)           # halves of d / 2
    assert not fp8._kernel_rotates(bf16, 64, table(16), False)       # pairs across threads
    assert fp8._kernel_rotates(bf16, 64, table(16), True)            # adjacent pairs: any width
    assert not fp8._kernel_rotates(bf16, None, table(64), False)     # per-tensor scales


def test_cpu_tensors_never_reach_the_quantizer(monkeypatch):
    from fa3gen import runtime

    monkeypatch.setattr(runtime, "get_library", lambda *a: types.SimpleNamespace(has_quantizer=True))
    assert fp8._quantizer_library(torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)) is None


def test_the_pytorch_path_applies_the_seeded_signs_and_the_interleaved_rotary():
    """Without the kernel: q8 is quantize(H(q x signs(seed))) and the rotary takes the
    layout asked for; bit for bit (the kernel is held to the same values on the GPU)."""
    q, k, v = tensors(d=64)
    q8, k8, _, ds = fp8.quantize_fp8(q, k, v, block=False, hadamard=True, seed=5)
    want, want_d = fp8.quantize(hadamard_transform(q.float() * random_signs(64, 5)))
    assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8)) and torch.equal(ds["q_descale"], want_d)
    theta = torch.rand(100, 8)
    rot = (theta.cos(), theta.sin())
    q8, _, _, _ = fp8.quantize_fp8(q, k, v, block=False, rotary=rot, rotary_interleaved=True)
    want, _ = fp8.quantize(apply_rotary(q, *rot, interleaved=True))
    assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8))


def test_a_contiguous_misaligned_input_reaches_the_quantizer_aligned(quantizer, monkeypatch):
    """contiguous() returns a contiguous view as it is: a view 2 bytes into its storage went
    to the kernel's 16-byte loads at that address (a misaligned-address fault on the GPU)."""
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 64))
    buf = torch.randn(100 * 2 * 128 + 1).to(torch.bfloat16)
    q = buf[1:].view(1, 100, 2, 128)
    assert q.is_contiguous() and q.data_ptr() % 16
    k, v = (torch.randn(1, 100, 2, 128).to(torch.bfloat16) for _ in range(2))
    fp8.quantize_fp8(q, k, v)
    assert quantizer and all(p["x"] % 16 == 0 for p in quantizer)


def test_quantize_gives_values_flash_attn_func_reads_and_refuses_a_bad_block():
    """A dense x with head_dim strided gave values of that layout, which flash_attn_func
    refuses; block_rows=0 was a ZeroDivisionError."""
    from fa3gen.errors import InvalidInputError

    x = torch.randn(1, 128, 4, 64).permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    assert x.stride(-1) != 1
    for block in (None, 64):
        values, _ = fp8.quantize(x, block)
        assert values.is_contiguous()
    for bad in (0, -64, 2.5):
        with pytest.raises(InvalidInputError, match="block_rows must be a positive int"):
            fp8.quantize(x, bad)


@pytest.mark.parametrize("seed", [5, 2**63 + 5])
def test_a_seed_past_2_63_compiles_as_it_runs_eagerly(fake_launches, seed):
    """The custom op's int is signed 64-bit: a seed in [2**63, 2**64), taken eagerly, failed
    under torch.compile."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=g).bfloat16() for _ in range(3))
    eager = fp8.quantize_fp8(q, k, v, block=False, hadamard=True, seed=seed)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fp8.quantize_fp8(q, k, v, block=False,
                                                              hadamard=True, seed=seed),
                             backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.equal(eager[0].view(torch.uint8), compiled[0].view(torch.uint8))


def test_rotary_is_a_tuple_or_list_and_block_sizes_takes_a_flag():
    """A set {cos, sin} unpacked in its own (hash) order, cos and sin maybe swapped; causal=2
    was taken as True by block_sizes."""
    from fa3gen.errors import InvalidInputError

    q, k, v = tensors(d=64)
    theta = torch.rand(100, 8)
    for rotary in ({theta.cos(), theta.sin()}, iter([theta.cos(), theta.sin()]), (theta.cos(),)):
        with pytest.raises(InvalidInputError, match=r"rotary must be a pair \(cos, sin\)"):
            fp8.quantize_fp8(q, k, v, block=False, rotary=rotary)
    fp8.quantize_fp8(q, k, v, block=False, rotary=[theta.cos(), theta.sin()])
    with pytest.raises(InvalidInputError, match="causal must be True or False, got 2"):
        fp8.block_sizes(q, k, causal=2)


def test_quantize_keeps_an_infinite_scope_infinite():
    """An inf input makes its scope's descale inf (the debug check then names it), and
    descales come contiguous (batch, heads, blocks)."""
    x = torch.ones(1, 40, 2, 64)
    x[0, 3, 1, 5] = float("inf")
    assert fp8.quantize(x)[1].isinf().all()
    _, scale = fp8.quantize(x, 16)
    assert scale.is_contiguous() and scale.shape == (1, 2, 3)
    assert scale[0, 1, 0].isinf() and scale.isfinite().sum() == 5


def test_quantize_a_scope_too_small_for_its_descale_gives_no_nan():
    """An fp32 scope whose largest magnitude times 1/448 rounds to 0 (below 448 x 2^-150): its
    descale is 1, as a scope of zeros', not 0 (which made 0 / 0 = NaN values)."""
    x = torch.zeros(1, 64, 2, 64)
    x[0, 0, 0, 0] = 1e-44
    for block_rows in (None, 16):
        values, scale = fp8.quantize(x, block_rows)
        assert not values.float().isnan().any() and (scale > 0).all()
        assert scale.flatten()[0] == 1.0


def test_q_blocks_count_query_rows(fake_launches):
    """300 queries and 200 keys in tiles of 128: q takes 3 blocks, k 2."""
    q = torch.zeros(1, 300, 2, 128, dtype=torch.float8_e4m3fn)
    kv = torch.zeros(1, 200, 2, 128, dtype=torch.float8_e4m3fn)
    ops.flash_attn_func(q, kv, kv, causal=True, q_descale=torch.ones(1, 2, 3), k_descale=torch.ones(1, 2, 2))
    assert fake_launches[-1][1].q_descale_block_stride == 1


def test_the_grid_mode_is_part_of_an_fp8_plan(fake_launches, monkeypatch):
    x = torch.zeros(1, 256, 2, 128, dtype=torch.float8_e4m3fn)
    modes = []
    for mode in ("persistent", "tiles"):
        monkeypatch.setenv("FA3GEN_GRID", mode)
        ops.flash_attn_func(x, x, x, causal=True)
        modes.append(fake_launches[-1][1].grid_mode)
    assert modes[0] != modes[1]


def test_empty_tensors_quantize_and_their_descales_are_taken(fake_launches):
    """No rows: values and scales of the right shapes (per tensor: scale 1), and
    flash_attn_func takes the (batch, heads, 0) block descales quantize gives for them."""
    empty = torch.zeros(1, 0, 2, 128)
    vals, scale = fp8.quantize(empty)
    assert vals.shape == empty.shape and torch.equal(scale, torch.ones(1))
    vals, scale = fp8.quantize(empty, 128)
    assert vals.shape == empty.shape and scale.shape == (1, 2, 0)
    kv, kd = fp8.quantize(torch.ones(1, 200, 2, 128), 128)
    out = ops.flash_attn_func(vals, kv, kv, causal=True, q_descale=scale, k_descale=kd)
    assert out.shape == (1, 0, 2, 128) and fake_launches == []


_POINTERS = ("x", "out", "descale", "amax_workspace", "signs", "rotary_cos", "rotary_sin")


@pytest.mark.parametrize("case", ["blocks", "per_tensor", "hadamard_rotary"])
def test_torch_compile_fullgraph_quantizes_as_eager(quantizer, monkeypatch, case):
    """torch.compile(fullgraph=True) traces quantize_fp8 through the fa3gen::quantize_fp8 custom
    op: the fused kernel gets the eager call's params (pointers aside) and the outputs have
    the eager shapes (the fake's block counts from the serving variant's tiles, 64 q rows and
    32 keys here)."""
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 32))
    q, k, v = tensors(s=300)
    theta = torch.rand(300, 32) * 6.3
    kw = dict(block=case != "per_tensor", causal=True)
    if case == "hadamard_rotary":
        kw.update(hadamard=True, seed=5, rotary=(theta.cos(), theta.sin()), rotary_interleaved=True)
    eager = fp8.quantize_fp8(q, k, v, **kw)
    params = [{n: v for n, v in p.items() if n not in _POINTERS} for p in quantizer]
    quantizer.clear()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fp8.quantize_fp8(q, k, v, **kw), backend="aot_eager",
                             fullgraph=True)(q, k, v)
    assert [{n: v for n, v in p.items() if n not in _POINTERS} for p in quantizer] == params
    assert len(params) == 3
    shapes = [t.shape for t in (*eager[:3], *eager[3].values())]
    assert [t.shape for t in (*compiled[:3], *compiled[3].values())] == shapes
    assert [t.dtype for t in compiled[:3]] == [fp8.FP8_DTYPE] * 3


def test_torch_compile_takes_the_pytorch_path_values_bit_for_bit(fake_launches):
    """Without the fused quantizer (CPU tensors) the op runs the PyTorch path: the values and
    descales of a compiled call are the eager call's, for lengths dynamo makes dynamic too."""
    f = torch.compile(lambda q, k, v: fp8.quantize_fp8(q, k, v, hadamard=True, causal=True),
                      backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    for s in (100, 300):
        q, k, v = tensors(s=s)
        eager = fp8.quantize_fp8(q, k, v, hadamard=True, causal=True)
        compiled = f(q, k, v)
        for a, b in zip(eager[:3], compiled[:3]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(eager[3].values(), compiled[3].values()):
            assert a.shape == b.shape and torch.equal(a, b)


def test_the_quantize_op_passes_opcheck_on_cpu(fake_launches, monkeypatch):
    """fa3gen::quantize_fp8's schema and fake (shapes, strides, dtypes) against the op, block
    scales (q's 64 rows, k's and v's 32) and per tensor, a strided input among them (the op
    returns it contiguous)."""
    monkeypatch.setattr(fp8, "block_sizes", lambda *a: (64, 32))
    q, k, v = tensors(s=150)
    for block in (True, False):
        torch.library.opcheck(torch.ops.fa3gen.quantize_fp8.default,
                              (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, block, False, 0,
                               True, "", None, None, False),
                              test_utils=("test_schema", "test_faketensor"))


def test_signs_a_cuda_graph_captured_outlive_the_bounded_cache(monkeypatch):
    """A graph reads the signs' address on every replay: signs handed out under capture stay
    alive after 64 other keys have evicted them from the cache."""
    cuda = torch.device("cuda")  # no tensor goes there: random_signs is replaced below
    monkeypatch.setattr(fp8, "_graph_signs", {})
    fp8._cached_signs.cache_clear()
    monkeypatch.setattr("fa3gen.reference.random_signs", lambda d, seed, device: object())
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    try:
        captured = fp8._signs(64, 1, cuda)
        capturing[0] = False
        for seed in range(2, 70):
            fp8._signs(64, seed, cuda)
        assert fp8._cached_signs.cache_info().currsize == 64  # seed 1 left the cache ...
        assert fp8._graph_signs == {(64, 1, cuda): captured}  # ... and is still held
        capturing[0] = True
        assert fp8._signs(64, 1, cuda) is captured  # a second capture reads the same tensor
    finally:  # no stub stays cached under a cuda key
        fp8._cached_signs.cache_clear()
