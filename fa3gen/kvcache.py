"""Decode attention over a KV cache: `flash_attn_with_kvcache`, flash-attn's name and argument
order. A few new query rows per kv head (seqlen_q x heads_q / heads_kv <= 16) against a
contiguous or paged cache, the key range split across CTAs (split-KV) and merged; forward
only. What it does not do yet is an error, never a different answer: appending k/v into the
cache, cache_leftpad, rotary, sliding windows, softcap, more than 16 rows per kv head (use
flash_attn_func for prefill), fp8 caches.
"""
from __future__ import annotations

import os

import torch

from fa3gen import ops, runtime
from fa3gen.errors import InvalidInputError

MAX_ROWS = 16         # seqlen_q * heads_q / heads_kv per kv head: one M=16 tile (decode.cuh)
HEAD_DIMS = (64, 128, 256)
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 128
# CTAs of the split kernel resident per SM, from its shared memory (decode.cuh's Config: 66, 100
# and 200 KB of the 227 KB an H100/H200 SM offers).
CTAS_PER_SM = {64: 3, 128: 2, 256: 1}


def num_splits_heuristic(batch: int, heads_kv: int, seqlen_k: int, num_sms: int,
                         head_dim: int = 128) -> int:
    """The fewest splits whose CTAs (one per split, kv head and sequence) fill the GPU's
    resident CTA slots nearly as evenly as the best count does (within 85%: the last wave of a
    memory-bound kernel runs at the bandwidth of the CTAs in it), and no split shorter than
    MIN_KEYS_PER_SPLIT keys."""
    pairs = max(1, batch * heads_kv)
    slots = num_sms * CTAS_PER_SM.get(head_dim, 1)
    most = max(1, min(seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS))

    def filled(splits):  # the share of the slots busy, averaged over the waves
        ctas = pairs * splits
        return ctas / (-(-ctas // slots) * slots)

    best = max(filled(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if filled(s) >= 0.85 * best)


def _int32_vector(name, t, batch, device):
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be an int32 tensor of shape ({batch},), got "
                                f"{type(t).__name__}")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.device != device:
        raise InvalidInputError(f"{name} must be int32 of shape ({batch},) on {device}, got "
                                f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t.contiguous()


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0,
                            return_lse=False):
    """softmax(q k^T * scale) v of new query rows over a KV cache, flash-attn's semantics.

    q (batch, seqlen_q, heads_q, d) bf16/fp16, d in 64/128/256, seqlen_q * heads_q / heads_kv
    at most 16. Cache contiguous: k_cache, v_cache (cache batch, capacity, heads_kv, d), with
    cache_batch_idx (batch,) int32 choosing a cache row per sequence (default: the same index);
    or paged: k_cache, v_cache (pages, page_size, heads_kv, d) with block_table (batch, max
    pages) int32. cache_seqlens (batch,) int32 or an int: the keys each sequence has (default:
    the capacity; required when paged). causal: query i of seqlen_q sees keys
    j <= cache_seqlen - seqlen_q + i. num_splits: 0 chooses. Returns out (like q), and lse
    (batch, heads_q, seqlen_q) fp32 when return_lse. k, v (appending new keys) are not supported
    yet. FA3GEN_DEBUG_CHECKS=1 checks on the host that block_table and cache_batch_idx stay in
    range (that needs a device sync)."""
    ops._check_tensors(q, k_cache, v_cache)
    if k is not None or v is not None:
        raise InvalidInputError("appending k, v into the cache is not supported yet: write them "
                                "into k_cache/v_cache and pass the new cache_seqlens")
    mask = ops.masking(causal, window_size, softcap)
    if mask.local or mask.softcap > 0:
        raise InvalidInputError("flash_attn_with_kvcache: window_size and softcap are not "
                                "supported yet")
    ops.check_device(q, k_cache, v_cache)
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise InvalidInputError("q, k_cache and v_cache must be 4-D (batch or pages, seqlen, "
                                "heads, head_dim)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.bfloat16,
                                                                         torch.float16):
        raise InvalidInputError(f"q, k_cache, v_cache must share one dtype, bf16 or fp16; got "
                                f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    b, sq, hq, d = q.shape
    pages_or_b, rows_per, hkv, dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or dk != d:
        raise InvalidInputError(f"k_cache and v_cache must have one shape (.., .., heads_kv, "
                                f"{d}); got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if d not in HEAD_DIMS:
        raise InvalidInputError(f"head_dim {d}: the decode kernels serve {list(HEAD_DIMS)}")
    if hkv < 1 or hq % hkv:
        raise InvalidInputError(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv})")
    if sq * (hq // hkv) > MAX_ROWS:
        raise InvalidInputError(
            f"seqlen_q x heads_q / heads_kv = {sq * (hq // hkv)} query rows per kv head; the "
            f"decode kernels serve at most {MAX_ROWS} (use flash_attn_func for prefill)")
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or \
                block_table.dim() != 2 or block_table.shape[0] != b or \
                block_table.device != q.device:
            raise InvalidInputError(f"block_table must be int32 (batch={b}, max pages) on "
                                    f"{q.device}")
        if cache_seqlens is None:
            raise InvalidInputError("a paged cache needs cache_seqlens")
        if cache_batch_idx is not None:
            raise InvalidInputError("cache_batch_idx applies to a contiguous cache, not a paged "
                                    "one (the block table says where each sequence is)")
        capacity = block_table.shape[1] * rows_per
    else:
        capacity = rows_per
        if cache_batch_idx is None and pages_or_b < b:
            raise InvalidInputError(f"the cache holds {pages_or_b} sequences for a batch of {b} "
                                    "(pass cache_batch_idx to map them)")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise InvalidInputError(f"cache_seqlens {cache_seqlens} outside [0, {capacity}]")
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None:
        cache_seqlens = _int32_vector("cache_seqlens", cache_seqlens, b, q.device)
    if cache_batch_idx is not None:
        cache_batch_idx = _int32_vector("cache_batch_idx", cache_batch_idx, b, q.device)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InvalidInputError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
    ops.check_layout(q=q, k_cache=k_cache, v_cache=v_cache)
    if os.environ.get("FA3GEN_DEBUG_CHECKS") == "1":
        _debug_checks(cache_seqlens, cache_batch_idx, block_table, pages_or_b, rows_per, capacity)

    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if b == 0 or sq == 0 or hq == 0:
        return (out, lse) if return_lse else out
    splits = num_splits or num_splits_heuristic(b, hkv, capacity, ops._num_sms(q.device.index), d)
    splits = max(1, min(splits, 65535, -(-capacity // 64)))  # 64 keys: one CTA step
    p = runtime.DecodeParams()
    p.q, p.k_cache, p.v_cache = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    p.out, p.lse = out.data_ptr(), lse.data_ptr()
    p.cache_seqlens = cache_seqlens.data_ptr() if cache_seqlens is not None else None
    p.cache_batch_idx = cache_batch_idx.data_ptr() if cache_batch_idx is not None else None
    p.block_table = block_table.data_ptr() if paged else None
    p.block_table_batch_stride = block_table.stride(0) if paged else 0
    for name, t in (("q", q), ("k", k_cache), ("v", v_cache), ("out", out)):
        for dim, stride in zip(("batch", "row", "head"), t.stride()[:3]):
            setattr(p, f"{name}_{dim}_stride", stride)
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim = b, sq, capacity, hq, hkv, d
    p.page_size = rows_per if paged else 0
    p.cache_rows = pages_or_b
    p.num_splits, p.causal, p.fp16 = splits, int(mask.causal), int(q.dtype == torch.float16)
    p.softmax_scale = ops._softmax_scale(softmax_scale, d)
    if splits > 1:  # freed when this returns: the allocator orders its reuse on the stream
        o_accum = torch.empty(b * hq * sq * splits * d, dtype=torch.float32, device=q.device)
        lse_accum = torch.empty(b * hq * sq * splits, dtype=torch.float32, device=q.device)
        p.o_accum, p.lse_accum = o_accum.data_ptr(), lse_accum.data_ptr()
    _launch_decode(q.device, p)
    return (out, lse) if return_lse else out


def _launch_decode(device, params) -> None:
    """The library's decode kernels on the current stream (the CPU tests replace this)."""
    lib = runtime.get_library()
    with torch.cuda.device(device):
        lib.decode(params, torch.cuda.current_stream().cuda_stream)


def _debug_checks(cache_seqlens, cache_batch_idx, block_table, pages_or_b, rows_per, capacity):
    """FA3GEN_DEBUG_CHECKS=1: what needs the data on the host."""
    if cache_seqlens is not None:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > capacity:
            raise InvalidInputError(f"cache_seqlens in [{lo}, {hi}], outside [0, {capacity}]")
    if cache_batch_idx is not None:
        lo, hi = int(cache_batch_idx.min()), int(cache_batch_idx.max())
        if lo < 0 or hi >= pages_or_b:
            raise InvalidInputError(f"cache_batch_idx in [{lo}, {hi}], outside the cache's "
                                    f"{pages_or_b} rows")
    if block_table is not None and cache_seqlens is not None:
        used = [(-(-int(n) // rows_per)) for n in cache_seqlens.tolist()]
        for i, n in enumerate(used):
            pages = block_table[i, :n]
            if n and (int(pages.min()) < 0 or int(pages.max()) >= pages_or_b):
                raise InvalidInputError(f"block_table row {i} points outside the cache's "
                                        f"{pages_or_b} pages")
