"""torch entry points: input checks, variant dispatch, and the fa3gen::fwd custom op.

Layers, so that each is testable alone and backward can be added later:
  flash_attn_func  - public wrapper: validates, resolves the variant name, calls the op
  fa3gen::fwd      - torch custom op (+ fake impl) taking a concrete variant name;
                     register_autograd goes on it when the backward kernels exist
  _fwd_into        - writes into caller-provided out/lse (tests poison those first)

Edge cases (decided here, documented in the docstring of flash_attn_func):
  batch, seqlen_q or heads_q == 0 -> empty outputs, no launch;
  seqlen_k == 0 -> every query sees no key: out = 0, lse = -inf (as for fully masked rows).
"""

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from fa3gen import runtime
from fa3gen.errors import Fa3genError, InvalidInputError

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: dt for dt, name in _DTYPES.items()}  # "bf16" -> torch.bfloat16
_TMA_ALIGN_BYTES = 16  # TMA: base addresses and non-unit strides must be 16-byte multiples


@dataclass(frozen=True)
class Dims:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str  # "bf16" | "fp16"


# ---------------------------------------------------------------------------------------------
# Validation. Pure functions: they run on CPU/meta tensors so the CPU tests can check messages.


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_device(q, k, v) -> None:
    """CUDA tensors on one sm_90 device. Non-CUDA tensors fail before any CUDA call."""
    _check_tensors(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise Fa3genError(
                f"{name} is on device '{t.device}'; fa3gen runs on CUDA Hopper GPUs (sm_90: "
                f"H100/H200). Move the tensors there, e.g. {name}.cuda()"
            )
    if not (q.device == k.device == v.device):
        raise Fa3genError(
            f"q, k, v must be on one device, got q: {q.device}, k: {k.device}, v: {v.device}"
        )
    cap = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        raise Fa3genError(
            f"fa3gen kernels are built for sm_90a (H100/H200); {q.device} is "
            f"{torch.cuda.get_device_name(q.device)} with compute capability {cap[0]}.{cap[1]}"
        )


def check_inputs(q, k, v) -> Dims:
    """Types, dtypes and shapes of q, k, v; returns the problem sizes. No device checks."""
    _check_tensors(q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidInputError(
            f"q, k, v must have one dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}"
        )
    if q.dtype not in _DTYPES:
        raise InvalidInputError(
            f"unsupported dtype {q.dtype}; fa3gen supports torch.bfloat16 and torch.float16"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise InvalidInputError(
                f"{name} must have 4 dims (batch, seqlen, heads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise InvalidInputError(
            f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}"
        )
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if bk != b:
        raise InvalidInputError(f"batch differs: q has {b}, k/v have {bk}")
    if dk != d:
        raise InvalidInputError(f"head_dim differs: q has {d}, k/v have {dk}")
    if hkv < 1 or hq % hkv:
        raise InvalidInputError(
            f"heads_q ({hq}) must be a multiple of heads_kv ({hkv}) "
            "(equal: MHA, multiple: GQA, heads_kv=1: MQA)"
        )
    return Dims(b, sq, sk, hq, hkv, d, _DTYPES[q.dtype])


def check_layout(**tensors: torch.Tensor) -> None:
    """TMA requirements for each named (b, s, h, d) tensor: head_dim stride 1, the other strides
    multiples of 16 bytes, data pointer 16-byte aligned. Dims of size 1 are exempt (their
    stride is never used; _strides() replaces it)."""
    for name, t in tensors.items():
        hint = f"make it contiguous first ({name} = {name}.contiguous())"
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise InvalidInputError(
                f"{name}.stride(-1) is {t.stride(-1)}; the head_dim dimension must be "
                f"contiguous (stride 1), {hint}"
            )
        per = _TMA_ALIGN_BYTES // t.element_size()
        for dim, what in ((0, "batch"), (1, "seqlen"), (2, "heads")):
            if t.shape[dim] > 1 and t.stride(dim) % per:
                raise InvalidInputError(
                    f"{name}.stride({dim}) ({what}) is {t.stride(dim)} elements, not a multiple "
                    f"of {per} (TMA needs 16-byte strides); {hint}"
                )
        if t.device.type != "meta" and t.data_ptr() % _TMA_ALIGN_BYTES:
            raise InvalidInputError(
                f"{name}.data_ptr() is not 16-byte aligned (TMA requirement), e.g. a view at an "
                f"odd offset; {hint}"
            )


def _check_outputs(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, dims: Dims) -> None:
    want_o = (dims.batch, dims.seqlen_q, dims.heads_q, dims.head_dim)
    want_l = (dims.batch, dims.heads_q, dims.seqlen_q)
    if tuple(out.shape) != want_o or out.dtype != q.dtype or out.device != q.device:
        raise InvalidInputError(
            f"out must be {q.dtype} {want_o} on {q.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if tuple(lse.shape) != want_l or lse.dtype != torch.float32 or lse.device != q.device:
        raise InvalidInputError(
            f"lse must be float32 {want_l} on {q.device}, "
            f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}"
        )
    if not lse.is_contiguous():
        raise InvalidInputError("lse must be contiguous (the C ABI takes no lse strides)")
    check_layout(out=out)


# ---------------------------------------------------------------------------------------------
# Launch.


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The params field num_sms is the number of persistent CTAs the launcher starts (it launches
# min(query tiles, num_sms)). Causal tiles differ in work by up to seqlen / tile_n times, and
# the kernel deals tiles round robin: on the H200 that left d128 causal at seqlen 16k at 390
# TFLOP/s (544 at 8k). So causal launches one CTA per tile and lets the hardware block
# scheduler balance them (the kernel orders each head's tiles longest first); non-causal
# tiles are equal and run persistent. FA3GEN_GRID=persistent|tiles overrides (measurements).
_ONE_CTA_PER_TILE = 2**31 - 1


def _launch_ctas(device_index: int, causal: bool) -> int:
    mode = os.environ.get("FA3GEN_GRID", "auto")
    if mode not in ("auto", "persistent", "tiles"):
        raise InvalidInputError(f"FA3GEN_GRID={mode!r}: expected auto, persistent or tiles")
    tiles = mode == "tiles" or (mode == "auto" and causal)
    return _ONE_CTA_PER_TILE if tiles else _num_sms(device_index)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides; a size-1 dim gets a harmless legal stride (the packed one)."""
    out = []
    for dim in range(3):
        if t.shape[dim] > 1:
            out.append(t.stride(dim))
        else:
            inner = max([t.shape[-1]] + [t.stride(j) * t.shape[j] for j in range(dim + 1, 3)])
            out.append(-(-inner // 8) * 8)
    return tuple(out)


def _make_params(q, k, v, out, lse, dims: Dims, scale: float, num_sms: int):
    p = runtime.FwdParams()
    p.q, p.k, p.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.o, p.lse = out.data_ptr(), lse.data_ptr()
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = _strides(q)
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = _strides(k)
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = _strides(v)
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = _strides(out)
    p.batch, p.seqlen_q, p.seqlen_k = dims.batch, dims.seqlen_q, dims.seqlen_k
    p.heads_q, p.heads_kv, p.head_dim = dims.heads_q, dims.heads_kv, dims.head_dim
    p.softmax_scale = scale
    p.num_sms = num_sms
    return p


def _fwd_into(
    q, k, v, out, lse, causal: bool, softmax_scale: float, variant: str, lib=None
) -> None:
    """Run forward variant `variant` writing into out (b, sq, hq, d) and lse (b, hq, sq) fp32.

    lib: a runtime.Library (default: runtime.get_library()); quick_check passes its own."""
    check_device(q, k, v)
    dims = check_inputs(q, k, v)
    _check_outputs(out, lse, q, dims)
    lib = lib or runtime.get_library()
    info = lib.find("fwd", dims.dtype, dims.head_dim, causal, variant)
    check_layout(q=q, k=k, v=v)
    if dims.batch == 0 or dims.seqlen_q == 0 or dims.heads_q == 0:
        return
    if dims.seqlen_k == 0:  # no key at all: the fully-masked-row convention
        out.zero_()
        lse.fill_(float("-inf"))
        return
    with torch.cuda.device(q.device):
        num_sms = _launch_ctas(q.device.index, causal)
        params = _make_params(q, k, v, out, lse, dims, float(softmax_scale), num_sms)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        lib.launch_fwd(info, params, stream)


def _empty_outputs(q: torch.Tensor):
    b, sq, hq, d = q.shape
    out = q.new_empty((b, sq, hq, d))  # contiguous whatever q's strides are
    lse = q.new_empty((b, hq, sq), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("fa3gen::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _empty_outputs(q)
    _fwd_into(q, k, v, out, lse, causal, softmax_scale, variant)
    return out, lse


@_fwd_op.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, variant):
    return _empty_outputs(q)


# Backward: add _fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
# saving (q, k, v, out, lse); flash_attn_func needs no change.


# ---------------------------------------------------------------------------------------------
# Public API.


def resolve_variant(dims: Dims, causal: bool, variant: str | None = None) -> str:
    """Name of the forward variant that serves dims (default dispatch or the named one)."""
    return runtime.get_library().find("fwd", dims.dtype, dims.head_dim, causal, variant).name


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    variant: str | None = None,
):
    """Attention softmax(q k^T * scale) v on Hopper with an fa3gen-generated kernel.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    bf16 or fp16 on an sm_90 GPU; heads_q a multiple of heads_kv (GQA/MQA: query head i uses
    kv head i // (heads_q // heads_kv)). head_dim stride must be 1, other strides multiples
    of 16 bytes (views like qkv[:, :, 0] of a packed tensor are fine, no copy is made).
    causal: bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q);
    rows that see no key (also every row when seqlen_k == 0) give 0 and lse -inf.
    softmax_scale: default 1/sqrt(head_dim). variant: a variant name of the loaded library
    instead of the spec's default for (dtype, head_dim, causal).
    Returns out (batch, seqlen_q, heads_q, head_dim), plus lse (batch, heads_q, seqlen_q)
    float32 when return_lse.
    """
    check_device(q, k, v)
    dims = check_inputs(q, k, v)
    name = resolve_variant(dims, bool(causal), variant)
    check_layout(q=q, k=k, v=v)
    scale = 1.0 / math.sqrt(dims.head_dim) if softmax_scale is None else float(softmax_scale)
    out, lse = torch.ops.fa3gen.fwd(q, k, v, bool(causal), scale, name)
    return (out, lse) if return_lse else out
