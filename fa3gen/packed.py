"""flash-attn's packed entry points: q, k and v (or k and v) stacked in one tensor, as a fused
QKV projection gives them. The kernels read the packed tensor in place (q, k, v are views of it,
no copy), and the backward of an eager call writes the gradient of each packed tensor in one
piece (dq, dk, dv are views of it), where autograd through the views would allocate three
gradients and stack them.

    flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, ...)
    flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, ...)
    flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, *, ...)
    flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, *, ...)

Positional order and keywords as flash_attn_func and flash_attn_varlen_func (FlashAttention-3's
order: softmax_scale where flash-attn 2 has dropout_p; keyword-only after the varlen lengths),
FlashAttention-3's other keywords too (`**fa3_keywords`: q_descale, k_descale, v_descale,
out_dtype for an fp8 qkv or q and kv; qv, attention_chunk, num_splits, pack_gqa, sm_margin),
with the meaning and limits they have there.
"""
from __future__ import annotations

import inspect
import numbers
import re

import torch

from fa3gen import ops, varlen
from fa3gen.errors import InvalidInputError


# FlashAttention-3's keywords the packed functions pass on, with the unpacked functions' own
# defaults: flash_attn_func takes all of them, flash_attn_varlen_func all but out_dtype (and
# its descales only as None).
_FA3_NAMES = ("q_descale", "k_descale", "v_descale", "out_dtype", "qv", "attention_chunk",
              "num_splits", "pack_gqa", "sm_margin", "dropout_p", "alibi_slopes")


def _defaults(function, names) -> dict:
    params = inspect.signature(function).parameters
    return {n: params[n].default for n in names if n in params}


_DENSE_KEYWORDS = _defaults(ops.flash_attn_func, _FA3_NAMES)
_VARLEN_KEYWORDS = _defaults(varlen.flash_attn_varlen_func, _FA3_NAMES)


def _fa3_keywords(function: str, given: dict, accepted: dict) -> dict:
    """The call's FlashAttention-3 keywords, checked as the unpacked function checks them; an
    unknown name is Python's TypeError for it."""
    if not given:  # the usual call: the defaults (read, never changed)
        return accepted
    for name in given:
        if name not in accepted:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    kw = {**accepted, **given}
    ops.check_fa3_extras(kw["qv"], kw["attention_chunk"], kw["num_splits"], kw["pack_gqa"],
                         kw["sm_margin"], kw["dropout_p"], kw["alibi_slopes"])
    if "out_dtype" not in accepted:
        varlen.check_no_descales(kw["q_descale"], kw["k_descale"], kw["v_descale"])
    return kw


def _raise_in_packed_terms(error: InvalidInputError, *notes: tuple):
    """Raises the unpacked function's error, with what the names it uses are in the packed call
    (the caller passed qkv or kv, not q, k, v): each (names, note) whose names it uses."""
    message = str(error)
    said = [note for names, note in notes
            if any(re.search(rf"\b{name}\b", message) for name in names)]
    if not said:
        raise error
    raise InvalidInputError(f"{message} (here {'; '.join(said)})") from error


_QKV_VIEWS = (("q", "k", "v"), "q, k, v are views of qkv")
_QKV_GQA_VIEWS = (("q", "k", "v"), "q, k, v are qkv's heads split at num_heads_q")
_KV_VIEWS = (("k", "v"), "k, v are views of kv")
_ONE_BOUNDARY = ((("cu_seqlens_q", "cu_seqlens_k"), "cu_seqlens_q and cu_seqlens_k are cu_seqlens"),
                 (("max_seqlen_q", "max_seqlen_k"), "max_seqlen_q and max_seqlen_k are max_seqlen"))


def _shape(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}"


def _split_qkv(qkv, num_heads_q, batch_dims: int):
    """unpack(tensors) -> (q, k, v) for a packed qkv: (.., 3, heads, d) (flash-attn's), or with
    num_heads_q (FlashAttention-3's GQA layout) (.., heads_q + 2 * heads_kv, d)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    ops.refuse_layout("qkv", qkv)
    lead = "(batch, seqlen" if batch_dims == 2 else "(total"
    if num_heads_q is None:
        if qkv.dim() != batch_dims + 3 or qkv.shape[batch_dims] != 3:
            hint = (" (FlashAttention-3's (.., heads_q + 2 * heads_kv, head_dim) takes "
                    "num_heads_q)" if batch_dims == 2 else "")  # the varlen form has none
            raise InvalidInputError(f"qkv must be {lead}, 3, heads, head_dim), got "
                                    f"{_shape(qkv)}{hint}")
        return lambda tensors: tensors[0].unbind(batch_dims)
    if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, numbers.Integral):
        raise TypeError(f"num_heads_q must be an int, got {type(num_heads_q).__name__}")
    num_heads_q = int(num_heads_q)  # numpy integers too, as the other int arguments
    heads = qkv.shape[batch_dims] if qkv.dim() == batch_dims + 2 else -1
    hkv = (heads - num_heads_q) // 2
    if heads < 0 or num_heads_q < 1 or hkv < 1 or num_heads_q + 2 * hkv != heads:
        raise InvalidInputError(f"with num_heads_q={ops.shown(num_heads_q)}, qkv must be "
                                f"{lead}, heads_q + 2 * heads_kv, head_dim) with heads_kv >= 1, "
                                f"got {_shape(qkv)}")
    hq = num_heads_q

    def unpack(tensors):
        t = tensors[0]
        return (t.narrow(batch_dims, 0, hq), t.narrow(batch_dims, hq, hkv),
                t.narrow(batch_dims, hq + hkv, hkv))
    return unpack


def _split_kv(q, kv, batch_dims: int):
    """unpack((q, kv)) -> (q, k, v) for kv (.., 2, heads_kv, d)."""
    for name, t in (("q", q), ("kv", kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        ops.refuse_nested(name, t)
    if kv.dim() != batch_dims + 3 or kv.shape[batch_dims] != 2:
        lead = "(batch, seqlen_k" if batch_dims == 2 else "(total_k"
        raise InvalidInputError(f"kv must be {lead}, 2, heads_kv, head_dim), got {_shape(kv)}")
    return lambda tensors: (tensors[0], *tensors[1].unbind(batch_dims))


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                              softcap=0.0, deterministic=False, return_attn_probs=False,
                              return_lse=False, num_heads_q=None, variant=None,
                              **fa3_keywords):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, head_dim), q, k, v = qkv.unbind(2); or
    with num_heads_q (FlashAttention-3), qkv (batch, seqlen, heads_q + 2 * heads_kv, head_dim)
    holding q's heads, then k's, then v's. Differentiable in qkv; the rest as flash_attn_func."""
    kw = _fa3_keywords("flash_attn_qkvpacked_func", fa3_keywords, _DENSE_KEYWORDS)
    unpack = _split_qkv(qkv, num_heads_q, 2)
    try:
        return ops._attention(*unpack((qkv,)), softmax_scale, causal, window_size, softcap,
                              deterministic, ops.returns_lse(return_lse, return_attn_probs),
                              variant, kw["q_descale"], kw["k_descale"], kw["v_descale"],
                              kw["out_dtype"], packed=((qkv,), unpack))
    except InvalidInputError as e:
        _raise_in_packed_terms(e, _QKV_VIEWS if num_heads_q is None else _QKV_GQA_VIEWS)


def flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                             softcap=0.0, deterministic=False, return_attn_probs=False,
                             return_lse=False, variant=None, **fa3_keywords):
    """flash_attn_func on q (batch, seqlen_q, heads_q, head_dim) and kv (batch, seqlen_k, 2,
    heads_kv, head_dim), k, v = kv.unbind(2). Differentiable in q and kv."""
    kw = _fa3_keywords("flash_attn_kvpacked_func", fa3_keywords, _DENSE_KEYWORDS)
    unpack = _split_kv(q, kv, 2)
    try:
        return ops._attention(*unpack((q, kv)), softmax_scale, causal, window_size, softcap,
                              deterministic, ops.returns_lse(return_lse, return_attn_probs),
                              variant, kw["q_descale"], kw["k_descale"], kw["v_descale"],
                              kw["out_dtype"], packed=((q, kv), unpack))
    except InvalidInputError as e:
        _raise_in_packed_terms(e, _KV_VIEWS)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, *, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     deterministic=False, return_attn_probs=False,
                                     return_lse=False, variant=None, **fa3_keywords):
    """flash_attn_varlen_func on qkv (total, 3, heads, head_dim) with one set of sequence
    boundaries for queries and keys. Differentiable in qkv."""
    _fa3_keywords("flash_attn_varlen_qkvpacked_func", fa3_keywords, _VARLEN_KEYWORDS)
    unpack = _split_qkv(qkv, None, 1)
    try:
        return varlen._attention(*unpack((qkv,)), cu_seqlens, cu_seqlens, max_seqlen,
                                 max_seqlen, softmax_scale, causal, window_size, softcap,
                                 deterministic, ops.returns_lse(return_lse, return_attn_probs),
                                 None, None, variant, packed=((qkv,), unpack))
    except InvalidInputError as e:
        _raise_in_packed_terms(e, _QKV_VIEWS, *_ONE_BOUNDARY)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, *, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, deterministic=False,
                                    return_attn_probs=False, return_lse=False, seqused_k=None,
                                    variant=None, **fa3_keywords):
    """flash_attn_varlen_func on q (total_q, heads_q, head_dim) and kv (total_k, 2, heads_kv,
    head_dim). Differentiable in q and kv."""
    _fa3_keywords("flash_attn_varlen_kvpacked_func", fa3_keywords, _VARLEN_KEYWORDS)
    unpack = _split_kv(q, kv, 1)
    try:
        return varlen._attention(*unpack((q, kv)), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                 deterministic, ops.returns_lse(return_lse, return_attn_probs),
                                 None, seqused_k, variant, packed=((q, kv), unpack))
    except InvalidInputError as e:
        _raise_in_packed_terms(e, _KV_VIEWS)


class PackedAttention(torch.autograd.Function):
    """An eager call that autograd records, on views of packed tensors: `run` (DenseRun or
    VarlenRun) computes it; the backward allocates one gradient per packed tensor and has the
    kernels write dq, dk, dv into views of them. apply(run, *packed, *run.tensors): the
    call's other tensors (cu_seqlens, seqused_k) are inputs too, saved as autograd saves them
    (an in-place change before the backward is an error, as in the unpacked call)."""

    @staticmethod
    def forward(ctx, run, *inputs):
        n = len(inputs) - len(run.tensors)
        packed, others = inputs[:n], inputs[n:]
        q, k, v = run.unpack(packed)
        out, lse = run.forward(q, k, v, *others)
        ctx.run, ctx.packed = run, len(packed)
        ctx.save_for_backward(*inputs, out, lse)
        ctx.mark_non_differentiable(lse)  # as the custom ops: gradients flow through out only
        ctx.set_materialize_grads(False)  # lse's zero gradient as None (ops._EagerAttention)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        *inputs, out, lse = ctx.saved_tensors
        packed, others = inputs[:ctx.packed], inputs[ctx.packed:]
        if dout is None:  # not reached through out: nothing flows back
            return (None,) * (1 + len(inputs))
        run = ctx.run
        grads = tuple(t.new_empty(t.shape) for t in packed)  # the views cover every element
        run.backward(dout, *run.unpack(packed), out, lse, run.unpack(grads), *others)
        return (None, *ops.no_second_derivative(*packed, dout, grads=grads),
                *(None,) * len(others))


class DenseRun:
    """flash_attn_func's eager forward and backward of one planned call."""
    tensors = ()  # no other tensor inputs

    def __init__(self, plan, deterministic: bool, unpack):
        self.plan, self.deterministic, self.unpack = plan, deterministic, unpack

    def forward(self, q, k, v):
        return ops._eager_forward(self.plan, q, k, v)

    def backward(self, dout, q, k, v, out, lse, grads):
        ops._eager_backward(self.plan, self.deterministic, dout, q, k, v, out, lse, grads)


class VarlenRun(DenseRun):
    """flash_attn_varlen_func's, with the call's sequence boundaries (and seqused_k) as the
    other tensor inputs."""

    def __init__(self, plan, deterministic: bool, unpack, cu_q, cu_k, seqused_k):
        super().__init__(plan, deterministic, unpack)
        self.tensors = (cu_q, cu_k) if seqused_k is None else (cu_q, cu_k, seqused_k)

    def forward(self, q, k, v, cu_q, cu_k, seqused_k=None):
        return varlen._eager_forward(self.plan, q, k, v, cu_q, cu_k, seqused_k)

    def backward(self, dout, q, k, v, out, lse, grads, cu_q, cu_k, seqused_k=None):
        varlen._eager_backward(self.plan, self.deterministic, dout, q, k, v, out, lse, cu_q, cu_k,
                               seqused_k, grads)
