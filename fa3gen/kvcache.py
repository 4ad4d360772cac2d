"""Decode attention over a KV cache: `flash_attn_with_kvcache`, flash-attn's name and semantics
(everything after q, k_cache, v_cache, k, v is keyword-only: flash-attn 2 passes rotary_cos
sixth, FlashAttention-3 qv, so a positional sixth argument could only mean something else
here). A few new query rows per
kv head (seqlen_q x heads_q / heads_kv <= 16) against a contiguous or paged cache of q's dtype
or e4m3 (with dequantization factors), new keys and values appended first when given, the key
range split across CTAs (split-KV) and merged; more rows per kv head (chunked prefill) go to
the forward kernels; forward only. Rotary embedding of q and the new keys (rotary_cos,
rotary_sin) runs as PyTorch operations before the append (or in the append kernel, below).
FlashAttention-3's keywords:
page_table, k_descale and v_descale name block_table, k_scale and v_scale; cache_leftpad and
the other features fa3gen lacks are refused unless at their defaults.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from fa3gen import contract, ops, runtime, tracing
from fa3gen.contract import INT32_MAX
from fa3gen.errors import Fa3genError, InvalidInputError, VariantNotBuiltError, build_command
from fa3gen.fp8 import E4M3_MAX, FP8_DTYPE as FP8

CACHE_NAMES = ("q", "k_cache", "v_cache")  # in errors, as the signature names them
MAX_ROWS = 16         # seqlen_q * heads_q / heads_kv per kv head: one M=16 tile (decode.cuh)
HEAD_DIMS = contract.DECODE_HEAD_DIMS
# One 16-key slice per warp of the split kernel's 4. Splits that short pay: a small cache is
# latency-bound, and more CTAs keep more loads in flight (H200, batch 1, 8 kv heads, 1k keys:
# 15 us at 2 splits, 7.2 us at 16; 2026-11-30).
MIN_KEYS_PER_SPLIT = 64
MAX_GRID_DIM = 65535  # a grid's y and z dimensions: the decode kernels' batch, kv heads and splits
MAX_SPLITS = 128
# CTAs of the split kernel resident per SM, from its shared memory (decode.cuh's Config: 66, 100
# and 200 KB of the 227 KB an H100/H200 SM offers).
CTAS_PER_SM = {64: 3, 128: 2, 256: 1}


@lru_cache(maxsize=4096)
def num_splits_heuristic(batch: int, heads_kv: int, seqlen_k: int, num_sms: int,
                         head_dim: int = 128) -> int:
    """A split count for seqlen_k keys: the fewest splits whose CTAs (one per split, kv head
    and sequence) fill the GPU's resident CTA slots nearly as evenly as the best count does
    (within 95%: the last wave of a memory-bound kernel runs at the bandwidth of the CTAs in
    it), raised while the same number of waves gives each CTA fewer keys; no split shorter
    than MIN_KEYS_PER_SPLIT keys. Counts are what the kernel runs: it rounds a split's keys up
    to a multiple of MIN_KEYS_PER_SPLIT, so 14 splits of 1024 keys run as 8 of 128. H200, d128,
    graph replay (2026-12-01): batch 1, 8 kv heads, 64k keys, 29 splits 74.4 us, 32 splits
    69.8 us; 1k keys, 14 (8 busy) 9.1 us, 16 7.7 us."""
    if seqlen_k <= 0:  # no key (an empty cache, cache_seqlens 0): one split writes the empty rows
        return 1
    pairs = max(1, batch * heads_kv)
    slots = num_sms * CTAS_PER_SM.get(head_dim, 1)
    most = max(1, min(-(-seqlen_k // MIN_KEYS_PER_SPLIT), MAX_SPLITS))

    def keys_per_split(splits):  # as the kernel rounds them: up to a multiple of the minimum
        keys = -(-seqlen_k // splits)
        return -(-keys // MIN_KEYS_PER_SPLIT) * MIN_KEYS_PER_SPLIT

    runs = sorted({-(-seqlen_k // keys_per_split(s)) for s in range(1, most + 1)})

    def waves(splits):
        return -(-(pairs * splits) // slots)

    def filled(splits):  # the share of the slots busy, averaged over the waves
        return pairs * splits / (waves(splits) * slots)

    best = max(filled(s) for s in runs)
    good = [s for s in runs if filled(s) >= 0.95 * best]
    return min((s for s in good if waves(s) == waves(good[0])), key=lambda s: (keys_per_split(s), s))


def _refuse_layouts(instead: str, **tensors) -> None:
    """The tensors among the arguments, if nested or sparse: one error naming the argument
    (their sizes or data pointers raise inside torch)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            ops.refuse_layout(name, t, instead)


def _check_int32_vector(name, t, batch, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be an int32 tensor of shape ({batch},), got "
                                f"{type(t).__name__}")
    ops.refuse_layout(name, t, f"an int32 tensor of shape ({batch},)")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.device != device:
        raise InvalidInputError(f"{name} must be int32 of shape ({batch},) on {device}, got "
                                f"{t.dtype} {tuple(t.shape)} on {t.device}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                            cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0,
                            return_lse=False, k_scale=None, v_scale=None, rotary_cos=None,
                            rotary_sin=None, rotary_interleaved=True, return_softmax_lse=False,
                            **fa3_keywords):
    """softmax(q k^T * scale) v of new query rows over a KV cache, flash-attn's semantics.

    q (batch, seqlen_q, heads_q, d) bf16/fp16, d in 64/128/256: up to 16 query rows per kv
    head (seqlen_q * heads_q / heads_kv) run the decode kernels, more the forward kernels
    (chunked prefill). Cache contiguous: k_cache, v_cache (cache batch, capacity, heads_kv, d), with
    cache_batch_idx (batch,) int32 choosing a cache row per sequence (default: the same index);
    or paged: k_cache, v_cache (pages, page_size, heads_kv, d) with block_table (batch, max
    pages) int32. cache_seqlens (batch,) int32 or an int: the keys each sequence has (default:
    the capacity; required when paged or when k, v are given). Query i of seqlen_q sits at position
    p = cache_seqlen - seqlen_q + i; causal: it sees keys j <= p; window_size (left, right):
    p - left <= j <= p + right (-1: unbounded; work grows with the window, not the cache);
    softcap > 0: scores s (scaled) become softcap * tanh(s / softcap) (flash-attn's). num_splits:
    0 chooses. Returns out (like q), and lse (batch, heads_q, seqlen_q) fp32 when return_lse (or
    flash-attn's return_softmax_lse). FlashAttention-3's keywords (fa3_keywords): page_table,
    k_descale, v_descale are block_table, k_scale, v_scale; pack_gqa, sm_margin hints; qv,
    attention_chunk, alibi_slopes (flash-attn 2's) and those of _UNSUPPORTED_KEYWORDS
    (cache_leftpad, ...) only at their defaults. k, v (batch, seqlen_new, heads_kv, d): new keys and values
    written into the cache (in place) at positions cache_seqlens .. cache_seqlens + seqlen_new -
    1 of each sequence before attending, which then covers
    cache_seqlens + seqlen_new keys (cache_seqlens itself is not changed). A cache too small for
    them is an error when cache_seqlens is an int; with a tensor that check needs the data on
    the host: FA3GEN_DEBUG_CHECKS=1 makes it (with the range checks of block_table and
    cache_batch_idx, and that no cache position, a row of a cache row or page, receives two
    new rows; a device sync), otherwise rows past the capacity are not written (the cache's
    last row may then keep its old value) and nothing is read or written outside it.
    Appending into a cache whose elements may share memory (a stride of 0 over a dimension of
    more than one, as expand() makes, or rows laid over each other) raises InvalidInputError,
    as does an append that a block_table or cache_batch_idx with a stride of 0 over the batch
    and one length for every sequence would send to one place; reading such a cache is fine.

    An e4m3 cache (k_cache, v_cache float8_e4m3fn; q bf16/fp16): the cached values are
    value * k_scale (v_scale), each None (1), a float, or an fp32 tensor of shape (heads_kv,) or
    (batch, heads_kv) on q's device (two tensors of one shape). Appended k, v in q's dtype are
    quantized with those factors (value / factor, saturated to +-448); e4m3 k, v are written as
    they are. The decode kernels read the e4m3 bytes (half the traffic of a 16-bit cache);
    chunked prefill dequantizes the keys it reads into q's dtype first (a copy).

    Rotary (flash-attn's): rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2), with k and v
    given, rotate the new keys at positions cache_seqlens, cache_seqlens + 1, ... and q at the
    same positions when causal or with a window that hides a key (_window_masks), else all of q
    at position cache_seqlens; pairs (0, 1), (2, 3), ... (rotary_interleaved, the default) or
    the two halves of the first rotary_dim values. In fp32, rounded once to q's (k's) dtype, by PyTorch operations before
    the append when the append kernel does not do it (FA3GEN_APPEND_KERNEL=0, a compiled call, an e4m3 cache, ...; bit for bit the same). Positions past seqlen_ro are an error when
    cache_seqlens is an int; with a tensor they are clamped to the last row (checked under
    FA3GEN_DEBUG_CHECKS=1)."""
    ops._check_tensors(q, k_cache, v_cache, CACHE_NAMES)
    if fa3_keywords:  # the usual call passes none
        block_table, k_scale, v_scale = _other_keywords(block_table, k_scale, v_scale,
                                                        num_splits, **fa3_keywords)
    softmax_scale = ops.check_softmax_scale(softmax_scale)  # a tensor's value, read once
    return_lse = ops.returns_lse(return_lse, return_softmax_lse, "return_softmax_lse")
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = int(cache_seqlens)  # a numpy integer too, as flash-attn takes it
    if isinstance(num_splits, numbers.Integral) and not isinstance(num_splits, bool):
        num_splits = int(num_splits)
    captured = ops._captured(q, k_cache, v_cache)
    rotary, interleaved = None, ops.flag("rotary_interleaved", rotary_interleaved)
    if rotary_cos is not None or rotary_sin is not None:
        rotary = (rotary_cos, rotary_sin, interleaved)
        if captured:  # the rotation as PyTorch operations in the graph
            per_row = bool(causal) or _window_masks(window_size, q, k_cache, block_table)
            _check_rotary(q, k, v, cache_seqlens, rotary_cos, rotary_sin, per_row)
            q, k = _rotate(q, k, cache_seqlens, *rotary, per_row)
    args = (k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal, window_size,
            softcap, num_splits, k_scale, v_scale)
    if captured:
        return _captured_call(q, k_cache, v_cache, args, return_lse)
    return _eager_call(q, k_cache, v_cache, args, return_lse, rotary)


# FlashAttention-3's (and flash-attn 2's) keywords for what fa3gen does not do, each taken
# only at its default: what the caller meant to be done is then refused, not ignored.
_UNSUPPORTED_KEYWORDS = {
    "cache_leftpad": "left-padded caches",
    "cu_seqlens_q": "variable-length query rows",
    "cu_seqlens_k_new": "variable-length new keys",
    "max_seqlen_q": "variable-length query rows",
    "rotary_seqlens": "rotary positions apart from cache_seqlens",
    "q_descale": "an fp8 q (q is bf16 or fp16 here)",
    "scheduler_metadata": "FlashAttention-3's precomputed schedule",
}


def _other_keywords(block_table, k_scale, v_scale, num_splits, *, page_table=None,
                    k_descale=None, v_descale=None, qv=None, attention_chunk=0, pack_gqa=None,
                    sm_margin=0, alibi_slopes=None, **unsupported) -> tuple:
    """(block_table, k_scale, v_scale) of a call that passed FlashAttention-3's keywords (or
    flash-attn 2's alibi_slopes): page_table, k_descale and v_descale are FA3's names of those
    three (one name each per call); pack_gqa and sm_margin are hints, as in flash_attn_func;
    the rest must be at their defaults. Any other name is Python's TypeError."""
    for name in unsupported:
        if name not in _UNSUPPORTED_KEYWORDS:
            raise TypeError(f"flash_attn_with_kvcache() got an unexpected keyword argument {name!r}")
    for fa3, value, ours, given in (("page_table", page_table, "block_table", block_table),
                                    ("k_descale", k_descale, "k_scale", k_scale),
                                    ("v_descale", v_descale, "v_scale", v_scale)):
        if value is not None and given is not None:
            raise InvalidInputError(f"{fa3} is FlashAttention-3's name for {ours}: pass one of "
                                    "them")
    for name, value in unsupported.items():
        if value is not None:
            raise InvalidInputError(f"{name} ({_UNSUPPORTED_KEYWORDS[name]}) is not supported by "
                                    f"fa3gen's flash_attn_with_kvcache; pass None")
    ops.check_fa3_extras(qv, attention_chunk, num_splits, pack_gqa, sm_margin,
                         alibi_slopes=alibi_slopes)
    return (page_table if block_table is None else block_table,
            k_descale if k_scale is None else k_scale, v_descale if v_scale is None else v_scale)


def _eager_call(q, k_cache, v_cache, args, return_lse, rotary=None):
    """A call's plan (once per signature), append and launch. rotary: (cos, sin, interleaved)
    of a call with the rotary embedding, whose checks and path the plan holds too: the append
    kernel rotates the new keys and writes the attention's q (a Rotary's q_out), or PyTorch
    rotates both first."""
    k, v, cache_seqlens, cache_batch_idx, block_table, _, _, _, _, _, k_scale, v_scale = args
    try:  # keyed by the library too: another one (FA3GEN_LIB, use_spec) may lack the kernels
        lib = runtime.get_library()
    except Fa3genError:  # none: the checks or the launch say so; one found later plans again
        lib = None
    try:
        key = (_call_key(q, k_cache, v_cache, args), lib)
        if rotary is not None:  # the tables' layouts, and what decides the rotation's path
            cos, sin, interleaved = rotary
            key += (ops._signature(cos), ops._signature(sin), interleaved,
                    _rotation_keeps_grad(q, k, cos, sin), _rotary_kernel_on(lib, k))
        plan = _plans.get(key)
    except (TypeError, AttributeError, RuntimeError):  # unhashable, not a tensor, or nested (its
        key, plan = None, None  # sizes raise inside torch): the checks below say so
    planned = None  # a rotary plan's attention q and new keys, made while planning
    if plan is None:
        if rotary is not None:
            plan, planned = _plan_rotary(q, k_cache, v_cache, args, rotary, lib)
        else:
            plan = _plan(q, k_cache, v_cache, *args)
        if key is not None:
            ops._remember(_plans, key, plan)
    elif rotary is not None:
        _check_rotary_positions(q, k, cache_seqlens, rotary[0], plan.rotary.per_row)
    if rotary is not None:
        cos, sin, interleaved = rotary
        if plan.rotary.template is not None:
            q_out = planned[0] if planned else torch.empty(q.shape, dtype=q.dtype, device=q.device)
            rotary = Rotary(q, q_out, cos, sin, interleaved, plan.rotary.per_row,
                            plan.rotary.template)
            q = q_out  # written by the append, before the attention reads it
        else:
            q, k = planned or _rotate(q, k, cache_seqlens, cos, sin, interleaved,
                                      plan.rotary.per_row)
            rotary = None
    result = _run(plan, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                  return_lse, k_scale, v_scale, lib, rotary)
    # For `fa3gen spec --from-trace`: the decode kernels a model needs (a chunked prefill runs
    # the forward kernels, which record their own variants; one that appends new keys needs
    # the append kernels, which a build has only with the decode kernels).
    if tracing._active and (plan.prefill is None or plan.append):
        tracing.record_decode("fp16" if q.dtype == torch.float16 else "bf16", q.shape[-1])
    return result


def _captured_call(q, k_cache, v_cache, args, return_lse):
    """A call under torch.compile (or on tensor subclasses): the checks while tracing, the
    append as PyTorch operations in the graph, the attention as the fa3gen::kvcache custom op,
    which plans and launches when the graph runs (as an eager call, no device sync on the
    decode path). Eagerly instead, outside the graph: a chunked prefill whose q needs a
    gradient (it gathers the keys, a sync, and the op has no backward), and every call under
    FA3GEN_DEBUG_CHECKS (its checks read the lengths and indices on the host, before the
    append writes anything)."""
    (k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal, window_size,
     softcap, num_splits, k_scale, v_scale) = args
    c = _check(q, k_cache, v_cache, *args)
    if ops.debug_checks_enabled() or (c.prefill and torch.is_grad_enabled() and q.requires_grad):
        return torch.compiler.disable(_eager_call)(q, k_cache, v_cache, args, return_lse)
    b, sq, hq, d = q.shape
    seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    length = cache_seqlens if seqlens is None else None  # an int (or None: the capacity)
    if c.prefill and 0 not in (b, sq, hq):  # as _run: before the append in the graph
        _require_prefill_forward(q, k_cache, c.geometry[2], c.kv_fp8, c.mask, seqlens,
                                 cache_batch_idx, block_table)
    if c.append and b:
        _append(c.geometry, k_cache, v_cache, k, v, length if seqlens is None else seqlens,
                cache_batch_idx, block_table, c.kv_fp8, k_scale, v_scale)
        if seqlens is None:
            length = c.seqlen_k  # the int after the append
        else:
            seqlens = seqlens + c.append
    if 0 in (b, sq, hq):
        return _no_attention(q, return_lse)
    scales = [(s, 1.0) if isinstance(s, torch.Tensor) else (None, 1.0 if s is None else float(s))
              for s in (k_scale, v_scale)]
    out, lse = torch.ops.fa3gen.kvcache(
        q.detach(), k_cache, v_cache, seqlens, -1 if length is None else length, cache_batch_idx,
        block_table, ops._softmax_scale(softmax_scale, d), c.mask.causal, c.mask.window_left,
        c.mask.window_right, c.mask.softcap, num_splits, *scales[0], *scales[1])
    return (out, lse) if return_lse else out


@torch.library.custom_op("fa3gen::kvcache", mutates_args=())
def _kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_length: int,
    cache_batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    k_scale: torch.Tensor | None,
    k_scale_value: float,
    v_scale: torch.Tensor | None,
    v_scale_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of a compiled flash_attn_with_kvcache call, after its append: an eager
    call. cache_length: an int cache_seqlens (-1: none given); a factor is its tensor, else
    its value (1.0: none)."""
    length = cache_seqlens if cache_seqlens is not None else (
        cache_length if cache_length >= 0 else None)
    ks, vs = ((t if t is not None else (None if value == 1.0 else value))
              for t, value in ((k_scale, k_scale_value), (v_scale, v_scale_value)))
    out, lse = _eager_call(q, k_cache, v_cache, (
        None, None, length, cache_batch_idx, block_table, softmax_scale, causal,
        (window_left, window_right), softcap, num_splits, ks, vs), True)
    return out, lse.contiguous()  # the chunked prefill's is a transposed view


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_length, cache_batch_idx, block_table,
                  softmax_scale, causal, window_left, window_right, softcap, num_splits, k_scale,
                  k_scale_value, v_scale, v_scale_value):
    return ops._empty_outputs(q)


def _window_masks(window_size, q, k_cache, block_table) -> bool:
    """Whether a window hides any key (FlashAttention-3's rule, which decides how q is rotated:
    a left side of at least capacity - 1 keys, or a right side of at least seqlen_q - 1, hides
    none and counts as -1)."""
    try:
        left, right = (int(x) for x in window_size)
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        return 0 <= left < capacity - 1 or 0 <= right < q.shape[1] - 1
    except (TypeError, ValueError, AttributeError, IndexError):  # the plan's checks say what is wrong
        return False


def _check_rotary(q, k, v, cache_seqlens, cos, sin, per_row: bool) -> None:
    """The checks of a call with rotary_cos, rotary_sin: positions past the tables are an error
    (with a tensor cache_seqlens only under FA3GEN_DEBUG_CHECKS; otherwise they clamp to the
    last row)."""
    if k is None or v is None:
        raise InvalidInputError("rotary_cos and rotary_sin rotate the new keys: pass k and v "
                                "(flash-attn applies them only with k and v)")
    _refuse_layouts("a dense (batch, seqlen_new, heads_kv, head_dim) tensor", k=k, v=v)
    _refuse_layouts("a dense (seqlen_ro, rotary_dim / 2) tensor", rotary_cos=cos, rotary_sin=sin)
    if not all(isinstance(t, torch.Tensor) for t in (cos, sin)) or cos.dim() != 2 or \
            cos.shape != sin.shape or not cos.is_floating_point() or sin.dtype != cos.dtype or \
            cos.device != q.device or not 1 <= cos.shape[1] <= q.shape[-1] // 2 or cos.shape[0] < 1:
        raise InvalidInputError(
            f"rotary_cos and rotary_sin must be floating-point tensors of one shape (seqlen_ro >= 1, "
            f"rotary_dim / 2 <= {q.shape[-1] // 2}) and dtype on {q.device}; got "
            f"{[(getattr(t, 'dtype', type(t).__name__), tuple(getattr(t, 'shape', ()))) for t in (cos, sin)]}")
    if q.dim() != 4 or not isinstance(k, torch.Tensor) or k.dim() != 4 or \
            k.dtype not in (torch.bfloat16, torch.float16) or k.shape[0] != q.shape[0] or \
            k.shape[-1] != q.shape[-1]:
        raise InvalidInputError(
            f"rotary embedding needs q (batch, seqlen_q, heads_q, d) and 16-bit k (batch, "
            f"seqlen_new, heads_kv, d) of one batch and d; got q {tuple(q.shape)}, k "
            f"{getattr(k, 'dtype', type(k).__name__)} {tuple(getattr(k, 'shape', ()))}")
    if cache_seqlens is None:
        raise InvalidInputError("appending k, v needs cache_seqlens (where they go)")
    if not isinstance(cache_seqlens, int):
        _check_int32_vector("cache_seqlens", cache_seqlens, q.shape[0], q.device)
    _check_rotary_positions(q, k, cache_seqlens, cos, per_row)


def _check_rotary_positions(q, k, cache_seqlens, cos, per_row: bool) -> None:
    """_check_rotary's checks of values, which a planned call runs again: an int cache_seqlens,
    or under FA3GEN_DEBUG_CHECKS a tensor one, past the tables' positions."""
    rows = cos.shape[0]
    span = max(k.shape[1], q.shape[1] if per_row else 1)  # positions past cache_seqlens used
    if isinstance(cache_seqlens, int):
        if cache_seqlens < 0 or cache_seqlens + span > rows:
            raise InvalidInputError(f"rotary_cos has {rows} positions; the call needs "
                                    f"cache_seqlens + {span} = {ops.shown(cache_seqlens + span)}")
    elif ops.debug_checks_enabled():
        need = int((_start_rows(cache_seqlens, q.shape[0], q.device).max() + span).item())
        if need > rows:
            raise InvalidInputError(f"rotary_cos has {rows} positions; cache_seqlens needs {need}")


def _rotate(q, k, cache_seqlens, cos, sin, interleaved: bool, per_row: bool):
    """(q, k) with the rotary embedding at their positions (flash_attn_with_kvcache's rule;
    positions past the tables clamp to their last row), by PyTorch operations."""
    from fa3gen.reference import rotary_at

    b, n, seqlen_q, rows = q.shape[0], k.shape[1], q.shape[1], cos.shape[0]
    start = _start_rows(cache_seqlens, b, q.device)
    positions = (start + torch.arange(max(n, seqlen_q), device=q.device)).clamp(0, rows - 1)
    q_positions = (positions[:, :seqlen_q] if per_row
                   else start.clamp(0, rows - 1).expand(b, seqlen_q))
    return (rotary_at(q, cos, sin, q_positions, interleaved).to(q.dtype),
            rotary_at(k, cos, sin, positions[:, :n], interleaved).to(k.dtype))


def _table_type(cos) -> int | None:
    """fa3gen_rotary_params.cos_type of a rotary table's dtype (None: the kernel takes none)."""
    return contract.ROTARY_COS_TYPES.get(str(cos.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Rotary:
    """A call's rotary embedding left to the append kernel: q rotated into q_out (contiguous,
    the attention's q) and the new keys as they are written."""
    q: torch.Tensor
    q_out: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    per_row: bool
    template: bytes | None = None  # rotary_params' fields but the pointers (the plan's)


def _rotary_kernel_on(lib, k) -> bool:
    """Whether an eager call with new keys k has the append kernel with the rotary (k on a GPU,
    not FA3GEN_APPEND_KERNEL=0, lib, or the library found, has fa3gen_kvcache_append_rotary)."""
    try:
        lib = _append_library(lib, k)
    except Fa3genError:  # no library
        return False
    return lib is not None and lib.has_append_rotary


def _rotation_keeps_grad(q, k, cos, sin) -> bool:
    """Whether the rotation must keep a gradient (autograd on, an input that requires it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))


def _fused_rotary(q, k, k_cache, cos, sin, lib=None) -> bool:
    """Whether the append kernel rotates (not FA3GEN_APPEND_KERNEL=0, on a GPU, lib (None: the
    library found) with fa3gen_kvcache_append_rotary): q, k and the cache of one 16-bit dtype,
    cos and sin fp32 / bf16 / fp16, q's head dim contiguous, rows to write, and no gradient to
    keep through the rotation."""
    if not (q.dtype == k.dtype == k_cache.dtype and q.numel() and k.numel()
            and q.stride(-1) == 1 and _table_type(cos) is not None):
        return False
    return not _rotation_keeps_grad(q, k, cos, sin) and _rotary_kernel_on(lib, k)


@dataclass(frozen=True)
class _RotaryPlan:
    """A rotary call's planned path: q rotated at each row's own position (per_row: causal or a
    window), and the append kernel's params but the pointers (None: PyTorch rotates)."""
    per_row: bool
    template: bytes | None


def _plan_rotary(q, k_cache, v_cache, args, rotary, lib=None) -> tuple[_DecodePlan, tuple]:
    """_plan for a call with the rotary embedding: its checks, and the plan of the attention's
    q (the kernel's contiguous q_out, or PyTorch's rotated q and k) with the rotation's path
    (lib: the library the plan is keyed by); and this call's (attention q, new keys)."""
    k, v, cache_seqlens, _, block_table, _, causal, window_size = args[:8]
    cos, sin, interleaved = rotary
    per_row = bool(causal) or _window_masks(window_size, q, k_cache, block_table)
    _check_rotary(q, k, v, cache_seqlens, cos, sin, per_row)
    if _fused_rotary(q, k, k_cache, cos, sin, lib):
        attention_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan = _plan(attention_q, k_cache, v_cache, *args)
        template = bytes(_rotary_template(q, cos, sin, interleaved, per_row))
    else:
        attention_q, k = _rotate(q, k, cache_seqlens, cos, sin, interleaved, per_row)
        plan = _plan(attention_q, k_cache, v_cache, k, *args[1:])
        template = None
    return replace(plan, rotary=_RotaryPlan(per_row, template)), (attention_q, k)


# Eager calls repeat one signature (shapes, strides, dtypes, the other arguments) step after
# step: its checks, split count and static params are computed once.
_plans: dict = {}


def _call_key(q, k_cache, v_cache, args) -> tuple:
    """The plan's key: tensors by shape, strides, dtype and device, other arguments by type and
    value (an unhashable one raises TypeError), except an int cache_seqlens (args[2]), which
    grows by one every decode step: one plan serves every value. softmax_scale and softcap
    (args[5], args[8]) by their value even when given as a 0-d tensor or a numpy number.
    Flat: it runs every call."""
    sig = ops._signature
    key = [sig(q), sig(k_cache), sig(v_cache)]
    for i, a in enumerate(args):
        value = ops.real_number(a) if i in (5, 8) and type(a) is not float else None
        if value is not None:
            key.append(value)
        elif isinstance(a, torch.Tensor):
            key.append(sig(a))
        elif i == 2 and type(a) is int:
            key.append(int)
        else:  # a tuple of ints (window_size) hashes as it is; a list of tensors is refused
            key.append((type(a), a))
    return tuple(key)


class _LookUp:
    """The append template's third state beside bytes (planned) and None (no kernel): not
    planned, so append_params looks the layouts up (_append_templates)."""

    def __repr__(self) -> str:
        return "LOOK_UP"

    def __copy__(self):  # one instance, so that `is LOOK_UP` holds in a copied plan too
        return self

    def __deepcopy__(self, memo):
        return self


LOOK_UP = _LookUp()


@dataclass(frozen=True)
class _DecodePlan:
    params: bytes            # DecodeParams with every field but the pointers
    out_shape: tuple         # (batch, seqlen_q, heads_q, head_dim)
    split_args: tuple        # (num_splits, batch, heads_kv, SMs, head_dim, window keys): _split_count
    geometry: tuple          # (cache rows: pages or sequences, page size, capacity)
    append: int              # seqlen_new of k, v (0: nothing to append)
    prefill: tuple | None    # (mask, softmax scale): more rows than the decode kernels take
    kv_fp8: bool = False     # an e4m3 cache (its factors: k_scale, v_scale)
    rotary: _RotaryPlan | None = None  # a call with rotary_cos / rotary_sin: its path
    # The append kernel's params but the pointers (_append_template; None: the layouts do not
    # suit it), planned with the new keys' and the cache's layouts; LOOK_UP: looked up per call
    # (an e4m3 cache, whose new rows are quantized first).
    append_template: bytes | None | _LookUp = LOOK_UP


@dataclass(frozen=True)
class _Checked:
    """What the checks of a call found (all from metadata: torch.compile runs them while it
    traces)."""
    mask: ops.Masking
    kv_fp8: bool
    geometry: tuple          # (cache rows: pages or sequences, page size, capacity)
    heads_kv: int
    append: int              # seqlen_new of k, v (0: nothing to append)
    seqlen_k: int            # the keys of an int cache_seqlens after the append, else capacity
    prefill: bool            # more rows than the decode kernels take: the forward kernels
    scale_strides: tuple     # (batch, head) strides of the e4m3 factor tensors


def _check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
           causal, window_size, softcap, num_splits, k_scale, v_scale) -> _Checked:
    """Every check that the tensors' metadata and the arguments allow."""
    mask = ops.masking(causal, window_size, softcap)
    ops.check_device(q, k_cache, v_cache, CACHE_NAMES)
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise InvalidInputError("q, k_cache and v_cache must be 4-D (batch or pages, seqlen, "
                                "heads, head_dim)")
    kv_fp8 = k_cache.dtype == v_cache.dtype == FP8
    if q.dtype not in (torch.bfloat16, torch.float16) or \
            not (kv_fp8 or q.dtype == k_cache.dtype == v_cache.dtype):
        raise InvalidInputError(f"q must be bf16 or fp16 and k_cache, v_cache of q's dtype or "
                                f"both float8_e4m3fn; got {q.dtype}, {k_cache.dtype}, "
                                f"{v_cache.dtype}")
    b, sq, hq, d = q.shape
    pages_or_b, rows_per, hkv, dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or dk != d:
        raise InvalidInputError(f"k_cache and v_cache must have one shape (.., .., heads_kv, "
                                f"{d}); got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if d not in HEAD_DIMS:
        raise InvalidInputError(f"head_dim {d}: the decode kernels serve {list(HEAD_DIMS)}")
    if hkv < 1 or hq % hkv:
        raise InvalidInputError(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv})")
    prefill = sq * (hq // hkv) > MAX_ROWS  # chunked prefill: the forward kernels serve it
    if not prefill and (b > MAX_GRID_DIM or hkv > MAX_GRID_DIM):  # the decode kernels' grid
        raise InvalidInputError(f"the decode kernels take a batch and heads_kv of at most "
                                f"{MAX_GRID_DIM}; got batch {b}, heads_kv {hkv}")
    paged = block_table is not None
    # The decode kernels clamp every page or sequence index into the cache: there must be one
    # (a contiguous cache of no rows per sequence is legal: no keys).
    if pages_or_b == 0 or (paged and rows_per == 0):
        raise InvalidInputError(f"k_cache and v_cache {tuple(k_cache.shape)} hold no "
                                f"{'pages' if pages_or_b == 0 else 'rows'}: a paged cache needs "
                                f"pages of at least one row, a contiguous one a sequence")
    if paged:
        if isinstance(block_table, torch.Tensor):
            ops.refuse_layout("block_table", block_table, f"an int32 tensor (batch={b}, max pages)")
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or \
                block_table.dim() != 2 or block_table.shape[0] != b or \
                block_table.device != q.device:
            raise InvalidInputError(f"block_table must be int32 (batch={b}, max pages) on "
                                    f"{q.device}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise InvalidInputError("block_table's rows must be contiguous (stride(1) == 1); "
                                    "pass block_table.contiguous()")
        if cache_seqlens is None:
            raise InvalidInputError("a paged cache needs cache_seqlens")
        if cache_batch_idx is not None:
            raise InvalidInputError("cache_batch_idx applies to a contiguous cache, not a paged "
                                    "one (the block table says where each sequence is)")
        capacity = block_table.shape[1] * rows_per  # bounded with the queries' below
    else:
        capacity = rows_per
        if cache_batch_idx is None and pages_or_b < b:
            raise InvalidInputError(f"the cache holds {pages_or_b} sequences for a batch of {b} "
                                    "(pass cache_batch_idx to map them)")
    if capacity + sq > INT32_MAX // 2:  # int32 params, and a query's position adds to the keys'
        layout = f" ({block_table.shape[1]} pages of {rows_per} rows)" if block_table is not None else ""
        raise InvalidInputError(f"a cache of {capacity} keys a sequence{layout} and {sq} queries: "
                                "at most 2^30 - 1 together")
    scale_strides = _check_scales(k_scale, v_scale, kv_fp8, b, hkv, q.device)
    _check_score_scale(k_scale, ops._softmax_scale(softmax_scale, q.shape[-1]))
    append = _check_new_kv(k, v, k_cache, b, cache_seqlens, q.dtype)
    if append > capacity:  # from the shapes alone, whatever cache_seqlens holds
        raise InvalidInputError(f"k and v append {append} rows a sequence, more than the cache "
                                f"holds ({capacity})")
    seqlen_k = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlen_k = _int_length(cache_seqlens, capacity, append)  # no tensor needed
    elif cache_seqlens is not None:
        _check_int32_vector("cache_seqlens", cache_seqlens, b, q.device)
    if cache_batch_idx is not None:
        _check_int32_vector("cache_batch_idx", cache_batch_idx, b, q.device)
    if append:
        _check_append_places(b, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InvalidInputError(f"num_splits must be an int >= 0 (0: automatic), got "
                                f"{ops.shown(num_splits)}")
    ops.check_layout(q=q, k_cache=k_cache, v_cache=v_cache)
    if not prefill:  # last: bad arguments are reported before a missing kernel
        _require_decode_kernels("fp16" if q.dtype == torch.float16 else "bf16",
                                ops.static_head_dim(d))
    return _Checked(mask, kv_fp8, (pages_or_b, rows_per, capacity), hkv, append, seqlen_k,
                    prefill, scale_strides)


def _plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
          causal, window_size, softcap, num_splits, k_scale, v_scale) -> _DecodePlan:
    """The checks, and the static params."""
    c = _check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
               softmax_scale, causal, window_size, softcap, num_splits, k_scale, v_scale)
    mask, (pages_or_b, rows_per, _), seqlen_k = c.mask, c.geometry, c.seqlen_k
    b, sq, hq, d = q.shape
    hkv, paged = c.heads_kv, block_table is not None
    # A side that reaches past every key is unbounded (-1): the kernel adds it to int32 positions.
    left, right = (_decode_window_side(w, c.geometry[2] + sq)
                   for w in (mask.window_left, mask.window_right))
    # A window: the splits share only the keys some query sees, the last window_left + seqlen_q.
    window_keys = left + sq + 15 if left >= 0 else None
    split_args = (num_splits, b, hkv, ops._num_sms(q.device.index), d, window_keys)
    splits = _split_count(seqlen_k, *split_args)
    out_strides = (sq * hq * d, hq * d, d)  # out is allocated contiguous
    p = runtime.DecodeParams()
    p.block_table_batch_stride = block_table.stride(0) if paged else 0
    for name, strides in (("q", q.stride()), ("k", k_cache.stride()), ("v", v_cache.stride()),
                          ("out", out_strides)):
        for dim, stride in zip(("batch", "row", "head"), strides[:3]):
            setattr(p, f"{name}_{dim}_stride", stride)
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim = b, sq, seqlen_k, hq, hkv, d
    p.page_size = rows_per if paged else 0
    p.cache_rows = pages_or_b
    p.num_splits, p.causal, p.fp16 = splits, int(mask.causal), int(q.dtype == torch.float16)
    p.softmax_scale = ops._softmax_scale(softmax_scale, d)
    p.window_left, p.window_right, p.softcap = left, right, mask.softcap
    p.kv_fp8 = int(c.kv_fp8)
    p.kv_scale_batch_stride, p.kv_scale_head_stride = c.scale_strides
    p.k_scale_value, p.v_scale_value = (1.0 if s is None or isinstance(s, torch.Tensor)
                                        else float(s) for s in (k_scale, v_scale))
    template = _append_template(c.geometry, (k, v, k_cache, v_cache), block_table) \
        if c.append and not c.kv_fp8 else LOOK_UP
    return _DecodePlan(bytes(p), (b, sq, hq, d), split_args, c.geometry, c.append,
                       (mask, p.softmax_scale) if c.prefill else None, c.kv_fp8,
                       append_template=template)


def _decode_window_side(w: int, reach: int) -> int:
    """A window side as the decode kernel takes it: -1 (unbounded) from `reach` (the cache's
    capacity plus the query rows) on, where it shows every key anyway, so that position +- w
    stays inside int32 (a side near 2^31 wrapped and masked every key)."""
    return -1 if w >= reach else w


# A float factor travels as an fp32 param: a smaller one would be 0 or subnormal there.
FP32_TINY, FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _check_scales(k_scale, v_scale, kv_fp8, batch, heads_kv, device) -> tuple:
    """The (batch, head) strides of the factor tensors ((0, 0) without one)."""
    given = [(n, s) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None]
    if given and not kv_fp8:
        raise InvalidInputError("k_scale and v_scale dequantize an e4m3 cache (k_cache, v_cache "
                                "float8_e4m3fn); this cache holds 16-bit values")
    tensors = []
    for name, s in given:
        if isinstance(s, torch.Tensor):
            ops.refuse_layout(name, s, "a dense fp32 tensor")
            if s.dtype != torch.float32 or s.device != device or \
                    tuple(s.shape) not in ((heads_kv,), (batch, heads_kv)):
                raise InvalidInputError(f"{name} must be fp32 of shape ({heads_kv},) or ({batch}, "
                                        f"{heads_kv}) on {device}, got {s.dtype} "
                                        f"{tuple(s.shape)} on {s.device}")
            tensors.append(s)
        elif (value := ops.real_number(s)) is None or not _normal_fp32(value):
            raise InvalidInputError(f"{name} must be a positive float within fp32's normal range "
                                    f"or an fp32 tensor, got {ops.shown(s)}")
    if not tensors:
        return 0, 0
    if len(tensors) == 2 and (tensors[0].shape != tensors[1].shape or
                              tensors[0].stride() != tensors[1].stride()):
        raise InvalidInputError("k_scale and v_scale tensors must share one shape and strides")
    t = tensors[0]
    return (0, t.stride(0)) if t.dim() == 1 else (t.stride(0) if batch > 1 else 0, t.stride(1))


def _int_length(cache_seqlens: int, capacity: int, append: int) -> int:
    """The keys every sequence has after the append, for an int cache_seqlens."""
    if not 0 <= cache_seqlens <= capacity - append:
        raise InvalidInputError(
            f"cache_seqlens {ops.shown(cache_seqlens)} outside [0, {capacity - append}]"
            + (f" (the cache holds {capacity} rows, {append} are appended)" if append else ""))
    return cache_seqlens + append


def _split_count(keys: int, num_splits: int, batch: int, heads_kv: int, num_sms: int,
                 head_dim: int, window_keys: int | None) -> int:
    if window_keys is not None:
        keys = min(keys, window_keys)
    splits = num_splits or num_splits_heuristic(batch, heads_kv, keys, num_sms, head_dim)
    return max(1, min(splits, MAX_GRID_DIM, -(-keys // MIN_KEYS_PER_SPLIT)))  # a split: a slice per warp


def _check_new_kv(k, v, k_cache, batch, cache_seqlens, q_dtype) -> int:
    """seqlen_new of the keys and values to append (0 when there are none)."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise InvalidInputError("pass both k and v to append to the cache, or neither")
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError("k and v must be torch.Tensors")
    _refuse_layouts("a dense (batch, seqlen_new, heads_kv, head_dim) tensor", k=k, v=v)
    want = (batch, k.shape[1] if k.dim() == 4 else -1, *k_cache.shape[2:])
    if k.dim() != 4 or tuple(k.shape) != want or tuple(v.shape) != want or k.shape[1] < 1:
        raise InvalidInputError(f"k and v must be (batch={batch}, seqlen_new >= 1, "
                                f"{k_cache.shape[2]}, {k_cache.shape[3]}); got {tuple(k.shape)} "
                                f"and {tuple(v.shape)}")
    # An e4m3 cache also takes k, v in q's dtype (quantized on the way in).
    dtypes = (k_cache.dtype, q_dtype) if k_cache.dtype == FP8 else (k_cache.dtype,)
    if k.dtype != v.dtype or k.dtype not in dtypes or k.device != k_cache.device or \
            v.device != k_cache.device:
        raise InvalidInputError(f"k and v must match the cache's dtype and device "
                                f"({' or '.join(map(str, dtypes))} on {k_cache.device})")
    if cache_seqlens is None:
        raise InvalidInputError("appending k, v needs cache_seqlens (where they go)")
    return k.shape[1]


def _may_share_memory(t: torch.Tensor) -> bool:
    """Whether two elements of t may sit at one address: unless each of its dimensions of more
    than one element, taken by stride, steps past all that the smaller ones span. Slices of a
    larger tensor pass; a stride of 0 (expand()) or rows that as_strided laid over each other
    do not (nor the rare layout that interleaves without overlapping)."""
    dims = [(stride, size) for stride, size in zip(t.stride(), t.shape) if size > 1]
    span = 0
    while dims:  # smallest stride first (no sort: dynamo traces this and sorts only ints)
        inner = 0
        for i in range(1, len(dims)):
            if dims[i][0] < dims[inner][0]:
                inner = i
        stride, size = dims.pop(inner)
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _solvable(target: int, terms: list[tuple[int, int, int]], budget: list[int]) -> bool:
    """Whether target = sum(stride * x) with lo <= x <= hi for each (stride, lo, hi) of terms
    (strides positive, largest first): depth first, each term taking only the values that the
    smaller ones can still complete, none where the strides' gcd does not divide target.
    budget[0] counts the steps left; past it, True (may)."""
    if not terms:
        return target == 0
    if target % math.gcd(*(t[0] for t in terms)):
        return False
    (stride, lo, hi), rest = terms[0], terms[1:]
    rest_lo = sum(s * a for s, a, _ in rest)
    rest_hi = sum(s * b for s, _, b in rest)
    first = max(lo, -((rest_hi - target) // stride))  # ceil((target - rest_hi) / stride)
    last = min(hi, (target - rest_lo) // stride)
    for x in range(first, last + 1):
        budget[0] -= 1
        if budget[0] < 0 or _solvable(target - stride * x, rest, budget):
            return True
    return False


_collisions: dict = {}  # (layouts, element size, offset between them) -> _caches_collide's answer


def _caches_collide(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether an element of k_cache and one of v_cache share a byte (slices of one buffer,
    such as k and v interleaved in one kv cache, do not). Cheap unless both are views of one
    storage; then exact over their strides, in bytes (a search too long to finish says yes),
    once a layout (_collisions)."""
    if k_cache.numel() == 0 or v_cache.numel() == 0 or \
            k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return False
    size = k_cache.element_size()
    delta = v_cache.data_ptr() - k_cache.data_ptr()  # k's element at v's start + offsets
    key = (k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), size, delta)
    found = _collisions.get(key)
    if found is None:
        found = ops._remember(_collisions, key, _strided_overlap(k_cache, v_cache, size, delta))
    return found


def _strided_overlap(k_cache, v_cache, size: int, delta: int) -> bool:
    merged: dict[int, list[int]] = {}  # stride in bytes -> the range of its summed index
    for t, sign in ((k_cache, 1), (v_cache, -1)):  # k's indices add, v's subtract
        for stride, n in zip(t.stride(), t.shape):
            if n > 1 and stride > 0:
                r = merged.setdefault(stride * size, [0, 0])
                r[0 if sign < 0 else 1] += sign * (n - 1)
    terms = sorted(((s, lo, hi) for s, (lo, hi) in merged.items()), reverse=True)
    budget = [100_000]
    return any(_solvable(delta + e, terms, budget) for e in range(1 - size, size))


def _check_caches_apart(k_cache, v_cache, k, v, transformed: bool) -> None:
    """An append writes k into k_cache and v into v_cache: where the caches share memory one of
    the two would be lost, unless they are one view and k, v too, written as they are (not
    `transformed`: rotated, or quantized by two scales), so the same values twice. Per call
    (the cost is a storage compare), not while captured (compiling, make_fx, vmap: fake and
    batched tensors have no memory to compare)."""
    if ops._captured(k_cache, v_cache, k, v) or not _caches_collide(k_cache, v_cache):
        return
    same = (k_cache.data_ptr(), k_cache.stride()) == (v_cache.data_ptr(), v_cache.stride()) and \
        (k.data_ptr(), k.stride()) == (v.data_ptr(), v.stride()) and not transformed
    if not same:
        raise InvalidInputError(
            "k_cache and v_cache share memory, and appending k, v writes both in place: the "
            "keys or the values written would be lost; pass caches of their own (slices of one "
            "buffer that do not overlap, such as kv[:, :, 0] and kv[:, :, 1], are fine)")


def _check_append_places(batch, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                         block_table) -> None:
    """The append writes k and v into the cache in place, where no two new rows may land on
    one place (the last writer would win; reading shared places is fine): refused are a cache
    whose elements may share memory, and a block_table or cache_batch_idx with a stride of 0
    over the batch (every sequence on one cache row or pages) with one length for every
    sequence (an int cache_seqlens, or a tensor with a stride of 0). From the layouts only:
    once a signature (FA3GEN_DEBUG_CHECKS reads the indices, _debug_check_disjoint_appends)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _may_share_memory(t):
            raise InvalidInputError(
                f"{name} {tuple(t.shape)} has strides {tuple(t.stride())}, by which its elements "
                "may share memory (a stride of 0, as expand() makes, or rows laid over each "
                "other), and appending k, v writes the cache in place; pass a cache with memory "
                "of its own (e.g. .contiguous()), or append separately")
    one_length = isinstance(cache_seqlens, int) or (
        isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.stride(0) == 0)
    if batch < 2 or not one_length:
        return
    for name, t in (("block_table", block_table), ("cache_batch_idx", cache_batch_idx)):
        if isinstance(t, torch.Tensor) and t.stride(0) == 0:
            raise InvalidInputError(
                f"{name} has a stride of 0 over the batch and every sequence appends at one "
                f"length: all {batch} sequences' new rows would be written to the same cache "
                "rows; give each sequence rows of its own")


def _start_rows(seqlens, batch: int, device) -> torch.Tensor:
    """(batch, 1) int64: each sequence's first new row, cache_seqlens (an int is every
    sequence's; negative values read as 0)."""
    if isinstance(seqlens, int):
        return torch.full((batch, 1), max(seqlens, 0), dtype=torch.long, device=device)
    return seqlens.long()[:, None].clamp(min=0)


def _append(geometry: tuple, k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table,
            kv_fp8: bool, k_scale, v_scale, lib=None, rotary: Rotary | None = None,
            template=LOOK_UP):
    """k, v into the cache at each sequence's positions seqlens + i (an e4m3 cache: quantized
    with its factors), untracked as flash-attn's raw writes: k, v that require grad must not
    pull the cache into their autograd graph (it would grow every step, keeping activations
    alive). By lib's append kernel (one launch) when given and the layouts suit it
    (append_params), else with PyTorch indexing (_write_rows; what a compiled call traces).
    rotary (only with lib): the keys are rotated as they are written and q into rotary.q_out,
    by the kernel or, where the layouts do not suit it, by PyTorch first. template: the plan's
    append_template (LOOK_UP: append_params looks it up). No host sync."""
    _check_caches_apart(k_cache, v_cache, k, v, rotary is not None or
                        (kv_fp8 and k_scale is not v_scale))
    with torch.no_grad():
        if kv_fp8:
            k, v = _quantize_new(k, k_scale), _quantize_new(v, v_scale)
        p = None if lib is None else append_params(geometry, k_cache, v_cache, k, v, seqlens,
                                                     cache_batch_idx, block_table, template)
        if p is None:
            if rotary is not None:
                q, k = _rotate(rotary.q, k, seqlens, rotary.cos, rotary.sin, rotary.interleaved,
                               rotary.per_row)
                rotary.q_out.copy_(q)
            _write_rows(geometry, k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table)
            return
        if rotary is None:
            ops.on_current_stream(k.device, lambda stream: lib.kvcache_append(p, stream))
        else:
            r = rotary_params(rotary, p)
            ops.on_current_stream(k.device, lambda stream: lib.kvcache_append_rotary(p, r, stream))
        for cache in (k_cache, v_cache):  # as an in-place PyTorch write: autograd sees it
            torch.autograd.graph.increment_version(cache)


def rotary_params(rotary: Rotary, p: runtime.AppendParams) -> runtime.RotaryParams:
    """The append kernel's rotary params (fa3gen_rotary_params) beside its append params p:
    the planned template (or one made now) with this call's pointers."""
    template = rotary.template
    if template is None:
        template = _rotary_template(rotary.q, rotary.cos, rotary.sin, rotary.interleaved,
                                    rotary.per_row)
    r = runtime.RotaryParams.from_buffer_copy(template)
    r.q, r.q_out = rotary.q.data_ptr(), rotary.q_out.data_ptr()
    r.cos, r.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
    return r


def _rotary_template(q, cos, sin, interleaved: bool, per_row: bool) -> runtime.RotaryParams:
    """rotary_params' fields that the layouts and flags fix (the pointers left null)."""
    r = runtime.RotaryParams()
    r.q_batch_stride, r.q_row_stride, r.q_head_stride = q.stride()[:3]
    r.cos_row_stride, r.cos_col_stride = cos.stride()
    r.sin_row_stride, r.sin_col_stride = sin.stride()
    r.seqlen_q, r.heads_q = q.shape[1], q.shape[2]
    r.rotary_half, r.rows = cos.shape[1], cos.shape[0]
    r.interleaved, r.q_per_row = interleaved, per_row
    r.cos_type = _table_type(cos)
    r.fp16 = q.dtype == torch.float16
    return r


APPEND_KERNEL_ENV = "FA3GEN_APPEND_KERNEL"


def _append_library(lib, k):
    """The library whose append kernel an eager call uses: k on a GPU and a library that has
    it, unless FA3GEN_APPEND_KERNEL=0 (the PyTorch path); else None."""
    if os.environ.get(APPEND_KERNEL_ENV, "") == "0" or not k.is_cuda:
        return None
    lib = lib or runtime.get_library()
    return lib if lib.has_append_kernel else None


def append_params(geometry: tuple, k_cache, v_cache, k, v, seqlens, cache_batch_idx,
                  block_table, template=LOOK_UP) -> runtime.AppendParams | None:
    """The append kernel's params (fa3gen_append_params) for k, v (in the cache's dtype) into
    the cache; None where a layout does not suit it: rows, pointers or strides not 16-byte
    aligned, a head dim not contiguous, a block table whose columns are not, a cache of no
    rows, k_cache and v_cache one tensor (the PyTorch path writes v last there; the kernel
    writes both at once). All but the pointers is kept per layout: template, the decode plan's
    (_DecodePlan.append_template; None: no kernel), or with LOOK_UP _append_templates'."""
    tensors = (k, v, k_cache, v_cache)
    if any(t.data_ptr() % 16 for t in tensors) or k_cache.data_ptr() == v_cache.data_ptr():
        return None
    if template is LOOK_UP:
        sig = ops._signature
        key = (geometry, sig(k), sig(v), sig(k_cache), sig(v_cache),
               None if block_table is None else (block_table.shape, block_table.stride()))
        template = _append_templates.get(key, LOOK_UP)
        if template is LOOK_UP:
            template = ops._remember(_append_templates, key,
                                     _append_template(geometry, tensors, block_table))
    if template is None:
        return None
    p = runtime.AppendParams.from_buffer_copy(template)
    p.k_new, p.v_new, p.k_cache, p.v_cache = (t.data_ptr() for t in tensors)
    if isinstance(seqlens, torch.Tensor):
        p.cache_seqlens = seqlens.data_ptr()  # int32, contiguous (_run)
    else:
        p.seqlen = seqlens
    if cache_batch_idx is not None:
        p.cache_batch_idx = cache_batch_idx.data_ptr()
    if block_table is not None:
        p.block_table = block_table.data_ptr()
    return p


_append_templates: dict = {}  # layouts -> AppendParams bytes but the pointers (None: no kernel)


def _append_template(geometry: tuple, tensors: tuple, block_table) -> bytes | None:
    """append_params' fields but the pointers, from the tensors' layout (k, v, k_cache,
    v_cache); None where it does not suit the kernel."""
    cache_rows, page_size, capacity = geometry
    k = tensors[0]
    size = tensors[2].element_size()
    if capacity == 0 or (k.shape[-1] * size) % 16 or \
            (block_table is not None and block_table.shape[1] > 1 and block_table.stride(1) != 1):
        return None
    if any(t.element_size() != size or t.stride(-1) != 1 or any(s * size % 16 for s in t.stride()[:3])
           for t in tensors):
        return None
    p = runtime.AppendParams()
    if block_table is not None:
        p.block_table_batch_stride = block_table.stride(0)
    for name, t in zip(("k_new", "v_new", "k", "v"), tensors):
        for dim, stride in zip(("batch", "row", "head"), t.stride()[:3]):
            setattr(p, f"{name}_{dim}_stride", stride)
    p.batch, p.seqlen_new, p.heads_kv, p.head_dim = k.shape
    p.element_bytes, p.capacity, p.page_size, p.cache_rows = size, capacity, page_size, cache_rows
    return bytes(p)


def _write_rows(geometry: tuple, k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table):
    """The append with PyTorch indexing. Rows past the capacity are not written: their
    positions clamp to the cache's last row, and every write there carries the same value (the
    sequence's last new row that fits, or the row's old value when none fits), so nothing
    outside the cache is touched and the duplicate writes cannot race."""
    cache_rows, page_size, capacity = geometry
    if capacity == 0:  # no row fits (a table of no pages, no rows a sequence; _plan refuses
        return          # a cache of no pages or sequences)
    b, n = k.shape[:2]
    device = k.device
    steps = torch.arange(n, device=device)
    start = _start_rows(seqlens, b, device)
    pos = (start + steps).clamp(max=capacity - 1)
    last_fit = capacity - 1 - start                      # (b, 1): the last new row that fits
    src = steps.clamp(max=last_fit.clamp(min=0))        # the new row each position receives
    any_fit = (last_fit >= 0)[..., None, None]
    if block_table is not None:
        pages = block_table.long().gather(1, pos // page_size).clamp(0, cache_rows - 1)
        where = (pages, pos % page_size)
    else:
        rows = (cache_batch_idx.long() if cache_batch_idx is not None
                else torch.arange(b, device=device)).clamp(0, cache_rows - 1)
        where = (rows[:, None].expand(b, n), pos)
    for cache, new in ((k_cache, k), (v_cache, v)):
        if cache.dtype == FP8:  # as bytes: PyTorch's indexing and where take no float8
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        fitted = new.gather(1, src[:, :, None, None].expand_as(new))
        cache[where] = torch.where(any_fit, fitted, cache[where])


def _no_attention(q, return_lse):
    """The (empty) outputs of a call with no query row or head."""
    out, lse = ops._empty_outputs(q)
    return (out, lse) if return_lse else out


def _run(plan: _DecodePlan, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
         block_table, return_lse, k_scale=None, v_scale=None, lib=None, rotary=None):
    """One call of a planned signature: the pointers, the outputs, the launch (on `lib`, the
    library the plan was keyed by; None: look it up)."""
    b, sq, hq, d = plan.out_shape
    no_query = 0 in (b, sq, hq)  # nothing to attend; new keys are still appended
    if no_query and not (b and plan.append):
        return _no_attention(q, return_lse)
    length = cache_seqlens if isinstance(cache_seqlens, int) else None  # one for every sequence
    seqlens = cache_seqlens.contiguous() if isinstance(cache_seqlens, torch.Tensor) else None
    batch_idx = cache_batch_idx.contiguous() if cache_batch_idx is not None else None
    # Alignment, checked before the append changes the cache (the plan checked the strides).
    pointers = None
    if not no_query and plan.prefill:  # the forward takes the pointers; q by _data_ptr (0 for
        ops._aligned_pointers(("k_cache", "v_cache"), k_cache, v_cache)  # torch.func's wrapper)
        if ops._data_ptr(q) % ops._TMA_ALIGN_BYTES:
            ops.check_layout(q=q)
    elif not no_query:
        pointers = ops._aligned_pointers(("q", "k_cache", "v_cache"), q, k_cache, v_cache)
    p = runtime.DecodeParams.from_buffer_copy(plan.params)
    if length is not None:  # this call's length: seqlen_k and the split count follow it
        p.seqlen_k = _int_length(length, plan.geometry[2], plan.append)
        p.num_splits = _split_count(p.seqlen_k, *plan.split_args)
    if ops.debug_checks_enabled():
        lengths = seqlens if seqlens is not None else torch.full(
            (b,), p.seqlen_k - plan.append, dtype=torch.int32, device=q.device)
        _debug_checks(lengths, batch_idx, block_table, *plan.geometry, appended=plan.append)
        _debug_check_scales(k_scale, v_scale, p.softmax_scale)
    if plan.prefill and not no_query:  # a missing forward: an error before the cache changes
        _require_prefill_forward(q, k_cache, plan.geometry[2], plan.kv_fp8, plan.prefill[0],
                                 seqlens, batch_idx, block_table,
                                 p.seqlen_k if seqlens is None else None)
    if plan.append:
        _append(plan.geometry, k_cache, v_cache, k, v, length if length is not None else seqlens,
                batch_idx, block_table, plan.kv_fp8, k_scale, v_scale,
                _append_library(lib, k), rotary, plan.append_template)
        if seqlens is not None:
            seqlens = seqlens + plan.append  # what attention covers; the caller's stays as it was
    if no_query:  # the append was the whole call
        return _no_attention(q, return_lse)
    if plan.prefill:
        return _prefill(plan, q, k_cache, v_cache, seqlens if seqlens is not None else p.seqlen_k,
                        batch_idx, block_table, return_lse, (k_scale, v_scale))
    out, lse = ops._empty_outputs(q)
    p.q, p.k_cache, p.v_cache = pointers
    p.out, p.lse = out.data_ptr(), lse.data_ptr()
    p.cache_seqlens = seqlens.data_ptr() if seqlens is not None else None
    p.cache_batch_idx = batch_idx.data_ptr() if batch_idx is not None else None
    p.block_table = block_table.data_ptr() if block_table is not None else None
    if plan.kv_fp8:
        p.k_scale, p.v_scale = (s.data_ptr() if isinstance(s, torch.Tensor) else None
                                for s in (k_scale, v_scale))
    if p.num_splits > 1:  # freed when this returns: the allocator orders its reuse on the stream
        rows = b * hq * sq * p.num_splits
        accum = torch.empty(rows * (d + 1), dtype=torch.float32, device=q.device)  # O, then LSE
        p.o_accum = accum.data_ptr()
        p.lse_accum = p.o_accum + rows * d * 4
    _launch_decode(q.device, p, lib)
    return (out, lse) if return_lse else out


def _factor(factor, sequences=slice(None)):
    """An e4m3 cache's factor (None: 1, a float, or (heads_kv,) / (batch, heads_kv) fp32) as a
    multiplier of rows (.., rows, heads_kv, d) of the given sequences (a slice of the batch, or
    an int for one)."""
    if not isinstance(factor, torch.Tensor):
        return 1.0 if factor is None else float(factor)
    f = factor[sequences] if factor.dim() == 2 else factor
    return f[..., None, :, None] if f.dim() == 2 else f[:, None]


def _quantize_new(x, factor):
    """New keys or values (batch, seqlen_new, heads_kv, d) for an e4m3 cache: x / factor,
    saturated to the e4m3 range; e4m3 input is written as it is."""
    if x.dtype == FP8:
        return x
    return (x.float() / _factor(factor)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _dequantize(x, factor, sequences, dtype):
    """Cached e4m3 rows x (.., rows, heads_kv, d) of the given sequences as `dtype`, multiplied
    by their factors."""
    return (x.float() * _factor(factor, sequences)).to(dtype)


def _prefill(plan: _DecodePlan, q, k_cache, v_cache, lengths, batch_idx, block_table, return_lse,
             scales=(None, None)):
    """More query rows per kv head than the decode kernels take (chunked prefill): the forward
    kernels over the cached keys. One sequence length for all (an int cache_seqlens) on a
    contiguous cache: flash_attn_func on a view of the cache, no copy. A tensor cache_seqlens
    on a contiguous cache without cache_batch_idx: flash_attn_varlen_func over the cache rows
    with seqused_k, no copy and no sync. A paged cache, or a contiguous one with
    cache_batch_idx (one page a sequence): the paged varlen forward through the block table
    (varlen.paged_forward), no copy and no sync, where the library has the variant and the
    pages suit it (varlen.paged_fits). Otherwise each sequence's keys are gathered into a
    packed copy for flash_attn_varlen_func, which needs the lengths on the host (a sync)."""
    from fa3gen import varlen

    mask, scale = plan.prefill
    if plan.kv_fp8:  # the forward kernels take one dtype: the keys read become q's
        def kv(cache_k, cache_v, sequences):
            return (_dequantize(cache_k, scales[0], sequences, q.dtype),
                    _dequantize(cache_v, scales[1], sequences, q.dtype))
    else:
        def kv(cache_k, cache_v, sequences):
            return cache_k, cache_v
    kwargs = dict(causal=mask.causal, window_size=(mask.window_left, mask.window_right),
                  softcap=mask.softcap)
    b, sq, hq, d = q.shape
    capacity = plan.geometry[2]
    # lengths: a tensor, or one int for every sequence (the capacity, or the int given)
    seqlens, length = (lengths, None) if isinstance(lengths, torch.Tensor) else (None, lengths)
    rows_k = k_cache[:b]
    table, route = _prefill_route(q, k_cache, capacity, plan.kv_fp8, seqlens, batch_idx,
                                  block_table)
    if route == "rows":
        # Lengths on the device, a contiguous cache: the varlen forward over the cache rows
        # themselves, sequence i at rows [i * capacity, ..) using its first length keys
        # (seqused_k). No copy, no device sync.
        cu_q, cu_k = varlen.packed_offsets(b, sq, capacity, q.device)
        kb, vb = kv(rows_k, v_cache[:b], slice(0, b))
        out, lse = varlen.flash_attn_varlen_func(
            q.reshape(b * sq, hq, d), kb.flatten(0, 1), vb.flatten(0, 1), cu_q, cu_k, sq,
            max(1, capacity), softmax_scale=scale, return_lse=True,
            seqused_k=seqlens.clamp(0, capacity), **kwargs)
        out = out.view(b, sq, hq, d)
        lse = lse.view(hq, b, sq).permute(1, 0, 2)
        return (out, lse) if return_lse else out
    if table is not None:  # the paged varlen forward, where the library has it
        lib = runtime.get_library()
        info = varlen.paged_variant(q, mask, lib)
        if info is not None:
            used = (seqlens if seqlens is not None  # the kernels clamp it to the capacity
                    else torch.full((b,), length, dtype=torch.int32, device=q.device))
            out, lse = varlen.paged_forward(q, k_cache, v_cache, table, used, mask, scale, info,
                                            lib)
            return (out, lse) if return_lse else out
    if route == "dense":
        if length is None:
            length = min(max(int(seqlens[0]), 0), capacity)  # a sync: the view's size
        if batch_idx is not None:
            rows = batch_idx.clamp(0, plan.geometry[0] - 1).tolist()  # a sync; consecutive: a view
            pick = (slice(rows[0], rows[0] + b) if rows == list(range(rows[0], rows[0] + b))
                    else torch.tensor(rows, device=k_cache.device))
        else:
            pick = slice(0, b)
        kb, vb = kv(k_cache[pick, :length], v_cache[pick, :length], slice(0, b))
        out, lse = ops.flash_attn_func(q, kb, vb, scale, return_lse=True, **kwargs)
        return (out, lse) if return_lse else out
    lengths = ([min(max(n, 0), capacity) for n in seqlens.tolist()] if seqlens is not None
               else [length] * b)
    ks, vs = [], []
    cache_rows = plan.geometry[0]
    for i, n in enumerate(lengths):
        # indices clamped as the decode kernels clamp them: bad ones give wrong numbers, never
        # an out-of-range read (FA3GEN_DEBUG_CHECKS=1 reports them)
        if block_table is not None:
            pages = block_table[i, :-(-n // k_cache.shape[1])].long().clamp(0, cache_rows - 1)
            ki, vi = k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n]
        else:
            row = (batch_idx[i].clamp(0, cache_rows - 1) if batch_idx is not None else i)
            ki, vi = k_cache[row, :n], v_cache[row, :n]
        ki, vi = kv(ki, vi, i)
        ks.append(ki)
        vs.append(vi)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu_k = torch.tensor(starts, dtype=torch.int32, device=q.device)
    cu_q = torch.arange(0, b * sq + 1, sq, dtype=torch.int32, device=q.device)
    out, lse = varlen.flash_attn_varlen_func(
        q.reshape(b * sq, hq, d), torch.cat(ks), torch.cat(vs), cu_q, cu_k, sq,
        max(1, max(lengths)), softmax_scale=scale, return_lse=True, **kwargs)
    out = out.view(b, sq, hq, d)
    lse = lse.view(hq, b, sq).permute(1, 0, 2)
    return (out, lse) if return_lse else out


def _prefill_route(q, k_cache, capacity: int, kv_fp8: bool, seqlens, batch_idx, block_table):
    """(table, route): how _prefill serves a chunked prefill, from shapes and flags alone (the
    check before the append takes the same path). route "rows": the varlen forward over the
    cache rows themselves (lengths on the device, a contiguous cache: no copy, no sync);
    "dense": flash_attn_func on a view of the cache (one length); "gather": the varlen forward
    over packed copies of each sequence's keys. table: where the paged varlen forward may take
    the call first (a paged cache, or a contiguous one with cache_batch_idx: one page a
    sequence, its cache row), else None. The paths that read the cache in place have no
    backward: a q that wants one gathers."""
    b = q.shape[0]
    differentiable = torch.is_grad_enabled() and q.requires_grad
    rows_k = k_cache[:b]
    if (block_table is None and seqlens is not None and batch_idx is None and not differentiable
            and rows_k.stride(0) == capacity * rows_k.stride(1)):
        return None, "rows"
    table = block_table if block_table is not None else (
        batch_idx.view(b, 1) if batch_idx is not None else None)
    if table is not None and (kv_fp8 or differentiable or not _varlen().paged_fits(q, k_cache,
                                                                                     table)):
        table = None
    dense = block_table is None and (seqlens is None or b == 1)
    return table, "dense" if dense else "gather"


def _require_prefill_forward(q, k_cache, capacity: int, kv_fp8: bool, mask: ops.Masking,
                             seqlens, batch_idx, block_table, length: int | None = None) -> None:
    """VariantNotBuiltError before the append writes anything, where the library lacks the
    forward a chunked prefill would run (a library built for decoding alone, say). length:
    the keys of one int cache_seqlens after the append, when the call knows it (eager)."""
    table, route = _prefill_route(q, k_cache, capacity, kv_fp8, seqlens, batch_idx, block_table)
    # The forward's seqlen_k where known now (its variant may be a seqlen_k range's choice):
    # the dense view's length, the cache rows' capacity; the gathered copies' longest is not.
    seqlen_k = length if route == "dense" else max(1, capacity) if route == "rows" else None
    if torch.compiler.is_compiling():  # sizes may be symbolic: a constant function takes none
        seqlen_k = None
    _require_forward("fp16" if q.dtype == torch.float16 else "bf16",
                     ops.static_head_dim(q.shape[-1]), *ops._key_flags(mask), table is not None,
                     route == "dense", seqlen_k)


_served_prefills: set = set()  # (library, key, paged, dense) whose every length is served


@ops._assume_constant_result  # as _require_decode_kernels: the lookup runs while tracing
def _require_forward(dtype: str, head_dim: int, causal: bool, local: bool, softcap: bool,
                     paged: bool, dense: bool, seqlen_k: int | None) -> bool:
    lib = runtime.get_library()
    key = (lib, dtype, head_dim, causal, local, softcap, paged, dense)
    if key in _served_prefills:  # a lookup without a length scans the variant table: once
        return True
    flags = dict(local=local, softcap=softcap)
    found = None
    if paged:
        try:
            found = lib.find("fwd", dtype, head_dim, causal, varlen=True, paged=True, **flags)
        except VariantNotBuiltError:
            pass
    if found is None:
        try:  # as the forward picks it: the seqlen_k range holding the length, else the default
            found = lib.find("fwd", dtype, head_dim, causal, varlen=not dense, seqlen_k=seqlen_k,
                             **flags)
        except VariantNotBuiltError:  # no default: ranges alone (a filtered build) may hold a
            ranged = contract.make_key("fwd", dtype, head_dim, causal, local, softcap,
                                       not dense, False)  # length not known before the gather
            if seqlen_k is None and lib.seqlen_dispatch.get(ranged):
                return True
            raise
    if found.is_default:  # every length is served; a range's choice depends on the length
        if len(_served_prefills) >= 256:
            _served_prefills.clear()
        _served_prefills.add(key)
    return True


def _varlen():
    from fa3gen import varlen  # imported by the first prefill, as _prefill does
    return varlen


def _built_decode_pairs() -> frozenset:
    """The (dtype, head_dim) pairs of the loaded library's decode kernels."""
    return runtime.get_library().decode_kernels


@ops._assume_constant_result  # torch.compile runs it once, while tracing (as ops._variant_name)
def _require_decode_kernels(dtype: str, head_dim: int) -> bool:
    """True where the library has decode kernels for the pair, else VariantNotBuiltError: raised
    in here, since dynamo can trace neither the lookup (files, ctypes) nor the error's
    construction. A bool, not the set: dynamo (torch 2.11, 2.13) cannot guard `in` on a set
    that came from such a function (NotImplementedError in ConstantSource.make_guard)."""
    built = _built_decode_pairs()
    if (dtype, head_dim) not in built:
        have = ", ".join(f"[{dt}, {hd}]" for dt, hd in sorted(built)) or "none"
        raise VariantNotBuiltError(
            f"decode over a KV cache, {dtype} head_dim {head_dim}", [f"decode kernels: {have}"],
            f"add dtype {dtype} and head_dim {head_dim} to the spec's `decode:` axes (or "
            f"[{dtype}, {head_dim}] to its list of pairs) and build it again: {_rebuild_command()}",
            lead="")
    return True


def _rebuild_command() -> str:
    try:
        return runtime.get_library().rebuild_hint[1]
    except Exception:  # noqa: BLE001 - only a hint
        return build_command(None)


def _launch_decode(device, params, lib=None) -> None:
    """lib's decode kernels (None: the loaded library's) on the current stream (the CPU tests
    replace this)."""
    lib = lib or runtime.get_library()
    ops.on_current_stream(device, lambda stream: lib.decode(params, stream))


def _normal_fp32(x):
    """Whether x (a float, or a tensor's entries) lies within fp32's positive normal range."""
    return (FP32_TINY <= x) & (x <= FP32_MAX)


def _check_score_scale(k_scale, softmax_scale: float) -> None:
    """The decode kernel scales scores by softmax_scale x k_scale (x a power of two >= 1) in
    fp32, flushed to zero below the normal range: every score 0 then, and the rows' output 0
    with lse -inf (found by an emulation of decode.cuh); past FP32_MAX, inf and NaN. A float k_scale is checked here; a
    tensor's entries under FA3GEN_DEBUG_CHECKS (_debug_check_scales)."""
    if k_scale is not None and not isinstance(k_scale, torch.Tensor) and \
            not _normal_fp32(float(k_scale) * softmax_scale):
        raise InvalidInputError(f"k_scale {ops.shown(k_scale)} x softmax_scale {softmax_scale:g} "
                                "is outside fp32's normal range (the scores' scale would be 0 or "
                                "inf): store the cache with a k_scale nearer 1")


def _debug_check_scales(k_scale, v_scale, softmax_scale: float) -> None:
    """FA3GEN_DEBUG_CHECKS=1: factor tensors of an e4m3 cache positive and finite (as a float
    factor must be; appended rows are divided by them), and k_scale's entries times
    softmax_scale within fp32's normal range (_check_score_scale)."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, torch.Tensor):
            ops.check_entries(name, s, ~(torch.isfinite(s) & (s > 0)),
                              "factors must be positive and finite")
    if isinstance(k_scale, torch.Tensor):
        ops.check_entries("k_scale", k_scale, ~_normal_fp32(k_scale.double() * softmax_scale),
                          f"factors times softmax_scale {softmax_scale:g} must be within fp32's "
                          "normal range")


def _debug_checks(cache_seqlens, cache_batch_idx, block_table, pages_or_b, rows_per, capacity,
                  appended=0):
    """FA3GEN_DEBUG_CHECKS=1: what needs the data on the host."""
    if cache_seqlens is not None:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > capacity - appended:
            raise InvalidInputError(
                f"cache_seqlens in [{lo}, {hi}], outside [0, {capacity - appended}]"
                + (f" (the cache holds {capacity} rows, {appended} are appended)" if appended else ""))
    if cache_batch_idx is not None:
        lo, hi = int(cache_batch_idx.min()), int(cache_batch_idx.max())
        if lo < 0 or hi >= pages_or_b:
            raise InvalidInputError(f"cache_batch_idx in [{lo}, {hi}], outside the cache's "
                                    f"{pages_or_b} rows")
    if block_table is not None and cache_seqlens is not None:  # the pages the attention reads
        used = [(-(-int(n) // rows_per)) for n in (cache_seqlens + appended).tolist()]
        for i, n in enumerate(used):
            pages = block_table[i, :n]
            if n and (int(pages.min()) < 0 or int(pages.max()) >= pages_or_b):
                raise InvalidInputError(f"block_table row {i} points outside the cache's "
                                        f"{pages_or_b} pages")
    if appended and cache_seqlens is not None and (cache_batch_idx is not None or
                                                   block_table is not None):
        _debug_check_disjoint_appends(cache_seqlens, appended, cache_batch_idx, block_table,
                                      rows_per)


def _debug_check_disjoint_appends(starts, appended, cache_batch_idx, block_table, rows_per) -> None:
    """FA3GEN_DEBUG_CHECKS=1 with k, v appended: no cache position (a row of a cache row or
    page) receives two new rows, as where cache_batch_idx maps two sequences to one cache row,
    or block_table lists a page twice, at positions both write: those writes would race, the
    last one winning. Sharing positions that are only read is fine."""
    steps = torch.arange(appended, device=starts.device)
    pos = starts.long()[:, None] + steps                        # (batch, appended) positions
    if block_table is not None:
        slot = block_table.long().gather(1, pos // rows_per) * rows_per + pos % rows_per
    else:
        slot = cache_batch_idx.long()[:, None] * rows_per + pos
    ordered, order = slot.flatten().sort(stable=True)  # equal slots: the earlier row first
    same = (ordered[1:] == ordered[:-1]).nonzero()
    if same.numel():
        first = int(same[0, 0])
        (i, a), (j, b) = (divmod(int(order[first + e]), appended) for e in (0, 1))
        where, by = ("page", "block_table") if block_table is not None else \
            ("cache row", "cache_batch_idx")
        raise InvalidInputError(
            f"sequence {i}'s new row {a} and sequence {j}'s new row {b} would both be written to "
            f"{where} {int(ordered[first]) // rows_per}, position {int(ordered[first]) % rows_per} "
            f"({by} maps them there); the appends would overwrite each other")
