"""flash_attn_with_kvcache on CPU: argument checks, what a call writes into the decode params
(the launch stubbed), the split heuristic and the reference. The kernels:
tests/gpu/test_kvcache_kernels.py."""
import re

import pytest
import torch

from fa3gen import kvcache, ops
from fa3gen.errors import InvalidInputError, VariantNotBuiltError
from fa3gen.reference import kvcache_attention_reference

BF = torch.bfloat16
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def every_decode_kernel(monkeypatch):
    """The tests run without a library: as if it had every decode kernel."""
    from fa3gen import contract
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))


@pytest.fixture
def launched(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: calls.append(p))
    return calls


def test_contiguous_cache_params(launched):
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = vc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    seqlens = torch.tensor([700, 5], dtype=torch.int32)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                               cache_batch_idx=idx, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF and lse.shape == (2, 8, 1)
    (p,) = launched
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (2, 1, 1000, 8, 2, 128)
    assert p.cache_seqlens and p.cache_batch_idx and not p.block_table and p.page_size == 0
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == (1000 * 256, 256, 128)
    assert p.causal == 1 and p.fp16 == 0 and p.softmax_scale == pytest.approx(128 ** -0.5)
    assert p.num_splits == kvcache.num_splits_heuristic(2, 2, 1000, 132, 128) == 16  # 15 of 64 keys and one of 40
    assert p.o_accum and p.cache_rows == 3  # indices are clamped to it
    launched.clear()
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=4, cache_batch_idx=idx)
    assert launched[0].num_splits == 4 and launched[0].o_accum and launched[0].lse_accum
    launched.clear()
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=100, cache_batch_idx=idx)
    assert launched[0].num_splits == 16  # at most one split per 64 keys of capacity


def test_paged_cache_params(launched):
    q = torch.zeros(2, 2, 4, 64, dtype=torch.float16)
    kc = vc = torch.zeros(50, 64, 2, 64, dtype=torch.float16)
    table = torch.arange(20, dtype=torch.int32).reshape(2, 10)
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=300, block_table=table, num_splits=1)
    (p,) = launched
    # an int cache_seqlens is every sequence's length: seqlen_k, no tensor
    assert p.page_size == 64 and p.seqlen_k == 300 and not p.cache_seqlens and p.block_table_batch_stride == 10
    assert p.num_splits == 1 and not p.o_accum and p.fp16 == 1 and p.cache_rows == 50
    assert (p.k_batch_stride, p.k_row_stride) == (64 * 2 * 64, 2 * 64)


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=torch.zeros(1)), "both k and v"),
    (dict(window_size=(-2, 0)), "window_size left must be an int >= -1"),
    (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
    (dict(num_splits=-1), "num_splits"),
    (dict(softmax_scale=0.0), "softmax_scale must be a finite number > 0"),
    (dict(softmax_scale=float("nan")), "softmax_scale must be a finite number > 0"),
    (dict(softmax_scale=True), "softmax_scale must be a finite number > 0"),
    (dict(cache_seqlens=2000), "outside"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), "cache_seqlens must be int32"),
    (dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32)), r"cache_batch_idx must be int32 of shape \(2,\)"),
])
def test_errors(launched, kwargs, match):
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(q, kc, kc, **kwargs)
    assert not launched


def test_shape_errors(launched):
    kc = torch.zeros(3, 100, 2, 128, dtype=BF)
    with pytest.raises(InvalidInputError, match="of q's dtype or both float8_e4m3fn"):
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 128, dtype=torch.float16), kc, kc)
    with pytest.raises(InvalidInputError, match="of q's dtype or both float8_e4m3fn"):  # one e4m3
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 128, dtype=BF), kc.to(FP8), kc)
    with pytest.raises(InvalidInputError, match="head_dim 96"):
        k96 = torch.zeros(3, 100, 2, 96, dtype=BF)
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 96, dtype=BF), k96, k96)
    with pytest.raises(InvalidInputError, match="holds 3 sequences for a batch of 4"):
        kvcache.flash_attn_with_kvcache(torch.zeros(4, 1, 2, 128, dtype=BF), kc, kc)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="needs cache_seqlens"):
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 128, dtype=BF), kc, kc, block_table=table)
    with pytest.raises(InvalidInputError, match="contiguous cache, not a paged"):
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 128, dtype=BF), kc, kc, block_table=table,
                                        cache_seqlens=10, cache_batch_idx=torch.zeros(1, dtype=torch.int32))


def test_debug_checks_catch_out_of_range_pages(launched, monkeypatch):
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    q = torch.zeros(1, 1, 2, 64, dtype=BF)
    kc = torch.zeros(4, 16, 2, 64, dtype=BF)
    table = torch.tensor([[0, 9]], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="block_table row 0"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=20, block_table=table)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=16, block_table=table)  # page 9 unused


def test_split_heuristic():
    # b=1, 8 kv heads, d128 (2 CTAs per SM: 264 slots): 33 splits of 3972 keys (rounded up to
    # 4032) fill every slot; 32 (256 CTAs) is below 95% of that ...
    assert kvcache.num_splits_heuristic(1, 8, 131072, 132, 128) == 33
    # ... and at 64k, 31 splits are the fewest within 95% of the best fill (32: 33 would run as 32
    # splits of 2048 keys), and 32 run fewer keys per CTA in the same single wave
    assert kvcache.num_splits_heuristic(1, 8, 65536, 132, 128) == 32
    # 14 splits of 1024 keys would run as 8 of 128: 16 of 64
    assert kvcache.num_splits_heuristic(1, 8, 1024, 132, 128) == 16
    assert kvcache.num_splits_heuristic(8, 8, 32768, 132, 128) == 4     # 256 of 264 slots
    assert kvcache.num_splits_heuristic(8, 8, 32768, 132, 256) == 2     # 1 CTA per SM: 128 of 132
    assert kvcache.num_splits_heuristic(256, 8, 4096, 132, 128) == 1
    assert kvcache.num_splits_heuristic(1, 1, 1000, 132, 64) == 16      # 15 of 64 keys and one of 40
    assert kvcache.num_splits_heuristic(1, 1, 100, 132, 64) == 2        # 64 keys and 36
    assert kvcache.num_splits_heuristic(1, 8, 0, 132, 128) == 1         # no key: one split


def test_no_keys_at_all_launches_one_split(launched):
    """cache_seqlens 0 (an int) or an empty cache with the automatic split count: one split (the
    heuristic divided by zero), the rows then see no key (tests/gpu/test_kvcache_kernels.py)."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    for cache, lengths in ((torch.zeros(2, 64, 2, 128, dtype=BF), 0),
                           (torch.zeros(2, 0, 2, 128, dtype=BF), None)):
        launched.clear()
        kvcache.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths)
        (p,) = launched
        assert p.seqlen_k == 0 and p.num_splits == 1


def test_return_softmax_lse_is_flash_attns_name(launched):
    q = torch.zeros(1, 1, 8, 128, dtype=BF)
    kc = torch.zeros(1, 100, 2, 128, dtype=BF)
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=50, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 8, 1)


def test_reference_paged_equals_contiguous():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 64, generator=g)
    cont = torch.randn(2, 96, 2, 64, generator=g), torch.randn(2, 96, 2, 64, generator=g)
    # the same keys in 16-row pages, sequence 0 on pages 5, 1, ..., sequence 1 on 0, 2, ...
    order = [[5, 1, 7, 3, 9, 11], [0, 2, 4, 6, 8, 10]]
    paged = [torch.zeros(12, 16, 2, 64) for _ in range(2)]
    for b in range(2):
        for j, page in enumerate(order[b]):
            for t, c in zip(paged, cont):
                t[page] = c[b, 16 * j:16 * (j + 1)]
    seqlens = torch.tensor([90, 17], dtype=torch.int32)
    table = torch.tensor(order, dtype=torch.int32)
    a, la = kvcache_attention_reference(q, *cont, seqlens, causal=True)
    b_, lb = kvcache_attention_reference(q, *paged, seqlens, block_table=table, causal=True)
    assert torch.allclose(a, b_) and torch.allclose(la, lb)


def test_a_repeated_signature_is_planned_once(launched, monkeypatch):
    """The checks and static params run once per call signature; pointers change per call."""
    planned = []
    real = kvcache._plan
    monkeypatch.setattr(kvcache, "_plan", lambda *a: planned.append(1) or real(*a))
    kvcache._plans.clear()
    kc = torch.zeros(2, 256, 2, 64, dtype=BF)
    seqlens = torch.tensor([200, 7], dtype=torch.int32)
    qs = [torch.randn(2, 1, 4, 64).to(BF) for _ in range(3)]  # alive: three addresses
    for q in qs:
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlens)
    assert len(planned) == 1 and len(launched) == 3
    assert len({p.q for p in launched}) == 3 and launched[0].num_splits == launched[2].num_splits
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlens, causal=True)
    assert len(planned) == 2 and launched[-1].causal == 1
    # an int length that grows every step: one plan; seqlen_k and the splits follow the value
    long_cache = torch.zeros(2, 4096, 2, 64, dtype=BF)
    for n in (1, 2, 3000):
        kvcache.flash_attn_with_kvcache(q, long_cache, long_cache, cache_seqlens=n)
    assert len(planned) == 3 and [p.seqlen_k for p in launched[-3:]] == [1, 2, 3000]
    assert [p.num_splits for p in launched[-3:]] == [1, 1, kvcache.num_splits_heuristic(2, 2, 3000, 132, 64)]
    assert launched[-1].num_splits > 1 and launched[-1].o_accum and not launched[-3].o_accum
    with pytest.raises(InvalidInputError, match=r"cache_seqlens 4097 outside \[0, 4096\]"):
        kvcache.flash_attn_with_kvcache(q, long_cache, long_cache, cache_seqlens=4097)
    with pytest.raises(InvalidInputError, match="rows must be contiguous"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlens,
                                        block_table=torch.zeros(4, 2, dtype=torch.int32).t())


def _lengths(p, batch):
    """The int32 lengths a launch got (CPU memory, alive while the stubbed launch runs)."""
    import ctypes
    return list((ctypes.c_int32 * batch).from_address(p.cache_seqlens)) if p.cache_seqlens else None


def test_append_contiguous(monkeypatch):
    """k, v land at cache_seqlens[b] + i of cache row cache_batch_idx[b]; nothing else changes;
    the attention covers the new length; the caller's cache_seqlens is unchanged."""
    seen = []
    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: seen.append((p, _lengths(p, 2))))
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(3, 40, 2, 64, generator=g).to(BF) for _ in range(2))
    k0, v0 = kc.clone(), vc.clone()
    k, v = (torch.randn(2, 3, 2, 64, generator=g).to(BF) for _ in range(2))
    seqlens = torch.tensor([5, 37], dtype=torch.int32)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    q = torch.zeros(2, 3, 4, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, cache_batch_idx=idx)
    assert torch.equal(kc[2, 5:8], k[0]) and torch.equal(vc[2, 5:8], v[0])
    assert torch.equal(kc[0, 37:40], k[1]) and torch.equal(vc[0, 37:40], v[1])
    for cache, before in ((kc, k0), (vc, v0)):
        changed = (cache != before).any(dim=(2, 3))
        assert changed.sum() <= 6 and not changed[1].any()
        assert not (cache[2, :5] != before[2, :5]).any()
        assert not (cache[0, :37] != before[0, :37]).any()
    assert seen[0][1] == [8, 40] and seqlens.tolist() == [5, 37]
    # an int cache_seqlens: the same positions for every sequence, the length in seqlen_k
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=10)
    assert torch.equal(kc[1, 10:13], k[1]) and seen[-1][0].seqlen_k == 13 and not seen[-1][0].cache_seqlens
    before = kc.clone()  # no row fits: nothing is written
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([40, 45], dtype=torch.int32))
    assert torch.equal(kc, before)
    # a negative length (unchecked without FA3GEN_DEBUG_CHECKS) reads as 0: rows 0-2, never
    # rows counted back from the cache's end
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([-3, 5], dtype=torch.int32))
    expect = before.clone()
    expect[0, 0:3], expect[1, 5:8] = k[0], k[1]
    assert torch.equal(kc, expect)
    with pytest.raises(InvalidInputError, match=r"outside \[0, 37\] \(the cache holds 40 rows, 3 are appended\)"):
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=38)


def test_append_paged_crosses_pages_and_never_writes_past_the_cache(monkeypatch):
    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: None)
    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(6, 16, 1, 64, generator=g).to(BF) for _ in range(2))
    k0 = kc.clone()
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)  # 32 rows per sequence
    k, v = (torch.randn(2, 4, 1, 64, generator=g).to(BF) for _ in range(2))
    q = torch.zeros(2, 1, 1, 64, dtype=BF)
    seqlens = torch.tensor([14, 30], dtype=torch.int32)  # 14..17 crosses page 4 -> 1; 30..33 overflows
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(kc[4, 14:16], k[0, :2]) and torch.equal(kc[1, 0:2], k[0, 2:])
    assert torch.equal(vc[4, 14:16], v[0, :2]) and torch.equal(vc[1, 0:2], v[0, 2:])
    assert torch.equal(kc[5, 14:16], k[1, :2])  # rows 30, 31; 32 and 33 are past the capacity
    expect = k0.clone()
    expect[4, 14:16], expect[1, 0:2], expect[5, 14:16] = k[0, :2], k[0, 2:], k[1, :2]
    assert torch.equal(kc, expect)
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    with pytest.raises(InvalidInputError, match="4 are appended"):
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)


@pytest.mark.parametrize("kwargs,match", [
    (dict(v=None), "both k and v"),
    (dict(k=torch.zeros(2, 1, 2, 32, dtype=BF)), r"k and v must be \(batch=2, seqlen_new >= 1, 2, 64\)"),
    (dict(k=torch.zeros(2, 1, 2, 64), v=torch.zeros(2, 1, 2, 64)), "match the cache's dtype"),
    (dict(cache_seqlens=None), "needs cache_seqlens"),
    # more new rows than the cache holds, whatever the lengths (a tensor is not read)
    (dict(k=torch.zeros(2, 33, 2, 64, dtype=BF), v=torch.zeros(2, 33, 2, 64, dtype=BF),
          cache_seqlens=torch.zeros(2, dtype=torch.int32)), r"append 33 rows a sequence, more "
     r"than the cache holds \(32\)"),
])
def test_append_errors(launched, kwargs, match):
    kc = torch.zeros(2, 32, 2, 64, dtype=BF)
    args = dict(k=torch.zeros(2, 1, 2, 64, dtype=BF), v=torch.zeros(2, 1, 2, 64, dtype=BF),
                cache_seqlens=3)
    args.update(kwargs)
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, kc, **args)


def test_softcap_and_scale_given_as_tensors_key_the_plan_by_value(launched):
    """A 0-d tensor softcap or softmax_scale (masking() takes them) is part of the plan's key by
    its value: a second call with another value does not reuse the first one's plan."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(2, 256, 2, 128, dtype=BF)
    for cap, scale in ((1.0, 0.5), (30.0, 0.25), (0.0, 0.5)):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, softcap=torch.tensor(cap),
                                        softmax_scale=torch.tensor(scale))
    assert [p.softcap for p in launched] == [1.0, 30.0, 0.0]
    assert [p.softmax_scale for p in launched] == [0.5, 0.25, 0.5]


def test_window_and_softcap_params(launched):
    """flash-attn's window and softcap reach the kernel as the forward's masking() gives them;
    the split count follows the keys the window leaves, not the cache."""
    kc = torch.zeros(1, 65536, 2, 128, dtype=BF)
    q = torch.zeros(1, 1, 8, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=65536, window_size=(1024, 0), softcap=30.0)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=65536, causal=True)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=65536, window_size=(100, 7))
    windowed, causal, both_sides = launched
    assert (windowed.window_left, windowed.window_right, windowed.causal) == (1024, 0, 0)
    assert windowed.softcap == 30.0 and causal.softcap == 0.0
    assert (causal.window_left, causal.window_right, causal.causal) == (-1, -1, 1)
    assert (both_sides.window_left, both_sides.window_right) == (100, 7)
    assert windowed.num_splits == kvcache.num_splits_heuristic(1, 2, 1024 + 1 + 15, 132, 128) == 17
    assert causal.num_splits == kvcache.num_splits_heuristic(1, 2, 65536, 132, 128) > windowed.num_splits


def test_more_rows_than_decode_takes_go_to_the_forward_kernels(launched, monkeypatch):
    """Chunked prefill (more than 16 query rows per kv head): one length and a contiguous cache
    call flash_attn_func on a view of the cache (no copy); ragged lengths or pages gather each
    sequence's keys for flash_attn_varlen_func; window, softcap, scale and causal pass through."""
    import fa3gen.varlen as varlen
    calls = []
    monkeypatch.setattr(kvcache, "_require_forward", lambda *a: True)  # stubbed forwards
    monkeypatch.setattr(ops, "flash_attn_func", lambda q, k, v, scale, **kw: calls.append(
        ("dense", k, v, scale, kw)) or (torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    monkeypatch.setattr(varlen, "flash_attn_varlen_func", lambda q, k, v, cu_q, cu_k, mq, mk, **kw: calls.append(
        ("varlen", k, v, cu_q, cu_k, mq, mk, kw)) or (torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])))
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(3, 100, 2, 64, generator=g).to(BF) for _ in range(2))
    q = torch.zeros(2, 9, 4, 64, dtype=BF)  # 18 rows per kv head
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=40, causal=True, softcap=5.0,
                                               return_lse=True)
    kind, k, v, scale, kw = calls[-1]
    assert kind == "dense" and k.shape == (2, 40, 2, 64) and k.data_ptr() == kc.data_ptr()
    assert kw["causal"] and kw["softcap"] == 5.0 and scale == pytest.approx(64 ** -0.5)
    assert out.shape == q.shape and lse.shape == (2, 4, 9) and not launched
    seqlens = torch.tensor([30, 7], dtype=torch.int32)
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, window_size=(16, 0),
                                               cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
                                               return_lse=True)
    kind, k, v, cu_q, cu_k, mq, mk, kw = calls[-1]
    assert kind == "varlen" and cu_k.tolist() == [0, 30, 37] and cu_q.tolist() == [0, 9, 18]
    assert (mq, mk) == (9, 30) and kw["window_size"] == (16, 0) and not kw["causal"]
    assert torch.equal(k[:30], kc[2, :30]) and torch.equal(v[30:], vc[0, :7])
    assert out.shape == q.shape and lse.shape == (2, 4, 9)
    table = torch.tensor([[1, 0], [2, 1]], dtype=torch.int32)  # kc as 3 pages of 100 rows
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([150, 50], dtype=torch.int32),
                                    block_table=table)
    kind, k, v, cu_q, cu_k, mq, mk, kw = calls[-1]
    assert kind == "varlen" and cu_k.tolist() == [0, 150, 200] and mk == 150
    assert torch.equal(k[:100], kc[1]) and torch.equal(k[100:150], kc[0, :50]) and torch.equal(k[150:], kc[2, :50])
    # Lengths as a tensor, a contiguous cache, no cache_batch_idx: the varlen forward over the
    # cache rows themselves (no copy), sequence i at rows i * capacity, seqused_k = its length
    # clamped to the capacity; cu_seqlens built on the device (no .tolist() sync)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("host sync"))
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([130, 7], dtype=torch.int32),
                                               causal=True, return_lse=True)
    kind, k, v, cu_q, cu_k, mq, mk, kw = calls[-1]
    monkeypatch.undo()
    assert kind == "varlen" and k.data_ptr() == kc.data_ptr() and k.shape == (200, 2, 64)
    assert cu_k.tolist() == [0, 100, 200] and cu_q.tolist() == [0, 9, 18] and (mq, mk) == (9, 100)
    assert kw["seqused_k"].tolist() == [100, 7] and kw["causal"]
    assert out.shape == q.shape and lse.shape == (2, 4, 9)


def test_a_decode_kernel_the_library_lacks(launched, monkeypatch):
    """A spec's `decode:` may list some pairs: a call for another gets VariantNotBuiltError
    with the line to add; the runtime reads the pairs from the build info."""
    from fa3gen import runtime
    from fa3gen.errors import VariantNotBuiltError
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset({("bf16", 128)}))
    monkeypatch.setattr(kvcache, "_rebuild_command", lambda: "fa3gen build --spec mymodel")
    kc = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    with pytest.raises(VariantNotBuiltError, match=r"fp16 head_dim 64(.|\n)*decode kernels: \[bf16, 128\]"
                                                   r"(.|\n)*add dtype fp16 and head_dim 64 to the spec's `decode:` axes \(or \[fp16, 64\]"
                                                   r"(.|\n)*fa3gen build --spec mymodel"):
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 64, dtype=torch.float16), kc, kc)
    assert runtime.decode_pairs({"decode": [["bf16", 128], ["fp16", 96]]}, True) == {("bf16", 128)}
    assert runtime.decode_pairs({"decode": True}, True) == set(kvcache.contract.DECODE_PAIRS)
    assert runtime.decode_pairs({"decode": True}, False) == set() == runtime.decode_pairs({}, True)


def test_no_kv_heads_is_an_input_error(launched):
    kc = torch.zeros(1, 64, 0, 128, dtype=BF)
    with pytest.raises(InvalidInputError, match="multiple of heads_kv"):
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 4, 128, dtype=BF), kc, kc)


def test_fp8_cache_params(launched):
    """An e4m3 cache: kv_fp8, the factors as pointers (per (batch, head) or per head) or values,
    strides in elements (bytes)."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = vc = torch.zeros(3, 1000, 2, 128, dtype=FP8)
    ks = torch.ones(2, 2)
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=500, k_scale=ks, v_scale=0.5)
    p = launched[-1]
    assert p.kv_fp8 == 1 and p.k_scale == ks.data_ptr() and not p.v_scale
    assert (p.kv_scale_batch_stride, p.kv_scale_head_stride) == (2, 1)
    assert (p.k_scale_value, p.v_scale_value) == (1.0, 0.5)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == (1000 * 256, 256, 128)
    per_head = torch.ones(2)
    kvcache.flash_attn_with_kvcache(q.half(), kc, vc, cache_seqlens=500, k_scale=per_head, v_scale=per_head)
    p = launched[-1]
    assert p.fp16 == 1 and p.k_scale == p.v_scale == per_head.data_ptr()
    assert (p.kv_scale_batch_stride, p.kv_scale_head_stride) == (0, 1)
    kvcache.flash_attn_with_kvcache(q, kc, vc)
    assert launched[-1].kv_fp8 == 1 and (launched[-1].k_scale_value, launched[-1].v_scale_value) == (1.0, 1.0)
    kvcache.flash_attn_with_kvcache(q, kc.to(BF), vc.to(BF))
    assert launched[-1].kv_fp8 == 0


def test_fp8_cache_errors(launched):
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=FP8)
    with pytest.raises(InvalidInputError, match="dequantize an e4m3 cache"):
        kvcache.flash_attn_with_kvcache(q, kc.to(BF), kc.to(BF), k_scale=2.0)
    for bad in (torch.ones(3), torch.ones(2, 2, dtype=torch.float64), torch.ones(1, 2)):
        with pytest.raises(InvalidInputError, match=r"k_scale must be fp32 of shape \(2,\) or \(2, 2\)"):
            kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=bad)
    for bad in (0.0, -1.0, float("nan"), True, "2"):
        with pytest.raises(InvalidInputError, match="v_scale must be a positive float"):
            kvcache.flash_attn_with_kvcache(q, kc, kc, v_scale=bad)
    with pytest.raises(InvalidInputError, match="one shape and strides"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=torch.ones(2), v_scale=torch.ones(2, 2))
    # a k_scale of fp32's normal range whose product with softmax_scale is not: the kernel's
    # score scale would flush to 0 (every row's output 0, lse -inf)
    for tiny_or_huge, scale in ((1e-37, None), (3e38, 2.0)):
        with pytest.raises(InvalidInputError, match=re.escape(f"k_scale {tiny_or_huge:g} x ")
                           + r"softmax_scale .* is outside fp32's normal range"):
            kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5, k_scale=tiny_or_huge,
                                            softmax_scale=scale)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5, k_scale=1e-37, softmax_scale=1.0)
    assert launched[-1].k_scale_value == pytest.approx(1e-37)


def test_fp8_cache_factor_values_under_debug_checks(launched, monkeypatch):
    """Factor tensors are read on the host only with FA3GEN_DEBUG_CHECKS=1: a zero, negative,
    infinite or NaN entry is then named."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=FP8)
    bad = torch.ones(2, 2)
    bad[1, 0] = 0
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=500, k_scale=bad)  # not read
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=500, k_scale=torch.ones(2, 2))
    for value in (0.0, -1.0, float("inf"), float("nan")):
        bad[1, 0] = value
        with pytest.raises(InvalidInputError, match=r"v_scale\[1, 0\] is .*positive and finite"):
            kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=500, v_scale=bad)
    bad[1, 0] = 1e-37  # normal, but not times softmax_scale
    with pytest.raises(InvalidInputError, match=r"k_scale\[1, 0\] is .*times softmax_scale"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=500, k_scale=bad)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=500, v_scale=bad)  # v's is fine
    with pytest.raises(InvalidInputError, match="float8_e4m3fn or torch.bfloat16"):  # k, v of another dtype
        new = torch.zeros(2, 1, 2, 128, dtype=torch.float16)
        kvcache.flash_attn_with_kvcache(q, kc, kc, k=new, v=new, cache_seqlens=5)
    with pytest.raises(InvalidInputError, match="multiple of 16"):  # e4m3 rows: 16-byte strides
        k8 = torch.zeros(3, 100, 2, 136, dtype=FP8)[..., :128]
        kvcache.flash_attn_with_kvcache(q, k8, k8)


def test_fp8_cache_append_quantizes(launched):
    """New 16-bit keys and values go into an e4m3 cache as value / factor, saturated; e4m3 ones
    as they are."""
    g = torch.Generator().manual_seed(3)
    q = torch.zeros(2, 1, 8, 64, dtype=BF)
    kc, vc = (torch.zeros(2, 32, 2, 64, dtype=FP8) for _ in range(2))
    k, v = (torch.randn(2, 3, 2, 64, generator=g).to(BF) * 40 for _ in range(2))
    ks = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    kvcache.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=torch.tensor([4, 10], dtype=torch.int32),
                                    k_scale=ks, v_scale=0.125)
    want_k = (k.float() / ks[:, None, :, None]).clamp(-448, 448).to(FP8)
    want_v = (v.float() / 0.125).clamp(-448, 448).to(FP8)
    assert (v.float() / 0.125).abs().max() > 448  # saturation is exercised
    for cache, want in ((kc, want_k), (vc, want_v)):
        assert torch.equal(cache[0, 4:7].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(cache[1, 10:13].view(torch.uint8), want[1].view(torch.uint8))
        assert cache.view(torch.uint8)[0, :4].eq(0).all() and cache.view(torch.uint8)[1, 13:].eq(0).all()
    k8 = k.float().clamp(-448, 448).to(FP8)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k=k8, v=k8, cache_seqlens=20)
    assert torch.equal(kc[:, 20:23].view(torch.uint8), k8.view(torch.uint8))


def test_fp8_cache_prefill_dequantizes(launched, monkeypatch):
    """Chunked prefill over an e4m3 cache hands the forward kernels keys in q's dtype,
    multiplied by their factors."""
    calls = []
    monkeypatch.setattr(kvcache, "_require_forward", lambda *a: True)  # stubbed forwards
    monkeypatch.setattr(ops, "flash_attn_func", lambda q, k, v, scale, **kw: calls.append((k, v)) or (
        torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    g = torch.Generator().manual_seed(4)
    kc, vc = (torch.randn(2, 50, 2, 64, generator=g).to(FP8) for _ in range(2))
    q = torch.zeros(2, 9, 4, 64, dtype=torch.float16)
    ks = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=30, k_scale=ks, v_scale=3.0)
    k, v = calls[-1]
    assert k.dtype == torch.float16 and k.shape == (2, 30, 2, 64)
    assert torch.equal(k, (kc[:, :30].float() * ks[:, None, :, None]).half())
    assert torch.equal(v, (vc[:, :30].float() * 3.0).half())


def _rotate_by_complex(x, cos, sin, pos, interleaved):
    """An independent rotary reference: pairs as complex numbers times e^(i theta)."""
    half = cos.shape[1]
    xf = x.double()
    if interleaved:
        z = torch.complex(xf[..., 0:2 * half:2], xf[..., 1:2 * half:2])
    else:
        z = torch.complex(xf[..., :half], xf[..., half:2 * half])
    z = z * torch.complex(cos.double()[pos], sin.double()[pos])[:, :, None]
    rot = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((rot, xf[..., 2 * half:]), -1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_rotary_rotates_new_keys_and_queries_at_their_positions(monkeypatch, interleaved):
    """rotary_cos/rotary_sin (flash-attn's): the appended keys at cache_seqlens + i; q at the
    same positions when causal (or local), all of q at cache_seqlens otherwise; values and
    the cache's other rows untouched; the first rotary_dim values only."""
    ran = []
    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: None)
    real_run = kvcache._run
    monkeypatch.setattr(kvcache, "_run", lambda plan, q, *a, **kw: ran.append(q) or real_run(plan, q, *a, **kw))
    g = torch.Generator().manual_seed(3)
    theta = torch.rand(50, 16, generator=g) * 6.3  # rotary_dim 32 of 64
    cos, sin = theta.cos(), theta.sin()
    kc, vc = torch.zeros(2, 40, 2, 64, dtype=BF), torch.zeros(2, 40, 2, 64, dtype=BF)
    k, v = (torch.randn(2, 3, 2, 64, generator=g).to(BF) for _ in range(2))
    q = torch.randn(2, 3, 4, 64, generator=g).to(BF)
    seqlens = torch.tensor([5, 30], dtype=torch.int32)
    kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, **kw)
    pos = torch.tensor([[5, 6, 7], [30, 31, 32]])
    want_k = _rotate_by_complex(k, cos, sin, pos, interleaved)
    for b, s in ((0, 5), (1, 30)):
        assert torch.allclose(kc[b, s:s + 3].double(), want_k[b], rtol=1e-2, atol=1e-2)
        assert torch.equal(vc[b, s:s + 3], v[b]) and not kc[b, :s].any()
    assert torch.allclose(ran[-1].double(), _rotate_by_complex(q, cos, sin, pos, interleaved), rtol=1e-2, atol=1e-2)
    assert torch.equal(kc[..., 32:][0, 5:8], k[0, :, :, 32:])  # past rotary_dim: as given
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, **kw)  # non-causal
    at_start = torch.tensor([[5, 5, 5], [30, 30, 30]])
    assert torch.allclose(ran[-1].double(), _rotate_by_complex(q, cos, sin, at_start, interleaved), rtol=1e-2, atol=1e-2)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, window_size=(8, 0), **kw)
    assert torch.allclose(ran[-1].double(), _rotate_by_complex(q, cos, sin, pos, interleaved), rtol=1e-2, atol=1e-2)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=7, causal=True, **kw)  # an int
    assert torch.allclose(kc[1, 7:10].double(), _rotate_by_complex(k, cos, sin, pos * 0 + torch.arange(7, 10), interleaved)[1], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rotary_cos=torch.ones(50, 16)), "one shape"),
    (dict(rotary_cos=torch.ones(50, 40), rotary_sin=torch.ones(50, 40)), "rotary_dim / 2 <= 32"),
    (dict(rotary_cos=torch.ones(50, 16), rotary_sin=torch.ones(50, 16, dtype=torch.float64)), "dtype"),
    (dict(rotary_cos=torch.ones(50, 16), rotary_sin=torch.ones(50, 16), no_kv=True), "pass k and v"),
    (dict(rotary_cos=torch.ones(10, 16), rotary_sin=torch.ones(10, 16), cache_seqlens=8), "10 positions"),
])
def test_rotary_errors(launched, kwargs, match):
    q = torch.zeros(2, 3, 4, 64, dtype=BF)
    kc = vc = torch.zeros(2, 40, 2, 64, dtype=BF)
    k = v = torch.zeros(2, 3, 2, 64, dtype=BF)
    if kwargs.pop("no_kv", False):
        k = v = None
    kwargs.setdefault("cache_seqlens", 5)
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, **kwargs)


def test_rotary_positions_past_the_table_under_debug_checks(launched, monkeypatch):
    """A tensor cache_seqlens is not read on the host by default (positions are clamped to the
    table); FA3GEN_DEBUG_CHECKS=1 reads it and names the positions needed."""
    q = torch.zeros(2, 3, 4, 64, dtype=BF)
    kc, vc = torch.zeros(2, 60, 2, 64, dtype=BF), torch.zeros(2, 60, 2, 64, dtype=BF)
    k = v = torch.zeros(2, 3, 2, 64, dtype=BF)
    table = dict(rotary_cos=torch.ones(50, 16), rotary_sin=torch.zeros(50, 16))
    seqlens = torch.tensor([48, 5], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, **table)
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    with pytest.raises(InvalidInputError, match="50 positions; cache_seqlens needs 51"):
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, **table)


def test_appending_keys_that_require_grad_leaves_the_cache_untracked(launched):
    """flash-attn writes the cache as memory: k, v from a projection that requires grad must
    not put the cache into their graph (it grew a step a call and kept the activations)."""
    w = torch.ones(1, dtype=BF, requires_grad=True)
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    kc, vc = torch.zeros(2, 8, 2, 64, dtype=BF), torch.zeros(2, 8, 2, 64, dtype=BF)
    for step in range(3):
        k = torch.ones(2, 1, 2, 64, dtype=BF) * w
        kvcache.flash_attn_with_kvcache(q, kc, vc, k=k, v=2 * k, cache_seqlens=step)
    assert not kc.requires_grad and kc.grad_fn is None and not vc.requires_grad
    assert (kc[:, :3] == 1).all() and (vc[:, :3] == 2).all() and (kc[:, 3:] == 0).all()


def test_chunked_prefill_clamps_bad_indices_as_the_decode_kernels(launched, monkeypatch):
    """More rows than the decode kernels take go to the forward kernels through gathers of the
    cache: out-of-range pages or rows are clamped there too (an IndexError, on CUDA a device
    assert, before); FA3GEN_DEBUG_CHECKS=1 reports them."""
    calls = []
    monkeypatch.setattr(kvcache, "_require_forward", lambda *a: True)  # stubbed forwards
    monkeypatch.setattr(ops, "flash_attn_func", lambda *a, **k: calls.append(a) or (
        torch.zeros_like(a[0]), torch.zeros(a[0].shape[0], a[0].shape[2], a[0].shape[1])))
    from fa3gen import varlen
    monkeypatch.setattr(varlen, "flash_attn_varlen_func", lambda q, k, *a, **kw: calls.append(k) or (
        torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])))
    monkeypatch.setattr(varlen, "paged_variant", lambda *a: None)  # a library without one
    q = torch.zeros(2, 9, 4, 64, dtype=BF)
    kc = torch.zeros(3, 16, 2, 64, dtype=BF)
    table = torch.tensor([[0, 7], [1, 2]], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([20, 5], dtype=torch.int32),
                                    block_table=table)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([4, 5], dtype=torch.int32),
                                    cache_batch_idx=torch.tensor([0, 9], dtype=torch.int32))
    assert len(calls) == 2
    monkeypatch.setenv(ops.DEBUG_CHECKS_ENV, "1")
    with pytest.raises(InvalidInputError):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([20, 5], dtype=torch.int32),
                                        block_table=table)


def test_split_accumulators_and_debug_bounds_at_the_edge(launched, monkeypatch):
    """The fp32 partial LSEs follow the partial O (rows x d floats, 4 bytes each); under the
    debug checks the last page and cache row are in range, one past them is not."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=700, num_splits=4)
    (p,) = launched
    assert p.lse_accum - p.o_accum == 2 * 8 * 1 * 4 * 128 * 4  # b * hq * sq * splits * d floats
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    q1 = torch.zeros(1, 1, 2, 64, dtype=BF)
    pages = torch.zeros(4, 16, 2, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(q1, pages, pages, cache_seqlens=16, block_table=torch.tensor([[3]], dtype=torch.int32))
    with pytest.raises(InvalidInputError, match="block_table row 0"):
        kvcache.flash_attn_with_kvcache(q1, pages, pages, cache_seqlens=16,
                                        block_table=torch.tensor([[4]], dtype=torch.int32))
    rows = torch.zeros(3, 32, 2, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(q1, rows, rows, cache_seqlens=5,
                                    cache_batch_idx=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(InvalidInputError, match="cache_batch_idx in"):
        kvcache.flash_attn_with_kvcache(q1, rows, rows, cache_seqlens=5,
                                        cache_batch_idx=torch.tensor([3], dtype=torch.int32))


# What a mutation audit of fa3gen/kvcache.py (2026-12-02) found unpinned: each test below
# fails on one or more mutants of the checks, the params or the append.

def test_split_heuristic_head_dim_64_and_the_cap():
    assert kvcache.num_splits_heuristic(8, 8, 32768, 132, 64) == 6      # 3 CTAs an SM at d64
    assert kvcache.num_splits_heuristic(1, 1, 1 << 20, 132, 64) == 128  # at most 128 splits
    assert kvcache.num_splits_heuristic(1, 8, 6336, 132, 256) == 33     # within 95% of the best


def _q_cache(d=128, rows=1000, batch=2, heads_q=8, heads_kv=2, seqlen_q=1, dtype=BF):
    return (torch.zeros(batch, seqlen_q, heads_q, d, dtype=dtype),
            torch.zeros(3, rows, heads_kv, d, dtype=dtype))


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")), "on cpu"),
    (dict(cache_seqlens=[5, 7]), "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=True), "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=-1), r"outside \[0, 1000\]"),
    (dict(num_splits=True), "num_splits"),
    (dict(v_cache=torch.zeros(3, 500, 2, 128, dtype=BF)), "must have one shape"),
    (dict(k_cache=torch.zeros(3, 1000, 2, 64, dtype=BF), v_cache=torch.zeros(3, 1000, 2, 64, dtype=BF)),
     "must have one shape"),
    (dict(v_cache=torch.zeros(3, 1000, 2, 256, dtype=BF)[..., ::2]), r"v_cache.stride\(-1\)"),
])
def test_more_argument_errors(launched, kwargs, match):
    q, kc = _q_cache()
    args = dict(k_cache=kc, v_cache=kc)
    args.update(kwargs)
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(q, args.pop("k_cache"), args.pop("v_cache"), **args)
    assert not launched


def test_fp32_q_and_caches_are_refused(launched):
    q, kc = _q_cache(dtype=torch.float32)
    with pytest.raises(InvalidInputError, match="q must be bf16 or fp16"):
        kvcache.flash_attn_with_kvcache(q, kc, kc)


@pytest.mark.parametrize("table,match", [
    (torch.zeros(2, 10, dtype=torch.int64), "block_table must be int32"),
    (torch.zeros(1, 10, dtype=torch.int32), r"block_table must be int32 \(batch=2"),
    (torch.zeros(2, 2, dtype=torch.int32).t(), "rows must be contiguous"),
])
def test_block_table_errors(launched, table, match):
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    kc = torch.zeros(50, 64, 2, 64, dtype=BF)
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, block_table=table)


def test_the_plan_cache_does_not_skip_the_checks_of_a_new_signature(launched):
    q, kc = _q_cache()
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([5, 7], dtype=torch.int32))
    with pytest.raises(InvalidInputError, match="cache_seqlens must be int32"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([5, 7]))
    with pytest.raises(InvalidInputError, match="must have one shape"):
        kvcache.flash_attn_with_kvcache(q, kc, torch.zeros(3, 500, 2, 128, dtype=BF),
                                        cache_seqlens=torch.tensor([5, 7], dtype=torch.int32))


def test_strides_reach_the_params(launched):
    """q's own strides (a head slice), out's contiguous ones, the table's row stride (a padded
    view), and a window (-1, 0) sent as causal."""
    q = torch.zeros(2, 2, 16, 128, dtype=BF)[:, :, :8]
    kc = torch.zeros(50, 64, 2, 128, dtype=BF)
    table = torch.zeros(2, 16, dtype=torch.int32)[:, :10]
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, block_table=table,
                                    window_size=(-1, 0))
    (p,) = launched
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (2 * 16 * 128, 16 * 128, 128)
    assert (p.out_batch_stride, p.out_row_stride, p.out_head_stride) == (2 * 8 * 128, 8 * 128, 128)
    assert p.block_table_batch_stride == 16 and p.causal == 1


def test_sixteen_rows_a_kv_head_still_decode(launched, monkeypatch):
    monkeypatch.setattr(ops, "flash_attn_func", lambda *a, **k: pytest.fail("not a prefill"))
    q, kc = torch.zeros(1, 2, 8, 128, dtype=BF), torch.zeros(1, 100, 1, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=50)
    assert len(launched) == 1


def test_a_window_of_one_key_takes_one_split(launched):
    kc = torch.zeros(1, 65536, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 8, 128, dtype=BF), kc, kc,
                                    cache_seqlens=65536, window_size=(0, 0))
    assert launched[0].num_splits == 1


def test_an_explicit_split_count_up_to_65535(launched):
    kc = torch.zeros(1, 100000, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 8, 128, dtype=BF), kc, kc,
                                    cache_seqlens=100000, num_splits=1000)
    assert launched[0].num_splits == 1000


def test_the_split_workspace_holds_every_partial_lse(launched, monkeypatch):
    sizes, empty = [], torch.empty

    def recording(*shape, **kw):
        out = empty(*shape, **kw)
        if kw.get("dtype") == torch.float32:
            sizes.append(out.numel())
        return out
    monkeypatch.setattr(torch, "empty", recording)
    q, kc = _q_cache()
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=700, num_splits=4)
    rows = 2 * 8 * 1 * 4  # batch x heads_q x seqlen_q x splits
    assert rows * (128 + 1) in sizes
    (p,) = launched
    assert p.lse_accum - p.o_accum == rows * 128 * 4


def test_fp8_factor_errors_and_orientation(launched):
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 4, 128, dtype=FP8)
    kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=torch.ones(2, 4))  # (batch, heads_kv)
    for bad, match in ((torch.ones(4, 2), r"k_scale must be fp32 of shape \(4,\) or \(2, 4\)"),
                       (torch.ones(2, 4, device="meta"), "on cpu"),
                       (float("inf"), "positive"), (10 ** 400, "positive"), (1e39, "positive")):
        with pytest.raises(InvalidInputError, match=match):
            kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=bad)
    with pytest.raises(InvalidInputError, match="one shape and strides"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=torch.ones(4, 4)[:2],
                                        v_scale=torch.ones(4, 4).t()[:2])


@pytest.mark.parametrize("k,v,match,error", [
    ([0.0], [0.0], "torch.Tensors", TypeError),
    (torch.zeros(2, 3, 2, 64, dtype=BF), torch.zeros(2, 1, 2, 64, dtype=BF), "k and v must be", InvalidInputError),
    (torch.zeros(2, 0, 2, 64, dtype=BF), torch.zeros(2, 0, 2, 64, dtype=BF), "seqlen_new >= 1", InvalidInputError),
    (torch.zeros(2, 1, 2, 64, dtype=BF), torch.zeros(2, 1, 2, 64, device="meta", dtype=BF), None, InvalidInputError),
])
def test_new_key_errors(launched, k, v, match, error):
    kc = torch.zeros(2, 32, 2, 64, dtype=BF)
    with pytest.raises(error, match=match):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, kc, k, v, cache_seqlens=3)


def test_new_keys_of_two_dtypes_into_an_fp8_cache(launched):
    kc = torch.zeros(2, 32, 2, 64, dtype=FP8)
    with pytest.raises(InvalidInputError, match="match the cache's dtype"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, kc,
                                        torch.zeros(2, 1, 2, 64, dtype=BF),
                                        torch.zeros(2, 1, 2, 64, dtype=FP8), cache_seqlens=3)


def test_the_last_row_that_fits_is_written(launched):
    kc, vc = torch.zeros(2, 40, 2, 64, dtype=BF), torch.zeros(2, 40, 2, 64, dtype=BF)
    k = torch.ones(2, 1, 2, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, vc, k, k,
                                    cache_seqlens=torch.tensor([39, 0], dtype=torch.int32))
    assert (kc[0, 39] == 1).all() and (kc[1, 0] == 1).all() and kc.sum() == 2 * 2 * 64


def test_no_query_still_appends_and_launches_nothing(launched):
    """seqlen_q 0 (or no query heads): nothing to attend, but k, v still go into the cache (the
    early return skipped the append)."""
    kc, vc = torch.zeros(2, 8, 2, 64, dtype=BF), torch.zeros(2, 8, 2, 64, dtype=BF)
    k = torch.ones(2, 1, 2, 64, dtype=BF)
    for q in (torch.zeros(2, 0, 4, 64, dtype=BF), torch.zeros(2, 1, 0, 64, dtype=BF)):
        out = kvcache.flash_attn_with_kvcache(q, kc, vc, k, 2 * k, cache_seqlens=3)
        assert out.shape == q.shape and not launched
        assert (kc[:, 3] == 1).all() and (vc[:, 3] == 2).all() and kc.sum() == 2 * 2 * 64
        kc.zero_()
        vc.zero_()


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_seqlens=[-1, 5]), r"outside \[0, 16\]"),
    (dict(cache_batch_idx=[-1]), "cache_batch_idx in"),
])
def test_debug_checks_catch_negative_lengths_and_indices(launched, monkeypatch, kwargs, match):
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    batch = len(kwargs.get("cache_seqlens", [0]))
    kc = torch.zeros(4, 16, 2, 64, dtype=BF)
    args = {n: torch.tensor(v, dtype=torch.int32) for n, v in kwargs.items()}
    args.setdefault("cache_seqlens", torch.zeros(batch, dtype=torch.int32))
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(torch.zeros(batch, 1, 2, 64, dtype=BF), kc, kc, **args)


def test_debug_checks_catch_a_page_only_the_append_needs(launched, monkeypatch):
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    kc = torch.zeros(4, 16, 2, 64, dtype=BF)
    k = torch.zeros(1, 1, 2, 64, dtype=BF)
    for table, length in (([[0, 9]], 16), ([[-1]], 0)):  # page 9 holds only the new row
        with pytest.raises(InvalidInputError, match="block_table row 0"):
            kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 64, dtype=BF), kc, kc, k, k,
                                            cache_seqlens=torch.tensor([length], dtype=torch.int32),
                                            block_table=torch.tensor(table, dtype=torch.int32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(v=None), "pass k and v"),
    (dict(rotary_cos=torch.ones(50, 16), rotary_sin=torch.ones(40, 16)), "one shape"),
    (dict(rotary_cos=torch.ones(50, 16, dtype=torch.int64), rotary_sin=torch.ones(50, 16, dtype=torch.int64)),
     "floating-point"),
    (dict(k=torch.zeros(2, 3, 2, 64, dtype=FP8), v=torch.zeros(2, 3, 2, 64, dtype=FP8)), "16-bit k"),
    (dict(k=torch.zeros(2, 3, 2, 32, dtype=BF), v=torch.zeros(2, 3, 2, 32, dtype=BF)), "of one batch and d"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=BF), v=torch.zeros(2, 1, 2, 64, dtype=BF), causal=True,
          rotary_cos=torch.ones(10, 16), rotary_sin=torch.ones(10, 16), cache_seqlens=8),
     r"cache_seqlens \+ 3 = 11"),  # causal: q's 3 rows take positions 8, 9, 10
    (dict(cache_seqlens=-1), "10 positions; the call needs"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), r"shape \(2,\)"),
    (dict(rotary_cos=torch.ones(10, 16, device="meta"), rotary_sin=torch.ones(10, 16, device="meta")),
     "and dtype on cpu; got"),  # tables on another device than q
])
def test_more_rotary_errors(launched, kwargs, match):
    q = torch.zeros(2, 3, 4, 64, dtype=BF)
    kc = vc = torch.zeros(2, 40, 2, 64, dtype=BF)
    args = dict(k=torch.zeros(2, 3, 2, 64, dtype=BF), v=torch.zeros(2, 3, 2, 64, dtype=BF),
                rotary_cos=torch.ones(10, 16), rotary_sin=torch.ones(10, 16), cache_seqlens=5)
    if "k" in kwargs and kwargs["k"].dtype == FP8:
        kc = vc = kc.to(FP8)
    args.update(kwargs)
    with pytest.raises(InvalidInputError, match=match):
        kvcache.flash_attn_with_kvcache(q, kc, vc, **args)


def test_a_rotary_table_exactly_long_enough(launched):
    q, kc = torch.zeros(2, 1, 4, 64, dtype=BF), torch.zeros(2, 40, 2, 64, dtype=BF)
    k = torch.zeros(2, 3, 2, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc.clone(), k, k, cache_seqlens=7,
                                    rotary_cos=torch.ones(10, 16), rotary_sin=torch.ones(10, 16))
    assert len(launched) == 1


def _stub_forwards(monkeypatch):
    """The forward kernels chunked prefill calls (and the check that the library has them),
    recording (kind, k, cu_seqlens_k) and checking
    that each is asked for its LSE. The LSE they return reads 1000 h + r at head h, packed query
    row r (b * seqlen_q + s), each in its layout: flash_attn_func's (batch, heads_q, seqlen_q),
    the varlen function's (heads_q, total_q)."""
    from fa3gen import varlen
    calls = []

    def lse(heads, rows):
        return (torch.arange(heads)[:, None] * 1000 + torch.arange(rows)[None]).float()

    def dense(q, k, v, *a, **kw):
        assert kw["return_lse"] is True
        calls.append(("dense", k, None))
        b, sq, hq, _ = q.shape
        return torch.zeros_like(q), lse(hq, b * sq).view(hq, b, sq).permute(1, 0, 2)

    def packed(q, k, v, cu_q, cu_k, *a, **kw):
        assert kw["return_lse"] is True
        calls.append(("varlen", k, cu_k))
        return torch.zeros_like(q), lse(q.shape[1], q.shape[0])

    monkeypatch.setattr(ops, "flash_attn_func", dense)
    monkeypatch.setattr(varlen, "flash_attn_varlen_func", packed)
    monkeypatch.setattr(kvcache, "_require_forward", lambda *a: True)  # their lookup
    return calls


def test_chunked_prefill_needs_no_decode_kernel(launched, monkeypatch):
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset())
    calls = _stub_forwards(monkeypatch)
    kc = torch.zeros(2, 100, 2, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(torch.zeros(2, 9, 4, 64, dtype=BF), kc, kc, cache_seqlens=30)
    assert [c[0] for c in calls] == ["dense"] and not launched


def test_chunked_prefill_lengths_past_the_capacity_are_clamped(launched, monkeypatch):
    calls = _stub_forwards(monkeypatch)
    kc = torch.zeros(3, 100, 2, 64, dtype=BF)
    kvcache.flash_attn_with_kvcache(torch.zeros(2, 9, 4, 64, dtype=BF), kc, kc,
                                    cache_seqlens=torch.tensor([150, 5], dtype=torch.int32),
                                    cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    kind, k, cu_k = calls[-1]
    assert kind == "varlen" and cu_k.tolist() == [0, 100, 105] and k.shape[0] == 105


@pytest.mark.parametrize("paged", [True, False])
def test_appends_through_out_of_range_indices_are_clamped(launched, paged):
    """As the decode kernels read: a page index past the cache takes the last page, a row index
    the last row (FA3GEN_DEBUG_CHECKS=1 reports them instead)."""
    kc = torch.zeros(6 if paged else 3, 16, 2, 64, dtype=BF)
    k = torch.ones(1, 1, 2, 64, dtype=BF)
    where = (dict(block_table=torch.tensor([[9]], dtype=torch.int32)) if paged
             else dict(cache_batch_idx=torch.tensor([5], dtype=torch.int32)))
    kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 64, dtype=BF), kc, kc.clone(), k, k,
                                    cache_seqlens=torch.tensor([3], dtype=torch.int32), **where)
    last = kc.shape[0] - 1
    assert (kc[last, 3] == 1).all() and kc.sum() == 2 * 64


def test_degenerate_caches_and_tables_get_input_errors_or_no_writes(launched):
    q = torch.zeros(1, 1, 2, 64, dtype=BF)
    k = torch.ones(1, 1, 2, 64, dtype=BF)
    lengths = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="seqlen_ro >= 1"):  # was an IndexError
        kc = torch.zeros(1, 8, 2, 64, dtype=BF)
        kvcache.flash_attn_with_kvcache(q, kc, kc.clone(), k, k, cache_seqlens=lengths,
                                        rotary_cos=torch.ones(0, 16), rotary_sin=torch.ones(0, 16))
    pages = torch.zeros(4, 16, 2, 64, dtype=BF)
    no_page = torch.zeros(1, 0, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="more than the cache holds"):  # no room
        kvcache.flash_attn_with_kvcache(q, pages, pages.clone(), k, k, cache_seqlens=lengths,
                                        block_table=no_page)
    kvcache.flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=lengths,
                                    block_table=no_page)  # reading no page is fine
    assert not pages.any() and launched[-1].seqlen_k == 0
    # A cache of no rows: an input error (the decode kernels' own check raised a Fa3genError).
    for none, table in ((torch.zeros(0, 16, 2, 64, dtype=BF), torch.zeros(1, 1, dtype=torch.int32)),
                        (torch.zeros(4, 0, 2, 64, dtype=BF), torch.zeros(1, 1, dtype=torch.int32)),
                        (torch.zeros(0, 16, 2, 64, dtype=BF), None)):
        calls = len(launched)
        with pytest.raises(InvalidInputError, match="hold no (pages|rows)"):
            kvcache.flash_attn_with_kvcache(q, none, none.clone(), k, k, cache_seqlens=lengths,
                                            block_table=table, cache_batch_idx=(
                                                lengths if table is None else None))
        assert len(launched) == calls


def test_chunked_prefill_lse_layout_and_picked_sequences(launched, monkeypatch):
    """Every chunked-prefill path returns the forward kernels' LSE as (batch, heads_q,
    seqlen_q) (the varlen function's is (heads_q, total_q)), and an int length with a
    cache_batch_idx that is not consecutive reads those sequences (a copy, not a slice)."""
    calls = _stub_forwards(monkeypatch)
    kc, vc = (torch.randn(3, 100, 2, 64).to(BF) for _ in range(2))
    q = torch.zeros(2, 9, 4, 64, dtype=BF)  # 18 rows per kv head: the forward kernels
    want = (torch.arange(4)[None, :, None] * 1000 + torch.arange(2)[:, None, None] * 9
            + torch.arange(9)[None, None, :]).float()  # sequence b's row s is packed row 9 b + s
    lengths = torch.tensor([30, 7], dtype=torch.int32)
    for extra in ({},  # the varlen forward over the cache rows
                  {"cache_batch_idx": torch.tensor([2, 0], dtype=torch.int32)},  # gathered
                  {"block_table": torch.tensor([[1, 0], [2, 1]], dtype=torch.int32)}):  # paged
        _, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, return_lse=True,
                                                 **extra)
        assert torch.equal(lse, want), extra
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=40,
                                    cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    assert torch.equal(calls[-1][1], kc[[2, 0], :40])


def test_boundaries_that_are_legal(launched, monkeypatch):
    """Edges an operator-mutation pass found unpinned, each legal: a rotary table of one
    position and rotary_dim = head_dim, an int cache_seqlens of 0 with rotary, a one-page block
    table whose column stride is not 1, page 0 and cache_batch_idx 0 under
    FA3GEN_DEBUG_CHECKS=1, an fp8 factor of exactly the fp32 maximum."""
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    kc = torch.zeros(2, 40, 2, 64, dtype=BF)
    k = torch.zeros(2, 1, 2, 64, dtype=BF)
    for rows, half in ((1, 16), (4, 32)):  # one position; all 64 dims rotated
        kvcache.flash_attn_with_kvcache(q, kc, kc.clone(), k, k, cache_seqlens=0,
                                        rotary_cos=torch.ones(rows, half), rotary_sin=torch.zeros(rows, half))
    table = torch.zeros(2, 1, 2, dtype=torch.int32)[:, :, 0]  # (2, 1) with stride(1) == 2
    assert table.stride(1) == 2
    pages = torch.zeros(3, 16, 2, 64, dtype=BF)
    monkeypatch.setenv(ops.DEBUG_CHECKS_ENV, "1")
    kvcache.flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=torch.tensor([3, 16], dtype=torch.int32),
                                    block_table=table)
    assert launched[-1].page_size == 16
    kvcache.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=5,  # sequence 0 of the cache
                                    cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    monkeypatch.delenv(ops.DEBUG_CHECKS_ENV)
    kc8 = torch.zeros(2, 40, 2, 64).to(FP8)
    fp32_max = torch.finfo(torch.float32).max
    kvcache.flash_attn_with_kvcache(q, kc8, kc8.clone(), cache_seqlens=5, k_scale=fp32_max, v_scale=1.0)
    assert launched[-1].k_scale_value == fp32_max


def test_argument_errors_a_mutation_pass_found(launched):
    """q of 3 dims, and k given without v: one InvalidInputError each; k that is no tensor:
    a TypeError."""
    kc = torch.zeros(2, 40, 2, 64, dtype=BF)
    with pytest.raises(InvalidInputError, match="must be 4-D"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 4, 64, dtype=BF), kc, kc.clone(), cache_seqlens=5)
    k = torch.zeros(2, 1, 2, 64, dtype=BF)
    with pytest.raises(InvalidInputError, match="k and v"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, kc.clone(), k, None,
                                        cache_seqlens=5)
    with pytest.raises(TypeError, match="k and v must be torch.Tensors"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, kc.clone(), k.tolist(), k,
                                        cache_seqlens=5)
    # the caches by their own names (k and v are the new rows here)
    with pytest.raises(TypeError, match="^k_cache must be a torch.Tensor, got NoneType"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), None, kc, cache_seqlens=5)
    with pytest.raises(InvalidInputError, match="^v_cache is a nested tensor"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, torch.nested.nested_tensor(
            [torch.zeros(3, 64), torch.zeros(4, 64)]), cache_seqlens=5)
    assert not launched


def test_decode_calls_are_traced_with_their_dtype(launched, tmp_path):
    from fa3gen import tracing
    kc = torch.zeros(2, 40, 2, 64, dtype=BF)
    kc16 = torch.zeros(2, 40, 2, 128, dtype=torch.float16)
    with tracing.trace(tmp_path / "t.yaml") as t:
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 64, dtype=BF), kc, kc.clone(), cache_seqlens=5)
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 128, dtype=torch.float16), kc16,
                                        kc16.clone(), cache_seqlens=5)
    assert t.decode == {("bf16", 64), ("fp16", 128)}


def test_chunked_prefill_asks_for_the_lse_and_dequantizes_per_sequence(launched, monkeypatch):
    """The forward kernels are asked for their LSE on every prefill path, and per-(batch, head)
    e4m3 factors follow each sequence through the gather path (cache_batch_idx, ragged
    lengths); an out-of-range cache_batch_idx with an int length reads the last sequence, as
    the decode kernels clamp it."""
    calls = _stub_forwards(monkeypatch)
    g = torch.Generator().manual_seed(6)
    kc, vc = (torch.randn(3, 50, 2, 64, generator=g).to(FP8) for _ in range(2))
    q = torch.zeros(2, 9, 4, 64, dtype=BF)
    ks = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    lengths = torch.tensor([30, 7], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, k_scale=ks,
                                    cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    want = torch.cat([kc[2, :30].float() * ks[0][None, :, None], kc[0, :7].float() * ks[1][None, :, None]])
    assert torch.equal(calls[-1][1], want.to(BF))
    for extra in ({}, {"block_table": torch.tensor([[1, 0], [2, 1]], dtype=torch.int32)}):
        kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, **extra)
    kvcache.flash_attn_with_kvcache(q, kc.to(BF), vc.to(BF), cache_seqlens=20,
                                    cache_batch_idx=torch.tensor([7, 1], dtype=torch.int32))
    assert torch.equal(calls[-1][1], kc.to(BF)[[2, 1], :20])


PAGED_VARIANT = "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1_paged"  # the fake library's


def test_paged_prefill_reads_the_pages_in_place(fake_launches, monkeypatch, paged_forward_calls):
    """A paged cache goes to the library's paged varlen forward: the cache, table and lengths
    reach its params as they are (no gather, no sync), sequence b's keys bounded by its length
    clamped to the table's capacity; the outputs come back in flash-attn's layouts."""
    from fa3gen import varlen
    varlen_args = []
    real_set = varlen._set_varlen
    monkeypatch.setattr(varlen, "_set_varlen", lambda p, *a: varlen_args.append(a) or real_set(p, *a))
    tile_lists = []
    real_tiles = varlen._fwd_tile_list
    monkeypatch.setattr(varlen, "_fwd_tile_list",
                        lambda *a: tile_lists.append(real_tiles(*a)) or tile_lists[-1])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("a host sync"))
    q = torch.zeros(2, 200, 4, 128, dtype=BF)
    kc, vc = torch.zeros(10, 64, 2, 128, dtype=BF), torch.ones(10, 64, 2, 128, dtype=BF)
    table = torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.int32)
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([70, 500], dtype=torch.int32),
                                               block_table=table, causal=True, return_lse=True)
    ((name, p),) = fake_launches
    assert name == PAGED_VARIANT and out.shape == q.shape and lse.shape == (2, 4, 200)
    assert (p.k, p.v, p.block_table) == (kc.data_ptr(), vc.data_ptr(), table.data_ptr())
    assert (p.block_table_batch_stride, p.page_size, p.num_pages, p.block_table_cols) == (3, 64, 10, 3)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == (64 * 256, 256, 128)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (2, 200, 192, 400, 384)
    used = paged_forward_calls[0][4]  # the lengths as given (500 past the capacity: the kernels clamp it)
    assert used.dtype == torch.int32
    assert torch.equal(used, torch.tensor([70, 500], dtype=torch.int32))
    ((cu_q, cu_k, tiles, total_q, total_k),) = varlen_args  # sequence b: rows b * 200, keys b * 192
    assert (total_q, total_k) == (400, 384)
    assert torch.equal(cu_q, torch.tensor([0, 200, 400], dtype=torch.int32))
    assert torch.equal(cu_k, torch.tensor([0, 192, 384], dtype=torch.int32))
    (tile_list,) = tile_lists
    assert tiles == tile_list.data_ptr() == p.tile_list
    assert tile_list.dtype == torch.int32 and tile_list.numel() == 2 * 5 * 4  # FA3GEN_VARLEN_TILES(400, 2, 128) = 5, 4 heads


def test_paged_prefill_int_length(fake_launches, paged_forward_calls):
    """An int cache_seqlens is every sequence's length, made on the device."""
    q = torch.zeros(2, 40, 4, 128, dtype=BF)
    kc = torch.zeros(10, 64, 2, 128, dtype=BF)
    table = torch.tensor([[3, 0, 1, 0], [0, 0, 9, 0]], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=50, block_table=table, causal=True)
    ((name, p),) = fake_launches
    assert name == PAGED_VARIANT and p.block_table == table.data_ptr() and p.block_table_cols == 4
    assert torch.equal(paged_forward_calls[0][4], torch.tensor([50, 50], dtype=torch.int32))


@pytest.mark.parametrize("case", ["page_48", "requires_grad", "window", "fp16"])
def test_paged_prefill_falls_back_to_the_gather(fake_launches, monkeypatch, case):
    """What the paged forward does not take goes to the gathered copy as before: pages that
    are not a multiple of 64 rows (PAGED_CHUNK_ROWS), a q that requires grad (the paged forward has no backward),
    and keys the library has no paged variant for (a window here; fp16)."""
    calls = _stub_forwards(monkeypatch)
    page = 48 if case == "page_48" else 64
    q = torch.zeros(2, 40, 4, 128, dtype=torch.float16 if case == "fp16" else BF,
                    requires_grad=case == "requires_grad")
    kc = torch.zeros(10, page, 2, 128, dtype=q.dtype)
    table = torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([50, 60], dtype=torch.int32),
                                    block_table=table, causal=True,
                                    window_size=(100, 0) if case == "window" else (-1, -1))
    assert [c[0] for c in calls] == ["varlen"] and not fake_launches


@pytest.mark.parametrize("change,fits", [
    ({}, True),
    (dict(page=48), False),                  # not whole 64-row chunks
    (dict(page=128), True),
    (dict(cols=0), False),                   # a table of no column: no key to read
    (dict(cols=1), True),
    (dict(b=16384), True), (dict(b=16385), False),            # the varlen tile list's batch
    (dict(hq=32767), True), (dict(hq=32768), False),          # and heads
    (dict(sq=65535 * 64), True), (dict(sq=65535 * 64 + 1), False),  # its tiles per sequence
    (dict(cols=2**24 - 1), True), (dict(cols=2**24), False),  # b * capacity: int32 row offsets
])
def test_paged_fits_edges(change, fits):
    """Which calls the paged forward takes (the rest gather): its limits, inclusive."""
    from fa3gen import varlen
    a = {**dict(b=2, sq=40, hq=4, page=64, cols=3), **change}
    q = torch.empty(a["b"], a["sq"], a["hq"], 128, dtype=BF, device="meta")
    kc = torch.empty(10, a["page"], 2, 128, dtype=BF, device="meta")
    table = torch.empty(a["b"], a["cols"], dtype=torch.int32, device="meta")
    assert varlen.paged_fits(q, kc, table) is fits


@pytest.mark.parametrize("change", ["same", "pages", "cols", "scale", "grid"])
def test_paged_prefill_plans_per_signature(fake_launches, monkeypatch, change):
    """The paged forward checks and sizes a call signature once: a repeated one reuses them
    with its own pointers; the number of pages, the table's width, the scale and the grid mode
    each make a new plan."""
    from fa3gen import varlen
    q = torch.zeros(2, 40, 4, 128, dtype=BF)

    def call(pages=10, cols=3, scale=None, q=q):
        kc = torch.zeros(pages, 64, 2, 128, dtype=BF)
        table = torch.zeros(2, cols, dtype=torch.int32)
        lengths = torch.tensor([70, 100], dtype=torch.int32)
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lengths, block_table=table,
                                        causal=True, softmax_scale=scale)
        return kc, table, lengths, fake_launches[-1][1]

    call()
    if change == "grid":
        monkeypatch.setenv("FA3GEN_GRID", "persistent")
    args = dict(same={}, pages=dict(pages=11), cols=dict(cols=4), scale=dict(scale=0.5), grid={})
    kc, table, lengths, p = call(q=q.clone(), **args[change])
    assert len(varlen._paged_plans) == (1 if change == "same" else 2)
    assert (p.k, p.block_table, p.seqused_k) == (kc.data_ptr(), table.data_ptr(), lengths.data_ptr())
    assert (p.num_pages, p.block_table_cols) == (11 if change == "pages" else 10, 4 if change == "cols" else 3)
    assert p.softmax_scale == pytest.approx(0.5 if change == "scale" else 128**-0.5)
    assert p.grid_mode == (1 if change == "grid" else 0)


def test_a_traced_paged_prefill_puts_its_variant_in_the_spec(fake_launches, tmp_path):
    """A trace of chunked prefill over a paged cache records the paged variant (with the
    table's capacity as seqlen_k), so the trimmed spec written from it builds that variant
    instead of leaving the calls to the gather."""
    import yaml

    import fa3gen
    from fa3gen import cli
    path = tmp_path / "serve.yaml"
    q = torch.zeros(2, 40, 4, 128, dtype=BF)
    kc = torch.zeros(10, 64, 2, 128, dtype=BF)
    table = torch.zeros(2, 3, dtype=torch.int32)
    with fa3gen.trace(path):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([70, 100], dtype=torch.int32),
                                        block_table=table, causal=True)
    (entry,) = [e for e in yaml.safe_load(path.read_text())["calls"] if e["variant"] == PAGED_VARIANT]
    assert entry["count"] == 1 and entry["seqlen_k"] == [192, 192] and entry["paged"] is True
    out = tmp_path / "serve_spec.yaml"
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    assert any(g["axes"].get("paged") is True for g in yaml.safe_load(out.read_text())["groups"])


@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_prefill_with_cache_batch_idx_runs_the_paged_forward(fake_launches, monkeypatch, lengths):
    """Chunked prefill over a contiguous cache with cache_batch_idx reads each sequence's cache
    row in place as one page (the index as a one-column block table): no gather and no sync
    (either had one before)."""
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("a host sync"))
    q = torch.zeros(2, 40, 4, 128, dtype=BF)
    kc = torch.zeros(3, 128, 2, 128, dtype=BF)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    seqlens = torch.tensor([100, 50], dtype=torch.int32) if lengths == "tensor" else 77
    out = kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlens, cache_batch_idx=idx,
                                          causal=True)
    ((name, p),) = fake_launches
    assert name == PAGED_VARIANT and out.shape == q.shape
    assert (p.k, p.block_table, p.block_table_batch_stride) == (kc.data_ptr(), idx.data_ptr(), 1)
    assert (p.page_size, p.num_pages, p.block_table_cols, p.k_batch_stride) == (128, 3, 1, 128 * 256)
    if lengths == "tensor":
        assert p.seqused_k == seqlens.data_ptr()


def _fields(p) -> dict:
    """A DecodeParams' fields, pointers as set or not (a compiled call's buffers are its own)."""
    from fa3gen.contract import DECODE_PARAMS
    return {name: bool(getattr(p, name)) if "*" in ctype else getattr(p, name)
            for name, ctype in DECODE_PARAMS}


def _decode_case(case):
    """(q, k_cache, v_cache, kwargs) of one flash_attn_with_kvcache call, fresh tensors."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 8, 128, generator=g).to(BF)
    lengths = torch.tensor([700, 5], dtype=torch.int32)
    new = [torch.randn(2, 3, 2, 128, generator=g).to(BF) for _ in range(2)]
    kw = dict(cache_seqlens=lengths, causal=True)
    if case == "paged":
        kc, vc = (torch.randn(40, 64, 2, 128, generator=g).to(BF) for _ in range(2))
        kw.update(block_table=torch.randperm(40, generator=g)[:32].view(2, 16).to(torch.int32),
                  k=new[0], v=new[1])
    elif case == "fp8":
        kc, vc = (torch.randn(3, 1000, 2, 128, generator=g).to(FP8) for _ in range(2))
        kw.update(k=new[0], v=new[1], k_scale=torch.tensor([0.5, 2.0]), v_scale=0.25,
                  cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    else:
        kc, vc = (torch.randn(3, 1000, 2, 128, generator=g).to(BF) for _ in range(2))
        if case == "window_softcap_splits":
            kw.update(window_size=(100, 0), softcap=30.0, num_splits=3, softmax_scale=0.5)
        elif case == "int_append":
            kw.update(cache_seqlens=640, k=new[0], v=new[1])
        elif case == "rotary":
            theta = torch.rand(1000, 32, generator=g) * 6.3
            kw.update(k=new[0], v=new[1], rotary_cos=theta.cos(), rotary_sin=theta.sin(),
                      rotary_interleaved=False)
    return q, kc, vc, kw


@pytest.mark.parametrize("case", ["plain", "window_softcap_splits", "int_append", "paged", "fp8",
                                  "rotary"])
def test_torch_compile_fullgraph_does_what_eager_does(launched, case):
    """Under torch.compile(fullgraph=True), aot_eager (functionalized, as inductor gets it): the
    append (rotary included) runs as PyTorch operations in the graph and writes the same cache
    bytes as an eager call; the fa3gen::kvcache op launches the eager call's params."""
    q, kc, vc, kw = _decode_case(case)
    out_e, lse_e = kvcache.flash_attn_with_kvcache(q, kc, vc, return_lse=True, **kw)
    eager = [_fields(p) for p in launched]
    launched.clear()
    q, kc2, vc2, kw = _decode_case(case)
    torch._dynamo.reset()
    f = torch.compile(lambda q, kc, vc, kw: kvcache.flash_attn_with_kvcache(q, kc, vc, return_lse=True, **kw),
                      backend="aot_eager", fullgraph=True)
    out, lse = f(q, kc2, vc2, kw)
    assert [_fields(p) for p in launched] == eager and len(eager) == 1
    for a, b in ((kc, kc2), (vc, vc2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert out.shape == out_e.shape and lse.shape == lse_e.shape and lse.is_contiguous()
    if "k" in kw:  # the append happened (and only once)
        assert not torch.equal(kc2.view(torch.uint8), _decode_case(case)[1].view(torch.uint8))


def test_torch_compile_takes_a_growing_int_length_without_recompiling(launched):
    """An int cache_seqlens grows every decode step: dynamo makes it dynamic on the second value
    and compiles no more; each call launches its own length and split count."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    f = torch.compile(lambda q, kc, n: kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=n),
                      backend="eager", fullgraph=True)
    lengths = (700, 5, 64, 999, 1000, 0)
    for n in lengths:
        f(q, kc, n)
    assert [p.seqlen_k for p in launched] == list(lengths)
    assert [p.num_splits for p in launched] == [
        kvcache._split_count(n, 0, 2, 2, 132, 128, None) for n in lengths]
    assert counters["stats"]["unique_graphs"] == 2


def test_torch_compile_refuses_bad_input_as_eager_does(launched):
    """The checks run while tracing: an error, not a launch (fullgraph: dynamo's Unsupported
    carrying it)."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    call = lambda q, kc, n: kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=n)
    torch._dynamo.reset()
    with pytest.raises(InvalidInputError, match="cache_seqlens 2000 outside"):
        torch.compile(call, backend="eager")(q, kc, 2000)
    torch._dynamo.reset()
    from torch._dynamo.exc import Unsupported
    with pytest.raises(Unsupported, match="cache_seqlens 2000 outside"):
        torch.compile(call, backend="eager", fullgraph=True)(q, kc, 2000)
    assert not launched


def test_torch_compile_checks_the_built_decode_kernels_as_eager_does(launched, monkeypatch):
    """The library's decode pairs are checked while tracing (the real lookup goes through files
    and ctypes) by a function torch.compile runs as a constant, which raises the eager error
    itself: `in` on a set returned by such a function failed inside dynamo (torch 2.11 and
    2.13) on the GPU, where the CPU tests had replaced the marked function itself."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    call = lambda q, kc: kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5)
    assert kvcache._require_decode_kernels._dynamo_marked_constant  # the path the GPU takes
    torch._dynamo.reset()
    torch.compile(call, backend="eager", fullgraph=True)(q, kc)
    assert len(launched) == 1
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset({("fp16", 64)}))
    torch._dynamo.reset()
    # dynamo re-raises it as its InternalTorchDynamoError, the message kept
    with pytest.raises(Exception, match=r"VariantNotBuiltError: (.|\n)*decode kernels: \[fp16, 64\]"):
        torch.compile(call, backend="eager", fullgraph=True)(q, kc)
    assert len(launched) == 1


@pytest.mark.parametrize("layout", ["tensor", "int", "paged"])
def test_torch_compile_chunked_prefill(fake_launches, layout):
    """More rows than the decode kernels take: the op runs the eager call's forward (the
    fake library's variants) under fullgraph; a q that needs a gradient runs eagerly outside
    the graph (fullgraph refuses it), with its autograd."""
    q = torch.zeros(2, 40, 4, 128, dtype=BF)
    kw = dict(causal=layout != "int",  # the fake library's: varlen causal, dense non-causal
              cache_seqlens=torch.tensor([50, 60], dtype=torch.int32))
    if layout == "paged":
        kc = torch.zeros(10, 64, 2, 128, dtype=BF)
        kw["block_table"] = torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.int32)
    else:
        kc = torch.zeros(2, 128, 2, 128, dtype=BF)
        if layout == "int":
            kw["cache_seqlens"] = 77
    kvcache.flash_attn_with_kvcache(q, kc, kc, **kw)
    eager = [name for name, _ in fake_launches]
    fake_launches.clear()
    call = lambda q, kc: kvcache.flash_attn_with_kvcache(q, kc, kc, **kw)
    torch._dynamo.reset()
    assert torch.compile(call, backend="aot_eager", fullgraph=True)(q, kc).shape == q.shape
    assert [name for name, _ in fake_launches] == eager and len(eager) == 1
    q.requires_grad_()
    torch._dynamo.reset()
    assert torch.compile(call, backend="eager")(q, kc).requires_grad
    from torch._dynamo.exc import Unsupported
    torch._dynamo.reset()
    with pytest.raises(Unsupported):
        torch.compile(call, backend="eager", fullgraph=True)(q, kc)


def test_torch_compile_with_debug_checks_checks_before_the_append(launched, monkeypatch):
    """FA3GEN_DEBUG_CHECKS=1: a compiled call runs eagerly outside the graph, so its data checks
    see the lengths before the append and refuse a bad one before writing anything."""
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    torch._dynamo.reset()
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 1000, 2, 128, dtype=BF)
    new = torch.ones(2, 2, 2, 128, dtype=BF)
    call = lambda q, kc, k, s: kvcache.flash_attn_with_kvcache(q, kc, kc, k, k, cache_seqlens=s)
    with pytest.raises(InvalidInputError, match=r"cache_seqlens in \[-2, 5\], outside \[0, 998\]"):
        torch.compile(call, backend="aot_eager")(q, kc, new, torch.tensor([-2, 5], dtype=torch.int32))
    assert not kc.any() and not launched
    torch.compile(call, backend="aot_eager")(q, kc, new, torch.tensor([3, 5], dtype=torch.int32))
    assert kc[0, 3:5].eq(1).all() and launched[0].seqlen_k == 1000


def test_the_custom_op_passes_opcheck_on_cpu(launched):
    """fa3gen::kvcache's schema (it mutates nothing: the append runs before it) and its fake
    implementation (shapes, strides, dtypes of out and lse) against the op itself; the rest of
    opcheck compares values, which needs the kernels: tests/gpu/test_kvcache_kernels.py."""
    q = torch.zeros(2, 3, 8, 64, dtype=BF)
    kc = torch.zeros(3, 100, 2, 64, dtype=BF)  # (an e4m3 one: torch's schema check cannot
    args = (q, kc, kc, torch.tensor([7, 5], dtype=torch.int32), -1,    # multiply e4m3 on CPU)
            torch.tensor([2, 0], dtype=torch.int32), None, 0.125, True, 20, 0, 5.0, 3,
            None, 1.0, None, 1.0)
    torch.library.opcheck(torch.ops.fa3gen.kvcache.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    assert launched and all(p.window_left == 20 and p.softcap == 5.0 for p in launched)


@pytest.mark.parametrize("window,per_row", [((-1, -1), False), ((1000, 1000), False), ((47, -1), False),
                                            ((46, -1), True), ((-1, 1), False), ((-1, 0), True)])
def test_rotary_positions_of_q_follow_the_windows_reach(launched, monkeypatch, window, per_row):
    """q's rows are rotated at their own positions when the call is causal or its window hides
    a key, else all at cache_seqlens (FlashAttention-3's rule: a left side of >= capacity - 1
    keys or a right side of >= seqlen_q - 1 hides none), here capacity 48, seqlen_q 2."""
    seen = []
    real = kvcache._rotate
    monkeypatch.setattr(kvcache, "_rotate", lambda *a: seen.append(a[-1]) or real(*a))
    q = torch.zeros(2, 2, 8, 128, dtype=BF)
    kc = torch.zeros(2, 48, 2, 128, dtype=BF)
    new = torch.zeros(2, 2, 2, 128, dtype=BF)
    cos = torch.ones(48, 32)
    kvcache.flash_attn_with_kvcache(q, kc, kc.clone(), new, new, cache_seqlens=10, window_size=window,
                                    rotary_cos=cos, rotary_sin=cos)
    assert seen == [per_row]


def test_a_numpy_integer_cache_seqlens_is_an_int(launched):
    """flash-attn takes cache_seqlens as an int or a tensor; a numpy integer is an int."""
    np = pytest.importorskip("numpy")
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(3, 100, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=np.int32(70), cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=70, cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    (a, b) = launched
    assert a.seqlen_k == b.seqlen_k == 70 and not a.cache_seqlens


def test_a_numpy_integer_num_splits_is_an_int(launched):
    """num_splits as a numpy integer asks for what the same int asks for."""
    np = pytest.importorskip("numpy")
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(2, 1000, 2, 128, dtype=BF)
    for splits in (np.int64(4), 4):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=700, num_splits=splits)
    assert [p.num_splits for p in launched] == [4, 4]


def test_torch_compile_with_dynamic_shapes(launched):
    """torch.compile(dynamic=True): the head dim and the window and softcap flags reach the
    decode-kernel check and the plan as constants (ops.static_head_dim, Masking.key); two
    batch sizes run one graph, each appending where eager would."""
    torch._dynamo.reset()
    call = torch.compile(
        lambda q, kc, n, k: kvcache.flash_attn_with_kvcache(q, kc, kc, k, k, cache_seqlens=n, causal=True,
                                                            window_size=(100, 0), softcap=20.0),
        fullgraph=True, backend="aot_eager", dynamic=True)
    for b in (2, 3):
        kc = torch.zeros(b, 1000, 2, 128, dtype=BF)
        call(torch.zeros(b, 1, 8, 128, dtype=BF), kc, torch.tensor([7, 5, 3][:b], dtype=torch.int32),
             torch.ones(b, 1, 2, 128, dtype=BF))
        assert kc[0, 7].eq(1).all() and kc[1, 5].eq(1).all() and kc.sum() == b * 2 * 128
    assert len(launched) == 2 and launched[-1].window_left == 100 and launched[-1].softcap == 20.0


def test_fa3_names_page_table_and_descales_are_ours(launched):
    """FlashAttention-3's page_table, k_descale, v_descale launch what block_table, k_scale,
    v_scale launch; both names of one argument in one call is an error."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(40, 64, 2, 128).to(FP8)
    table = torch.arange(20, dtype=torch.int32).reshape(2, 10)
    ks = torch.full((2,), 0.5)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=300, block_table=table, k_scale=ks,
                                    v_scale=0.25)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=300, page_table=table, k_descale=ks,
                                    v_descale=0.25, pack_gqa=True, sm_margin=4)
    ours, fa3 = launched
    assert _fields(ours) == _fields(fa3)
    assert ours.block_table == fa3.block_table == table.data_ptr() and fa3.k_scale == ks.data_ptr()
    for kw in (dict(block_table=table, page_table=table), dict(k_scale=ks, k_descale=ks),
               dict(v_scale=0.5, v_descale=0.5)):
        fa3_name = [n for n in kw if n in ("page_table", "k_descale", "v_descale")][0]
        with pytest.raises(InvalidInputError, match=f"{fa3_name} is FlashAttention-3's name for"):
            kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=300, **{"block_table": table, **kw})
    assert len(launched) == 2


@pytest.mark.parametrize("keyword, value, message", [
    ("cache_leftpad", torch.zeros(2, dtype=torch.int32), r"cache_leftpad \(left-padded caches\) is not supported"),
    ("cu_seqlens_q", torch.zeros(3, dtype=torch.int32), "cu_seqlens_q .* is not supported"),
    ("cu_seqlens_k_new", torch.zeros(3, dtype=torch.int32), "cu_seqlens_k_new .* is not supported"),
    ("max_seqlen_q", 1, "max_seqlen_q .* is not supported"),
    ("rotary_seqlens", torch.zeros(2, dtype=torch.int32), "rotary_seqlens .* is not supported"),
    ("q_descale", torch.ones(2, 2), r"q_descale \(an fp8 q"),
    ("scheduler_metadata", torch.zeros(4, dtype=torch.int32), "scheduler_metadata .* is not supported"),
    ("alibi_slopes", torch.zeros(8), r"alibi_slopes \(ALiBi, flash-attn 2\) is not supported"),
    ("qv", torch.zeros(2, 1, 8, 128, dtype=BF), "qv .* is not supported"),
    ("attention_chunk", 64, r"attention_chunk=64 \(chunked local attention\) is not supported"),
    ("pack_gqa", "yes", "pack_gqa must be None, True or False"),
    ("sm_margin", -1, "sm_margin must be an int >= 0"),
])
def test_fa3_keywords_fa3gen_lacks_are_refused_unless_at_their_defaults(launched, keyword, value, message):
    """Every other keyword of FlashAttention-3's flash_attn_with_kvcache (and flash-attn 2's
    alibi_slopes) is taken at its default; a value that asks for the feature is an
    InvalidInputError naming it, before anything launches."""
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(2, 256, 2, 128, dtype=BF)
    defaults = dict(qv=None, cache_leftpad=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                    max_seqlen_q=None, rotary_seqlens=None, q_descale=None, attention_chunk=0,
                    scheduler_metadata=None, pack_gqa=None, sm_margin=0, alibi_slopes=None)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, **defaults)
    with pytest.raises(InvalidInputError, match=message):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, **{keyword: value})
    assert len(launched) == 1


def test_everything_after_v_is_keyword_only(launched):
    """flash-attn 2's sixth positional is rotary_cos, FlashAttention-3's qv: a sixth positional
    argument is a TypeError, never read as cache_seqlens (FA3's positional cache_seqlens would
    have landed on softmax_scale)."""
    import inspect
    params = inspect.signature(kvcache.flash_attn_with_kvcache).parameters
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k_cache", "v_cache", "k", "v"]
    q = torch.zeros(1, 1, 8, 128, dtype=BF)
    kc = torch.zeros(1, 256, 2, 128, dtype=BF)
    with pytest.raises(TypeError, match="positional"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, None, None, None, None, None, 5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_seqlen'"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlen=5)  # a typo stays Python's error
    assert launched == []


class _AppendRecorder:
    """A library with the append kernels that records their params (and writes nothing)."""
    has_append_kernel = has_append_rotary = True

    def __init__(self):
        self.calls, self.rotary_calls = [], []

    def kvcache_append(self, params, stream):
        self.calls.append(params)

    def kvcache_append_rotary(self, params, rotary, stream):
        self.rotary_calls.append((params, rotary))


def test_append_kernel_on_a_gpu_with_a_library_that_has_it_unless_turned_off(monkeypatch):
    import types
    lib, gpu = _AppendRecorder(), types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("FA3GEN_APPEND_KERNEL", raising=False)
    assert kvcache._append_library(lib, gpu) is lib  # the default
    for on in ("", "1"):
        monkeypatch.setenv("FA3GEN_APPEND_KERNEL", on)
        assert kvcache._append_library(lib, gpu) is lib
    monkeypatch.setenv("FA3GEN_APPEND_KERNEL", "0")
    assert kvcache._append_library(lib, gpu) is None
    monkeypatch.delenv("FA3GEN_APPEND_KERNEL")
    assert kvcache._append_library(lib, types.SimpleNamespace(is_cuda=False)) is None
    lib.has_append_kernel = False  # a library built before the kernel
    assert kvcache._append_library(lib, gpu) is None


@pytest.mark.parametrize("paged", [False, True])
def test_an_eager_append_is_one_kernel_launch(launched, monkeypatch, paged):
    """With the append kernel, an eager call's new rows go to it (params as append_params
    makes them: the e4m3 cache's rows quantized first), not to PyTorch indexing; new rows it
    cannot take (a head dim stride of 2) still go through PyTorch."""
    lib = _AppendRecorder()
    monkeypatch.setattr(kvcache, "_append_library", lambda lib_, k: lib)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call: call(0))
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    cache, vcache = (torch.zeros(8, 64, 2, 128).to(FP8) for _ in range(2))
    extra = dict(block_table=torch.arange(8, dtype=torch.int32).view(2, 4)) if paged else {}
    new = torch.ones(2, 1, 2, 128, dtype=BF)
    lengths = torch.tensor([5, 70], dtype=torch.int32)
    versions = cache._version, vcache._version
    kvcache.flash_attn_with_kvcache(q, cache, vcache, new, new, cache_seqlens=lengths, k_scale=0.5, **extra)
    (p,) = lib.calls
    assert not cache.view(torch.uint8).any()  # nothing written by PyTorch
    assert (cache._version, vcache._version) > versions  # autograd sees the write all the same
    assert (p.batch, p.seqlen_new, p.heads_kv, p.head_dim, p.element_bytes) == (2, 1, 2, 128, 1)
    assert (p.k_cache, p.v_cache) == (cache.data_ptr(), vcache.data_ptr())
    assert p.cache_seqlens == lengths.data_ptr()
    assert (p.capacity, p.cache_rows) == ((256, 8) if paged else (64, 8))
    assert bool(p.block_table) == paged and p.k_new != new.data_ptr()  # the quantized copy
    assert launched[-1].cache_seqlens != lengths.data_ptr()  # attention covers the longer lengths
    cache16, vcache16 = (torch.zeros(8, 64, 2, 128, dtype=BF) for _ in range(2))
    kvcache.flash_attn_with_kvcache(q, cache16, vcache16, new, new, cache_seqlens=lengths, **extra)
    assert len(lib.calls) == 2 and lib.calls[1].k_new == new.data_ptr()  # as it is
    assert lib.calls[1].element_bytes == 2 and not cache16.any()
    strided = torch.ones(2, 1, 2, 256, dtype=BF)[..., ::2]
    kvcache.flash_attn_with_kvcache(q, cache16, vcache16, strided, strided, cache_seqlens=lengths, **extra)
    assert len(lib.calls) == 2 and cache16.any()  # PyTorch wrote it
    kvcache.flash_attn_with_kvcache(q, vcache16, vcache16, new, new, cache_seqlens=lengths, **extra)
    assert len(lib.calls) == 2  # one tensor for both: PyTorch writes v last, the kernel would race


def test_append_templates_tell_layouts_apart():
    """Layouts of one shape but other strides (v, v_cache, block table) get their own params
    (_append_templates' key); k_cache and v_cache one tensor get none (the PyTorch path)."""
    b, n, h, d = 2, 1, 2, 64
    L = torch.tensor([1, 2], dtype=torch.int32)
    kn = torch.zeros(b, n, h, d, dtype=torch.bfloat16)
    vn_wide = torch.zeros(b, n, h, 2 * d, dtype=torch.bfloat16)[..., :d]
    kc, vc = (torch.zeros(4, 16, h, d, dtype=torch.bfloat16) for _ in range(2))
    vc_inter = torch.zeros(4, 16, 2, h, d, dtype=torch.bfloat16)[:, :, 1]
    table = torch.zeros(b, 3, dtype=torch.int32)[:, :1]
    for plain, other, field, args in (
            (kn, vn_wide, "v_new_head_stride", lambda x: (kc, vc, kn, x, None)),
            (vc, vc_inter, "v_row_stride", lambda x: (kc, x, kn, kn, None)),
            (torch.zeros(b, 1, dtype=torch.int32), table, "block_table_batch_stride", lambda x: (kc, vc, kn, kn, x))):
        for t in (plain, other):
            k_cache, v_cache, k, v, tab = args(t)
            p = kvcache.append_params((4, 16, 16), k_cache, v_cache, k, v, L, None, tab)
            strides = {"v_new_head_stride": v.stride(2), "v_row_stride": v_cache.stride(1),
                       "block_table_batch_stride": tab.stride(0) if tab is not None else 0}
            assert getattr(p, field) == strides[field]
    assert kvcache.append_params((4, 16, 16), kc, kc, kn, kn, L, None, None) is None


def test_an_unplanned_template_is_looked_up_and_none_means_no_kernel():
    """append_params' template: LOOK_UP (the default, and an e4m3 plan's) reads the layouts'
    params; None (a plan whose layouts do not suit the kernel) gives no params even where the
    layouts would suit it; LOOK_UP stays itself in a copied plan."""
    import copy

    kn = torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16)
    kc, vc = (torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    L = torch.tensor([1, 2], dtype=torch.int32)
    looked_up = kvcache.append_params((4, 16, 16), kc, vc, kn, kn, L, None, None)
    assert looked_up is not None and looked_up.k_cache == kc.data_ptr()
    assert kvcache.append_params((4, 16, 16), kc, vc, kn, kn, L, None, None, kvcache.LOOK_UP) is not None
    assert kvcache.append_params((4, 16, 16), kc, vc, kn, kn, L, None, None, None) is None
    assert copy.deepcopy(kvcache.LOOK_UP) is kvcache.LOOK_UP and repr(kvcache.LOOK_UP) == "LOOK_UP"


def _rotary_call(lib, monkeypatch, **kw):
    """A decode call with rotary through lib (as the append kernel's library): (q, k, caches,
    tables, lengths, kwargs)."""
    monkeypatch.setattr(kvcache, "_append_library", lambda lib_, k: lib)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call: call(0))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 256, generator=g).to(BF)[..., :128]
    k, v = (torch.randn(2, 2, 2, 128, generator=g).to(BF) for _ in range(2))
    kc, vc = (torch.zeros(2, 64, 2, 128, dtype=BF) for _ in range(2))
    theta = torch.rand(64, 32, generator=g)
    cos, sin = theta.cos(), theta.sin()
    lengths = torch.tensor([5, 60], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, rotary_cos=cos,
                                    rotary_sin=sin, **kw)
    return q, k, v, kc, vc, cos, sin, lengths


@pytest.mark.parametrize("causal", [False, True])
def test_rotary_with_the_append_kernel_is_one_launch(launched, monkeypatch, causal):
    """With the rotary append kernel, the rotation of q and the new keys goes to it: q's and the
    keys' own pointers (unrotated), the tables and flags as the call gave them, and the
    attention reads the kernel's q_out; PyTorch writes nothing."""
    lib = _AppendRecorder()
    q, k, v, kc, vc, cos, sin, lengths = _rotary_call(lib, monkeypatch, causal=causal,
                                                      rotary_interleaved=False)
    assert lib.calls == [] and len(lib.rotary_calls) == 1
    p, r = lib.rotary_calls[0]
    assert (p.k_new, p.v_new, p.cache_seqlens) == (k.data_ptr(), v.data_ptr(), lengths.data_ptr())
    assert (r.q, r.cos, r.sin) == (q.data_ptr(), cos.data_ptr(), sin.data_ptr())
    assert (r.q_batch_stride, r.q_row_stride, r.q_head_stride) == q.stride()[:3]
    assert (r.cos_row_stride, r.cos_col_stride, r.sin_row_stride, r.sin_col_stride) == (32, 1, 32, 1)
    assert (r.seqlen_q, r.heads_q, r.rotary_half, r.rows) == (1, 8, 32, 64)
    assert (r.interleaved, r.q_per_row, r.cos_type, r.fp16) == (0, int(causal), 0, 0)
    assert launched[-1].q == r.q_out != q.data_ptr()
    assert not kc.any() and not vc.any()


def test_rotary_with_the_append_kernel_falls_back_where_layouts_do_not_suit_it(launched, monkeypatch):
    """New keys the kernel cannot take (a head dim stride of 2): PyTorch rotates q into the
    buffer the attention reads and writes the rotated keys, as without the kernel."""
    from fa3gen.reference import rotary_at

    lib = _AppendRecorder()
    monkeypatch.setattr(kvcache, "_append_library", lambda lib_, k: lib)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call: call(0))
    read = []
    run = kvcache._run
    monkeypatch.setattr(kvcache, "_run", lambda plan, q, *a: (read.append(q), run(plan, q, *a))[1])
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 1, 8, 128, generator=g).to(BF)
    k = torch.randn(2, 1, 2, 256, generator=g).to(BF)[..., ::2]
    kc, vc = (torch.zeros(2, 64, 2, 128, dtype=BF) for _ in range(2))
    theta = torch.rand(64, 64, generator=g)
    lengths = torch.tensor([5, 60], dtype=torch.int32)
    kvcache.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lengths, rotary_cos=theta.cos(),
                                    rotary_sin=theta.sin(), causal=True)
    assert lib.calls == [] and lib.rotary_calls == []
    pos = lengths.long()[:, None]
    k_rot = rotary_at(k, theta.cos(), theta.sin(), pos, True).to(BF)
    assert torch.equal(kc[0, 5], k_rot[0, 0]) and torch.equal(kc[1, 60], k_rot[1, 0])
    (q_read,) = read
    assert torch.equal(q_read, rotary_at(q, theta.cos(), theta.sin(), pos, True).to(BF))
    assert launched[-1].q == q_read.data_ptr()


def test_rotary_stays_with_pytorch_where_the_kernel_does_not_apply(launched, monkeypatch):
    """No rotary kernel call for an e4m3 cache, fp64 tables, q or a table that needs a
    gradient, or a library without the kernel: PyTorch rotates as before."""
    lib = _AppendRecorder()
    for case in ("fp8", "fp64", "grad", "table grad", "old library"):
        q, cache_dtype, cos_dtype = torch.randn(1, 1, 8, 128).to(BF), BF, torch.float32
        if case == "fp8":
            cache_dtype = FP8
        elif case == "fp64":
            cos_dtype = torch.float64
        elif case == "grad":
            q.requires_grad_()
        lib.has_append_rotary = case != "old library"
        kc = torch.zeros(1, 64, 2, 128).to(cache_dtype)
        k = torch.randn(1, 1, 2, 128).to(BF)
        theta = torch.rand(64, 64, dtype=cos_dtype, requires_grad=case == "table grad")
        monkeypatch.setattr(kvcache, "_append_library", lambda lib_, k: lib)
        assert not kvcache._fused_rotary(q, k, kc, theta, theta)
    lib.has_append_rotary = True
    theta = theta.detach()
    assert kvcache._fused_rotary(q.detach(), k, torch.zeros(1, 64, 2, 128, dtype=BF), theta, theta)
    with torch.no_grad():  # no gradient to keep
        assert kvcache._fused_rotary(q, k, kc.to(BF), theta.requires_grad_(), theta)


def test_a_repeated_rotary_signature_is_planned_once(launched, monkeypatch):
    """The rotary checks, the kernel's decision and its params are planned with the call's
    signature: decode steps plan once and only the pointers change; a planned call still
    checks an int cache_seqlens against the tables, and FA3GEN_APPEND_KERNEL=0 or a q that
    needs a gradient plans again, for PyTorch's rotation."""
    import os

    lib = _AppendRecorder()
    monkeypatch.setattr(kvcache, "_append_library",
                        lambda lib_, k: None if os.environ.get(kvcache.APPEND_KERNEL_ENV) == "0" else lib)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call: call(0))
    checked = []
    real = kvcache._check_rotary
    monkeypatch.setattr(kvcache, "_check_rotary", lambda *a: checked.append(1) or real(*a))
    kvcache._plans.clear()
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.zeros(2, 64, 2, 128, dtype=BF) for _ in range(2))
    theta = torch.rand(32, 64, generator=g)
    cos, sin = theta.cos(), theta.sin()
    qs = [torch.randn(2, 1, 8, 128, generator=g).to(BF) for _ in range(3)]  # alive: three addresses
    k = torch.randn(2, 1, 2, 128, generator=g).to(BF)
    for step, q in enumerate(qs):
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=10 + step, rotary_cos=cos,
                                        rotary_sin=sin, causal=True)
    assert len(checked) == 1 and len(lib.rotary_calls) == 3 and len(launched) == 3
    fixed = [bytes(r)[32:] for _, r in lib.rotary_calls]  # all but q, q_out, cos and sin
    assert fixed[0] == fixed[1] == fixed[2]
    assert [r.q for _, r in lib.rotary_calls] == [q.data_ptr() for q in qs]
    assert all(p.q == r.q_out for p, (_, r) in zip(launched, lib.rotary_calls))
    assert bytes(kvcache.rotary_params(kvcache.Rotary(qs[0], qs[0], cos, sin, True, True),
                                       lib.rotary_calls[0][0]))[32:] == fixed[0]  # unplanned: equal
    with pytest.raises(InvalidInputError, match="rotary_cos has 32 positions; the call needs"):
        kvcache.flash_attn_with_kvcache(qs[0], kc, vc, k, k, cache_seqlens=40, rotary_cos=cos,
                                        rotary_sin=sin, causal=True)
    assert len(checked) == 1  # the planned call's values checked all the same
    monkeypatch.setenv(kvcache.APPEND_KERNEL_ENV, "0")
    kvcache.flash_attn_with_kvcache(qs[0], kc, vc, k, k, cache_seqlens=12, rotary_cos=cos,
                                    rotary_sin=sin, causal=True)
    assert len(checked) == 2 and len(lib.rotary_calls) == 3
    monkeypatch.delenv(kvcache.APPEND_KERNEL_ENV)
    kvcache.flash_attn_with_kvcache(qs[0].clone().requires_grad_(), kc, vc, k, k, cache_seqlens=12,
                                    rotary_cos=cos, rotary_sin=sin, causal=True)
    assert len(checked) == 3 and len(lib.rotary_calls) == 3


def test_the_append_kernels_params_are_planned_with_the_call(launched, monkeypatch):
    """A decode call that appends takes the append kernel's params but the pointers from its
    plan (made once per signature, equal to what append_params finds by itself); an e4m3
    cache, whose new rows are quantized first, looks them up per call."""
    lib = _AppendRecorder()
    monkeypatch.setattr(kvcache, "_append_library", lambda lib_, k: lib)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call: call(0))
    made = []
    real = kvcache._append_template
    monkeypatch.setattr(kvcache, "_append_template", lambda *a: made.append(1) or real(*a))
    kvcache._plans.clear()
    kvcache._append_templates.clear()
    kc, vc = (torch.zeros(2, 64, 2, 128, dtype=BF) for _ in range(2))
    news = [torch.randn(2, 1, 2, 128).to(BF) for _ in range(3)]  # alive: three addresses
    q = torch.randn(2, 1, 8, 128).to(BF)
    for step, k in enumerate(news):
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=5 + step)
    assert len(made) == 1 and not kvcache._append_templates and len(lib.calls) == 3
    assert [p.k_new for p in lib.calls] == [k.data_ptr() for k in news]
    assert [p.seqlen for p in lib.calls] == [5, 6, 7]
    looked_up = kvcache.append_params(kvcache._plans[next(iter(kvcache._plans))].geometry, kc, vc,
                                      news[0], news[0], 5, None, None)
    assert bytes(looked_up) == bytes(lib.calls[0])
    kvcache._append_templates.clear()
    # an e4m3 cache: the quantized rows' params looked up per layout, as before
    kc8, vc8 = (torch.zeros(2, 64, 2, 128, dtype=FP8) for _ in range(2))
    for step in range(2):
        kvcache.flash_attn_with_kvcache(q, kc8, vc8, news[0], news[0], cache_seqlens=5 + step)
    assert len(kvcache._append_templates) == 1 and len(lib.calls) == 5


@pytest.mark.parametrize("window,q_rows", [((-1, 2**31 - 1), 1), ((2**31 - 1, -1), 4),
                                          ((2**31 - 2, 2**31 - 2), 2), ((1100, 1100), 1)])
def test_a_window_side_past_every_key_reaches_the_kernel_unbounded(launched, window, q_rows):
    """The decode kernel adds a window side to int32 positions: a side near 2^31 wrapped and
    masked every key. A side reaching past the cache and the query rows is -1 (unbounded),
    which it means; a side short of that is kept as given."""
    kc = torch.zeros(1, 1000, 2, 128, dtype=BF)
    q = torch.zeros(1, q_rows, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, window_size=window)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, window_size=(999, 999))
    p, kept = launched
    assert (p.window_left, p.window_right) == tuple(-1 if w >= 1000 + q_rows else w for w in window)
    assert (kept.window_left, kept.window_right) == (999, 999)


def test_a_decode_batch_past_the_grid_is_an_input_error(launched):
    """The decode kernels' grid takes batch and kv heads in its y and z dimensions (at most
    65535): past that one clear error, before any launch (prefill takes other kernels)."""
    kc = torch.zeros(1, 1, 1, 128, dtype=BF).expand(70000, 1, 1, 128)
    q = torch.zeros(1, 1, 1, 128, dtype=BF).expand(70000, 1, 1, 128)
    with pytest.raises(InvalidInputError, match="at most 65535; got batch 70000"):
        kvcache.flash_attn_with_kvcache(q, kc, kc)
    assert not launched


def test_bad_arguments_are_reported_before_a_missing_decode_kernel(launched, monkeypatch):
    """The library's decode pairs are looked up after every argument check, so a bad tensor is
    named even where the library lacks the kernel (as flash_attn_func does)."""
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset())
    q, kc = _q_cache()
    table = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(InvalidInputError, match="block_table must be int32"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.zeros(2, dtype=torch.int32),
                                        block_table=table)
    with pytest.raises(InvalidInputError, match="num_splits"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, num_splits=-1)
    with pytest.raises(InvalidInputError, match=r"q.stride\(-1\)"):
        kvcache.flash_attn_with_kvcache(torch.zeros(2, 1, 8, 256, dtype=BF)[..., ::2], kc, kc)


@pytest.mark.parametrize("scale", [1e-46, 1e-39])
def test_fp8_cache_float_factors_below_fp32_normals_are_refused(launched, scale):
    """A float factor travels as an fp32 param: a tiny one would become 0 or subnormal there."""
    q = torch.zeros(1, 1, 8, 128, dtype=BF)
    kc = torch.zeros(1, 64, 2, 128, dtype=BF).to(FP8)
    with pytest.raises(InvalidInputError, match="k_scale must be a positive float within fp32's normal"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=scale)
    assert not launched
    # the smallest normal is legal where its product with softmax_scale stays normal too
    kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=1.2e-38, softmax_scale=1.0)
    assert launched[0].k_scale_value > 0


def test_fp8_cache_numpy_float_factors_are_taken(launched):
    np = pytest.importorskip("numpy")
    q = torch.zeros(1, 1, 8, 128, dtype=BF)
    kc = torch.zeros(1, 64, 2, 128, dtype=BF).to(FP8)
    kvcache.flash_attn_with_kvcache(q, kc, kc, k_scale=np.float32(0.5), v_scale=np.float64(0.25))
    assert (launched[0].k_scale_value, launched[0].v_scale_value) == (0.5, 0.25)
    with pytest.raises(InvalidInputError, match="v_scale must be a positive float"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, v_scale=np.bool_(True))


def test_a_trace_records_decode_kernels_only_for_decode_calls(launched, monkeypatch, tmp_path):
    """A chunked prefill runs the forward kernels (which record their own variants): it adds
    no decode pair to the trace, a decode call does."""
    from fa3gen import tracing
    monkeypatch.setattr(kvcache, "_require_forward", lambda *a: True)  # stubbed forwards
    monkeypatch.setattr(kvcache, "_prefill", lambda *a, **kw: (None, None))
    kc = torch.zeros(1, 256, 2, 64, dtype=torch.float16)
    with tracing.trace(tmp_path / "t.yaml") as t:
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 64, 2, 64, dtype=torch.float16), kc, kc,
                                        cache_seqlens=100)
        assert t.decode == set()
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 64, dtype=torch.float16), kc, kc,
                                        cache_seqlens=100)
        assert t.decode == {("fp16", 64)}


@pytest.mark.parametrize("pages", [16384, 32769])
def test_a_cache_past_the_kernels_position_arithmetic_is_refused(launched, pages):
    """The decode kernels add a query's position to a window side: a block table of 2^30 keys
    or more a sequence (with the queries) is refused, not wrapped; 32769 pages of 65536 rows
    are past int32 too (seqlen_k used to wrap to a negative length)."""
    kc = torch.zeros(1, 65536, 1, 64, dtype=BF)
    table = torch.zeros(1, 1, dtype=torch.int32).expand(1, pages)
    with pytest.raises(InvalidInputError, match=rf"a cache of {pages * 65536} keys a sequence "
                       rf"\({pages} pages of 65536 rows\) and 1 queries: at most 2\^30 - 1 together"):
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 2, 64, dtype=BF), kc, kc,
                                        cache_seqlens=torch.tensor([100], dtype=torch.int32),
                                        block_table=table.contiguous())
    assert not launched


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_append_into_a_cache_whose_rows_share_memory(launched, dim):
    """expand()ed caches (stride 0 over batch, rows or heads) are read as they are, but an
    append into one would land several sequences' (rows', heads') new keys on the same memory:
    refused before anything is written."""
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    shape = [2, 16, 2, 64]
    one = [1 if i == dim else n for i, n in enumerate(shape)]
    kc, vc = (torch.randn(*one).to(BF).expand(*shape) for _ in range(2))
    before = kc.clone()
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=8)  # reading: planned and launched
    p = launched[0]
    assert 0 in (p.k_batch_stride, p.k_row_stride, p.k_head_stride)
    new = torch.ones(2, 1, 2, 64, dtype=BF)
    for cache in ("k_cache", "v_cache"):
        caches = (kc, vc.contiguous()) if cache == "k_cache" else (kc.contiguous(), vc)
        with pytest.raises(InvalidInputError, match=f"{cache} .* may share memory .* appending"):
            kvcache.flash_attn_with_kvcache(q, *caches, new, new, cache_seqlens=8)
    assert torch.equal(kc, before)


def test_debug_checks_catch_appends_to_one_cache_row(launched, monkeypatch):
    """FA3GEN_DEBUG_CHECKS=1: new rows that would be written to one cache position (a cache row
    that cache_batch_idx maps twice, or a page that block_table lists twice, where both append)
    are refused before the append; one cache row or page appended to at other positions, or
    only read, is not."""
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    q = torch.zeros(2, 1, 2, 64, dtype=BF)
    kc, vc = torch.zeros(3, 32, 2, 64, dtype=BF), torch.zeros(3, 32, 2, 64, dtype=BF)
    new = torch.ones(2, 2, 2, 64, dtype=BF)
    i32 = dict(dtype=torch.int32)
    same_row = torch.tensor([1, 1], **i32)
    with pytest.raises(InvalidInputError, match="sequence 0's new row 1 and sequence 1's new row 0 "
                                                "would both be written to cache row 1, position 6"):
        kvcache.flash_attn_with_kvcache(q, kc, vc, new, new, cache_batch_idx=same_row,
                                        cache_seqlens=torch.tensor([5, 6], **i32))
    assert not kc.any()  # nothing was written
    # one cache row, rows 5-6 and 7-8: no overlap; and reading one row twice is fine
    kvcache.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=torch.tensor([5, 7], **i32),
                                    cache_batch_idx=same_row)
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([5, 5], **i32),
                                    cache_batch_idx=same_row)
    pages_k, pages_v = torch.zeros(4, 16, 2, 64, dtype=BF), torch.zeros(4, 16, 2, 64, dtype=BF)
    shared_page = torch.tensor([[0, 2], [1, 2]], **i32)  # both sequences' second page is 2
    kvcache.flash_attn_with_kvcache(q, pages_k, pages_v, new, new, block_table=shared_page,
                                    cache_seqlens=torch.tensor([20, 28], **i32))  # page 2 twice
    with pytest.raises(InvalidInputError, match="would both be written to page 2, position 4"):
        kvcache.flash_attn_with_kvcache(q, pages_k, pages_v, new, new, block_table=shared_page,
                                        cache_seqlens=torch.tensor([20, 19], **i32))
    rows_k, rows_v = torch.zeros(8, 1, 2, 64, dtype=BF), torch.zeros(8, 1, 2, 64, dtype=BF)
    twice = torch.tensor([[3, 3], [0, 1]], **i32)  # pages of one row: sequence 0 lists page 3 twice
    with pytest.raises(InvalidInputError, match="sequence 0's new row 0 and sequence 0's new row 1 "
                                                "would both be written to page 3, position 0"):
        kvcache.flash_attn_with_kvcache(q, rows_k, rows_v, new, new, block_table=twice,
                                        cache_seqlens=torch.tensor([0, 0], **i32))


def test_append_into_caches_laid_over_themselves_or_shared_rows(launched):
    """Memory shared without a stride of 0 (as_strided rows over each other) is refused for an
    append too, while slices of one buffer (k and v interleaved in a kv cache) are not; a
    block_table or cache_batch_idx with a stride of 0 over the batch, at one length for every
    sequence, would send every sequence's new rows to one place: refused without reading it."""
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    new = torch.ones(2, 1, 2, 64, dtype=BF)
    buf = torch.zeros(4096, dtype=BF)
    batch_over_rows = buf.as_strided((2, 16, 2, 64), (128, 128, 64, 1))  # b's row r is b+1's r-1
    rows_over_heads = buf.as_strided((2, 16, 2, 64), (2048, 64, 64, 1))  # r head 1 = r+1 head 0
    fine = torch.zeros(2, 16, 2, 64, dtype=BF)
    for cache in (batch_over_rows, rows_over_heads):
        with pytest.raises(InvalidInputError, match="k_cache .* may share memory"):
            kvcache.flash_attn_with_kvcache(q, cache, fine, new, new, cache_seqlens=3)
        kvcache.flash_attn_with_kvcache(q, cache, fine, cache_seqlens=3)  # reading is fine
    kv = torch.zeros(2, 16, 2, 2, 64, dtype=BF)  # (batch, rows, k or v, heads, d)
    kvcache.flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], new, new, cache_seqlens=3)
    assert (kv[:, 3, 0] == 1).all() and (kv[:, 3, 1] == 1).all() and kv[:, 4:].eq(0).all()
    i32 = dict(dtype=torch.int32)
    pages = torch.zeros(8, 16, 2, 64, dtype=BF)
    one_table = torch.tensor([[0, 1]], **i32).expand(2, 2)
    for lengths in (3, torch.tensor([3], **i32).expand(2)):
        with pytest.raises(InvalidInputError, match="block_table has a stride of 0 .* all 2"):
            kvcache.flash_attn_with_kvcache(q, pages, pages.clone(), new, new,
                                            block_table=one_table, cache_seqlens=lengths)
    kvcache.flash_attn_with_kvcache(q, pages, pages.clone(), block_table=one_table, cache_seqlens=3)
    kvcache.flash_attn_with_kvcache(q, pages, pages.clone(), new, new, block_table=one_table,
                                    cache_seqlens=torch.tensor([3, 9], **i32))  # other rows
    one_row = torch.tensor([1], **i32).expand(2)
    with pytest.raises(InvalidInputError, match="cache_batch_idx has a stride of 0"):
        kvcache.flash_attn_with_kvcache(q, fine, fine.clone(), new, new, cache_batch_idx=one_row,
                                        cache_seqlens=3)


def test_append_into_k_and_v_caches_that_share_memory(launched):
    """An append writes k into k_cache and v into v_cache: caches that share memory (one tensor
    for both, or slices of one buffer that overlap) are refused before anything is written,
    unless they are one view and k, v too (the same values written twice); slices that
    interleave without overlapping are fine."""
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    k_new, v_new = torch.ones(2, 1, 2, 64, dtype=BF), torch.full((2, 1, 2, 64), 2.0, dtype=BF)
    cache = torch.zeros(2, 16, 2, 64, dtype=BF)
    buf = torch.zeros(2, 16, 3, 64, dtype=BF)
    for kc, vc in ((cache, cache), (buf[:, :, 0:2], buf[:, :, 1:3]),
                   (cache[:, :10], cache[:, 6:])):
        with pytest.raises(InvalidInputError, match="k_cache and v_cache share memory"):
            kvcache.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=3)
        kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3)  # reading is fine
    assert not cache.any() and not buf.any()
    kvcache.flash_attn_with_kvcache(q, cache, cache, k_new, k_new, cache_seqlens=3)
    assert cache[:, 3].eq(1).all() and cache[:, 4:].eq(0).all()
    with pytest.raises(InvalidInputError, match="share memory"):  # rotated keys, plain values
        kvcache.flash_attn_with_kvcache(q, cache, cache, k_new, k_new, cache_seqlens=3,
                                        rotary_cos=torch.ones(16, 32),
                                        rotary_sin=torch.zeros(16, 32))
    kvcache.flash_attn_with_kvcache(q, cache[:, :8], cache[:, 8:], k_new, v_new, cache_seqlens=3)
    assert cache[:, 3].eq(1).all() and cache[:, 11].eq(2).all()
    kv = torch.zeros(2, 16, 2, 2, 64, dtype=BF)  # (batch, rows, heads, k or v, d): interleaved
    kvcache.flash_attn_with_kvcache(q, kv[:, :, :, 0], kv[:, :, :, 1], k_new, v_new,
                                    cache_seqlens=3)
    assert kv[:, 3, :, 0].eq(1).all() and kv[:, 3, :, 1].eq(2).all()


def test_caches_collide_against_every_byte(launched):
    """_caches_collide against a byte-by-byte comparison on random strided views of one
    buffer (and of two), elements of 2 bytes."""
    import itertools
    import random

    def addresses(t):
        starts = (t.data_ptr() + 2 * sum(i * s for i, s in zip(idx, t.stride()))
                  for idx in itertools.product(*map(range, t.shape)))
        return {a + b for a in starts for b in range(2)}

    buf = torch.zeros(512, dtype=BF)
    rng = random.Random(0)
    views = [(torch.zeros(2, 3, dtype=BF), torch.zeros(2, 3, dtype=BF))]
    for _ in range(300):
        shape = [rng.randint(1, 3) for _ in range(3)]
        views.append(tuple(buf.as_strided(shape, [rng.choice([1, 2, 3, 4, 6, 8, 24])
                                                  for _ in range(3)], rng.randint(0, 60))
                           for _ in range(2)))
    collided = [kvcache._caches_collide(a, b) for a, b in views]
    assert collided == [bool(addresses(a) & addresses(b)) for a, b in views]
    assert 50 < sum(collided) < 250  # both answers are exercised


def test_the_caches_overlap_check_stays_out_of_captured_calls(launched):
    """Fake and batched tensors have no memory to compare (fake ones all start at 0): an append
    under FakeTensorMode or vmap is not refused as one into shared caches, nor does it fail
    reading their storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.zeros(2, 1, 4, 64, dtype=BF)
        kc, vc = torch.zeros(2, 16, 2, 64, dtype=BF), torch.zeros(2, 16, 2, 64, dtype=BF)
        k, v = torch.ones(2, 1, 2, 64, dtype=BF), torch.ones(2, 2, 1, 64, dtype=BF).transpose(1, 2)
        kvcache._check_caches_apart(kc, vc, k, v, False)  # not an error
    q, kc, vc = torch.zeros(3, 2, 1, 4, 64, dtype=BF), torch.zeros(2, 16, 2, 64, dtype=BF), \
        torch.zeros(2, 16, 2, 64, dtype=BF)
    new = torch.ones(2, 1, 2, 64, dtype=BF)
    torch.func.vmap(lambda q: kvcache.flash_attn_with_kvcache(q, kc, vc, new, new,
                                                             cache_seqlens=3))(q)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("lengths", ["int", "tensor"])
def test_a_prefill_the_library_cannot_serve_leaves_the_cache_as_it_was(fake_launches, lengths,
                                                                       compiled):
    """The forward a chunked prefill runs is looked up before the append (as the decode
    kernels are): the fake library has no dense causal and no non-causal varlen bf16 d128
    forward, so both calls raise with nothing written. They wrote the 32 new rows first."""
    q = torch.zeros(1, 32, 2, 128, dtype=BF)  # 32 rows per kv head: the forward kernels
    kc, vc = torch.zeros(1, 128, 2, 128, dtype=BF), torch.zeros(1, 128, 2, 128, dtype=BF)
    new = torch.ones(1, 32, 2, 128, dtype=BF)
    seqlens = 10 if lengths == "int" else torch.tensor([10], dtype=torch.int32)

    def call(q, kc, vc, new, seqlens):
        return kvcache.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=seqlens,
                                               causal=lengths == "int")
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="no fa3gen variant built for direction=fwd dtype=bf16 "
                                        "head_dim=128 causal=(True|False)"):
        call(q, kc, vc, new, seqlens)
    assert not kc.any() and not vc.any() and not fake_launches


def test_a_prefill_served_by_a_seqlen_k_range_alone_runs(fake_launches):
    """A filtered build may keep a key's seqlen_k range choice and not its default: the
    prefill's forward picks by length, so the check before the append takes the key."""
    from fa3gen import runtime
    from fa3gen.contract import make_key
    lib = runtime.get_library()
    default = lib.find("fwd", "bf16", 128, False)
    ranged = next(v for v in lib.variants if v.key == default.key and v is not default)
    lib.variants = [v for v in lib.variants if v is not default]
    lib._by_name.pop(default.name)
    lib.seqlen_dispatch = {make_key("fwd", "bf16", 128, False): [(0, 4096, ranged)]}
    q = torch.zeros(1, 32, 2, 128, dtype=BF)
    kc, vc = torch.zeros(1, 128, 2, 128, dtype=BF), torch.zeros(1, 128, 2, 128, dtype=BF)
    new = torch.ones(1, 32, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=10)
    assert [name for name, _ in fake_launches] == [ranged.name] and kc[0, 10:42].eq(1).all()
    # a range that does not hold the call's 42 keys: refused before the append, as a key
    # without any variant is
    lib.seqlen_dispatch = {make_key("fwd", "bf16", 128, False): [(0, 16, ranged)]}
    kc.zero_()
    with pytest.raises(VariantNotBuiltError):
        kvcache.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=10)
    assert not kc.any() and len(fake_launches) == 1


def test_a_tensor_scale_is_read_once_a_decode_call(launched, counted_scale):
    """Each read of a CUDA tensor's value is a device sync: a decode call reads it once."""
    q, kc = torch.zeros(2, 1, 8, 128, dtype=BF), torch.zeros(2, 64, 2, 128, dtype=BF)
    scale, reads = counted_scale(0.25)
    for _ in range(2):  # planned, then the plan found by value
        reads.clear()
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, softmax_scale=scale)
        assert len(reads) == 1
    assert [p.softmax_scale for p in launched] == [0.25, 0.25]


def _decode_call_with(name: str, wrap):
    """A decode call whose argument `name` is passed through wrap (the others valid)."""
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    cache = torch.zeros(2, 40, 2, 64, dtype=BF)
    e4m3 = torch.zeros(2, 40, 2, 64, dtype=FP8)
    new = torch.zeros(2, 1, 2, 64, dtype=BF)
    args = {"q": q, "k_cache": cache, "v_cache": cache.clone(), "cache_seqlens": 5}
    if name in ("k_scale", "v_scale"):
        args.update(k_cache=e4m3, v_cache=e4m3.clone(), k_scale=torch.ones(2), v_scale=torch.ones(2))
    elif name == "block_table":
        args.update(k_cache=torch.zeros(6, 16, 2, 64, dtype=BF), block_table=torch.zeros(2, 3, dtype=torch.int32))
        args["v_cache"] = args["k_cache"].clone()
    elif name in ("k", "v", "rotary_cos", "rotary_sin"):
        args.update(k=new, v=new.clone())
        if name.startswith("rotary"):
            args.update(rotary_cos=torch.ones(64, 16), rotary_sin=torch.zeros(64, 16))
    elif name == "cache_batch_idx":
        args[name] = torch.tensor([1, 0], dtype=torch.int32)
    if name == "cache_seqlens":
        args[name] = torch.tensor([5, 3], dtype=torch.int32)
    args[name] = wrap(args[name])
    return kvcache.flash_attn_with_kvcache(**args)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # a prototype
@pytest.mark.parametrize("layout", ["nested", "sparse"])
@pytest.mark.parametrize("name", ["cache_seqlens", "cache_batch_idx", "block_table", "k_scale",
                                  "v_scale", "k", "v", "rotary_cos", "rotary_sin"])
def test_every_tensor_argument_refuses_a_nested_or_sparse_one(launched, name, layout):
    """These raised torch's "NestedTensorImpl doesn't support sizes", "Cannot access data
    pointer" or a sparse backend's NotImplementedError while the plan key was made or the
    rotation ran; each is now one error naming the argument."""
    _decode_call_with(name, lambda t: t)  # the call is valid as it is
    wrap = (lambda t: torch.nested.nested_tensor([t])) if layout == "nested" else torch.Tensor.to_sparse
    with pytest.raises(InvalidInputError, match=f"^{name} is a {layout}"):
        _decode_call_with(name, wrap)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # a prototype
@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_a_nested_scale_or_cap_is_one_error(launched, name):
    """The error message's description of the value read a nested tensor's shape, which raised
    inside torch instead of the check's InvalidInputError."""
    nested = torch.nested.nested_tensor([torch.ones(1)])
    q = torch.zeros(2, 1, 4, 64, dtype=BF)
    cache = torch.zeros(2, 40, 2, 64, dtype=BF)
    for call in (lambda: kvcache.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=5,
                                                         **{name: nested}),
                 lambda: ops.flash_attn_func(q, q, q, **{name: nested})):
        with pytest.raises(InvalidInputError, match=f"^{name} must be .* got a nested torch.float32 tensor"):
            call()
