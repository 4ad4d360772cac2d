"""flash_attn_with_kvcache's decode kernels on the GPU against kvcache_attention_reference (fp32
attention over each sequence's keys gathered from the cache): contiguous and paged caches (pages
of 16, 64 and 256 rows), GQA packing up to 16 rows per kv head, causal with seqlen_q > 1, ragged
cache_seqlens including 0, cache_batch_idx, one split and many (45: more than the combine
kernel's first batch of 32).

Tolerance, per query row (a row's own magnitude: one over the whole batch let a long sequence's
small outputs hide a dropped split behind a short one's large ones): max |out - ref| <= 1e-2
max |ref| + 2e-3 (the output is rounded to bf16/fp16; the kernel's fp32 sums run in another
order), LSE within 1e-3 + 1e-4 |lse|, -inf exactly where a row sees no key and no NaN."""
import pytest
import torch

from fa3gen import kvcache, ops, runtime
from fa3gen.reference import kvcache_attention_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib():
    lib = runtime.get_library()
    if lib._decode is None:
        pytest.skip("the library has no decode kernels (its spec lacks `decode: true`)")
    return lib


def _check(out, lse, ref, ref_lse):
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().amax(-1)  # per (batch, query, head) row
    tol = 1e-2 * ref.abs().amax(-1) + 2e-3
    assert (err <= tol).all(), f"max excess {(err - tol).max().item():.3g} at {(err - tol).argmax().item()}"
    assert not lse.isnan().any()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)
    assert ((lse - ref_lse)[finite].abs() <= 1e-3 + 1e-4 * ref_lse[finite].abs()).all()


CASES = [  # (batch, seqlen_q, heads_q, heads_kv, capacity)
    (3, 1, 8, 8, 1000), (2, 1, 32, 8, 3000), (2, 2, 16, 4, 517), (1, 4, 16, 8, 4096), (4, 1, 8, 1, 129),
    (2, 4, 32, 8, 20000), (1, 16, 4, 4, 3333),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_h{}x{}_cap{}".format(*c))
@pytest.mark.parametrize("splits", [1, 0, 7, 45], ids=["one_split", "auto", "seven", "forty_five"])
def test_contiguous(lib, dtype, d, case, splits):
    b, sq, hq, hkv, cap = case
    g = torch.Generator(device="cuda").manual_seed(d + cap)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    kc, vc = (torch.randn(b + 1, cap, hkv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    seqlens = torch.randint(0, cap + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
    seqlens[0] = 0 if b > 1 else cap  # an empty sequence
    idx = torch.randperm(b + 1, device="cuda", generator=g)[:b].to(torch.int32)
    for causal, scale in ((False, None), (True, 0.3)):  # 0.3: a kernel must take the call's scale
        out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_batch_idx=idx,
                                                   causal=causal, num_splits=splits, return_lse=True,
                                                   softmax_scale=scale)
        torch.cuda.synchronize()
        ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, cache_batch_idx=idx, causal=causal,
                                                   softmax_scale=scale)
        _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("dim", [0, 1, 2], ids=["batch", "rows", "heads"])
@pytest.mark.parametrize("seqlen_q", [1, 96], ids=["decode", "prefill"])
def test_expanded_cache_read(lib, dim, seqlen_q):
    """A cache expand()ed over batch, rows or heads (stride 0) is read as it is, by the decode kernels
    and by chunked prefill (an append into one is refused: tests/test_kvcache.py)."""
    g = torch.Generator(device="cuda").manual_seed(41 + dim)
    b, hq, hkv, d, cap = 3, 8, 4, 128, 300
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    shape = [b, cap, hkv, d]
    one = [1 if i == dim else n for i, n in enumerate(shape)]
    kc, vc = (torch.randn(*one, device="cuda", dtype=torch.bfloat16, generator=g).expand(*shape)
              for _ in range(2))
    seqlens = torch.tensor([cap, 150, 97], dtype=torch.int32, device="cuda")
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                               return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, causal=True)
    _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("splits", [0, 1])
def test_no_keys_at_all(lib, splits):
    """cache_seqlens 0 as an int (and an empty cache): every row sees no key, out 0 and LSE -inf
    (the split heuristic once divided by zero here)."""
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    for cap, lengths in ((64, 0), (0, None)):
        kc, vc = (torch.randn(2, cap, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, num_splits=splits,
                                                   return_lse=True)
        torch.cuda.synchronize()
        assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("page", [16, 24, 64, 256])
@pytest.mark.parametrize("d", [64, 128])
def test_paged(lib, page, d):
    b, sq, hq, hkv = 3, 1, 32, 8
    g = torch.Generator(device="cuda").manual_seed(page)
    seqlens = torch.tensor([5000, 1, 777], dtype=torch.int32, device="cuda")
    per = -(-5000 // page)
    pages = b * per + 5
    kc, vc = (torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    table = torch.randperm(pages, device="cuda", generator=g)[:b * per].reshape(b, per).to(torch.int32)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    for causal in (False, True):
        out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                   causal=causal, return_lse=True)
        torch.cuda.synchronize()
        ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, block_table=table, causal=causal)
        _check(out, lse, ref, ref_lse)


def _cache(b, capacity, hkv, d, g, page=None):
    """(k_cache, v_cache, extra kwargs): contiguous (b, capacity, hkv, d), or pages of `page`
    rows (a few spare) with a shuffled block table."""
    if page is None:
        kc, vc = (torch.randn(b, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(2))
        return kc, vc, {}
    pages = b * capacity // page
    kc, vc = (torch.randn(pages + 3, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(2))
    table = torch.randperm(pages + 3, device="cuda", generator=g)[:pages].reshape(b, -1).to(torch.int32)
    return kc, vc, {"block_table": table}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_append_then_attend(lib, paged):
    """k, v appended in place (crossing a 16-row page boundary), then attention over the longer
    sequences: the cache holds the new rows and nothing else changed; the output matches the
    reference on the updated cache."""
    b, sq, hq, hkv, d, new, cap = 3, 2, 8, 2, 128, 5, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    seqlens = torch.tensor([13, 0, 59], dtype=torch.int32, device="cuda")
    kc, vc, extra = _cache(b, cap, hkv, d, g, 16 if paged else None)
    k0, v0 = kc.clone(), vc.clone()
    for causal in (False, True):
        kc.copy_(k0)
        vc.copy_(v0)
        out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal,
                                                   return_lse=True, **extra)
        torch.cuda.synchronize()
        ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens + new, causal=causal, **extra)
        _check(out, lse, ref, ref_lse)
    for i in range(b):
        for j in range(new):
            pos = int(seqlens[i]) + j
            for cache, new_rows in ((kc, k), (vc, v)):
                row = cache[extra["block_table"][i, pos // 16], pos % 16] if paged else cache[i, pos]
                assert torch.equal(row, new_rows[i, j])
    assert int((kc != k0).any(dim=(-1, -2)).sum()) <= b * new
    assert int((vc != v0).any(dim=(-1, -2)).sum()) <= b * new


@pytest.mark.parametrize("window,softcap", [((100, 0), 0.0), ((37, 5), 0.0), ((-1, -1), 15.0), ((300, 0), 20.0)],
                         ids=["w100_0", "w37_5", "cap15", "w300_0_cap20"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("splits", [1, 0], ids=["one_split", "auto"])
def test_window_and_softcap(lib, window, softcap, paged, splits):
    """Sliding windows (bottom-right aligned per sequence, rows whose window is empty give 0 and
    LSE -inf) and softcap against the reference, seqlen_q 1 and 4 with GQA 4."""
    b, hq, hkv, d, cap = 3, 16, 4, 128, 5120
    g = torch.Generator(device="cuda").manual_seed(11)
    seqlens = torch.tensor([1, 777, 5000], dtype=torch.int32, device="cuda")
    kc, vc, extra = _cache(b, cap, hkv, d, g, 64 if paged else None)
    for sq, scale in ((1, None), (4, 0.3)):  # 0.3: the softcap's input scale is the call's
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, window_size=window,
                                                   softcap=softcap, num_splits=splits, return_lse=True,
                                                   softmax_scale=scale, **extra)
        torch.cuda.synchronize()
        ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, window_size=window, softcap=softcap,
                                                   softmax_scale=scale, **extra)
        _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("layout", ["one_length", "ragged", "paged", "one_sequence"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunked_prefill(lib, layout, causal):
    """More than 16 query rows per kv head go to the forward kernels (a view of the cache, the
    varlen forward over one sequence's cache row, or the gathered keys through the varlen
    forward): same semantics as the decode kernels."""
    b, sq, hq, hkv, d, cap = (1 if layout == "one_sequence" else 2), 96, 8, 2, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc, extra = _cache(b, cap, hkv, d, g, 64 if layout == "paged" else None)
    seqlens = (torch.tensor([1500, 1500] if layout == "one_length" else [1777, 96][:b], dtype=torch.int32,
                            device="cuda"))
    lengths = 1500 if layout == "one_length" else seqlens
    scale = 0.3 if causal else None  # not the default on one of the two
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=causal, return_lse=True,
                                               softmax_scale=scale, **extra)
    torch.cuda.synchronize()
    ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, causal=causal, softmax_scale=scale,
                                               **extra)
    _check(out, lse, ref, ref_lse)


def _poison_past_lengths(kc, vc, seqlens, block_table=None):
    """NaN in every cache row past its sequence's length, and in pages no sequence uses (what an
    uninitialized cache may hold)."""
    rows = kc.shape[1]
    valid = torch.zeros(kc.shape[:2], dtype=torch.bool, device=kc.device)
    for i, n in enumerate(seqlens.tolist()):
        pos = torch.arange(n, device=kc.device)
        if block_table is None:
            valid[i, :n] = True
        else:
            valid[block_table[i, pos // rows].long(), pos % rows] = True
    kc[~valid] = float("nan")
    vc[~valid] = float("nan")


@pytest.mark.parametrize("seqlen_q", [1, 96], ids=["decode", "prefill"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
def test_cache_rows_past_lengths_ignored(lib, seqlen_q, paged):
    """Rows past cache_seqlens may hold anything, NaN included: the output does not depend on
    them (decode and the chunked-prefill paths; FA3 propagates NaN from there)."""
    b, hq, hkv, d, cap = 2, 8, 2, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc, extra = _cache(b, cap, hkv, d, g, 64 if paged else None)
    seqlens = torch.tensor([1777, 130], dtype=torch.int32, device="cuda")
    _poison_past_lengths(kc, vc, seqlens, extra.get("block_table"))
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, return_lse=True,
                                               **extra)
    torch.cuda.synchronize()
    ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, causal=True, **extra)
    _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page", [64, 192, 256])
def test_paged_prefill_kernel(lib, dtype, d, causal, page, paged_forward_calls):
    """Chunked prefill over a paged cache runs the paged varlen forward (keys read through the
    block table in place; pages of 192 rows split key blocks): shuffled pages, ragged lengths
    (0, 1, odd, a page's end), GQA,
    NaN in every row no sequence uses and out-of-range table entries past the used pages (the
    kernel clamps them), a length past the table's capacity, against the reference on the
    gathered keys."""
    from fa3gen import varlen
    info = varlen.paged_variant(torch.empty(1, 1, 1, d, dtype=dtype), ops.masking(causal), lib)
    if info is None:
        pytest.skip("the library has no paged forward for this key")
    b, sq, hq, hkv, cols = 5, 80, 8, 2, -(-2560 // page)
    g = torch.Generator(device="cuda").manual_seed(11 + page + d)
    # 3000: past the table's capacity (cols * page, 2560-2688), which the kernel clamps it to
    seqlens = torch.tensor([3000, 0, 1, 1237, 5 * page], dtype=torch.int32, device="cuda")
    pages = b * cols + 2
    kc, vc = (torch.randn(pages, page, hkv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    table = torch.randperm(pages, device="cuda", generator=g)[:b * cols].reshape(b, cols).to(torch.int32)
    _poison_past_lengths(kc, vc, seqlens.clamp(max=cols * page), table)
    for i, n in enumerate(seqlens.tolist()):  # entries past a sequence's pages: anything
        used = min(-(-n // page), cols)
        table[i, used:] = torch.tensor([10**6, -5] * cols, device="cuda")[:cols - used]
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                               causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert len(paged_forward_calls) == 1
    clean = table.clamp(0, pages - 1)  # the reference gathers the used pages only
    ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, causal=causal, block_table=clean)
    _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("capacity", [2048, 2000], ids=["rows_of_64s", "other_rows"])
@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_prefill_with_cache_batch_idx(lib, capacity, lengths, paged_forward_calls):
    """Chunked prefill over a contiguous cache with cache_batch_idx (shuffled, one row unused):
    capacities of whole 64-row chunks run the paged forward with each cache row as one page,
    others gather; NaN in the rows no sequence reads; against the reference."""
    from fa3gen import varlen
    b, sq, hq, hkv, d = 3, 96, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc = (torch.randn(b + 1, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(2))
    idx = torch.tensor([3, 0, 2], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([1777, 96, 1999], dtype=torch.int32, device="cuda")
    if lengths == "int":
        seqlens = torch.full((b,), 1500, dtype=torch.int32, device="cuda")
    for row, n in zip(idx.tolist(), seqlens.tolist()):
        kc[row, n:], vc[row, n:] = float("nan"), float("nan")
    kc[1], vc[1] = float("nan"), float("nan")
    out, lse = kvcache.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=seqlens if lengths == "tensor" else 1500, cache_batch_idx=idx,
        causal=True, return_lse=True)
    torch.cuda.synchronize()
    info = varlen.paged_variant(q, ops.masking(True), lib)
    assert len(paged_forward_calls) == (1 if capacity % 64 == 0 and info is not None else 0)
    ref, ref_lse = kvcache_attention_reference(q, kc, vc, seqlens, cache_batch_idx=idx, causal=True)
    _check(out, lse, ref, ref_lse)


FP8 = torch.float8_e4m3fn


def _factors(kind, b, hkv, g):
    """(k_scale, v_scale) of an e4m3 cache: none, one value each, per kv head, per (batch, head)."""
    if kind == "none":
        return None, None
    if kind == "value":
        return 0.3, 1.7
    shape = (hkv,) if kind == "per_head" else (b, hkv)
    return tuple(torch.rand(shape, device="cuda", generator=g) + 0.5 for _ in range(2))


def _dequantized(cache, factor):
    """An e4m3 cache as fp32 values times their factors (contiguous: (batch, rows, heads, d))."""
    x = cache.float()
    if isinstance(factor, torch.Tensor):
        return x * (factor[:, None, :, None] if factor.dim() == 2 else factor[None, None, :, None])
    return x * (factor if factor is not None else 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("factors", ["none", "value", "per_head", "per_batch_head"])
def test_fp8_cache(lib, dtype, d, factors):
    """An e4m3 cache under bf16/fp16 queries: the kernels against attention over the dequantized
    cache, with one split and many, causal and not, an empty-ish and a full sequence."""
    b, sq, hq, hkv, cap = 3, 2, 16, 4, 3000
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    kc, vc = ((torch.randn(b, cap, hkv, d, device="cuda", generator=g) * 2).to(FP8) for _ in range(2))
    ks, vs = _factors(factors, b, hkv, g)
    seqlens = torch.tensor([cap, 1, 1777], dtype=torch.int32, device="cuda")
    ref_k, ref_v = _dequantized(kc, ks), _dequantized(vc, vs)
    for causal, splits in ((False, 0), (True, 1), (False, 7)):
        out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                                   num_splits=splits, return_lse=True, k_scale=ks, v_scale=vs)
        torch.cuda.synchronize()
        ref, ref_lse = kvcache_attention_reference(q, ref_k, ref_v, seqlens, causal=causal)
        _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_cache_paged_window_softcap_append(lib, d):
    """A paged e4m3 cache (64-row pages, shuffled, per-head factors): new bf16 keys appended
    (quantized on the way in) across a page boundary, then a windowed, softcapped attention."""
    b, sq, hq, hkv, page = 2, 1, 32, 8, 64
    g = torch.Generator(device="cuda").manual_seed(d + 1)
    per = 40
    pages = b * per + 3
    kc, vc = (torch.randn(pages, page, hkv, d, device="cuda", generator=g).to(FP8) for _ in range(2))
    table = torch.randperm(pages, device="cuda", generator=g)[:b * per].reshape(b, per).to(torch.int32)
    ks, vs = _factors("per_head", b, hkv, g)
    seqlens = torch.tensor([2000, 127], dtype=torch.int32, device="cuda")
    k, v = (torch.randn(b, 3, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k0, v0 = kc.clone(), vc.clone()
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens, block_table=table,
                                               window_size=(700, 0), softcap=20.0, return_lse=True,
                                               k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    # the appended rows hold k / k's factor and v / v's factor in e4m3; no other row changed
    for i, start in enumerate(seqlens.tolist()):
        for j in range(3):
            pos = start + j
            for cache, new, factor in ((kc, k, ks), (vc, v, vs)):
                row = cache[table[i, pos // page].long(), pos % page]
                want = (new[i, j].float() / factor[:, None]).clamp(-448, 448).to(FP8)
                assert torch.equal(row.view(torch.uint8), want.view(torch.uint8))
    for cache, before in ((kc, k0), (vc, v0)):
        changed = (cache.view(torch.uint8) != before.view(torch.uint8)).any(dim=(-1, -2))
        assert int(changed.sum()) <= b * 3
    ref_k = kc.float() * ks[None, None, :, None]
    ref_v = vc.float() * vs[None, None, :, None]
    ref, ref_lse = kvcache_attention_reference(q, ref_k, ref_v, seqlens + 3, block_table=table,
                                               window_size=(700, 0), softcap=20.0)
    _check(out, lse, ref, ref_lse)


def test_fp8_cache_bf16_queries_beyond_f16_range(lib):
    """bf16 q over an e4m3 cache runs the mma in f16, q scaled into its range by a power of
    two: queries far past 65504 (and rows of tiny ones beside them) still match."""
    b, sq, hq, hkv, d, cap = 2, 1, 8, 2, 128, 1500
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g)
    q[0] *= 3e5  # past f16's range
    q[1, :, :4] *= 1e-3  # small beside ordinary ones
    q = q.to(torch.bfloat16)
    kc, vc = (torch.randn(b, cap, hkv, d, device="cuda", generator=g).to(FP8) for _ in range(2))
    ks, vs = _factors("per_head", b, hkv, g)
    seqlens = torch.tensor([cap, 999], dtype=torch.int32, device="cuda")
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_lse=True,
                                               k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    ref, ref_lse = kvcache_attention_reference(q, _dequantized(kc, ks), _dequantized(vc, vs), seqlens)
    _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_rotary_append_then_attend(lib, paged, interleaved):
    """rotary_cos/rotary_sin: the cache receives the keys rotated at cache_seqlens + i, q is
    rotated at its own positions (causal), and the output is the reference's on the rotated
    q over the updated cache."""
    from fa3gen.reference import rotary_at

    b, sq, hq, hkv, d, cap = 3, 2, 8, 2, 128, 64
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sq, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    seqlens = torch.tensor([13, 0, 61], dtype=torch.int32, device="cuda")
    theta = torch.rand(cap, d // 4, device="cuda", generator=g) * 6.3  # rotary_dim d / 2
    cos, sin = theta.cos(), theta.sin()
    kc, vc, extra = _cache(b, cap, hkv, d, g, 16 if paged else None)
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                               return_lse=True, rotary_cos=cos, rotary_sin=sin,
                                               rotary_interleaved=interleaved, **extra)
    torch.cuda.synchronize()
    pos = seqlens.long()[:, None] + torch.arange(sq, device="cuda")
    q_rot = rotary_at(q, cos, sin, pos, interleaved).to(q.dtype)
    k_rot = rotary_at(k, cos, sin, pos, interleaved).to(k.dtype)
    for i in range(b):
        for j in range(sq):
            p = int(pos[i, j])
            row = kc[extra["block_table"][i, p // 16], p % 16] if paged else kc[i, p]
            assert torch.equal(row, k_rot[i, j])
    ref, ref_lse = kvcache_attention_reference(q_rot, kc, vc, seqlens + sq, causal=True, **extra)
    _check(out, lse, ref, ref_lse)


def _compiled_case(case):
    """(q, k_cache, v_cache, kwargs) of one call, fresh tensors (same values every time)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    b, hq, hkv, d, cap = 2, 8, 2, 128, 1024
    sq = 64 if case == "prefill" else 1
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    new = [torch.randn(b, 3, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    kc, vc, extra = _cache(b, cap, hkv, d, g, 64 if case in ("paged_int", "prefill") else None)
    kw = dict(cache_seqlens=torch.tensor([700, 5], dtype=torch.int32, device="cuda"), causal=True,
              **extra)
    if case == "append":
        kw.update(k=new[0], v=new[1], window_size=(100, 0), softcap=20.0)
    elif case == "paged_int":
        kw.update(cache_seqlens=900, k=new[0], v=new[1])
    elif case == "fp8_append":  # factors powers of 2: the quantizing division is exact anyway
        kc, vc = kc.to(FP8), vc.to(FP8)
        kw.update(k=new[0], v=new[1], k_scale=torch.tensor([0.5, 2.0], device="cuda"), v_scale=0.25)
    elif case == "rotary":
        theta = torch.rand(cap, d // 4, device="cuda", generator=g) * 6.3
        kw.update(k=new[0], v=new[1], rotary_cos=theta.cos(), rotary_sin=theta.sin())
    return q, kc, vc, kw


@pytest.mark.parametrize("case", ["append", "paged_int", "fp8_append", "prefill", "rotary"])
def test_compiled_calls_match_eager_ones(lib, case):
    """torch.compile(fullgraph=True) with inductor: the append compiled into the graph, the
    fa3gen::kvcache op running the eager call's kernels. Caches and outputs are bitwise the
    eager call's, but with rotary, whose compiled multiplies may round differently (within a
    bf16 step of the eager keys, outputs by the test's tolerance)."""
    q, kc, vc, kw = _compiled_case(case)
    out_e, lse_e = kvcache.flash_attn_with_kvcache(q, kc, vc, return_lse=True, **kw)
    torch._dynamo.reset()
    f = torch.compile(lambda q, kc, vc, kw: kvcache.flash_attn_with_kvcache(q, kc, vc, return_lse=True, **kw),
                      fullgraph=True)
    q, kc2, vc2, kw = _compiled_case(case)
    out, lse = f(q, kc2, vc2, kw)
    torch.cuda.synchronize()
    if case == "rotary":
        assert (kc2.float() - kc.float()).abs().max() <= 2 ** -7 * kc.float().abs().max()
        _check(out, lse, out_e.float(), lse_e)
        return
    for a, b in ((kc, kc2), (vc, vc2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_kvcache_op_opcheck(lib, cache):
    """fa3gen::kvcache under opcheck (schema, autograd registration, fake tensors, AOT dispatch
    with dynamic shapes), decode kernels on a paged cache. An e4m3 cache skips the schema test:
    it compares inputs with allclose, which torch does not implement for float8."""
    q, kc, vc, kw = _compiled_case("paged_int")
    tests = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    scales = (None, 1.0, None, 1.0)
    if cache == "e4m3":
        kc, vc, tests = kc.to(FP8), vc.to(FP8), tests[1:]
        scales = (torch.tensor([0.5, 2.0], device="cuda"), 1.0, None, 0.25)
    args = (q, kc, vc, torch.tensor([700, 5], dtype=torch.int32, device="cuda"), -1, None,
            kw["block_table"], 0.125, True, -1, 0, 0.0, 0, *scales)
    torch.library.opcheck(torch.ops.fa3gen.kvcache.default, args, test_utils=tests)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_decode_step_in_a_cuda_graph(lib, paged):
    """A decode step (append one token a sequence, then attend) captured in torch.cuda.graph, as
    inference servers run them: replays follow new values in the same buffers (the lengths
    and the new keys), and each matches an eager call on a copy of the cache, bit for bit."""
    b, hq, hkv, d, cap = 3, 8, 2, 128, 256
    g = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    seqlens = torch.tensor([13, 0, 200], dtype=torch.int32, device="cuda")
    kc, vc, extra = _cache(b, cap, hkv, d, g, 16 if paged else None)

    def step():
        return kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                               return_lse=True, **extra)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (the plan) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for i in range(2):
        seqlens.add_(1 + i)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g))
        kc_e, vc_e = kc.clone(), vc.clone()
        out_e, lse_e = kvcache.flash_attn_with_kvcache(q, kc_e, vc_e, k, v, cache_seqlens=seqlens,
                                                       causal=True, return_lse=True, **extra)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
        assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged16", "paged1", "long"])
@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_append_kernel_writes_what_pytorch_writes(lib, monkeypatch, cache_dtype, layout, lengths):
    """The append kernel (one launch of fa3gen_kvcache_append) against the PyTorch path (=0), on
    one poisoned cache each: the same cache bytes and the same attention output. New rows past
    the capacity dropped, lengths 0 and negative, a cache_batch_idx and a page out of range
    (clamped onto rows no other sequence uses), k and v (new and cached) of different strides
    (v a view of a wider tensor, v_cache interleaved with another), and "long": 512 new rows
    a sequence (chunked prefill), more chunks than one pass of the kernel's grid covers."""
    if not lib.has_append_kernel:
        pytest.skip("the library has no append kernel (built before it)")
    long = layout == "long"
    b, sq, hq, hkv, d, new, cap = (32, 1, 8, 8, 128, 512, 1024) if long else (4, 1, 8, 2, 128, 3, 48)
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, new, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, new, hkv, 2 * d, device="cuda", dtype=torch.bfloat16, generator=g)[..., d:]
    extra = {}
    if layout.startswith("paged"):
        page = int(layout[5:])
        pages = b * cap // page
        shape = (pages + 2, page, hkv, d)
        table = torch.randperm(pages + 2, device="cuda", generator=g)[:pages].reshape(b, -1).to(torch.int32)
        table[table == pages + 1] = pages + 9  # clamped back onto the last page
        extra["block_table"] = table
    else:
        shape = (b + 2, cap, hkv, d)
        if layout == "batch_idx":
            extra["cache_batch_idx"] = torch.tensor([9, 0, 3, 1], dtype=torch.int32, device="cuda")  # 9: row 5
    poison = torch.randn(shape[:2] + (2,) + shape[2:], device="cuda", generator=g).to(cache_dtype)
    if long:
        seqlens = torch.randint(-4, cap - new + 40, (b,), dtype=torch.int32, device="cuda", generator=g)
        seqlens = seqlens if lengths == "tensor" else cap - new
    else:
        seqlens = (torch.tensor([0, -3, 46, 20], dtype=torch.int32, device="cuda") if lengths == "tensor"
                   else 40)  # an int's new rows must fit (an error otherwise)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if cache_dtype != torch.bfloat16 else {}
    calls = []  # the kernel's launches: a layout it refused would compare PyTorch with itself
    real = lib.kvcache_append
    monkeypatch.setattr(lib, "kvcache_append", lambda *a: (calls.append(1), real(*a)))
    results = {}
    for kernel in ("0", "1"):
        monkeypatch.setenv("FA3GEN_APPEND_KERNEL", kernel)
        kc, pair = poison[:, :, 0].contiguous(), poison.clone()
        vc = pair[:, :, 1]  # interleaved with pair[:, :, 0], which must stay as it was
        out = kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                             **extra, **scales)
        torch.cuda.synchronize()
        results[kernel] = (kc.view(torch.uint8), pair.view(torch.uint8), out)
    assert len(calls) == 1
    (k0, v0, o0), (k1, v1, o1) = results["0"], results["1"]
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert torch.equal(o0, o1)
    assert torch.equal(v1[:, :, 0], poison[:, :, 0].view(torch.uint8))


@pytest.mark.parametrize("table", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("call", ["causal", "nocausal", "window", "prefill", "int"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rotary_append_kernel_writes_what_pytorch_writes(lib, monkeypatch, dtype, call, layout,
                                                         interleaved, table):
    """The append kernel with rotary_cos/rotary_sin (fa3gen_kvcache_append_rotary: q and the
    new keys rotated by the append kernel) against the PyTorch path: the same cache bytes and
    the same output, bit for bit. One in five q and k values subnormal-sized (the kernel must
    neither fuse a multiply-add nor flush to zero), rotary_dim 40 (not a multiple of a 16-byte
    chunk), q with strided heads, positions past the tables (clamped), new rows past the
    capacity; causal, not, a window (q rotated per row), chunked prefill (32 rows a kv head:
    the forward kernels read q_out) and an int cache_seqlens; the kernel path must have run."""
    if not lib.has_append_rotary:
        pytest.skip("the library has no rotary append kernel (built before it)")
    b, sq, hq, hkv, d, new, cap = 4, 2, 8, 2, 128, 3, 48
    if call == "prefill":
        sq, new = 8, 8
    g = torch.Generator(device="cuda").manual_seed(12)
    tiny = 1e-39 if dtype == torch.bfloat16 else 1e-6

    def values(*shape):
        x = torch.randn(*shape, device="cuda", generator=g) * 3
        return torch.where(torch.rand(*shape, device="cuda", generator=g) < 0.2, x * tiny, x).to(dtype)
    q = values(b, sq, hq, 2 * d)[..., :d]
    k, v = values(b, new, hkv, d), values(b, new, hkv, d)
    seqlens = (torch.tensor([0, -3, 46, 20], dtype=torch.int32, device="cuda") if call != "prefill"
               else torch.tensor([0, 5, 40, 20], dtype=torch.int32, device="cuda"))
    if call == "int":
        seqlens = 30
    theta = torch.rand(40, 20, device="cuda", generator=g) * 6.3  # 40 positions: 46 + i clamps
    cos, sin = theta.cos().to(table), theta.sin().to(table)
    mask = {"causal": call in ("causal", "prefill", "int")}
    if call == "window":
        mask["window_size"] = (5, 0)
    extra = {}
    if layout == "paged16":
        extra["block_table"] = torch.randperm(b * cap // 16, device="cuda", generator=g).to(
            torch.int32).view(b, -1)
        shape = (b * cap // 16, 16, hkv, d)
    else:
        shape = (b, cap, hkv, d)
    poison = torch.randn((2,) + shape, device="cuda", generator=g).to(dtype)
    calls = []
    real = lib.kvcache_append_rotary
    monkeypatch.setattr(lib, "kvcache_append_rotary", lambda *a: (calls.append(1), real(*a)))
    results = {}
    for kernel in ("0", "1"):
        monkeypatch.setenv("FA3GEN_APPEND_KERNEL", kernel)
        kc, vc = poison[0].clone(), poison[1].clone()
        out, lse = kvcache.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=seqlens, return_lse=True, rotary_cos=cos,
            rotary_sin=sin, rotary_interleaved=interleaved, **mask, **extra)
        torch.cuda.synchronize()
        results[kernel] = (kc, vc, out, lse)
    assert len(calls) == 1
    for want, got in zip(results["0"], results["1"]):  # (the prefill's LSE is a transposed view)
        assert torch.equal(want.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8))

