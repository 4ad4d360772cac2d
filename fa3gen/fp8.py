"""FP8 (e4m3) attention forward: what `flash_attn_func` runs when q, k, v are float8_e4m3fn.

FlashAttention-3's interface: q, k, v in float8_e4m3fn, optional fp32 descale factors per
(batch, heads_kv) for each (`q_descale`, `k_descale`, `v_descale`; None is 1; a single value
broadcasts), so that the attention is computed on q * q_descale, k * k_descale, v * v_descale.
The kernels scale the scores and the output by them, never the data. The output is bf16, or
fp16 with out_dtype=torch.float16; the LSE fp32. Forward only.
"""
from __future__ import annotations

import torch

from fa3gen import ops, runtime
from fa3gen.errors import InvalidInputError

FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)
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


def _descale_view(name: str, t, dims: ops.Dims, device) -> torch.Tensor | None:
    """t as a (batch, heads_kv) fp32 view on `device` (a single value broadcast, stride 0)."""
    if t is None:
        return None
    want = (dims.batch, dims.heads_kv)
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a float32 tensor of shape {want} or None, "
                                f"got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise InvalidInputError(f"{name} must be float32, got {t.dtype}")
    if t.device != device:
        raise InvalidInputError(f"{name} must be on {device} like q, got {t.device}")
    if t.numel() == 1:
        return t.reshape(1, 1).expand(want)
    if tuple(t.shape) != want:
        raise InvalidInputError(f"{name} must have shape (batch, heads_kv) = {want} or hold one "
                                f"value, got {tuple(t.shape)}")
    return t


def fp8_forward(q, k, v, mask: ops.Masking, softmax_scale, variant, descales: dict, out_dtype,
                out=None, lse=None):
    """(out, lse, variant name, dims) of the fp8 forward; every check first, one error each.
    out, lse: preallocated outputs (the tests pass poisoned ones), else new."""
    ops.check_device(q, k, v)
    dims = ops.check_inputs(q, k, v)  # one dtype for q, k, v
    if any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
        raise InvalidInputError("fp8 attention is forward only: q, k, v must not require grad "
                                "(run it under torch.no_grad() or detach them)")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise InvalidInputError(f"out_dtype must be torch.bfloat16 or torch.float16 for fp8 "
                                f"inputs, got {out_dtype}")
    if mask.local or mask.softcap > 0:
        raise InvalidInputError("fp8 attention with window_size or softcap is not supported yet "
                                "(causal and non-causal are)")
    views = {n: _descale_view(n, descales.get(n), dims, q.device) for n in DESCALE_NAMES}
    lib = runtime.get_library()
    name = ops.resolve_variant(dims, mask, variant)
    info = lib.find("fwd", dims.dtype, dims.head_dim, variant=name, **mask.key())
    ops.check_layout(q=q, k=k, v=v)
    b, sq, hq, d = q.shape
    if out is None:
        out = torch.empty((b, sq, hq, d), dtype=out_dtype, device=q.device)
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    elif (out.shape != (b, sq, hq, d) or out.dtype != out_dtype or not out.is_contiguous()
          or lse.shape != (b, hq, sq) or lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise InvalidInputError(f"out must be a contiguous {out_dtype} {(b, sq, hq, d)} and lse "
                                f"a contiguous float32 {(b, hq, sq)}")
    if not (dims.batch and dims.seqlen_q and dims.heads_q and dims.seqlen_k):
        if out.numel() and dims.seqlen_k == 0:  # no key: the fully-masked-row convention
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse, info.name, dims
    p = ops._make_params(q, k, v, out, lse, dims, ops._softmax_scale(softmax_scale, d),
                         ops._num_sms(q.device.index), ops._grid_mode(), mask)
    for n, t in views.items():
        if t is not None:
            setattr(p, n, t.data_ptr())
            setattr(p, f"{n}_batch_stride", t.stride(0))
            setattr(p, f"{n}_head_stride", t.stride(1))
    p.o_fp16 = int(out_dtype == torch.float16)
    ops._launch(lib, info, q.device, lambda: p)
    return out, lse, info.name, dims
