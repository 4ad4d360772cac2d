"""flash_attn_varlen_func: attention over variable-length sequences packed along the rows.

q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim); sequence b is rows
[cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k/v.
Served by the spec's varlen variants (the `varlen` key axis); the same layers as fa3gen.ops:
checks once per call signature (_Plan), an eager autograd.Function, and the custom ops
fa3gen::varlen_fwd / fa3gen::varlen_bwd for graph capture.

Checks that need the data of cu_seqlens on the host (a device sync) run only under
FA3GEN_DEBUG_CHECKS=1: cu_seqlens start at 0, never decrease and end at most at the total rows;
max_seqlen is at least the longest sequence; seqused_k[b] lies within sequence b's keys.
"""

import numbers

import torch
import torch.autograd.forward_ad as _forward_ad

from fa3gen import ops, runtime
from fa3gen import tracing as _trace
from fa3gen.contract import INT32_MAX, PAGED_CHUNK_ROWS, VARLEN_LIMITS, varlen_tiles
from fa3gen.errors import Fa3genError, InvalidInputError, VariantNotBuiltError
from fa3gen.ops import Dims, Masking, _Plan, _DTYPES, debug_checks_enabled


# ---------------------------------------------------------------------------------------------
# Validation (no device sync).

_INT32_VECTOR = "a 1-D int32 tensor"  # what cu_seqlens and seqused_k must be (nested: refused)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Dims:
    """Types, dtypes, shapes and devices; returns the sizes (batch = sequences, seqlen_q/k =
    the max_seqlen arguments)."""
    ops._check_tensors(q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidInputError(
            f"q, k, v must have one dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}")
    if q.dtype not in _DTYPES or _DTYPES[q.dtype] == "e4m3":  # no e4m3 varlen kernel exists
        raise InvalidInputError(f"unsupported dtype {q.dtype}; flash_attn_varlen_func takes "
                                "torch.bfloat16 and torch.float16 (no fp8 varlen kernels yet)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise InvalidInputError(f"{name} must have 3 dims (total_tokens, heads, head_dim) for "
                                    f"flash_attn_varlen_func, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise InvalidInputError(
            f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    total_q, hq, d = q.shape
    total_k, hkv, dk = k.shape
    if dk != d:
        raise InvalidInputError(f"head_dim differs: q has {d}, k/v have {dk}")
    if hkv < 1 or hq % hkv:
        raise InvalidInputError(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv}) "
                                "(equal: MHA, multiple: GQA, heads_kv=1: MQA)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        ops.refuse_layout(name, cu, _INT32_VECTOR)
        if cu.dtype != torch.int32:
            raise InvalidInputError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise InvalidInputError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                                    f"{tuple(cu.shape)}")
        if not cu.is_contiguous():  # the kernels read cu[b] at b * 4 bytes
            raise InvalidInputError(f"{name} must be contiguous (stride {cu.stride(0)}); pass "
                                    f"{name}.contiguous()")
        if cu.device != q.device:
            raise InvalidInputError(f"{name} is on {cu.device}, q on {q.device}: both must be on "
                                    "one device")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InvalidInputError(
            f"cu_seqlens_q and cu_seqlens_k must have batch + 1 entries each, got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    max_seqlen_q, max_seqlen_k = _check_max_seqlen(max_seqlen_q, max_seqlen_k)
    batch, limits = cu_seqlens_q.shape[0] - 1, VARLEN_LIMITS
    if batch > limits["batch"] or hq > limits["heads"]:
        raise InvalidInputError(f"varlen: at most {limits['batch']} sequences and "
                                f"{limits['heads']} query heads per call, got {batch} and {hq}")
    if total_q >= 2**31 or total_k >= 2**31:  # not max(): it would guard on their order (compile)
        raise InvalidInputError("total_q and total_k must be below 2^31 rows")
    return Dims(cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, hq, hkv, d, _DTYPES[q.dtype])


def _violated(bad, holds) -> bool:
    """While compiling (dynamo shows a SymInt as an int): whether a check's condition is known
    not to hold, `bad` (the caller raises; `holds` its negation, written out: dynamo traces no
    negation of a symbolic bool). One known only when the graph runs (a max_seqlen read from a
    tensor there) is asserted then, by torch._check (torch's assertion: torch 2.11's dynamo
    cannot trace torch._check_with's message function)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true
    if guard_or_false(bad):
        return True
    if not statically_known_true(holds):
        torch._check(holds)
    return False


def _check_max_seqlen(max_seqlen_q, max_seqlen_k) -> tuple:
    """(max_seqlen_q, max_seqlen_k) as Python ints (a numpy integer too, as flash-attn takes
    it; a torch.SymInt stays one: a max_seqlen that torch.compile made dynamic, or one read
    from a tensor inside the graph, `(cu[1:] - cu[:-1]).max().item()` with
    capture_scalar_outputs, whose checks run with the graph: _violated)."""
    compiling = torch.compiler.is_compiling()
    ints = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (numbers.Integral, torch.SymInt)) or (
                _violated(m <= 0, m >= 1) or _violated(m > INT32_MAX, m <= INT32_MAX)
                if compiling else m <= 0 or m > INT32_MAX):
            raise InvalidInputError(f"{name} must be an int in [1, 2**31) (the longest "
                                    f"sequence), got {ops.shown(m)}")
        ints.append(m if isinstance(m, (int, torch.SymInt)) else int(m))
    total = ints[0] + ints[1]  # the kernels' mask arithmetic (masking_args)
    if _violated(total > INT32_MAX // 2, total <= INT32_MAX // 2) if compiling else \
            total > INT32_MAX // 2:
        raise InvalidInputError(f"max_seqlen_q + max_seqlen_k must be at most 2**30 - 1, got "
                                f"{ints[0]} + {ints[1]}; they bound the longest "
                                "sequences, not the totals")
    return tuple(ints)


def check_cu_seqlens_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          seqused_k=None) -> None:
    """The checks that read cu_seqlens (and seqused_k) on the host (FA3GEN_DEBUG_CHECKS=1; a
    device sync). seqused_k[b] lies within [0, the keys of sequence b]; outside it the kernels
    clamp: wrong numbers, never an access outside k and v."""
    for name, cu, total, max_seqlen, side in (
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "q"),
            ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "k")):
        c = cu.cpu().tolist()
        if c[0] != 0:
            raise InvalidInputError(f"{name}[0] must be 0, got {c[0]}")
        lengths = [b - a for a, b in zip(c, c[1:])]
        if min(lengths) < 0:
            i = lengths.index(min(lengths))
            raise InvalidInputError(f"{name} must not decrease: entry {i + 1} is {c[i + 1]} after "
                                    f"{c[i]}")
        if c[-1] > total:  # fewer is legal: rows past the last sequence are padding (FA3's too)
            raise InvalidInputError(f"{name}[-1] is {c[-1]} but {side} has {total} rows")
        if max(lengths) > max_seqlen:
            raise InvalidInputError(f"max_seqlen_{side} is {max_seqlen} but sequence "
                                    f"{lengths.index(max(lengths))} has {max(lengths)} rows")
    if seqused_k is not None:  # `lengths` are the keys' now
        for b, used in enumerate(seqused_k.cpu().tolist()):
            if not 0 <= used <= lengths[b]:
                raise InvalidInputError(f"seqused_k[{b}] is {used} but sequence {b} has "
                                        f"{lengths[b]} keys (cu_seqlens_k)")


def _views(*tensors):
    """(1, total, heads, d) views: ops._make_params and ops._strides take 4-D tensors."""
    return [t.unsqueeze(0) for t in tensors]


def _empty_outputs(q: torch.Tensor):
    total, hq, d = q.shape
    return q.new_empty((total, hq, d)), q.new_empty((hq, total), dtype=torch.float32)


def _set_varlen(p, cu_seqlens_q, cu_seqlens_k, tile_list: int, total_q: int, total_k: int) -> None:
    """tile_list: the key-tile list's device address."""
    p.cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    p.tile_list = tile_list
    p.total_q, p.total_k = total_q, total_k


# ---------------------------------------------------------------------------------------------
# Forward.


def _fwd_tile_list(q: torch.Tensor, dims: Dims, tile_m: int) -> torch.Tensor:
    """The forward's query-tile list (written by the kernel): two ints per (tile, head) of the
    ABI's bound (FA3GEN_VARLEN_TILES)."""
    return q.new_empty(2 * varlen_tiles(q.shape[0], dims.batch, tile_m) * dims.heads_q,
                       dtype=torch.int32)


def _fwd_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
              mask: Masking, softmax_scale, variant: str | None, lib) -> _Plan:
    """Every check of a varlen forward call; `variant` None: the spec's default."""
    ops.check_device(q, k, v)
    dims = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # The spec's seqlen_k ranges of a varlen key are on max_seqlen_k (the longest sequence:
    # a packed batch has no one length, and the caller's bound costs no sync).
    info = lib.find("fwd", dims.dtype, dims.head_dim, variant=variant, varlen=True,
                    seqlen_k=max_seqlen_k, **mask.key())
    _check_tiles_per_seq("max_seqlen_q", max_seqlen_q, info.tile_m, info.name)
    q4, k4, v4, o4 = _views(q, k, v, out)
    ops.check_layout(q=q, k=k, v=v)
    scale = ops._softmax_scale(softmax_scale, dims.head_dim)
    params = None
    if q.shape[0] and dims.heads_q:
        params = ops._make_params(q4, k4, v4, o4, lse, dims, scale, ops._num_sms(q.device.index),
                                  ops._grid_mode(), mask)
    return _Plan(lib, info, dims, mask, scale, q.device, params)


def _check_tiles_per_seq(name: str, max_seqlen: int, tile: int, variant: str) -> None:
    """The tile list's bound (the launcher's check_varlen), known once the variant's tile is:
    the forward lists query tiles of max_seqlen_q, the backward key tiles of max_seqlen_k."""
    limit = VARLEN_LIMITS["tiles_per_seq"]
    if -(-max_seqlen // tile) > limit:
        raise InvalidInputError(f"{name}={max_seqlen} makes more than {limit} tiles of {tile} "
                                f"rows a sequence for {variant} (at most {limit * tile}); "
                                f"split longer sequences")


def _check_longest(name: str, cu_seqlens, rows: int, tile: int, variant: str) -> None:
    """The tile list's bound on the longest sequence itself, where `rows` alone could hold a
    sequence past it: max_seqlen is the caller's word (a bound read without a sync), and an
    understated one let the kernel that lists the tiles pack a block index past its 16 bits
    into the head field (a tile done twice, one never, writes past lse). Reading the lengths
    syncs, on problems of millions of rows only; skipped under CUDA graph capture."""
    if rows <= VARLEN_LIMITS["tiles_per_seq"] * tile or cu_seqlens.numel() < 2 or \
            (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    longest, limit = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), VARLEN_LIMITS["tiles_per_seq"]
    if -(-longest // tile) > limit:
        raise InvalidInputError(f"a sequence of {longest} rows makes more than {limit} tiles of "
                                f"{tile} rows for {variant} (at most {limit * tile}; {name} "
                                f"understates it); split longer sequences")


def _fwd_run(plan: _Plan, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, seqused_k=None,
             block_table=None) -> None:
    """Launch plan on tensors of its signature. block_table: a paged plan's (paged_forward; k
    and v are the pages, and sequence b's keys are the dims' seqlen_k rows from b times it)."""
    if plan.params is None:
        return
    if k.shape[0] == 0:  # no key in any sequence: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return
    _check_longest("max_seqlen_q", cu_seqlens_q, q.shape[0], plan.info.tile_m, plan.info.name)
    p = ops._fwd_call_params(plan, q, k, v, out, lse)
    d = plan.dims
    tiles = _fwd_tile_list(q, d, plan.info.tile_m)
    total_k = k.shape[0] if block_table is None else d.batch * d.seqlen_k
    _set_varlen(p, cu_seqlens_q, cu_seqlens_k, tiles.data_ptr(), q.shape[0], total_k)
    p.seqused_k = seqused_k.data_ptr() if seqused_k is not None else None
    if block_table is not None:
        p.block_table = block_table.data_ptr()
    ops._launch(plan.lib, plan.info, plan.device, lambda: p)


def _check_seqused_k(seqused_k, cu_seqlens_k) -> None:
    """FA3's seqused_k: int32 (batch,) on cu_seqlens_k's device. A cu_seqlens_k
    that is no tensor is left to check_varlen_inputs, which names it."""
    if isinstance(seqused_k, torch.Tensor):
        ops.refuse_layout("seqused_k", seqused_k, _INT32_VECTOR)
    other = cu_seqlens_k if isinstance(cu_seqlens_k, torch.Tensor) and not cu_seqlens_k.is_nested \
        and cu_seqlens_k.dim() == 1 else None
    if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32 or \
            seqused_k.dim() != 1 or (other is not None and (
                seqused_k.device != other.device or seqused_k.shape[0] != other.shape[0] - 1)):
        got = (f"{seqused_k.dtype} {tuple(seqused_k.shape)} on {seqused_k.device}"
               if isinstance(seqused_k, torch.Tensor) else type(seqused_k).__name__)
        raise InvalidInputError(f"seqused_k must be int32 of shape (batch,) = "
                                f"(len(cu_seqlens_k) - 1,) on cu_seqlens_k's device, got {got}")
    if not seqused_k.is_contiguous():
        raise InvalidInputError("seqused_k must be contiguous")


def _check_op_arguments(scale, seqused_k, cu_seqlens_k) -> None:
    """What the public function checks before an op body runs, for a direct op call (no sync)."""
    ops.check_softmax_scale(scale)
    if seqused_k is not None:
        _check_seqused_k(seqused_k, cu_seqlens_k)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale,
             variant, seqused_k=None):
    """The checked path (custom op body): (out (total_q, hq, d), lse (hq, total_q)); variant
    "": the default for max_seqlen_k. Records the call for fa3gen.trace. FA3GEN_DEBUG_CHECKS
    reads cu_seqlens here, with the graph's (or a vmapped entry's) real tensors."""
    _check_op_arguments(scale, seqused_k, cu_seqlens_k)
    if debug_checks_enabled():
        check_cu_seqlens_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              seqused_k)
    plan = _eager_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask,
                       scale, variant or None)  # once per call signature, as eager calls
    _trace_call(plan.info.name, not variant, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    return _eager_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)


def _eager_forward(plan: _Plan, q, k, v, cu_q, cu_k, seqused_k=None):
    """(out, lse), new, of a planned call (ops._eager_forward's varlen twin)."""
    out, lse = _empty_outputs(q)
    _fwd_run(plan, q, k, v, cu_q, cu_k, out, lse, seqused_k)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Forward over a paged KV cache (flash_attn_with_kvcache's chunked prefill).


_offsets: dict = {}  # (device, batch, seqlen_q, capacity) -> packed_offsets' result
_paged_plans: dict = {}  # paged_forward's call signature -> its _Plan
_paged_variants: dict = {}  # (library, dtype, head_dim, mask) -> paged_variant's answer


def packed_offsets(batch: int, seqlen_q: int, capacity: int, device):
    """(cu_seqlens_q, cu_seqlens_k) of `batch` sequences of seqlen_q query rows each, sequence
    b's keys from row b * capacity (a cache's rows): made once per shape and kept, so later
    calls launch no kernel for them (the kernels only read them). Not under CUDA graph
    capture: a graph holds the addresses it read, and the cache may drop (free) its tensors
    when full, so a capture makes its own, from the graph's pool."""
    key = (device, batch, seqlen_q, capacity)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    found = None if capturing else _offsets.get(key)
    if found is None:
        i32 = dict(dtype=torch.int32, device=device)
        found = (torch.arange(0, batch * seqlen_q + 1, seqlen_q, **i32),
                 torch.arange(0, (batch + 1) * capacity, capacity, **i32))
        if not capturing:
            ops._remember(_offsets, key, found)
    return found


def paged_variant(q, mask: Masking, lib=None):
    """The paged forward of the library (default: runtime.get_library()) for q's dtype, head
    dim and mask, else None (a library built without one, or before the axis existed)."""
    lib = lib or runtime.get_library()
    key = (lib, q.dtype, q.shape[-1], mask)
    if key not in _paged_variants:  # once: a miss costs a scan of the table and an error
        try:
            found = lib.find("fwd", _DTYPES[q.dtype], q.shape[-1], varlen=True, paged=True,
                             **mask.key())
        except VariantNotBuiltError:
            found = None
        ops._remember(_paged_variants, key, found)
    return _paged_variants[key]


def paged_fits(q, k_cache, block_table) -> bool:
    """Whether paged_forward takes this call: pages of whole TMA chunks, a table of at least one
    column, and sizes the varlen tile list and the int32 row offsets hold."""
    b, sq, hq, _ = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1]
    return (k_cache.shape[1] % PAGED_CHUNK_ROWS == 0 and block_table.shape[1] >= 1
            and b <= VARLEN_LIMITS["batch"] and hq <= VARLEN_LIMITS["heads"]
            and -(-sq // 64) <= VARLEN_LIMITS["tiles_per_seq"]  # 64: the smallest tile_m
            and b * max(capacity, sq) < 2**31)


def paged_forward(q, k_cache, v_cache, block_table, seqused_k, mask: Masking, scale: float,
                  info, lib, outputs=None):
    """Sequence b's seqlen_q rows of q (batch, seqlen_q, heads_q, d) over its first
    seqused_k[b] keys, key j in page block_table[b, j // page_size] of k_cache, v_cache (pages,
    page_size, heads_kv, d): the paged varlen variant `info` reads the pages where they lie (no
    gather, no sync). The caller (flash_attn_with_kvcache) checked the rest and routes here
    only what fits (paged_fits): page_size a multiple of PAGED_CHUNK_ROWS, seqused_k int32
    (batch,); the kernels clamp it to [0, capacity]. Returns out like q and lse (batch, heads_q,
    seqlen_q), views of `outputs` when given (out (batch * seqlen_q, heads_q, d) and lse
    (heads_q, batch * seqlen_q), contiguous, as _empty_outputs makes them)."""
    b, sq, hq, d = q.shape
    pages, page_size, hkv, _ = k_cache.shape
    cols = block_table.shape[1]  # its rows contiguous (flash_attn_with_kvcache checks)
    capacity = cols * page_size  # >= 1: the caller routes tables of no column elsewhere
    rows = q.reshape(b * sq, hq, d)
    out, lse = outputs if outputs is not None else _empty_outputs(rows)
    key = (lib, info.name, q.device, q.shape, q.stride(), out.stride(), k_cache.shape,
           k_cache.stride(), v_cache.stride(), cols, block_table.stride(0), mask, scale,
           ops._grid_mode())  # q's own shape: (2, 40) and (4, 20) rows are 80 either way
    plan = _paged_plans.get(key)
    if plan is None:  # the checks and sizes of this signature, once
        q4, o4 = _views(rows, out)
        ops.check_layout(q=q4, k_cache=k_cache, v_cache=v_cache)
        dims = Dims(b, sq, capacity, hq, hkv, d, _DTYPES[q.dtype])
        p = ops._make_params(q4, k_cache, v_cache, o4, lse, dims, scale,
                             ops._num_sms(q.device.index), ops._grid_mode(), mask)
        p.block_table_batch_stride = block_table.stride(0)
        p.page_size, p.num_pages, p.block_table_cols = page_size, pages, cols
        plan = ops._remember(_paged_plans, key, _Plan(lib, info, dims, mask, scale, q.device, p))
    if _trace._active:  # a trimmed build from the trace gets the paged variant, not the gather
        _trace.record(info.name, True, batch=b, seqlen_q=sq, seqlen_k=capacity, heads_q=hq,
                      heads_kv=hkv)
    _fwd_run(plan, rows, k_cache, v_cache, *packed_offsets(b, sq, capacity, q.device), out, lse,
             seqused_k, block_table)
    return out.view(b, sq, hq, d), lse.view(hq, b, sq).permute(1, 0, 2)


# ---------------------------------------------------------------------------------------------
# Backward.


def _bwd_layout(q: torch.Tensor, dims: Dims, total_k: int, tile_m: int, tile_n: int,
                deterministic: bool) -> ops.WorkspaceLayout:
    """The layout of the ABI's varlen workspace: stats and dq_accum over (heads_q, rows), each
    sequence's rows starting at a multiple of tile_m, rows = (total_q + batch * tile_m) rounded
    up to tile_m; the dQ semaphores (deterministic: one per query tile and head); and the
    key-tile list."""
    rows = -(-(q.shape[0] + dims.batch * tile_m) // tile_m) * tile_m
    return ops.WorkspaceLayout.of(
        dq_accum=((dims.heads_q, rows, dims.head_dim), torch.float32),
        lse_log2=((dims.heads_q, rows), torch.float32),
        dsum=((dims.heads_q, rows), torch.float32),
        dq_semaphore=((dims.heads_q, rows // tile_m) if deterministic else (1,), torch.int32),
        tile_list=((2 * varlen_tiles(total_k, dims.batch, tile_n) * dims.heads_kv,),
                   torch.int32),
    )


def _bwd_plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dq, dk, dv, mask: Masking, scale: float, variant: str | None, deterministic: bool,
              lib) -> _Plan:
    ops.check_device(q, k, v)
    dims = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for name, t, want, dtype in (("out", out, q.shape, q.dtype), ("dout", dout, q.shape, q.dtype),
                                 ("lse", lse, (dims.heads_q, q.shape[0]), torch.float32),
                                 ("dq", dq, q.shape, q.dtype), ("dk", dk, k.shape, k.dtype),
                                 ("dv", dv, v.shape, v.dtype)):
        if tuple(t.shape) != tuple(want) or t.dtype != dtype or t.device != q.device:
            raise InvalidInputError(f"{name} must be {dtype} {tuple(want)} on {q.device}, got "
                                    f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if not lse.is_contiguous():
        raise InvalidInputError("lse must be contiguous (the C ABI takes no lse strides)")
    info = lib.find("bwd", dims.dtype, dims.head_dim, variant=variant or None, varlen=True,
                    **mask.key())
    _check_tiles_per_seq("max_seqlen_k", max_seqlen_k, info.tile_n, info.name)
    ops.check_layout(q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv)
    views = _views(q, k, v, out, dout, dq, dk, dv)
    params = layout = None
    if q.shape[0] and k.shape[0] and dims.heads_q:
        layout = _bwd_layout(q, dims, k.shape[0], info.tile_m, info.tile_n, bool(deterministic))
        params = ops._make_bwd_params(*views[:4], views[4], lse, *views[5:], None, dims,
                                      scale, deterministic, mask)  # workspace: _bwd_run's
    return _Plan(lib, info, dims, mask, scale, q.device, params, bool(deterministic), layout)


def _bwd_run(plan: _Plan, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv,
             seqused_k=None):
    if plan.params is None:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    _check_longest("max_seqlen_k", cu_seqlens_k, k.shape[0], plan.info.tile_n, plan.info.name)
    if plan.deterministic:
        # Offsets that decrease (bad input, read only under FA3GEN_DEBUG_CHECKS) give wrong
        # numbers elsewhere, but here two sequences could share a query tile's dQ semaphore
        # and wait for each other forever: their running maximum (the offsets themselves when
        # valid; on the device, no sync) keeps the tiles apart.
        cu_seqlens_q = torch.cummax(cu_seqlens_q, 0).values
        cu_seqlens_k = torch.cummax(cu_seqlens_k, 0).values
    if seqused_k is not None:  # the kernels write no dk, dv row past seqused_k: those are 0
        dk.zero_()
        dv.zero_()
    workspace = ops._bwd_workspace(plan.workspace_layout, q.device)
    work = plan.workspace_layout.pointers(workspace)
    p = ops._bwd_call_params(plan, dout, q, k, v, out, lse, dq, dk, dv, work)
    _set_varlen(p, cu_seqlens_q, cu_seqlens_k, work["tile_list"], q.shape[0], k.shape[0])
    p.seqused_k = seqused_k.data_ptr() if seqused_k is not None else None
    ops._launch(plan.lib, plan.info, plan.device, lambda: p)


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              mask, scale, variant, deterministic, seqused_k=None):
    """The varlen backward op's body, planned once per call signature as ops._backward."""
    _check_op_arguments(scale, seqused_k, cu_seqlens_k)
    ins = (dout, q, k, v, out)
    lib = runtime.get_library()
    key = (ops._layout_key(*ins, lse), _cu_signature(cu_seqlens_q), _cu_signature(cu_seqlens_k),
           max_seqlen_q, max_seqlen_k, mask, float(scale), variant, bool(deterministic), lib,
           ops._grid_env())
    dq, dk, dv = ops._empty_grads(q, k, v)
    lse = lse.contiguous()
    plan, ready = ops._plan_once(_bwd_op_plans, key, ins, _tma_ready, lambda ready: _bwd_plan(
        *ready, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, mask,
        scale, variant, deterministic, lib))
    _bwd_run(plan, *ready, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, seqused_k)
    return dq, dk, dv


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """ops._tma_ready of a (total, h, d) tensor: t itself when it suits TMA (so that the eager
    backward can tell a copied dout from the one it was given)."""
    view = t.unsqueeze(0)
    ready = ops._tma_ready(view)
    return t if ready is view else ready.squeeze(0)


def _backward_variant(q, mask: Masking) -> str:
    dtype = _DTYPES.get(q.dtype, str(q.dtype))
    return ops._variant_name("bwd", dtype, q.shape[-1], None, *ops._key_flags(mask), True)


# ---------------------------------------------------------------------------------------------
# Custom ops (graph capture) and the eager autograd.Function.


@torch.library.custom_op("fa3gen::varlen_fwd", mutates_args=())
def _varlen_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float, variant: str, deterministic: bool, window_left: int,
    window_right: int, softcap: float, seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    ops.masking(causal, (window_left, window_right), softcap), softmax_scale,
                    variant, seqused_k)


@_varlen_fwd_op.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    return _empty_outputs(q)


@torch.library.custom_op("fa3gen::varlen_bwd", mutates_args=())
def _varlen_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, variant: str,
    deterministic: bool, window_left: int, window_right: int, softcap: float,
    seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = ops.masking(causal, (window_left, window_right), softcap)
    if _trace._active and variant:  # when the graph runs: a graph compiled before the trace too
        _trace_call(variant, ops._is_default(variant, lambda: _backward_variant(q, mask)), q, k,
                    cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, mask, softmax_scale, variant, deterministic, seqused_k)


@_varlen_bwd_op.register_fake
def _varlen_bwd_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, _variant, deterministic, wl, wr,
     softcap, seqused_k) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k)
    ctx.sizes, ctx.scale, ctx.deterministic = (max_q, max_k), scale, deterministic
    ctx.mask = ops.op_masking(causal, wl, wr, softcap)
    ctx.mark_non_differentiable(lse)


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
    m = ctx.mask
    name = ops.traced_backward_variant(lambda: _backward_variant(q, m))  # recorded when it runs
    dq, dk, dv = torch.ops.fa3gen.varlen_bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, *ctx.sizes, m.causal, ctx.scale, name,
        ctx.deterministic, m.window_left, m.window_right, m.softcap, seqused_k)
    return (dq, dk, dv) + (None,) * 12


_varlen_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def _varlen_vmap(info, in_dims, *inputs):
    """One call per vmapped entry (the sequences of one call are already its batch)."""
    if info.batch_size == 0:  # no entry to call: no rows of an entry's output shapes
        q = inputs[0] if in_dims[0] is None else inputs[0].movedim(in_dims[0], 0)
        total, hq, d = q.shape[-3:]
        return (q.new_empty((0, total, hq, d)),
                q.new_empty((0, hq, total), dtype=torch.float32)), (0, 0)
    entries = [_TransformedVarlen.apply(*(t.select(d, i) if d is not None else t
                                          for t, d in zip(inputs, in_dims)))
               for i in range(info.batch_size)]
    return tuple(torch.stack(ts) for ts in zip(*entries)), (0, 0)


# flash_attn_varlen_func under a torch.func transform (ops.transformable).
_TransformedVarlen = ops.transformable("_TransformedVarlen", torch.ops.fa3gen.varlen_fwd,
                                       _setup_context, _op_backward, _varlen_vmap)


class _EagerVarlenAttention(torch.autograd.Function):
    """As ops._EagerAttention, for packed sequences."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, plan: _Plan, deterministic: bool, seqused_k):
        out, lse = _eager_forward(plan, q, k, v, cu_q, cu_k, seqused_k)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k)
        ctx.plan, ctx.deterministic = plan, deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's zero gradient as None (ops._EagerAttention)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 8
        q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
        dq, dk, dv = _eager_backward(ctx.plan, ctx.deterministic, dout, q, k, v, out, lse, cu_q,
                                     cu_k, seqused_k)
        return (*ops.no_second_derivative(q, k, v, dout, grads=(dq, dk, dv)), None, None, None, None,
                None)


_bwd_plans: dict = {}  # ops._backward_key -> (_Plan, (copies dout,))
_bwd_op_plans: dict = {}  # the varlen bwd op's call signature -> (_Plan, which inputs it copies)


def _eager_backward(fwd: _Plan, deterministic: bool, dout, q, k, v, out, lse, cu_q, cu_k,
                    seqused_k=None, grads=None):
    """As ops._eager_backward: the checks and the dispatch once per signature (the forward
    plan's covers q, k, v, cu_seqlens and max_seqlen); grads as there."""
    ops.refuse_batched_backward(dout)
    sizes = (fwd.dims.seqlen_q, fwd.dims.seqlen_k)
    plan, dout = ops._backward_plan_once(
        _bwd_plans, ops._backward_key(fwd, deterministic, dout, grads, (q, k, v, out, lse)), dout,
        lambda ready: _bwd_plan(ready, q, k, v, out, lse, cu_q, cu_k, *sizes,
                                *(grads or ops._empty_grads(q, k, v)),
                                fwd.mask, fwd.scale, None, deterministic,  # fwd.lib's default
                                fwd.lib),
        ready=_tma_ready)
    _trace_call(plan.info.name, True, q, k, cu_q, *sizes)
    dq, dk, dv = grads or ops._empty_grads(q, k, v)
    _bwd_run(plan, dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, seqused_k)
    return dq, dk, dv


def _trace_call(name, default, q, k, cu_q, max_q, max_k):
    if _trace._active:
        _trace.record(name, default, batch=cu_q.shape[0] - 1, seqlen_q=max_q, seqlen_k=max_k,
                      heads_q=q.shape[1], heads_kv=k.shape[1])


_plans: dict = {}  # call signature -> _Plan (as ops._fwd_plans)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
    seqused_q: None = None,
    seqused_k: torch.Tensor | None = None,
    variant: str | None = None,
    q_descale: None = None,
    k_descale: None = None,
    v_descale: None = None,
    qv: None = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    dropout_p: float = 0.0,
    alibi_slopes: None = None,
    block_table: None = None,
):
    """Attention over variable-length sequences packed along the rows, as flash-attn's
    flash_attn_varlen_func.

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim), bf16 or fp16 on an
    sm_90 GPU (heads as in flash_attn_func: GQA/MQA). cu_seqlens_q / cu_seqlens_k: int32 on
    q's device, batch + 1 entries: sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of
    q against rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v. max_seqlen_q /
    max_seqlen_k: the longest sequences (ints > 0, as the caller knows them: no device sync).
    causal, window_size, softcap: flash_attn_func's meaning per sequence (causal aligned to
    each sequence's bottom-right corner). Zero-length sequences are legal (zero rows; a query
    sequence whose key sequence is empty gives 0 and lse -inf). Rows outside every sequence
    come out zero (lse -inf). FA3GEN_DEBUG_CHECKS=1 checks cu_seqlens and max_seqlen on the host (a
    sync per call).
    Everything after max_seqlen_k is keyword-only: flash-attn 2 (dropout_p) and
    FlashAttention-3 (seqused_q, seqused_k) put different things in the 8th position, so a
    positional call fails instead of meaning something else. seqused_k (FA3): int32 (batch,)
    on the device, sequence b using only the first seqused_k[b] keys of its cu_seqlens_k range
    (causal aligned to that length; the other keys get zero gradients). seqused_q is not
    supported.
    Differentiable in q, k, v. Returns out (total_q, heads_q, head_dim), plus lse
    (heads_q, total_q) float32 when return_lse (or return_attn_probs).
    FlashAttention-3's other keywords as in flash_attn_func (num_splits, pack_gqa, sm_margin:
    hints, not used; qv, attention_chunk: their defaults only); the descales only as None
    (no fp8 varlen). flash-attn 2's dropout_p and alibi_slopes as in flash_attn_func, and its
    block_table (paged keys) only as None: flash_attn_with_kvcache reads paged caches.
    """
    ops.check_fa3_extras(qv, attention_chunk, num_splits, pack_gqa, sm_margin, dropout_p,
                         alibi_slopes)
    if block_table is not None:
        raise InvalidInputError("block_table (flash-attn 2's paged keys for the varlen function) "
                                "is not supported by fa3gen's flash_attn_varlen_func; "
                                "flash_attn_with_kvcache takes paged caches")
    check_no_descales(q_descale, k_descale, v_descale)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_size, softcap, deterministic,
                      ops.returns_lse(return_lse, return_attn_probs), seqused_q, seqused_k,
                      variant)


def check_no_descales(q_descale, k_descale, v_descale) -> None:
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise InvalidInputError("descales are for fp8 inputs; fa3gen's varlen forward takes "
                                "bf16 and fp16 (pass None)")


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal, window_size, softcap, deterministic, return_lse, seqused_q, seqused_k,
               variant, packed=None):
    """flash_attn_varlen_func's body; packed as in ops._attention."""
    if seqused_q is not None:
        raise InvalidInputError("seqused_q is not supported by fa3gen; pass cu_seqlens_q that "
                                "bound the used rows instead")
    softmax_scale = ops._check_fa3_arguments(softmax_scale, positional=False)  # keyword-only
    mask = ops.masking(causal, window_size, softcap)
    deterministic = ops.deterministic_backward(deterministic)
    ops.check_variant(variant)
    ops._check_tensors(q, k, v)
    if seqused_k is not None:
        _check_seqused_k(seqused_k, cu_seqlens_k)
    max_seqlen_q, max_seqlen_k = _check_max_seqlen(max_seqlen_q, max_seqlen_k)
    captured = ops._captured(q, k, v)
    if debug_checks_enabled() and not captured:  # captured: the op's body checks, when it runs
        check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        check_cu_seqlens_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              seqused_k)
    if captured:
        ops.check_device(q, k, v)
        dims = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k)
        # As flash_attn_func's: tracing checks that the key (or the named variant) is built,
        # and the op picks a default call's variant when it runs, by max_seqlen_k as eager
        # calls do. (A max_seqlen_k that dynamo made dynamic passes isinstance(m, int) while
        # tracing, and cannot reach the library lookup, whose arguments are constants.)
        name = ops._variant_name("fwd", dims.dtype, dims.head_dim, variant,
                                 *ops._key_flags(mask), True)
        ops.check_layout(q=q, k=k, v=v)
        fwd = _TransformedVarlen.apply if ops.transforming() else torch.ops.fa3gen.varlen_fwd
        out, lse = fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask.causal,
            ops._softmax_scale(softmax_scale, dims.head_dim), "" if variant is None else name,
            bool(deterministic),
            mask.window_left, mask.window_right, mask.softcap, seqused_k)
        return (out, lse) if return_lse else out
    if _forward_ad._current_level >= 0:  # inside forward_ad.dual_level(): rarely
        ops.refuse_tangents(q, k, v)
    plan = _eager_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask,
                       softmax_scale, variant)
    _trace_call(plan.info.name, variant is None, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if packed is None:
            out, lse = _EagerVarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, plan,
                                                   bool(deterministic), seqused_k)
        else:
            from fa3gen.packed import PackedAttention, VarlenRun
            run = VarlenRun(plan, bool(deterministic), packed[1], cu_seqlens_q, cu_seqlens_k,
                            seqused_k)
            out, lse = PackedAttention.apply(run, *packed[0], *run.tensors)
    else:
        out, lse = _eager_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
    return (out, lse) if return_lse else out


def _eager_plan(q, k, v, cu_q, cu_k, max_q, max_k, mask, softmax_scale, variant) -> _Plan:
    try:
        lib = runtime.get_library()
    except Fa3genError:  # bad tensors are reported before a missing library
        ops.check_device(q, k, v)
        check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
        ops.check_layout(q=q, k=k, v=v)
        raise
    sig = ops._signature
    key = (sig(q), sig(k), sig(v), _cu_signature(cu_q), _cu_signature(cu_k), max_q, max_k, mask,
           softmax_scale if softmax_scale is None else float(softmax_scale), variant, lib,
           ops._grid_env())
    plan = _plans.get(key)
    if plan is None:
        ops.check_device(q, k, v)
        check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
        out, lse = _empty_outputs(q)
        plan = ops._remember(_plans, key, _fwd_plan(q, k, v, cu_q, cu_k, max_q, max_k, out, lse,
                                                    mask, softmax_scale, variant, lib))
    return plan


def _cu_signature(cu) -> tuple:
    """What the checks read of a cu_seqlens argument (its data is the kernel's)."""
    if not isinstance(cu, torch.Tensor) or cu.is_nested:  # a miss: the checks reject it
        return (type(cu), isinstance(cu, torch.Tensor))
    return cu.shape, cu.stride(), cu.dtype, cu.device
