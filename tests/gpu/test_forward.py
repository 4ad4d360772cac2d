"""Forward kernels on the GPU: every built variant against the fp32 reference.

Outputs are poisoned with NaN before each launch (and sit inside a NaN guard region), so an
element the kernel forgot to write, or a write past the end, fails the test.
Tolerance rule (fa3gen.reference.compare_to_reference): max|out - ref| <= 2 * max|plain
PyTorch in the same low precision - ref| + 1e-3, over the tensor and per row (a row's bound
adds eps of the output dtype times the row's largest value); LSE within 1e-4 + 3e-5 |lse|,
-inf exactly where a row sees no key.
"""

import math

import pytest
import torch

from fa3gen import ops
from fa3gen.checks import probe_masking
from fa3gen.contract import GRID_MODES
from fa3gen.errors import Fa3genError, InvalidInputError, VariantNotBuiltError
from fa3gen.ops import flash_attn_func
from fa3gen.reference import attention_reference, compare_to_reference

pytestmark = pytest.mark.gpu

DTYPES = ops.TORCH_DTYPES

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, softmax_scale or None for 1/sqrt(d))
SHAPES = [
    (1, 1, 1, 1, 1, None),
    (2, 7, 7, 4, 4, None),
    (1, 113, 257, 8, 2, None),  # GQA, seqlen_q < seqlen_k
    (2, 257, 113, 8, 2, None),  # seqlen_q > seqlen_k: causal rows with no visible key
    (1, 1000, 1000, 4, 1, None),  # MQA, not a tile multiple
    (3, 128, 256, 2, 2, 0.5),  # tile multiples, explicit scale
    (1, 1, 1000, 8, 8, None),  # one query (decode-like)
    (2, 1000, 7, 3, 1, None),  # MQA, few keys, mostly masked when causal
]


def _sid(s):
    return "b{}_sq{}_sk{}_h{}x{}".format(*s[:5]) + ("" if s[5] is None else f"_scale{s[5]}")


def make_qkv(batch, sq, sk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v


GUARD = 4096  # NaN elements after each output: catches writes past the end


def poisoned(shape, dtype, offset=0):
    """A NaN-filled view of `shape` starting `offset` elements into its buffer (NaN before it,
    for offset > 0, and GUARD NaN elements after it). Returns (buffer, view)."""
    n = math.prod(shape)
    buf = torch.full((offset + n + GUARD,), float("nan"), device="cuda", dtype=dtype)
    return buf, buf[offset : offset + n].view(shape)


def run_poisoned(q, k, v, causal, scale, name, **masking):
    """masking: window_size / softcap (fa3gen.checks.probe_masking for a variant's features)."""
    b, sq, hq, d = q.shape
    obuf, out = poisoned((b, sq, hq, d), q.dtype)
    lbuf, lse = poisoned((b, hq, sq), torch.float32)
    ops._fwd_into(q, k, v, out, lse, causal, scale, name, **masking)
    torch.cuda.synchronize()
    assert torch.isnan(obuf[-GUARD:]).all(), "kernel wrote past the end of out"
    assert torch.isnan(lbuf[-GUARD:]).all(), "kernel wrote past the end of lse"
    return out, lse


def check(out, lse, q, k, v, causal, scale, what, **masking):
    res = compare_to_reference(out, lse, q, k, v, causal, scale, **masking)
    assert res["ok"], f"{what}: {res['why']} (out err {res.get('out_err')}, " \
        f"tol {res.get('out_tol')}, lse err {res.get('lse_err')})"


@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_variant_matches_reference(lib, fwd_variant, shape):
    info = lib.get(fwd_variant)
    b, sq, sk, hq, hkv, scale = shape
    q, k, v = make_qkv(b, sq, sk, hq, hkv, info.head_dim, DTYPES[info.dtype])
    scale = scale if scale is not None else info.head_dim**-0.5
    extra = probe_masking(info)
    out, lse = run_poisoned(q, k, v, info.causal, scale, info.name, **extra)
    check(out, lse, q, k, v, info.causal, scale, f"{info.name} {_sid(shape)}", **extra)
    if info.causal and sq > sk:  # first sq - sk queries see no key: exactly 0 and -inf
        assert (out[:, : sq - sk] == 0).all()
        assert torch.isneginf(lse[:, :, : sq - sk]).all()


def test_variant_strided_output(lib, fwd_variant):
    """o strides are honoured: out is a view with padded heads (head stride d + 8)."""
    info = lib.get(fwd_variant)
    d, dtype = info.head_dim, DTYPES[info.dtype]
    q, k, v = make_qkv(2, 150, 190, 4, 2, d, dtype, seed=1)
    buf = torch.full((2, 150, 4, d + 8), float("nan"), device="cuda", dtype=dtype)
    out = buf[..., :d]
    lse = torch.full((2, 4, 150), float("nan"), device="cuda")
    extra = probe_masking(info)
    ops._fwd_into(q, k, v, out, lse, info.causal, d**-0.5, info.name, **extra)
    torch.cuda.synchronize()
    assert torch.isnan(buf[..., d:]).all(), "kernel wrote into the padding between heads"
    check(out, lse, q, k, v, info.causal, d**-0.5, f"{info.name} strided out", **extra)


def test_variant_unaligned_out_through_c_abi(lib, fwd_variant):
    """The C ABI takes an `o` that is only 4-byte aligned (Python's checks ask 16 bytes of every
    tensor, so flash_attn_func never passes one): the epilogue then stores 4 bytes at a time
    instead of 16. Driven through the library directly, the way a C caller would."""
    info = lib.get(fwd_variant)
    d, dtype = info.head_dim, DTYPES[info.dtype]
    q, k, v = make_qkv(2, 150, 190, 4, 2, d, dtype, seed=6)
    obuf, out = poisoned((2, 150, 4, d), dtype, offset=2)  # 4 bytes past a 16-byte boundary
    assert out.data_ptr() % 16 == 4
    lse = torch.full((2, 4, 150), float("nan"), device="cuda")
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    extra = probe_masking(info)
    params = ops._make_params(q, k, v, out, lse, ops.check_inputs(q, k, v), d**-0.5, num_sms,
                              GRID_MODES["auto"], ops.masking(info.causal, **extra))
    lib.launch(info, params, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.isnan(obuf[:2]).all() and torch.isnan(obuf[-GUARD:]).all(), "wrote outside out"
    check(out, lse, q, k, v, info.causal, d**-0.5, f"{info.name} 4-byte aligned out", **extra)


def check_tile_walk(info, sq, sk, seed, label):
    """One call of 9 batches x 16 query heads (4 kv heads), more query tiles than SMs, against
    the reference: how the grid walks them (FA3GEN_GRID) is the caller's."""
    q, k, v = make_qkv(9, sq, sk, 16, 4, info.head_dim, DTYPES[info.dtype], seed=seed)
    scale = info.head_dim**-0.5
    extra = probe_masking(info)
    out, lse = run_poisoned(q, k, v, info.causal, scale, info.name, **extra)
    check(out, lse, q, k, v, info.causal, scale, f"{info.name} {label}", **extra)


@pytest.mark.parametrize("grid", ["auto", "persistent", "tiles"])
def test_variant_many_tiles_per_cta(lib, fwd_variant, grid, monkeypatch):
    """More query tiles than SMs: each persistent CTA walks several tiles (Q, pipeline phases
    and GEMM turns carried from tile to tile; causal tiles in long/short pairs). Odd m_blocks
    per head, so the paired causal schedule has a middle tile of its own."""
    info = lib.get(fwd_variant)
    monkeypatch.setenv("FA3GEN_GRID", grid)
    sq = 5 * info.tile_m - 17  # 5 query tiles per head
    check_tile_walk(info, sq, sq + 40, seed=4, label=f"grid={grid}")


def test_variant_causal_even_tiles_per_head(lib, fwd_variant, monkeypatch):
    """Causal, persistent, 6 query tiles a head over 144 (head, batch) groups: every (longest,
    shortest) pair full (test_variant_many_tiles_per_cta's 5 tiles leave a middle tile alone),
    432 pairs over a grid they do not divide, so CTAs end one pair apart."""
    info = lib.get(fwd_variant)
    if not info.causal:
        pytest.skip("causal tiles only")
    monkeypatch.setenv("FA3GEN_GRID", "persistent")
    sq = 6 * info.tile_m - 5
    check_tile_walk(info, sq, sq, seed=6, label="even tiles")


def test_variant_deterministic(lib, fwd_variant):
    info = lib.get(fwd_variant)
    q, k, v = make_qkv(2, 300, 300, 4, 2, info.head_dim, DTYPES[info.dtype], seed=2)
    scale = info.head_dim**-0.5
    extra = probe_masking(info)
    o1, l1 = run_poisoned(q, k, v, info.causal, scale, info.name, **extra)
    o2, l2 = run_poisoned(q, k, v, info.causal, scale, info.name, **extra)
    assert torch.equal(o1, o2) and torch.equal(l1, l2), f"{info.name} is not deterministic"


def test_default_dispatch(lib, fwd_default_key):
    """flash_attn_func with no variant picks the spec's default and returns correct results."""
    dtype_name, d, causal = fwd_default_key
    q, k, v = make_qkv(2, 200, 333, 8, 2, d, DTYPES[dtype_name], seed=3)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == q.dtype
    assert lse.shape == (2, 8, 200) and lse.dtype == torch.float32 and lse.is_contiguous()
    check(out, lse, q, k, v, causal, d**-0.5, f"default {fwd_default_key}")
    # the key's default, or the spec's range default for this seqlen_k where it has one
    picked = lib.find("fwd", dtype_name, d, causal, seqlen_k=k.shape[1])
    assert picked in lib.dispatched("fwd")
    out2 = flash_attn_func(q, k, v, causal=causal, variant=picked.name)
    assert torch.equal(out, out2)


def test_packed_qkv_views(lib, fwd_default_key):
    """q, k, v as strided views of one packed (b, s, 3, h, d) tensor: legal without a copy."""
    dtype_name, d, causal = fwd_default_key
    g = torch.Generator(device="cuda").manual_seed(4)
    qkv = torch.randn(2, 177, 3, 4, d, device="cuda", dtype=DTYPES[dtype_name], generator=g)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal, d**-0.5, f"packed qkv {fwd_default_key}")


def test_empty_and_keyless(lib, fwd_default_key):
    dtype_name, d, causal = fwd_default_key
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(2, 0, 5, 4, 2, d, dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 0, 4, d) and lse.shape == (2, 4, 0)
    q, k, v = make_qkv(2, 5, 0, 4, 2, d, dtype)  # no keys: every row is "fully masked"
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_opcheck(lib, fwd_default_key):
    dtype_name, d, causal = fwd_default_key
    if d != max(v.head_dim for v in lib.defaults("fwd") if v.dtype == dtype_name):
        pytest.skip("opcheck once per dtype/causal (largest head_dim) keeps the suite short")
    q, k, v = make_qkv(1, 64, 80, 2, 1, d, DTYPES[dtype_name], seed=5)
    name = lib.find("fwd", dtype_name, d, causal).name
    torch.library.opcheck(torch.ops.fa3gen.fwd.default, (q, k, v, causal, d**-0.5, name))


def test_gpu_input_errors(lib, fwd_default_key):
    dtype_name, d, causal = fwd_default_key
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(1, 16, 16, 2, 2, d, dtype)
    flat = torch.randn(q.numel() + 1, device="cuda", dtype=dtype)
    misaligned = flat[1:].view(q.shape)  # 2-byte offset: breaks TMA's 16-byte alignment
    with pytest.raises(InvalidInputError, match="16-byte aligned"):
        flash_attn_func(misaligned, k, v, causal=causal)
    with pytest.raises(VariantNotBuiltError, match="no_such_variant"):
        flash_attn_func(q, k, v, causal=causal, variant="no_such_variant")
    other = next((x for x in lib.variants if x.direction == "fwd" and x.causal != causal), None)
    if other is not None:
        with pytest.raises(Fa3genError, match="serves"):
            flash_attn_func(q, k, v, causal=causal, variant=other.name)
    built = {x.head_dim for x in lib.variants}
    hd = next(h for h in (40, 72, 200, 48, 24) if h not in built)
    q2, k2, v2 = make_qkv(1, 16, 16, 2, 2, hd, dtype)
    with pytest.raises(VariantNotBuiltError, match=f"head_dim={hd}"):
        flash_attn_func(q2, k2, v2, causal=causal)


def test_reference_self_consistency():
    """The reference itself, on GPU: fp32 path vs an fp64 computation with the same mask."""
    q, k, v = make_qkv(1, 37, 50, 4, 2, 64, torch.bfloat16, seed=6)
    out, lse = attention_reference(q, k, v, causal=True)
    o64, l64 = attention_reference(q.double(), k.double(), v.double(), causal=True, upcast=False)
    torch.testing.assert_close(out, o64.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, l64.float(), atol=1e-5, rtol=1e-5)


def test_cuda_graph_capture_and_replay(lib, fwd_default_key):
    """flash_attn_func inside torch.cuda.graph: the eager path launches on the capture stream
    and allocates from the graph's pool; replays recompute the same output into the same
    buffer (inference servers capture decode steps this way)."""
    dtype, d, causal = fwd_default_key
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, DTYPES[dtype], seed=41)
    expected = flash_attn_func(q, k, v, causal=causal)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        flash_attn_func(q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=causal)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    q.copy_(torch.randn_like(q))  # new inputs in the same buffers: the replay follows them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attn_func(q, k, v, causal=causal))


def skip_unless_served(call, backward=False):
    """Skip where the library has no default for the call's key (a candidate spec such as
    specs/o_tma_store.yaml builds variants without defaults): the eager call (and, with
    backward, its gradient) raises VariantNotBuiltError there."""
    q, k, v = (t.requires_grad_(backward) for t in make_qkv(1, 64, 64, 4, 2, 128, torch.bfloat16))
    try:
        out = call(q, k, v)[0]
        if backward:
            out.sum().backward()
    except VariantNotBuiltError as e:
        pytest.skip(str(e).splitlines()[0])


def test_compiled_with_cuda_graphs(lib):
    """torch.compile(mode="reduce-overhead", fullgraph=True): inductor records the fa3gen::fwd
    op in a CUDA graph and replays it; each replay gives the eager call's bits for that step's
    inputs (copied into the graph's buffers)."""
    def call(q, k, v):
        return flash_attn_func(q, k, v, causal=True, return_lse=True)
    skip_unless_served(call)
    f = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    torch._dynamo.reset()
    for step in range(4):  # warm-up, record, replays
        q, k, v = make_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16, seed=50 + step)
        out, lse = f(q, k, v)
        want, want_lse = call(q, k, v)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), step


def test_compiled_with_dynamic_shapes(lib):
    """torch.compile(dynamic=True, fullgraph=True) with inductor, forward and backward: one
    graph across batch sizes and lengths (the head dim and the masking flags fixed per graph),
    each step the eager call's bits (out, lse and the gradients, deterministic)."""
    def call(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(77, 0), deterministic=True,
                               return_lse=True)
    skip_unless_served(call, backward=True)
    f = torch.compile(call, dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    for step, (b, sq, sk) in enumerate(((2, 300, 300), (3, 129, 400), (1, 1000, 640))):
        q, k, v = (t.requires_grad_(True) for t in
                   make_qkv(b, sq, sk, 4, 2, 128, torch.bfloat16, seed=60 + step))
        got, want = f(q, k, v), call(q, k, v)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), step
        dout = torch.randn_like(got[0])
        grads = [torch.autograd.grad(o[0], (q, k, v), dout) for o in (got, want)]
        assert all(torch.equal(g, w) for g, w in zip(*grads)), step
