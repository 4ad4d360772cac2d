"""FP8 (e4m3) attention forward: what `flash_attn_func` runs when q, k, v are float8_e4m3fn.

FlashAttention-3's interface: q, k, v in float8_e4m3fn, optional fp32 descale factors
(`q_descale`, `k_descale`, `v_descale`; None is 1), so that the attention is computed on
q * q_descale, k * k_descale, v * v_descale. Each descale is one value, one per
(batch, heads_kv) as in FA3, or one per (batch, heads, block) for block quantization: blocks of
the serving variant's tiles (`block_sizes`), (batch, heads_q, ceil(seqlen_q / tile_m)) for q and
(batch, heads_kv, ceil(seqlen_k / tile_n)) for k and v. `quantize` makes such tensors. Factors
must be finite and not negative (checked only with FA3GEN_DEBUG_CHECKS=1: that needs the data
on the host; a NaN turns the rows it reaches NaN). The kernels
scale the scores and the output by them, never the data. The output is bf16, or fp16 with
out_dtype=torch.float16; the LSE fp32. Forward only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fa3gen import ops, runtime
from fa3gen.errors import Fa3genError, InvalidInputError

FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)  # the first: when out_dtype is None
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8(*tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE for t in tensors)


def check_descale_use(q, k, v, descales: dict, out_dtype) -> None:
    """Descale factors and out_dtype belong to fp8 calls only."""
    if is_fp8(q, k, v):
        return
    given = [name for name, t in descales.items() if t is not None]
    if given or out_dtype is not None:
        what = ", ".join(given + (["out_dtype"] if out_dtype is not None else []))
        raise InvalidInputError(f"{what} apply to float8_e4m3fn q, k, v only (got {q.dtype})")


def _descale_view(name: str, t, dims: ops.Dims, device, blocks: int, block_rows: int):
    """(t, (batch, head, block) strides in floats, head divisor) of a descale, or None for None:
    one value (strides 0), (batch, heads_kv), or (batch, heads, blocks) with heads = heads_q
    for q_descale (heads_kv otherwise) and `blocks` blocks of `block_rows` rows."""
    if t is None:
        return None
    per_kv = (dims.batch, dims.heads_kv)
    heads = dims.heads_q if name == "q_descale" else dims.heads_kv
    per_block = (dims.batch, heads, blocks)
    want = f"one value, {per_kv} (batch, heads_kv) or {per_block} (batch, heads, blocks of " \
           f"{block_rows} rows)"
    _refuse_non_tensor(name, t, want)
    ops.refuse_nested(name, t, f"a dense one ({want})")  # its sizes raise inside torch
    if t.dtype != torch.float32:
        raise InvalidInputError(f"{name} must be float32, got {t.dtype}")
    if t.layout != torch.strided:  # the kernel reads it by strides
        raise InvalidInputError(f"{name} must be a dense (strided) tensor, got {t.layout}; "
                                "pass .to_dense()")
    if t.device != device:
        raise InvalidInputError(f"{name} must be on {device} like q, got {t.device}")
    group = dims.heads_q // dims.heads_kv if name == "q_descale" else 1
    if t.numel() == 1:
        return t, (0, 0, 0), 1
    if tuple(t.shape) == per_kv:
        return t, (t.stride(0), t.stride(1), 0), group
    if tuple(t.shape) == per_block:
        made_for = getattr(t, BLOCK_ROWS_ATTR, None)
        if made_for is not None and made_for != block_rows:
            raise InvalidInputError(
                f"{name} holds blocks of {made_for} rows (from fa3gen.quantize_fp8 or "
                f"fa3gen.fp8.quantize), but this call's variant reads blocks of {block_rows}: "
                "quantize with the call's causal and variant (fa3gen.fp8.block_sizes)")
        return t, (t.stride(0), t.stride(1), t.stride(2) if blocks > 1 else 0), 1
    raise InvalidInputError(f"{name} must have {want}, got shape {tuple(t.shape)}")


def _refuse_non_tensor(name: str, t, want: str = "") -> None:
    """A descale that is neither a tensor nor None: one message, eager (want: the shapes it may
    have) or traced (their check waits for the op)."""
    if t is not None and not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a float32 tensor{f' ({want})' if want else ''} "
                                f"or None, got {type(t).__name__}")


def block_sizes(q, k, causal: bool = False, variant: str | None = None) -> tuple[int, int]:
    """(rows per q block, keys per k/v block) of block-quantized descales for a call on q, k:
    the tiles (tile_m, tile_n) of the variant that serves it."""
    dims = ops.Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                    "e4m3")
    causal = ops.flag("causal", causal)
    info = runtime.get_library().find("fwd", "e4m3", dims.head_dim, causal,
                                      variant=ops.resolve_variant(dims, causal, variant))
    return info.tile_m, info.tile_n


E4M3_MAX = 448.0
# descale = amax times this (one rounded multiply, as the fused kernel: PyTorch's CUDA division
# by a Python number multiplies by its reciprocal, the CPU's divides; this is the same on both).
INV_E4M3_MAX = 1.0 / E4M3_MAX
# A block descale made here (quantize, quantize_fp8) carries its block rows in this attribute:
# a call whose variant reads other blocks refuses it, even where the block counts agree.
BLOCK_ROWS_ATTR = "_fa3gen_block_rows"


def _tag_blocks(descale: torch.Tensor, block_rows: int | None) -> torch.Tensor:
    if block_rows:
        setattr(descale, BLOCK_ROWS_ATTR, int(block_rows))
    return descale


def _descale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, or 1 where that is 0: a scope of zeros, and an fp32 one whose largest
    magnitude is below 448 x 2^-150 (the product rounds to 0, and 0 / 0 would be NaN). fp16
    inputs never get near; a bf16 scope whose largest magnitude is below 448 x 2^-126 (about
    5e-36) does, and there the fused kernel (built with fast math, which flushes the subnormal
    product to 0) writes descale 0 and NaN values (its zeros, 0 / 0): not fixed yet, a kernel
    change (take descale 1 there) waiting for a GPU run."""
    scale = amax * INV_E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


@torch.no_grad()  # quantization is not differentiable; fp8 inputs must not need grad
def quantize(x: torch.Tensor, block_rows: int | None = None):
    """(float8_e4m3fn values, fp32 descale) of x (batch, seqlen, heads, d), x ~ values *
    descale, the largest magnitude of each scope mapped to 448: one scale for the tensor
    (shape (1,)), or one per (batch, head, block of block_rows rows) (shape (batch, heads,
    blocks)), the layout flash_attn_func takes (block_rows from block_sizes). PyTorch
    operations, not a fused kernel."""
    if block_rows is not None and (type(block_rows) is not int or block_rows < 1):
        raise InvalidInputError(f"quantize: block_rows must be a positive int or None, got "
                                f"{ops.shown(block_rows)}")
    b, s, h, d = x.shape
    xf = x.float()
    # The amax skips NaN, as the fused kernel's fmaxf does: one NaN must not turn a whole
    # scope's scale into 1 (a NaN input stays NaN in the values either way).
    mag = xf.abs().nan_to_num(nan=0.0, posinf=math.inf)
    if block_rows is None:
        amax = mag.amax().reshape(1) if mag.numel() else mag.new_zeros(1)  # empty: scale 1
        scale = _descale(amax)
        # contiguous: x's layout (a dense x with head_dim strided) may be one flash_attn_func
        # does not read
        return (xf / scale).to(FP8_DTYPE).contiguous(), scale
    blocks = -(-s // block_rows)
    padded = torch.nn.functional.pad(mag, (0, 0, 0, 0, 0, blocks * block_rows - s))
    amax = padded.reshape(b, blocks, block_rows, h, d).amax(dim=(2, 4))  # (b, blocks, h)
    scale = _descale(amax)
    rows = scale.repeat_interleave(block_rows, dim=1)[:, :s, :, None]           # (b, s, h, 1)
    return (xf / rows).to(FP8_DTYPE).contiguous(), _tag_blocks(scale.permute(0, 2, 1).contiguous(), block_rows)


@torch.no_grad()  # quantization is not differentiable; fp8 inputs must not need grad
def quantize_fp8(q, k, v, *, block: bool = True, hadamard: bool = False, seed: int = 0,
                 causal: bool = False, variant: str | None = None, rotary=None,
                 rotary_interleaved: bool = False):
    """(q8, k8, v8, descales) for flash_attn_func(q8, k8, v8, causal=causal, **descales): q, k, v
    (batch, seqlen, heads, d) quantized to e4m3 with one scale per (batch, head, block of the
    serving variant's tiles) (block=True; a library must be loaded) or per tensor.
    hadamard=True first multiplies q and k along d by the same random orthogonal matrix
    diag(random signs from `seed`) x Hadamard / sqrt(d) (incoherent processing: q k^T is
    unchanged in exact arithmetic, outliers are spread; d a power of two). On bf16/fp16 CUDA
    tensors with head dim 64, 128 or 256 and a library that has the quantizer (specs with e4m3
    variants), one fused kernel per tensor does it all; otherwise PyTorch operations (`quantize`)
    give the same values (with hadamard=True, block scales and no rotary the kernel's transform runs on
    the tensor cores: a byte may then be one e4m3 step from the PyTorch path's). rotary=(cos, sin), each (>= seqlen, rotary_dim / 2): rotary position
    embedding of q and k first (positions 0, 1, ...; flash-attn's apply_rotary_emb, halves
    rotated together, or adjacent pairs with rotary_interleaved), in fp32 before the Hadamard
    transform and the rounding, so the embedding adds no rounding of its own; inside the fused
    kernel for block scales (blocks of at most 32768 / d rows) with adjacent pairs or with
    rotary_dim d or d / 2, else by PyTorch operations first."""
    from fa3gen.reference import apply_rotary, hadamard_transform

    block, hadamard, causal, rotary_interleaved = (
        ops.flag(n, x) for n, x in (("block", block), ("hadamard", hadamard), ("causal", causal),
                                    ("rotary_interleaved", rotary_interleaved)))
    _check_quantize_inputs(q, k, v, hadamard, seed)
    if ops._captured(q, k, v):  # torch.compile: the checks here, the work in the custom op
        _check_rotary(rotary, q, k)
        cos, sin = rotary if rotary is not None else (None, None)
        # the op's int is signed 64-bit: a seed from 2**63 as its two's complement, which
        # seeds a torch generator alike
        q8, k8, v8, qd, kd, vd = torch.ops.fa3gen.quantize_fp8(
            q, k, v, bool(block), bool(hadamard), seed - 2**64 if seed >= 2**63 else seed,
            bool(causal), variant or "", cos, sin, bool(rotary_interleaved))
        return q8, k8, v8, {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    lib = _quantizer_library(q)
    key = _quantize_key((q, k, v), rotary,
                        (block, hadamard, seed, causal, variant, rotary_interleaved, lib))
    plan = _quantize_plans.get(key) if key is not None else None
    if plan is not None and all(x.data_ptr() % 16 == 0 for x in (q, k, v)):  # no copy needed
        signs = _signs(q.shape[-1], seed, q.device) if hadamard else None
        (q8, qd), (k8, kd), (v8, vd) = (
            _quantize_launch(plan.lib, template, x, signs if qk else None,
                             rotary if qk else None)
            for template, x, qk in zip(plan.templates, (q, k, v), (True, True, False)))
        return q8, k8, v8, {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    _check_rotary(rotary, q, k)
    block_q, block_k = block_sizes(q, k, causal, variant) if block else (None, None)
    signs = _signs(q.shape[-1], seed, q.device) if hadamard else None
    out, templates = [], []
    for given, rows, qk in ((q, block_q, True), (k, block_k, True), (v, block_k, False)):
        x, s, rot = given, signs if qk else None, rotary if qk else None
        if rot is not None and not (lib is not None and _kernel_serves(x)
                                    and _kernel_rotates(x, rows, rot, rotary_interleaved)):
            x, rot = apply_rotary(x, *rot, interleaved=rotary_interleaved), None
        if lib is not None and _kernel_serves(x):
            x, template = _quantize_params(x, rows, rot, rotary_interleaved)
            templates.append(template if x is given else None)  # a plan takes them as given
            out.append(_quantize_launch(lib, template, x, s, rot))
        else:
            templates.append(None)
            xr = hadamard_transform(x.float() * s) if s is not None else x
            out.append(quantize(xr, rows))
    if key is not None and all(t is not None for t in templates):  # all three on the kernel
        ops._remember(_quantize_plans, key, _QuantizePlan(lib, tuple(templates)))
    (q8, qd), (k8, kd), (v8, vd) = out
    return q8, k8, v8, {"q_descale": qd, "k_descale": kd, "v_descale": vd}


@torch.library.custom_op("fa3gen::quantize_fp8", mutates_args=())
def _quantize_fp8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: bool,
                     hadamard: bool, seed: int, causal: bool, variant: str,
                     rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                     rotary_interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor, torch.Tensor]:
    """What torch.compile traces for quantize_fp8 (variant "": None): the eager call, its
    outputs contiguous as the fake's (the PyTorch path keeps a strided input's layout)."""
    q8, k8, v8, d = quantize_fp8(
        q, k, v, block=block, hadamard=hadamard, seed=seed, causal=causal,
        variant=variant or None, rotary=None if rotary_cos is None else (rotary_cos, rotary_sin),
        rotary_interleaved=rotary_interleaved)
    return tuple(t.contiguous() for t in (q8, k8, v8, *(d[n] for n in DESCALE_NAMES)))


@_quantize_fp8_op.register_fake
def _quantize_fp8_fake(q, k, v, block, hadamard, seed, causal, variant, rotary_cos, rotary_sin,
                       rotary_interleaved):
    """The shapes: values like the inputs, descales per tensor (1,) or per (batch, heads,
    block) of the serving variant's tiles (chosen by length, as the eager call chooses)."""
    rows = block_sizes(q, k, causal, variant or None) if block else (None, None)
    out = [x.new_empty(x.shape, dtype=FP8_DTYPE) for x in (q, k, v)]
    for x, r in zip((q, k, v), (rows[0], rows[1], rows[1])):
        b, s, h, _ = x.shape
        out.append(x.new_empty((b, h, -(-s // r)) if r else (1,), dtype=torch.float32))
    return tuple(out)


def _check_quantize_inputs(q, k, v, hadamard: bool, seed) -> None:
    """quantize_fp8's arguments, before any work: one InvalidInputError each (the fused kernel
    takes the Hadamard signs of q's head dim for k too)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point() \
                or x.element_size() < 2:  # not fp8 already
            raise InvalidInputError(f"quantize_fp8: {name} must be a (batch, seqlen, heads, d) "
                                    f"floating-point tensor of 16 bits or more, got {_describe(x)}")
    if k.shape != v.shape:
        raise InvalidInputError(f"quantize_fp8: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InvalidInputError(f"quantize_fp8: q {tuple(q.shape)} and k {tuple(k.shape)} need "
                                "the same batch and head dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise InvalidInputError(f"quantize_fp8: q's {q.shape[2]} heads are not a multiple of "
                                f"k's {k.shape[2]}")
    d = q.shape[3]
    if hadamard and (d < 1 or d & (d - 1)):
        raise InvalidInputError(f"quantize_fp8: hadamard=True needs a power-of-two head dim, got {d}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
        raise InvalidInputError(f"quantize_fp8: seed must be an int in [-2**63, 2**64) (a torch "
                                f"generator's seed), got {ops.shown(seed)}")
    if not q.device == k.device == v.device:  # the kernel and the signs take q's device
        raise InvalidInputError(f"quantize_fp8: q, k, v must be on one device, got q: "
                                f"{q.device}, k: {k.device}, v: {v.device}")


def _describe(x) -> str:
    return (f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
            else type(x).__name__)


@dataclass(frozen=True)
class _QuantizePlan:
    """A quantize_fp8 call signature whose three tensors go to the fused kernel as they are:
    the library and each tensor's params template (all but the pointers)."""
    lib: object
    templates: tuple


# quantize_fp8 call signature -> _QuantizePlan (ops._remember bounds it).
_quantize_plans: dict = {}


def _quantize_key(tensors, rotary, options: tuple):
    """The plan key of a quantize_fp8 call: q, k, v and the rotary tables by shape, strides,
    dtype and device, and the other arguments (options); None when one is not what a plan can
    hold."""
    try:
        tables = None if rotary is None else tuple(ops._signature(t) for t in rotary)
        key = (*(ops._signature(x) for x in tensors), tables, options)
        hash(key)
        return key
    except (TypeError, AttributeError, ValueError):  # the checks of the unplanned call say why
        return None


_graph_signs: dict = {}  # (d, seed, device) -> signs a CUDA graph captured: kept for good


def _signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """reference.random_signs on `device`, made once (_cached_signs). Under CUDA graph capture
    the tensor is also kept in _graph_signs for the process: the graph reads its address on
    every replay, and the bounded cache may free it once 64 other keys came by."""
    signs = _cached_signs(d, seed, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        signs = _graph_signs.setdefault((d, seed, device), signs)
    return signs


@functools.lru_cache(maxsize=64)
def _cached_signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """Drawn on the CPU: without the cache, its copy to the GPU would wait for the stream's
    earlier work on every call."""
    from fa3gen.reference import random_signs

    return random_signs(d, seed, device)


def _check_rotary(rotary, q, k) -> None:
    if rotary is None:
        return
    # a tuple or list: a set of two tensors unpacks in an order of its own (cos and sin swapped)
    if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
        raise InvalidInputError("rotary must be a pair (cos, sin) of tensors")
    cos, sin = rotary
    d = q.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        # q's and k's lengths compared one at a time: max() of symbolic sizes would guard on
        # their order under torch.compile (torch.sym_max is no op dynamo can put in a graph).
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point() or \
                t.device != q.device or t.shape != cos.shape or t.shape[0] < q.shape[1] or \
                t.shape[0] < k.shape[1] or \
                not 1 <= t.shape[1] <= d // 2:
            s = max(q.shape[1], k.shape[1])
            raise InvalidInputError(
                f"rotary {name} must be a floating-point tensor (>= seqlen = {s}, rotary_dim / 2 "
                f"in [1, {d // 2}]) on {q.device}, cos and sin alike; got "
                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def _quantizer_library(x):
    """The loaded library when it has the fp8 quantizer and x is on a GPU, else None."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return None
    try:
        lib = runtime.get_library()
    except Exception:  # no library: PyTorch operations serve
        return None
    return lib if lib.has_quantizer else None


MAX_QUANTIZER_GRID = 65535  # quantize_fp8.cuh's limit on batch and heads (a test reads it)


def _kernel_serves(x) -> bool:
    """Whether the fused kernel takes x; else PyTorch operations quantize it. Its launches put
    batch and heads on grid dimensions of at most MAX_QUANTIZER_GRID (the kernel refuses more)."""
    b, s, h, d = x.shape
    return (x.dtype in (torch.bfloat16, torch.float16) and d in (64, 128, 256)
            and min(b, s, h) >= 1 and max(b, h) <= MAX_QUANTIZER_GRID)


# The fused kernel's limits (quantize_fp8.cuh, kStagedBlockValues): block scales come from the
# one-read kernel (and rotary with them) for blocks of at most this many values (rows x head_dim).
KERNEL_BLOCK_VALUES = 32768


def staged_blocks(d: int, block_rows: int | None) -> bool:
    """Whether the fused kernel reads blocks of block_rows rows once (its staged kernel: where
    rotary is fused and the Hadamard transform runs on the tensor cores)."""
    return block_rows is not None and block_rows * d <= KERNEL_BLOCK_VALUES


def _kernel_rotates(x, block_rows: int | None, rotary, interleaved: bool) -> bool:
    """Whether the fused kernel applies `rotary` itself on x: block scales of a size it holds,
    and rotated pairs that stay inside a thread (adjacent pairs, or halves of d or d / 2)."""
    d, half = x.shape[-1], rotary[0].shape[-1]
    return staged_blocks(d, block_rows) and (interleaved or half in (d // 4, d // 2))


def _quantize_kernel(lib, x, block_rows: int | None, signs, rotary=None, interleaved: bool = False):
    """fa3gen_quantize_fp8 on x: (e4m3 values, descale) as `quantize` returns them (of
    apply_rotary(x, *rotary) when rotary is given: _kernel_rotates must hold)."""
    x, template = _quantize_params(x, block_rows, rotary, interleaved)
    return _quantize_launch(lib, template, x, signs, rotary)


def _quantize_params(x, block_rows: int | None, rotary=None, interleaved: bool = False):
    """(x, params template): x made contiguous when the kernel cannot read it as it is (16-byte
    vectors), and every field but the pointers."""
    if x.stride(-1) != 1 or any(x.stride(i) % 8 for i in range(3)):
        x = x.contiguous()  # the kernel reads 16-byte vectors
    if x.data_ptr() % 16:  # contiguous() returns a contiguous view as it is: a copy
        x = x.clone(memory_format=torch.contiguous_format)
    b, s, h, d = x.shape
    p = runtime.QuantizeParams()
    p.x_batch_stride, p.x_row_stride, p.x_head_stride = x.stride(0), x.stride(1), x.stride(2)
    p.batch, p.seqlen, p.heads, p.head_dim = b, s, h, d
    p.block_rows, p.x_fp16 = block_rows or 0, int(x.dtype == torch.float16)
    if rotary is not None:
        p.rotary_half, p.rotary_interleaved = rotary[0].shape[-1], int(interleaved)
    return x, p


def _quantize_launch(lib, template, x, signs, rotary):
    """One launch of a params template on x (laid out as planned): new outputs, the pointers."""
    b, s, h, d = x.shape
    block_rows = template.block_rows
    out = torch.empty((b, s, h, d), dtype=FP8_DTYPE, device=x.device)
    descale = torch.empty((b, h, -(-s // block_rows)) if block_rows else (1,),
                          dtype=torch.float32, device=x.device)
    work = None if block_rows else torch.empty(1, dtype=torch.float32, device=x.device)  # the amax
    p = runtime.QuantizeParams.from_buffer_copy(template)
    p.x, p.out, p.descale = x.data_ptr(), out.data_ptr(), descale.data_ptr()
    p.amax_workspace = work.data_ptr() if work is not None else None
    p.signs = signs.data_ptr() if signs is not None else None
    if rotary is not None:  # fp32 rows of rotary_dim / 2, 16-byte aligned (vector loads)
        cos, sin = (t[:s].to(torch.float32).contiguous() for t in rotary)
        cos, sin = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (cos, sin))
        p.rotary_cos, p.rotary_sin = cos.data_ptr(), sin.data_ptr()
    ops.on_current_stream(x.device, lambda stream: lib.quantize_fp8(p, stream))
    return out, _tag_blocks(descale, block_rows)


def _out_dtype(out_dtype: torch.dtype | None) -> torch.dtype:
    return OUT_DTYPES[0] if out_dtype is None else out_dtype


def check_call(q, k, v, mask: ops.Masking, out_dtype, descales: dict | None = None) -> torch.dtype:
    """What an fp8 call may not ask for, before any tracing or launch; the output dtype.
    descales (the traced call's): each a tensor or None, as the custom op's schema takes them
    (their shapes are checked when the op runs)."""
    descales = descales or {}
    for name, t in descales.items():
        _refuse_non_tensor(name, t)
    if torch.is_grad_enabled():
        _refuse_grad(q, k, v, descales)
    out_dtype = _out_dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise InvalidInputError(f"out_dtype must be torch.bfloat16 or torch.float16 for fp8 "
                                f"inputs, got {out_dtype}")
    if mask.local or mask.softcap > 0:
        raise InvalidInputError("fp8 attention with window_size or softcap is not supported yet "
                                "(causal and non-causal are)")
    return out_dtype


def _refuse_grad(q, k, v, descales: dict) -> None:
    """Under grad mode: no input needs a gradient, a descale included (eagerly its gradient was
    dropped; compiled, the op has no autograd formula)."""
    if any(t is not None and t.requires_grad for t in (q, k, v, *descales.values())):
        raise InvalidInputError("fp8 attention is forward only: q, k, v and the descales must "
                                "not require grad (run it under torch.no_grad() or detach them)")


@torch.library.custom_op("fa3gen::fwd_fp8", mutates_args=())
def _fwd_fp8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
                v_descale: torch.Tensor | None, causal: bool, softmax_scale: float, variant: str,
                out_fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.compile / export traces for an fp8 call: `variant` "" is the default for
    the call's length, resolved here on concrete shapes (block descales are made for its
    tiles). Records the call for fa3gen.trace."""
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse, name, dims = fp8_forward(q, k, v, ops.masking(causal), softmax_scale,
                                       variant or None, descales,
                                       torch.float16 if out_fp16 else torch.bfloat16)
    if ops._trace._active:
        ops._trace_call(name, not variant, dims)
    return out, lse


@_fwd_fp8_op.register_fake
def _fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, variant,
                  out_fp16):
    return ops._empty_outputs(q, torch.float16 if out_fp16 else torch.bfloat16)


def check_descale_data(descales: dict) -> None:
    """FA3GEN_DEBUG_CHECKS=1: every descale finite and not negative (0 is the attention of zeros
    on that side, which the kernels take). Reads them on the host: a device sync per call. A
    descale of the wrong kind (dtype, layout, device) is left to _descale_view's message."""
    for name in DESCALE_NAMES:
        t = descales.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or \
                t.layout != torch.strided or t.is_meta:
            continue
        ops.check_entries(name, t, ~(torch.isfinite(t) & (t >= 0)),
                          "descales must be finite and not negative")


def fp8_forward(q, k, v, mask: ops.Masking, softmax_scale, variant, descales: dict, out_dtype,
                out=None, lse=None):
    """(out, lse, variant name, dims) of the fp8 forward: ops' checks, plan and launch, plus the
    descale fields. out, lse: preallocated outputs (the tests pass poisoned ones), else new.
    The checks and the params are planned once per call signature (the tensors' shapes,
    strides, dtypes and devices, the descales' too, and the other arguments)."""
    if ops.debug_checks_enabled():
        check_descale_data(descales)
    key = None
    if out is None:
        try:
            key = (ops._signature(q), ops._signature(k), ops._signature(v), mask,
                   softmax_scale if softmax_scale is None else float(softmax_scale),  # a tensor's value
                   variant, out_dtype, ops._grid_env(), runtime.get_library(),
                   *(_descale_signature(descales.get(n)) for n in DESCALE_NAMES))
            plan = _plans.get(key)
        except (TypeError, AttributeError, RuntimeError, Fa3genError):
            # not tensors, sparse or nested ones, no library: the checks below say what is
            # wrong (bad tensors first)
            key, plan = None, None
        if plan is not None:  # the key holds what check_call checks, except grad mode
            if torch.is_grad_enabled():
                _refuse_grad(q, k, v, descales)
            out, lse = ops._empty_outputs(q, _out_dtype(out_dtype))
            ops._fwd_run(plan, q, k, v, out, lse, _descale_pointers(descales))
            return out, lse, plan.info.name, plan.dims
    ops.check_device(q, k, v)
    dims = ops.check_inputs(q, k, v)  # one dtype for q, k, v
    out_dtype = check_call(q, k, v, mask, out_dtype, descales)
    lib = runtime.get_library()
    name = ops.resolve_variant(dims, mask, variant)
    if out is None:
        out, lse = ops._empty_outputs(q, out_dtype)
    plan = ops._fwd_plan(q, k, v, out, lse, mask, ops._softmax_scale(softmax_scale, dims.head_dim),
                         name, lib, out_dtype)
    rows = {"q_descale": plan.info.tile_m, "k_descale": plan.info.tile_n,
            "v_descale": plan.info.tile_n}
    lengths = {"q_descale": dims.seqlen_q, "k_descale": dims.seqlen_k, "v_descale": dims.seqlen_k}
    views = {n: _descale_view(n, descales.get(n), dims, q.device,  # 0 rows: 0 blocks, as quantize
                              math.ceil(lengths[n] / rows[n]), rows[n])
             for n in DESCALE_NAMES}
    if plan.params is not None:  # None: nothing to launch (a zero size)
        p = plan.params  # the plan's template: these fields are the same for every call
        p.q_descale_head_div = 1
        for n, view in views.items():
            if view is not None:
                _, strides, head_div = view
                for dim, stride in zip(("batch", "head", "block"), strides):
                    setattr(p, f"{n}_{dim}_stride", stride)
                if n == "q_descale":
                    p.q_descale_head_div = head_div
        p.o_fp16 = int(out_dtype == torch.float16)
    if key is not None:
        ops._remember(_plans, key, plan)
    ops._fwd_run(plan, q, k, v, out, lse, _descale_pointers(descales))
    return out, lse, plan.info.name, dims


# fp8 call signature -> ops._Plan whose params hold the descale strides (pointers per call).
_plans: dict = {}


def _descale_signature(t):
    """A descale's part of the plan key: its layout, and the block rows it was made for."""
    if not isinstance(t, torch.Tensor):
        return None if t is None else (type(t),)
    return ops._signature(t), getattr(t, BLOCK_ROWS_ATTR, None)


def _descale_pointers(descales: dict) -> dict:
    """This call's descale pointer fields (a null pointer for an absent descale: the kernel
    reads 1)."""
    return {n: (descales[n].data_ptr() if descales.get(n) is not None else None)
            for n in DESCALE_NAMES}
