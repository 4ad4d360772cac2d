"""torch entry points: input checks, variant dispatch, and the fa3gen::fwd custom op.

Layers, so that each is testable alone:
  flash_attn_func  - public wrapper: validates, resolves the variant name, then calls the
                     custom op under graph capture (torch.compile, export, fake tensors) and
                     _EagerAttention otherwise (same kernels, no custom-op machinery)
  fa3gen::fwd      - torch custom op (+ fake impl) taking a concrete variant name; its
                     autograd formula calls fa3gen::bwd with the default backward variant
  fa3gen::bwd      - torch custom op (+ fake impl): dq, dk, dv
  _forward, _backward  - the ops' bodies, shared with _EagerAttention
  _fwd_into, _bwd_into - write into caller-provided tensors (tests poison those first)

Edge cases (decided here, documented in the docstring of flash_attn_func):
  batch, seqlen_q or heads_q == 0 -> empty outputs, no launch;
  seqlen_k == 0 -> every query sees no key: out = 0, lse = -inf (as for fully masked rows).
"""

import collections.abc
import decimal
import math
import numbers
import os
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as _forward_ad

try:
    import numpy as _np  # torch's optional dependency: only to name numpy values in errors
except ImportError:
    _np = None

from fa3gen import runtime
from fa3gen import fp8 as _fp8
from fa3gen import tracing as _trace
from fa3gen.contract import DTYPES, GRID_MODES, INT32_MAX, SUPPORTED_HEAD_DIMS
from fa3gen.errors import Fa3genError, InvalidInputError, VariantNotBuiltError

# "bf16" -> torch.bfloat16
TORCH_DTYPES = {name: getattr(torch, d.torch) for name, d in DTYPES.items()}
_DTYPES = {dt: name for name, dt in TORCH_DTYPES.items()}
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


@dataclass(frozen=True)
class Masking:
    """causal, window_size and softcap as the kernels take them (see masking())."""
    causal: bool = False
    window_left: int = -1   # -1: unbounded
    window_right: int = -1
    softcap: float = 0.0    # 0: none

    @property
    def local(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def key(self) -> dict:
        """The dispatch-key part: causal, local, softcap (Library.find's arguments). Each flag
        by a branch: torch.compile with dynamic=True makes masking()'s float() and int()
        results symbolic, so a comparison stays symbolic too, and a constant function (the
        variant lookup) cannot take it; a branch decides it while tracing (a guard)."""
        local = True if self.local else False
        softcap = True if self.softcap > 0 else False
        return dict(causal=self.causal, local=local, softcap=softcap)


_UNMASKED, _CAUSAL = Masking(), Masking(causal=True)  # masking()'s usual answers


# The kernels take softmax_scale and softcap as fp32 and derive scale * log2(e), scale / softcap
# and softcap * log2(e) from them: within these bounds each stays a finite, normal fp32 number
# (1e40 would have reached the kernel as inf, 1e-40 as a denormal: a silent wrong answer).
FP32_ARG_RANGE = _FP32_LO, _FP32_HI = (2.0**-60, 2.0**60)


def _fp32_range_error(name: str, value) -> None:
    raise InvalidInputError(f"{name}={shown(value)} is outside [2^-60, 2^60] (about 8.7e-19 to "
                            "1.2e18), the range in which the kernels' fp32 arithmetic stays "
                            "finite")


def _is_numpy_bool(x) -> bool:
    """A numpy bool (flash-attn takes one as causal), without importing numpy otherwise."""
    if type(x).__module__ != "numpy":
        return False
    import numpy
    return isinstance(x, numpy.bool_)


def real_number(x) -> float | None:
    """x as a float when it is one real number: a Python, numpy or Decimal one, a 0-d real
    tensor or numpy array (or, under torch.compile, a symbolic one); not a bool, text, a
    complex number or a tensor or array with dims. Else None. A nonzero value that float()
    rounds to 0 comes back as the smallest positive double, so that range checks see it."""
    if type(x) is float:
        return x
    if _is_bool_like(x):
        return None
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 or x.is_complex():
            return None
        if torch.compiler.is_compiling():  # its value is known only when the graph runs
            raise InvalidInputError("under torch.compile, softmax_scale and softcap must be "
                                    "Python numbers, not tensors (pass float(t) from outside "
                                    "the compiled function)")
        if x.requires_grad and torch.is_grad_enabled():  # float() would drop its gradient
            raise InvalidInputError("softmax_scale and softcap take no gradient: pass a Python "
                                    "number or a tensor that does not require grad (t.detach())")
    elif not isinstance(x, (numbers.Real, decimal.Decimal, torch.SymFloat, torch.SymInt)) and \
            not _is_numpy_real_0d(x):
        return None
    try:
        value = float(x)
        return math.copysign(math.ulp(0.0), x) if value == 0.0 and x != 0 else value
    except OverflowError:  # an int past float's range: out of any range checked against
        try:
            return math.inf if x > 0 else -math.inf
        except Exception:
            return None
    except Exception:  # a meta tensor has no value; a __float__ that raises
        return None


def _is_numpy_real_0d(x) -> bool:
    """A plain 0-d numpy array of ints or floats (np.array(0.5)), without importing numpy."""
    if type(x).__module__ != "numpy":
        return False
    import numpy
    return type(x) is numpy.ndarray and x.ndim == 0 and x.dtype.kind in "iuf"


def shown(x) -> str:
    """x for an error message: a tensor by dtype and shape, an int too long to print by its
    size (repr of an int past 4300 digits raises ValueError, in a tuple too)."""
    if isinstance(x, torch.Tensor):
        if x.is_nested:  # its shape raises inside torch
            return f"a nested {x.dtype} tensor"
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    if _np is not None and isinstance(x, _np.ndarray) and torch.compiler.is_compiling():
        # dynamo traces a numpy scalar as an array, whose value and repr it cannot read
        return "a numpy value, which torch.compile traces as an array (pass int(...) or float(...))"
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 100:
        return f"an int of about {'-' if x < 0 else ''}10^{x.bit_length() * 0.30103:.0f}"
    try:
        return repr(x)
    except ValueError:
        return f"a {type(x).__name__} holding an int too long to print"
    except Exception:  # a __repr__ that raises
        return f"a {type(x).__name__}"


def _is_bool_like(x) -> bool:
    """A Python, numpy or torch bool (or array of them): never a number here, where float()
    would take it as 1.0."""
    return isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool) or \
        (type(x).__module__ == "numpy" and str(getattr(x, "dtype", "")) == "bool")


def _is_flag(value) -> bool:
    """True or False, a numpy bool, 0 or 1: what flash-attn takes as a flag."""
    return type(value) is bool or _is_numpy_bool(value) or \
        (isinstance(value, int) and value in (0, 1))


def flag(name: str, value) -> bool:
    """value as a bool when it is a flag (_is_flag); anything else one clear error (truthiness
    would take "no" or a tensor of flags as True)."""
    if type(value) is bool:
        return value
    if _is_flag(value):
        return bool(value)
    raise InvalidInputError(f"{name} must be True or False, got {shown(value)}")


def deterministic_backward(deterministic) -> bool:
    """A call's deterministic flag, or torch.use_deterministic_algorithms(True)'s: a program
    that asked torch for reproducible results gets the ordered dq additions whatever the call
    passed (as torch's own operations do)."""
    return flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()


def returns_lse(return_lse, alias, alias_name: str = "return_attn_probs") -> bool:
    """Whether a call returns (out, lse): return_lse, or the flag another API names it
    (FlashAttention-3's return_attn_probs, flash_attn_with_kvcache's return_softmax_lse)."""
    return flag("return_lse", return_lse) | flag(alias_name, alias)


def op_masking(causal, window_left, window_right, softcap) -> Masking:
    """masking() of a custom op's arguments, for its autograd context. Window sides that
    torch.compile made symbolic (a size that varies between calls) come from the public
    function's masking() already: taken as they are (masking() refuses a SymInt)."""
    if isinstance(window_left, torch.SymInt) or isinstance(window_right, torch.SymInt):
        return Masking(bool(causal), window_left, window_right, float(softcap))
    return masking(causal, (window_left, window_right), softcap)


def masking(causal=False, window_size=(-1, -1), softcap=0.0) -> Masking:
    """flash-attn's semantics: causal sets window_size[1] to 0; a window (-1, 0) is causal;
    (-1, -1) is no window; anything else is local (sliding window), query i seeing keys
    [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right], -1 unbounded. A window
    wider than the sequence stays local (the key must not depend on the sequence length: a
    trace-trimmed build would otherwise miss the local variant at longer lengths)."""
    # The usual call (a bool, no window, no softcap) skips the checks: 0.2 us instead of 1.2.
    if type(causal) is bool and type(window_size) is tuple and len(window_size) == 2 \
            and type(window_size[0]) is int and type(window_size[1]) is int \
            and window_size[0] == -1 and window_size[1] == -1 \
            and (type(softcap) is float or type(softcap) is int) and softcap == 0:
        return _CAUSAL if causal else _UNMASKED
    causal = flag("causal", causal)
    # Indexed as flash-attn does: a set, a dict or an iterator would unpack in an order of its
    # own ({-1, 0} as (0, -1)), a silently different mask.
    try:
        if type(window_size) is not tuple and isinstance(
                window_size, (str, bytes, collections.abc.Set, collections.abc.Mapping)):
            raise TypeError  # (a tuple skips the ABC checks: 0.2 us a call)
        if len(window_size) != 2:
            raise TypeError
        left, right = window_size[0], window_size[1]
    except (TypeError, KeyError, IndexError):
        raise InvalidInputError(f"window_size must be a pair (left, right), got "
                                f"{shown(window_size)}")
    for side, w in (("left", left), ("right", right)):  # numpy integers too, as flash-attn
        if (type(w) is not int and (isinstance(w, bool) or not isinstance(w, numbers.Integral))) \
                or w < -1:
            raise InvalidInputError(f"window_size {side} must be an int >= -1 (-1: unbounded), "
                                    f"got {shown(w)}")
    left, right = int(left), int(right)
    value = real_number(softcap)
    if value is None or not 0.0 <= value < math.inf:
        raise InvalidInputError(f"softcap must be a finite number >= 0 (0: none), "
                                f"got {shown(softcap)}")
    softcap = value
    if softcap and not _FP32_LO <= softcap <= _FP32_HI:
        _fp32_range_error("softcap", softcap)
    # Wider than any sequence (the kernels take int32): unbounded on that side, not wrapped.
    if left > INT32_MAX:
        left = -1
    if right > INT32_MAX:
        right = -1
    if causal:
        right = 0
    if left < 0 and right == 0:
        return Masking(causal=True, softcap=float(softcap))
    if left < 0 and right < 0:
        return Masking(softcap=float(softcap))
    return Masking(False, int(left), int(right), float(softcap))


# ---------------------------------------------------------------------------------------------
# Validation. Pure functions: they run on CPU/meta tensors so the CPU tests can check messages.


QKV = ("q", "k", "v")
_STRIDED = torch.strided  # a global lookup, not torch's attribute, on every call


def check_variant(variant) -> None:
    """variant= names one variant (a str) or none; anything else (a list of names, say) would
    fail a plan-cache lookup as an unhashable key."""
    if variant is not None and not isinstance(variant, str):
        raise InvalidInputError(f"variant must be a variant name (str) or None, "
                                f"got {shown(variant)}")


def _check_tensors(q, k, v, names: tuple = QKV) -> None:
    """names: the three as the caller's signature names them (k_cache, v_cache: the cache's).
    One test a tensor here (this runs on every call); the message is found on a failure."""
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor) or t.is_nested or t.layout is not _STRIDED:
            _refuse_tensors(q, k, v, names)


def _refuse_tensors(q, k, v, names: tuple) -> None:
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        refuse_layout(name, t)


_PACKED_INSTEAD = "packed rows with cu_seqlens (the varlen functions)"  # what to pass for nested


def refuse_layout(name: str, t: torch.Tensor, instead: str = _PACKED_INSTEAD) -> None:
    """A tensor the kernels cannot read by strides and a pointer: nested or sparse."""
    refuse_nested(name, t, instead)
    refuse_sparse(name, t)


def refuse_sparse(name: str, t: torch.Tensor) -> None:
    """Sparse layouts have no strides or data pointer the kernels could read."""
    if t.layout is not _STRIDED:
        raise InvalidInputError(f"{name} is a {str(t.layout).replace('torch.', '')} tensor; "
                                f"fa3gen takes dense ones (pass {name}.to_dense())")


def refuse_nested(name: str, t: torch.Tensor, instead: str = _PACKED_INSTEAD) -> None:
    """A nested tensor's shape and strides raise inside torch: say what to pass instead."""
    if t.is_nested:
        raise InvalidInputError(f"{name} is a nested tensor; pass {instead} instead")


def check_device(q, k, v, names: tuple = QKV) -> None:
    """CUDA tensors on one sm_90 device. Non-CUDA tensors fail before any CUDA call."""
    _check_tensors(q, k, v, names)
    for name, t in zip(names, (q, k, v)):
        if t.device.type != "cuda":
            raise Fa3genError(
                f"{name} is on device '{t.device}'; fa3gen runs on CUDA Hopper GPUs (sm_90: "
                f"H100/H200). Move the tensors there, e.g. {name}.cuda()"
            )
    if not (q.device == k.device == v.device):
        raise Fa3genError(
            f"{', '.join(names)} must be on one device, got " +
            ", ".join(f"{n}: {t.device}" for n, t in zip(names, (q, k, v))))
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
            f"unsupported dtype {q.dtype}; fa3gen supports "
            + " and ".join(str(dt) for dt in TORCH_DTYPES.values())
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
    # The params are int32, and the masks add a query's position to the keys' (masking_args).
    # Comparisons one size at a time: max() of symbolic sizes guards on their order (compile).
    if b > INT32_MAX or hq > INT32_MAX or sq + sk > INT32_MAX // 2:
        raise InvalidInputError(f"batch and heads must be below 2^31 and seqlen_q + seqlen_k at "
                                f"most 2^30 - 1; got batch {b}, heads {hq}, seqlen_q {sq}, "
                                f"seqlen_k {sk}")
    return Dims(b, sq, sk, hq, hkv, d, _DTYPES[q.dtype])


def check_layout(**tensors: torch.Tensor) -> None:
    """TMA requirements for each named (b, s, h, d) tensor, or varlen's (rows, h, d): head_dim
    stride 1, the other strides multiples of 16 bytes, data pointer 16-byte aligned. Dims of
    size 1 are exempt (their stride is never used; _strides() replaces it). Errors name the
    caller's own dims."""
    for name, t in tensors.items():
        hint = f"make it contiguous first ({name} = {name}.contiguous())"
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise InvalidInputError(
                f"{name}.stride(-1) is {t.stride(-1)}; the head_dim dimension must be "
                f"contiguous (stride 1), {hint}"
            )
        per = _TMA_ALIGN_BYTES // t.element_size()
        for dim, what in enumerate(("batch", "seqlen", "heads") if t.dim() == 4 else ("rows", "heads")):
            if t.shape[dim] > 1 and t.stride(dim) % per:
                raise InvalidInputError(
                    f"{name}.stride({dim}) ({what}) is {t.stride(dim)} elements, not a multiple "
                    f"of {per} (TMA needs 16-byte strides); {hint}"
                )
        if _data_ptr(t) % _TMA_ALIGN_BYTES:
            raise InvalidInputError(
                f"{name}.data_ptr() is not 16-byte aligned (TMA requirement), e.g. a view at an "
                f"odd offset; {hint}"
            )


def _data_ptr(t: torch.Tensor) -> int:
    """t's address, or 0 for tensors without storage (meta, fake tensors while torch.compile
    traces): the op re-checks the real tensors when it runs."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return 0
    try:
        return t.data_ptr()
    except RuntimeError:
        return 0


def _check_outputs(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, dims: Dims,
                   out_dtype=None) -> None:
    """out_dtype: of O, when not q's (fp8 inputs give bf16/fp16)."""
    want_o = (dims.batch, dims.seqlen_q, dims.heads_q, dims.head_dim)
    want_l = (dims.batch, dims.heads_q, dims.seqlen_q)
    out_dtype = out_dtype or q.dtype
    if tuple(out.shape) != want_o or out.dtype != out_dtype or out.device != q.device:
        raise InvalidInputError(
            f"out must be {out_dtype} {want_o} on {q.device}, "
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


# A device's capability and SM count, asked once per device index. Plain dicts, not
# lru_cache: check_device runs while torch.compile traces, and dynamo warns of (and traces
# through) an lru_cache wrapper.
_capabilities: dict = {}
_sm_counts: dict = {}


def _capability(index: int) -> tuple[int, int]:
    cap = _capabilities.get(index)
    if cap is None:
        cap = _capabilities[index] = torch.cuda.get_device_capability(index)
    return cap


def _num_sms(index: int) -> int:
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


# The plan keys' part that the environment sets: a plan's params carry the grid mode
# (_grid_mode), so a changed FA3GEN_GRID plans again.
GRID_ENV = "FA3GEN_GRID"
_grid_env = runtime.env_reader(GRID_ENV)


def _grid_mode() -> int:
    """FA3GEN_GRID: the forward's CTA count. auto (default): persistent (one CTA per SM), except
    one CTA per query tile where tiles are long or uneven: causal over more than 8192 keys,
    windows that show a query 2048 keys, varlen calls that are paged, causal over sequences
    of more than 512 keys on average, or windowed over sequences shorter than twice the window
    (the policy lives in launch_fwd); persistent |
    tiles force one policy, for measurements."""
    mode = os.environ.get(GRID_ENV) or "auto"  # set but empty: unset, as the others
    if mode not in GRID_MODES:
        raise InvalidInputError(f"{GRID_ENV}={mode!r}: expected auto, persistent or tiles")
    return GRID_MODES[mode]


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides; a size-1 dim gets a harmless legal stride (the packed one,
    rounded up to 16 bytes as TMA needs)."""
    out, per = [], _TMA_ALIGN_BYTES // t.element_size()
    for dim in range(3):
        if t.shape[dim] > 1:
            out.append(t.stride(dim))
        else:
            inner = max([t.shape[-1]] + [t.stride(j) * t.shape[j] for j in range(dim + 1, 3)])
            out.append(-(-inner // per) * per)
    return tuple(out)


def _set_masking(p, m: Masking) -> None:
    p.window_left, p.window_right, p.softcap = m.window_left, m.window_right, m.softcap


def _make_params(q, k, v, out, lse, dims: Dims, scale: float, num_sms: int, grid_mode: int,
                 mask: Masking = Masking()):
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
    _set_masking(p, mask)
    p.num_sms = num_sms
    p.grid_mode = grid_mode
    return p


def _fwd_into(
    q, k, v, out, lse, causal: bool, softmax_scale: float, variant: str, lib=None, *,
    window_size=(-1, -1), softcap: float = 0.0,
) -> None:
    """Run forward variant `variant` writing into out (b, sq, hq, d) and lse (b, hq, sq) fp32.

    lib: a runtime.Library (default: runtime.get_library()); quick_check passes its own."""
    mask = masking(causal, window_size, softcap)
    plan = _fwd_plan(q, k, v, out, lse, mask, float(softmax_scale), variant,
                     lib or runtime.get_library())
    _fwd_run(plan, q, k, v, out, lse)


@dataclass(frozen=True, eq=False)
class _Plan:
    """What the checks decide for one call signature (shapes, strides, dtypes and devices of
    the tensors, masking, scale, variant, library): a later call with that signature only
    needs its pointers checked (16-byte alignment) and written into a copy of `params`."""
    lib: runtime.Library
    info: runtime.VariantInfo
    dims: Dims
    mask: Masking
    scale: float
    device: torch.device
    params: object  # FwdParams / BwdParams with this call's pointers; None: a zero size
    deterministic: bool = False
    workspace_layout: "WorkspaceLayout | None" = None  # the backward's scratch buffers


def _fwd_plan(q, k, v, out, lse, mask: Masking, scale: float, variant: str, lib,
              out_dtype=None) -> _Plan:
    """Every check of a forward call, in the order of its error messages (out_dtype: of O when
    not q's)."""
    check_device(q, k, v)
    dims = check_inputs(q, k, v)
    # e4m3 kernels store a 16-bit O (out_dtype), 16-bit ones q's dtype: a custom op called
    # directly with the other family would get an output of the wrong size or label.
    if (dims.dtype == "e4m3") != (out_dtype is not None):
        raise InvalidInputError(
            "e4m3 q, k, v take the fp8 forward (flash_attn_func, or the op fa3gen::fwd_fp8)"
            if out_dtype is None else
            f"fa3gen::fwd_fp8 takes float8_e4m3fn q, k, v, got {q.dtype}; 16-bit inputs take "
            "flash_attn_func (or the op fa3gen::fwd)")
    _check_outputs(out, lse, q, dims, out_dtype)
    info = lib.find("fwd", dims.dtype, dims.head_dim, variant=variant, **mask.key())
    check_layout(q=q, k=k, v=v)
    launches = dims.batch and dims.seqlen_q and dims.heads_q and dims.seqlen_k
    params = _make_params(q, k, v, out, lse, dims, scale, _num_sms(q.device.index),
                          _grid_mode(), mask) if launches else None
    return _Plan(lib, info, dims, mask, scale, q.device, params)


def _fwd_run(plan: _Plan, q, k, v, out, lse, pointers: dict | None = None) -> None:
    """Launch plan on tensors of its signature (out, lse: as _empty_outputs makes them; lse
    None: none is written). pointers: more of this call's pointer fields (the fp8 descales)."""
    if plan.params is None:
        if out.numel() and plan.dims.seqlen_k == 0:  # no key: the fully-masked-row convention
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        return
    p = _fwd_call_params(plan, q, k, v, out, lse)
    for name, value in (pointers or {}).items():
        setattr(p, name, value)
    _launch(plan.lib, plan.info, plan.device, lambda: p)


_FWD_POINTERS = ("q", "k", "v", "out")  # _aligned_pointers' names, as check_layout's messages
_BWD_POINTERS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")


def _fwd_call_params(plan: _Plan, q, k, v, out, lse):
    """A copy of plan's params with this call's pointers (checked for alignment)."""
    p = runtime.FwdParams.from_buffer_copy(plan.params)
    p.q, p.k, p.v, p.o = _aligned_pointers(_FWD_POINTERS, q, k, v, out)
    p.lse = lse.data_ptr() if lse is not None else None
    return p


def _aligned_pointers(names: tuple, *tensors: torch.Tensor) -> list[int]:
    """The tensors' addresses, checked for TMA alignment: the per-call part of check_layout
    (strides are part of a plan's signature). One test of their OR on the common path; the
    names (the tensors', in order) only for the error. Positional: a call costs no dict."""
    pointers = [t.data_ptr() for t in tensors]
    combined = 0
    for ptr in pointers:
        combined |= ptr
    if combined % _TMA_ALIGN_BYTES:  # raises with the message of the first misaligned one
        check_layout(**{name: t.unsqueeze(0) if t.dim() == 3 else t  # varlen's (total, h, d)
                        for name, t in zip(names, tensors)})
    return pointers


# torch's own fast accessor of the current stream (what compiled graphs use); public fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The current device without torch.cuda.current_device()'s lazy-init check (a call's tensors
# are on a CUDA device, so CUDA is initialized): 0.3 us a call less.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _launch(lib, info, device, make_params) -> None:
    """info's launcher on the current stream of `device`, with the params make_params() builds
    (the CPU tests replace this, the one place that needs a GPU)."""
    on_current_stream(device, lambda stream: lib.launch(info, make_params(), stream))


def on_current_stream(device, call):
    """call(the raw current stream of `device`) with that device current, as the library's
    entry points want it; the common case (already current) costs no context switch."""
    index = device.index
    if index != _current_device():
        with torch.cuda.device(device):
            return on_current_stream(device, call)
    return call(_raw_stream(index) if _raw_stream else torch.cuda.current_stream(index).cuda_stream)


def _empty_outputs(q: torch.Tensor, out_dtype: torch.dtype | None = None,
                   with_lse: bool = True):
    """(out, lse) for q: out (b, sq, hq, d) contiguous whatever q's strides are, in out_dtype
    (default q's; fp8 inputs give bf16/fp16), lse fp32 (b, hq, sq), or None unless with_lse."""
    b, sq, hq, d = q.shape
    if out_dtype is None:  # q's dtype and shape: empty_like parses less (0.3-0.6 us a call)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        out = q.new_empty((b, sq, hq, d), dtype=out_dtype)
    lse = q.new_empty((b, hq, sq), dtype=torch.float32) if with_lse else None
    return out, lse


@torch.library.custom_op("fa3gen::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    variant: str,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic only matters to the backward (see _fwd_setup_context).
    return _forward(q, k, v, masking(causal, (window_left, window_right), softcap),
                    softmax_scale, variant)


def _forward(q, k, v, mask: Masking, softmax_scale: float, variant: str):
    """(out, lse) of forward variant `variant` ("": the default for the call's length): the
    custom op's body, which also records the call for fa3gen.trace. Planned once per call
    signature, as eager calls are: a compiled call's host time then drops from ~88 us (the
    checks and params on every call) to ~55 (a 2-core CPU host, launch stubbed)."""
    check_softmax_scale(softmax_scale)  # a direct op call has had no public function's checks
    plan = _eager_fwd_plan(q, k, v, mask, float(softmax_scale), variant or None)
    if _trace._active:
        _trace_call(plan.info.name, not variant, plan.dims)
    return _eager_forward(plan, q, k, v)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, variant, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0):
    return _empty_outputs(q)


# ---------------------------------------------------------------------------------------------
# Backward.


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself when its layout suits TMA, else a contiguous copy. For incoming gradients,
    which autograd may hand over expanded (stride 0) or otherwise strided."""
    if t.numel() == 0:  # contiguous() keeps an empty tensor's (e.g. expanded, stride 0) strides
        return t.new_empty(t.shape)
    try:
        check_layout(t=t)
        return t
    except InvalidInputError:  # a copy: contiguous() of a contiguous view at an odd address is itself
        return t.clone(memory_format=torch.contiguous_format)


def _check_bwd_inputs(dout, out, lse, dq, dk, dv, q, k, v, dims: Dims) -> None:
    _check_outputs(out, lse, q, dims)  # the forward's out and lse, checked as the forward does
    for name, t, like in (("dout", dout, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype or t.device != like.device:
            raise InvalidInputError(
                f"{name} must be {like.dtype} {tuple(like.shape)} on {like.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    check_layout(dout=dout, dq=dq, dk=dk, dv=dv)


def _make_bwd_params(q, k, v, out, dout, lse, dq, dk, dv, work: dict | None, dims: Dims,
                     scale: float, deterministic: bool, mask: Masking = Masking()):
    """BwdParams of one call; work: the workspace's pointers (WorkspaceLayout.pointers), or
    None for a plan's params (0 until _bwd_call_params sets a call's)."""
    p = runtime.BwdParams()
    _set_pointers(p, dict(q=q, k=k, v=v, o=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv))
    if work is not None:
        _set_workspace(p, work)
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        strides = _strides(t)
        for what, value in zip(("batch", "row", "head"), strides):
            setattr(p, f"{name}_{what}_stride", value)
    p.batch, p.seqlen_q, p.seqlen_k = dims.batch, dims.seqlen_q, dims.seqlen_k
    p.heads_q, p.heads_kv, p.head_dim = dims.heads_q, dims.heads_kv, dims.head_dim
    p.softmax_scale = scale
    _set_masking(p, mask)
    p.deterministic = int(bool(deterministic))
    return p


def _set_pointers(p, tensors: dict) -> None:
    for name, t in tensors.items():
        setattr(p, name, t.data_ptr())


_WORKSPACE = ("dq_accum", "lse_log2", "dsum", "dq_semaphore")  # the ABI's scratch buffers


def _set_workspace(p, work: dict) -> None:
    for name in _WORKSPACE:
        setattr(p, name, work[name])


@dataclass(frozen=True)
class WorkspaceLayout:
    """Where the backward's scratch buffers of the C ABI (fa3gen_bwd_params: dq_accum,
    lse_log2, dsum, dq_semaphore; varlen also tile_list) lie in the one allocation a call
    makes for all of them (four or five torch.empty calls before: 6.7 -> 3.4 us on the CPU
    host, docs/BENCHMARKS.md). Fixed per plan; every buffer starts on a 256-byte boundary (the
    kernels need 16 bytes). Left uninitialised: the backward's preprocess zeroes dq_accum and
    dq_semaphore (since ABI 3), and varlen's tile-list kernel writes every tile_list entry."""
    parts: tuple  # ((name, shape, dtype, byte offset), ...)
    nbytes: int

    ALIGN = 256

    @classmethod
    def of(cls, **parts: tuple) -> "WorkspaceLayout":
        """parts: name=(shape, dtype), in the order they are laid out."""
        laid, offset = [], 0
        for name, (shape, dtype) in parts.items():
            laid.append((name, tuple(shape), dtype, offset))
            size = math.prod(shape) * dtype.itemsize
            offset += -(-size // cls.ALIGN) * cls.ALIGN
        return cls(tuple(laid), max(offset, cls.ALIGN))

    def pointers(self, buffer: torch.Tensor) -> dict:
        """{name: device address} in `buffer` (an allocation of nbytes)."""
        base = buffer.data_ptr()
        return {name: base + offset for name, _, _, offset in self.parts}

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Buffer `name` of `buffer` as a tensor of its shape and dtype (tests, poisoning)."""
        for part, shape, dtype, offset in self.parts:
            if part == name:
                size = math.prod(shape) * dtype.itemsize
                return buffer[offset:offset + size].view(dtype).view(shape)
        raise KeyError(name)


def _bwd_layout(dims: Dims, tile_m: int, deterministic: bool) -> WorkspaceLayout:
    """The layout of the dense backward's workspace, its rows padded to whole query blocks."""
    rows = -(-dims.seqlen_q // tile_m) * tile_m
    stats = (dims.batch, dims.heads_q, rows)
    return WorkspaceLayout.of(
        dq_accum=(stats + (dims.head_dim,), torch.float32),
        lse_log2=(stats, torch.float32),
        dsum=(stats, torch.float32),
        dq_semaphore=((dims.batch, dims.heads_q, rows // tile_m) if deterministic else (1,),
                      torch.int32),
    )


def _bwd_workspace(layout: WorkspaceLayout, device: torch.device) -> torch.Tensor:
    """One call's workspace: an uninitialised allocation of layout.nbytes."""
    return torch.empty(layout.nbytes, dtype=torch.uint8, device=device)


def _bwd_into(
    dout, q, k, v, out, lse, dq, dk, dv, causal: bool, softmax_scale: float, variant: str,
    deterministic: bool = False, lib=None, *, window_size=(-1, -1), softcap: float = 0.0,
) -> None:
    """Run backward variant `variant`, writing dq, dk, dv (shaped like q, k, v). For GQA the
    kernel sums dk, dv over the query heads of each kv head."""
    mask = masking(causal, window_size, softcap)
    plan = _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, mask, float(softmax_scale), variant,
                     deterministic, lib or runtime.get_library())
    _bwd_run(plan, dout, q, k, v, out, lse, dq, dk, dv)


def _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, mask: Masking, scale: float, variant: str,
              deterministic: bool, lib) -> _Plan:
    """Every check of a backward call (the params' pointers are this call's; _bwd_run sets
    the workspace's)."""
    check_device(q, k, v)
    dims = check_inputs(q, k, v)
    _check_bwd_inputs(dout, out, lse, dq, dk, dv, q, k, v, dims)
    info = lib.find("bwd", dims.dtype, dims.head_dim, variant=variant or None, **mask.key())
    check_layout(q=q, k=k, v=v)
    launches = dims.batch and dims.heads_q and dims.seqlen_q and dims.seqlen_k
    params = layout = None
    if launches:
        layout = _bwd_layout(dims, info.tile_m, bool(deterministic))
        params = _make_bwd_params(q, k, v, out, dout, lse, dq, dk, dv, None, dims, scale,
                                  deterministic, mask)  # _bwd_run allocates the workspace
    return _Plan(lib, info, dims, mask, scale, q.device, params, bool(deterministic), layout)


def _bwd_run(plan: _Plan, dout, q, k, v, out, lse, dq, dk, dv) -> None:
    """Launch plan on tensors of its signature (dq, dk, dv: as _empty_grads makes them)."""
    if plan.params is None:
        dq.zero_()  # no query or no key: nothing flows back
        dk.zero_()
        dv.zero_()
        return
    workspace = _bwd_workspace(plan.workspace_layout, q.device)
    p = _bwd_call_params(plan, dout, q, k, v, out, lse, dq, dk, dv,
                         plan.workspace_layout.pointers(workspace))
    _launch(plan.lib, plan.info, plan.device, lambda: p)


def _bwd_call_params(plan: _Plan, dout, q, k, v, out, lse, dq, dk, dv, work: dict):
    """A copy of plan's params with this call's pointers (checked for alignment) and those of
    its workspace (`work`: WorkspaceLayout.pointers)."""
    p = runtime.BwdParams.from_buffer_copy(plan.params)
    p.q, p.k, p.v, p.o, p.dout, p.dq, p.dk, p.dv = _aligned_pointers(
        _BWD_POINTERS, q, k, v, out, dout, dq, dk, dv)
    p.lse = lse.data_ptr()
    _set_workspace(p, work)
    return p


def _empty_grads(q, k, v):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("fa3gen::bwd", mutates_args=())
def _bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    variant: str,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = masking(causal, (window_left, window_right), softcap)
    if _trace._active and variant:  # when the graph runs: a graph compiled before the trace too
        _trace.record(variant, _is_default(variant, lambda: resolve_bwd_variant(q, q.shape[-1],
                                                                                mask)),
                      batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                      heads_q=q.shape[2], heads_kv=k.shape[2])
    return _backward(dout, q, k, v, out, lse, mask, softmax_scale, variant, deterministic)


def _is_default(variant: str, resolve) -> bool:
    """Whether variant is the key's default (resolve() names it): a backward op is called with
    the default its autograd formula resolved, or with a variant named by the caller (bench)."""
    try:
        return variant == resolve()
    except VariantNotBuiltError:
        return False


def _backward(dout, q, k, v, out, lse, mask: Masking, softmax_scale: float, variant: str,
              deterministic: bool):
    """(dq, dk, dv) of backward variant `variant`: the custom op's body (and the eager path's
    for a misaligned dout). Autograd (or a compiled graph) may hand over any strides: what TMA
    cannot read is copied. The checks and params are planned once per call signature (with
    which inputs it copies), as the eager backward's are."""
    check_softmax_scale(softmax_scale)  # as _forward's
    ins = (dout, q, k, v, out)
    lib = runtime.get_library()
    key = (_layout_key(*ins, lse), mask, float(softmax_scale), variant, bool(deterministic), lib,
           _grid_env())
    dq, dk, dv = _empty_grads(q, k, v)
    lse = lse.contiguous()
    plan, ready = _plan_once(_bwd_op_plans, key, ins, _tma_ready, lambda ready: _bwd_plan(
        *ready, lse, dq, dk, dv, mask, float(softmax_scale), variant, deterministic, lib))
    _bwd_run(plan, *ready, lse, dq, dk, dv)
    return dq, dk, dv


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, variant, deterministic,
              window_left=-1, window_right=-1, softcap=0.0):
    return _empty_grads(q, k, v)


def resolve_bwd_variant(q: torch.Tensor, head_dim: int, mask: Masking | bool) -> str:
    """Name of the default backward variant for q's dtype (clear error when none was built).
    mask: the call's Masking, or just causal. No length: a compiled backward fixes its variant
    when traced, so the spec allows no seqlen_k ranges on backward keys (eager runs the same)."""
    dtype = _DTYPES.get(q.dtype, str(q.dtype))
    return _variant_name("bwd", dtype, head_dim, None, *_key_flags(mask), False)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, causal, softmax_scale, _variant, deterministic, window_left, window_right,
     softcap) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.deterministic = softmax_scale, deterministic
    ctx.mask = op_masking(causal, window_left, window_right, softcap)
    # Gradients flow through out only: lse is a by-product (like FlashAttention's).
    ctx.mark_non_differentiable(lse)


def traced_backward_variant(resolve) -> str:
    """resolve() (the key's default backward variant, whose name a compiled graph bakes in),
    or "" where the library lacks it: the backward op's body resolves "" when it runs, so that
    a compiled forward whose inputs require grad (AOT traces the backward with it) runs without
    a backward variant, as an eager one does, until a backward runs and raises."""
    try:
        return resolve()
    except VariantNotBuiltError:
        return ""


def _backward_variant(q, k, mask: Masking) -> str:
    """The default backward variant of the key (fa3gen::bwd records it when it runs)."""
    return traced_backward_variant(lambda: resolve_bwd_variant(q, q.shape[-1], mask))


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    m = ctx.mask
    dq, dk, dv = torch.ops.fa3gen.bwd(dout, q, k, v, out, lse, m.causal, ctx.softmax_scale,
                                      _backward_variant(q, k, m), ctx.deterministic,
                                      m.window_left, m.window_right, m.softcap)
    return dq, dk, dv, None, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------
# torch.func's transforms (grad, vjp, jacrev, vmap). The custom ops' own autograd wrapper is a
# Function without setup_context, which those transforms refuse; this one wraps the same ops
# in the form they take. Attention is independent per batch entry, so a vmapped dimension is
# folded into the batch: one launch, not one per vmapped entry.


def _fold_vmapped(info, in_dims, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with its vmapped dimension (broadcast where it has none) merged into dim 0."""
    folded = []
    for t, dim in zip(tensors, in_dims):
        t = t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)
        folded.append(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]))  # no -1: sizes may be 0
    return folded


def _unfold_vmapped(info, batch: int, *tensors: torch.Tensor) -> tuple:
    """Each output's dim 0 (vmapped entries x `batch`, one entry's) split again; `batch` is
    given, not divided out, so that a vmapped size of 0 works."""
    return tuple(t.reshape(info.batch_size, batch, *t.shape[1:]) for t in tensors)


def _folding_rule(call, tensors: int):
    """A vmap rule that calls `call` once on the first `tensors` inputs folded into the batch
    (the rest as they are) and unfolds each output."""

    def rule(info, in_dims, *inputs):
        folded = _fold_vmapped(info, in_dims[:tensors], *inputs[:tensors])
        first, dim = inputs[0], in_dims[0]
        batch = first.shape[0] if dim is None else first.movedim(dim, 0).shape[1]
        outputs = _unfold_vmapped(info, batch, *call(*folded, *inputs[tensors:]))
        return outputs, (0,) * len(outputs)

    return rule


torch.library.register_vmap("fa3gen::fwd", _folding_rule(torch.ops.fa3gen.fwd, 3))
torch.library.register_vmap("fa3gen::bwd", _folding_rule(torch.ops.fa3gen.bwd, 6))


NO_FORWARD_MODE = ("fa3gen's attention has no forward-mode derivative (torch.func.jvp, jacfwd, "
                   "torch.autograd.forward_ad): use reverse mode (grad, vjp, jacrev)")


def refuse_tangents(*tensors) -> None:
    """Forward-mode AD (torch.autograd.forward_ad) through an eager call: a dual input's
    tangent would be dropped (the kernels have no jvp), so an error instead. Call it inside a
    dual level only (forward_ad._current_level >= 0): unpack_dual costs microseconds."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            raise Fa3genError(NO_FORWARD_MODE)


def transforming() -> bool:
    """Whether a torch.func transform that needs `transformable`'s Function (grad, vjp, jacrev,
    vmap, jvp) is on top; not while compiling (dynamo traces the transforms), nor under
    functionalize, which takes the custom ops as they are."""
    if not _functorch_active() or torch.compiler.is_compiling():
        return False
    return _peek_interpreter().key() != _FUNCTIONALIZE


def transformable(name: str, op, setup_context, op_backward, vmap) -> type:
    """An autograd.Function over custom op `op` in the form torch.func's transforms take:
    setup_context and op_backward are the op's autograd registration (the first three inputs
    q, k, v the differentiable ones), vmap(info, in_dims, *inputs) its batching rule. The
    backward's op runs without grad mode (the transforms keep it on, and the backward ops have
    no derivative), so a second derivative raises instead; forward-mode AD raises."""

    def forward(*inputs):
        return op(*inputs)

    def backward(ctx, *grad_outputs):
        with torch.no_grad():
            grads = op_backward(ctx, *grad_outputs)
        return (*no_second_derivative(*ctx.saved_tensors[:3], grad_outputs[0],
                                      grads=grads[:3]), *grads[3:])

    def jvp(ctx, *_):
        raise Fa3genError(NO_FORWARD_MODE)

    return type(name, (torch.autograd.Function,), {
        "__doc__": f"{op} under a torch.func transform (ops.transformable).",
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "vmap": staticmethod(vmap),
        "jvp": staticmethod(jvp)})


# flash_attn_func under a transform; its vmap rule folds the vmapped dimension into the batch.
_TransformedAttention = transformable(
    "_TransformedAttention", torch.ops.fa3gen.fwd, _fwd_setup_context, _fwd_backward,
    _folding_rule(lambda *inputs: _TransformedAttention.apply(*inputs), 3))


# ---------------------------------------------------------------------------------------------
# Eager path: flash_attn_func outside graph capture. The checks, the dispatch and the params
# are computed once per call signature; a call that repeats one costs two allocations, the
# pointer checks and the launch.

_fwd_plans: dict = {}  # forward call signature -> _Plan
_bwd_plans: dict = {}  # _backward_key (forward _Plan, dout's layout, ...) -> (_Plan, (copies dout,))
_bwd_op_plans: dict = {}  # the bwd op's call signature -> (_Plan, which of dout..out it copies)
_MAX_PLANS = 1024  # emptied when full: shapes that never repeat re-plan, memory stays bounded


def _signature(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _layout_key(*tensors: torch.Tensor) -> tuple:
    """What a backward op body's checks read of its tensors (the TMA checks read the data
    pointer's alignment too): part of the key its plan is kept under."""
    return tuple((*_signature(t), _data_ptr(t) % _TMA_ALIGN_BYTES) for t in tensors)


def _plan_once(plans: dict, key, given: tuple, ready, make_plan) -> tuple:
    """(plan, `given` as it reads them) for a backward op body: make_plan(ready tensors) runs
    the checks once per key, and remembers which of `given` `ready` copied (TMA cannot read
    their layout); a repeated key copies those again and plans nothing."""
    found = plans.get(key)
    if found is None:
        made = tuple(ready(t) for t in given)
        plan = make_plan(made)
        _remember(plans, key, (plan, tuple(m is not t for m, t in zip(made, given))))
        return plan, made
    plan, copies = found
    return plan, tuple(ready(t) if c else t for t, c in zip(given, copies))


def _remember(plans: dict, key, value):
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = value
    return value


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _eager_fwd_plan(q, k, v, mask: Masking, softmax_scale, variant: str | None) -> _Plan:
    try:
        lib = runtime.get_library()
    except Fa3genError:  # bad tensors are reported before a missing library
        check_device(q, k, v)
        check_inputs(q, k, v)
        check_layout(q=q, k=k, v=v)
        raise
    key = (_signature(q), _signature(k), _signature(v), mask,
           softmax_scale if softmax_scale is None else float(softmax_scale), variant, lib,
           _grid_env())
    plan = _fwd_plans.get(key)
    if plan is None:
        check_device(q, k, v)
        dims = check_inputs(q, k, v)
        name = resolve_variant(dims, mask, variant)
        out, lse = _empty_outputs(q)
        plan = _remember(_fwd_plans, key, _fwd_plan(
            q, k, v, out, lse, mask, _softmax_scale(softmax_scale, dims.head_dim), name, lib))
    return plan


def _eager_forward(plan: _Plan, q, k, v, with_lse: bool = True):
    """(out, lse) of plan on q, k, v; lse None unless with_lse (the kernel then writes none:
    one allocation a call less where nothing reads it)."""
    out, lse = _empty_outputs(q, with_lse=with_lse)
    _fwd_run(plan, q, k, v, out, lse)
    return out, lse


def _backward_plan_once(plans: dict, key, dout, make_plan, ready=None):
    """(plan, dout as the kernels take it) of an eager backward whose signature is
    `key`: make_plan(dout) runs the checks and the dispatch once per signature. Autograd may
    hand over dout with strides TMA cannot read; then every call copies it (`ready` makes the
    copy the plan is checked on; default _tma_ready)."""
    plan, (dout,) = _plan_once(plans, key, (dout,), ready or _tma_ready,
                               lambda made: make_plan(made[0]))
    return plan, dout


def _backward_key(fwd: _Plan, deterministic: bool, dout, grads, saved: tuple) -> tuple:
    """An eager backward's plan key (dense and varlen): dout's layout with its alignment, which
    decides a copy (_plan_once), the saved tensors' strides (the forward's plan read q, k, v
    as the forward got them, but a saved-tensor hook such as save_on_cpu gives them back
    contiguous; shapes, dtypes and devices stay the forward's, and the pointers' alignment is
    checked on every call) and the given gradients' strides: all of them are the params'."""
    key = (fwd, deterministic, *_layout_key(dout), *(t.stride() for t in saved))
    return key if grads is None else key + tuple(_signature(g) for g in grads)


def refuse_batched_backward(dout: torch.Tensor) -> None:
    """A batched gradient reaches the eager backward as a dout without storage (autograd's
    own vmap wrapper): one clear error instead of torch's about data pointers. (A sparse
    dout has none either: torch's own error names it.)"""
    if not _has_storage(dout) and dout.layout is _STRIDED:
        raise Fa3genError(
            "batched gradients through an eager fa3gen call (autograd.grad(..., "
            "is_grads_batched=True), autograd.functional.jacobian / hessian with "
            "vectorize=True) are not supported; torch.func.jacrev or vmap over torch.func.vjp "
            "of the same function are")


def _eager_backward(fwd: _Plan, deterministic: bool, dout, q, k, v, out, lse, grads=None):
    """dq, dk, dv for a forward that ran `fwd` on q, k, v (whose layout it checked), new, or
    written into `grads` (views of packed gradients, fa3gen.packed)."""
    refuse_batched_backward(dout)
    plan, dout = _backward_plan_once(
        _bwd_plans, _backward_key(fwd, deterministic, dout, grads, (q, k, v, out, lse)), dout,
        lambda ready: _bwd_plan(ready, q, k, v, out, lse, *(grads or _empty_grads(q, k, v)),
                                fwd.mask, fwd.scale, None,  # fwd.lib's default
                                deterministic, fwd.lib))
    if _trace._active:
        _trace_call(plan.info.name, True, plan.dims)
    # (a misaligned dout arrives copied: its alignment is in the key, and the plan copies it)
    dq, dk, dv = grads or _empty_grads(q, k, v)
    _bwd_run(plan, dout, q, k, v, out, lse, dq, dk, dv)
    return dq, dk, dv


class _EagerAttention(torch.autograd.Function):
    """flash_attn_func outside graph capture: the same kernels as the custom ops, without the
    custom-op machinery, whose first call imports torch._dynamo (3-4 s in a fresh process;
    torch wraps every custom-op kernel in torch._disable_dynamo) and which adds dispatch work
    to every call."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, deterministic: bool):
        out, lse = _eager_forward(plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.deterministic = plan, deterministic
        ctx.mark_non_differentiable(lse)  # as the custom op: gradients flow through out only
        # lse's gradient is always zero: passed as None instead of a zero-filled tensor (an
        # allocation and a fill kernel per backward call otherwise).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # not reached through out (lse carries no gradient): nothing flows back
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _eager_backward(ctx.plan, ctx.deterministic, dout, q, k, v, out, lse)
        return (*no_second_derivative(q, k, v, dout, grads=(dq, dk, dv)), None, None)


def _c_apply(function: type):
    """function.apply without torch.autograd.Function.apply's Python layer (1.5-2 us a call):
    its C entry, for calls where no torch.func transform is active (the layer's other work is
    for transforms); the layer's unwrapping of dead functorch wrappers is done here for the
    tensors. Function.apply where this torch has no such entry."""
    entry = getattr(torch._C, "_FunctionBase", None)
    entry = entry and entry.__dict__.get("apply")
    unwrap = getattr(torch._C._functorch, "unwrap_if_dead", None)
    if entry is None or unwrap is None:
        return function.apply
    apply = entry.__get__(None, function)
    return lambda q, k, v, *rest: apply(unwrap(q), unwrap(k), unwrap(v), *rest)


_eager_attention = _c_apply(_EagerAttention)  # outside transforms only (_captured is False)


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients as they are, but an error (not zeros) if anything differentiates them:
    tied to every input (the first `anchors` arguments), so that differentiating them with
    respect to any one raises. Written with setup_context, so torch.func's transforms take it
    too."""

    generate_vmap_rule = True

    @staticmethod
    def forward(anchors, *tensors):
        # copies, not views: a view made inside a Function cannot be modified in place, and
        # a gradient of create_graph=True is a tensor the caller may scale or clip in place
        return tuple(g.clone() if g is not None else None for g in tensors[anchors:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise Fa3genError("fa3gen's attention has no second derivative: its backward is not "
                          "differentiable (create_graph=True, torch.func.grad of a grad, or "
                          "torch.autograd.functional.jvp / hvp, through flash_attn_func)")


def no_second_derivative(*inputs: torch.Tensor, grads: tuple) -> tuple:
    """The backward's gradients; under create_graph (grad mode on in backward), tied to the
    inputs (q, k, v and the incoming gradient dout) when one requires grad, so that
    differentiating them raises instead of giving silent zeros (the custom ops say "no
    autograd formula" then; eager must not be silently different). Every input is tied, not
    only one that requires grad here: a nested torch.func.grad may differentiate with respect
    to another at an outer level, and autograd.functional.jvp differentiates with respect to
    dout (the double-backward trick)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return grads
    return _NoSecondDerivative.apply(len(inputs), *inputs, *grads)


def _trace_call(name: str, default: bool, dims: Dims) -> None:
    _trace.record(name, default, batch=dims.batch, seqlen_q=dims.seqlen_q,
                  seqlen_k=dims.seqlen_k, heads_q=dims.heads_q, heads_kv=dims.heads_kv)


# One call per flash_attn_func (not one per tensor): whether a torch.func transform is running.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_has_storage = getattr(torch._C, "_has_storage", lambda t: True)
_peek_interpreter = torch._C._functorch.peek_interpreter_stack
_FUNCTIONALIZE = torch._C._functorch.TransformType.Functionalize


def _captured(*tensors: torch.Tensor) -> bool:
    """True where the custom ops must serve the call: under torch.compile / export tracing, for
    tensor subclasses (fake, functional, distributed) that hold no plain device memory, and
    under torch.func's transforms (vmap, grad), whose tensors look plain but have no storage."""
    for t in tensors:  # a loop, not any(generator): 0.3 us a call instead of 0.7
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return True
    return torch.compiler.is_compiling() or _functorch_active()


# ---------------------------------------------------------------------------------------------
# Public API.


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without its import of torch._dynamo (3-4 s at
    import of this module, which eager callers never need): that decorator only sets this
    attribute, which tests/test_api.py pins against torch's own."""
    fn._dynamo_marked_constant = True
    return fn


# Checks that read tensor values on the host (a device sync per call) run only when this is
# set to anything but empty or 0 (README: FA3GEN_DEBUG_CHECKS).
DEBUG_CHECKS_ENV = "FA3GEN_DEBUG_CHECKS"


@_assume_constant_result  # torch.compile reads the switch once, while tracing
def debug_checks_enabled() -> bool:
    return os.environ.get(DEBUG_CHECKS_ENV, "") not in ("", "0")


def check_entries(name: str, t: torch.Tensor, bad: torch.Tensor, requirement: str) -> None:
    """A debug check's error: names the first entry of t where `bad` holds (reads it on the
    host)."""
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise InvalidInputError(f"{name}{at} is {t[tuple(at)].item()}: {requirement}")


def _variant_name(direction: str, dtype: str, head_dim, variant, causal: bool, local: bool,
                  softcap: bool, varlen: bool = False, seqlen_k=None) -> str:
    return _lookup_variant_name(direction, dtype, static_head_dim(head_dim), variant, causal,
                                local, softcap, varlen, seqlen_k)


def static_head_dim(head_dim):
    """head_dim as a constant: under torch.compile with dynamic shapes (dynamic=True, or a
    recompile after a head_dim changed) it is a SymInt, which a constant function cannot take
    and int() does not make constant; comparing it with each head dim fa3gen builds does (a
    guard per comparison: the head dim picks the kernels). Another value in [0, 2^31) comes back
    as the int of its value (whose lookup names what the library has)."""
    for known in SUPPORTED_HEAD_DIMS:
        if head_dim == known:
            return known
    # No kernel's. A SymInt (dynamo's: isinstance cannot tell) becomes its value by a bisection
    # of guards, for the lookup's error; torch 2.11's dynamo refused the SymInt there.
    if 0 <= head_dim < 1 << 31:
        lo, hi = 0, 1 << 31
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if head_dim < mid else (mid, hi)
        return lo
    return head_dim


@_assume_constant_result
def _lookup_variant_name(direction: str, dtype: str, head_dim: int, variant, causal: bool,
                         local: bool, softcap: bool, varlen: bool, seqlen_k) -> str:
    # torch.compile runs this once while tracing and bakes the name into the graph (the
    # library lookup touches files and ctypes, which dynamo cannot trace).
    return runtime.get_library().find(direction, dtype, head_dim, causal, variant, local=local,
                                      softcap=softcap, varlen=varlen, seqlen_k=seqlen_k).name


def resolve_variant(dims: Dims, mask: Masking | bool, variant: str | None = None,
                    by_length: bool = True) -> str:
    """Name of the forward variant that serves dims (default dispatch, the spec's seqlen_k
    range default for dims.seqlen_k when by_length, or the named one). mask: the call's
    Masking, or causal. Graph capture passes by_length=False (a traced length may be dynamic)
    only to check that the key is built: the op resolves a default call when it runs."""
    return _variant_name("fwd", dims.dtype, dims.head_dim, variant, *_key_flags(mask), False,
                         dims.seqlen_k if by_length else None)


def _key_flags(mask: Masking | bool) -> tuple:
    """Masking.key() as positional values (causal, local, softcap): _variant_name's are
    positional, which torch.compile bakes in as constants."""
    m = mask if isinstance(mask, Masking) else Masking(causal=bool(mask))
    return tuple(m.key().values())


def check_softmax_scale(softmax_scale, hint: str = "") -> float | None:
    """None (1 / sqrt(head_dim)) or a number in FP32_ARG_RANGE, returned as a float (a tensor's
    value read once: a CUDA one's read is a device sync); anything else one clear error."""
    if softmax_scale is None:
        return None
    value = real_number(softmax_scale)
    if value is None or not 0.0 < value < math.inf:
        raise InvalidInputError(f"softmax_scale must be a finite number > 0 (None: 1 / "
                                f"sqrt(head_dim)), got {shown(softmax_scale)}{hint}")
    if not _FP32_LO <= value <= _FP32_HI:
        _fp32_range_error("softmax_scale", value)
    return value


def _check_fa3_arguments(softmax_scale, positional: bool = True) -> float | None:
    """A scale that comes from another order (fa3gen's old (q, k, v, causal, softmax_scale),
    flash-attn 2's dropout_p): an error, never a different result. positional: the scale may
    be passed right after the tensors (the dense and the dense packed functions)."""
    if softmax_scale is None:  # the usual call
        return None
    if _is_bool_like(softmax_scale):
        raise InvalidInputError(
            f"softmax_scale={shown(softmax_scale)}: flash_attn_func follows FlashAttention-3's "
            "order (q, k, v, softmax_scale, causal); pass causal=... by keyword")
    return check_softmax_scale(
        softmax_scale, ": with flash-attn 2's order the positional argument after the tensors is "
        "dropout_p, here (FlashAttention-3's order) it is the scale" if positional else "")


def check_fa3_extras(qv, attention_chunk, num_splits, pack_gqa, sm_margin, dropout_p=0.0,
                     alibi_slopes=None) -> None:
    """FlashAttention-3's keywords that fa3gen takes only as hints (or at their defaults), and
    flash-attn 2's dropout_p and alibi_slopes, only as 0.0 and None."""
    if qv is None and type(attention_chunk) is int and attention_chunk == 0 and \
            type(num_splits) is int and num_splits == 1 and pack_gqa is None and \
            type(sm_margin) is int and sm_margin == 0 and type(dropout_p) is float and \
            dropout_p == 0.0 and alibi_slopes is None:  # the usual call: its defaults
        return
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise InvalidInputError(f"dropout_p={shown(dropout_p)}: attention dropout (flash-attn 2) "
                                "is not supported by fa3gen; only 0.0 is accepted")
    if alibi_slopes is not None:
        raise InvalidInputError("alibi_slopes (ALiBi, flash-attn 2) is not supported by fa3gen; "
                                "pass None")
    if qv is not None:
        raise InvalidInputError("qv (FlashAttention-3's extra q-v scores of multi-head latent "
                                "attention) is not supported by fa3gen")
    for name, value, least in (("attention_chunk", attention_chunk, 0),
                               ("num_splits", num_splits, 0), ("sm_margin", sm_margin, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise InvalidInputError(f"{name} must be an int >= {least}, got {shown(value)}")
    if attention_chunk:
        raise InvalidInputError(f"attention_chunk={shown(attention_chunk)} (chunked local "
                                "attention) is not supported by fa3gen; window_size gives sliding "
                                "windows")
    if pack_gqa is not None and not _is_flag(pack_gqa):
        raise InvalidInputError(f"pack_gqa must be None, True or False, got {shown(pack_gqa)}")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
    variant: str | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    qv: None = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    dropout_p: float = 0.0,
    alibi_slopes: None = None,
):
    """Attention softmax(q k^T * scale) v on Hopper with an fa3gen-generated kernel.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    bf16 or fp16 on an sm_90 GPU; heads_q a multiple of heads_kv (GQA/MQA: query head i uses
    kv head i // (heads_q // heads_kv)). head_dim stride must be 1, other strides multiples
    of 16 bytes (views like qkv[:, :, 0] of a packed tensor are fine, no copy is made).
    causal: bottom-right aligned mask (query i sees key j iff j <= i + seqlen_k - seqlen_q);
    rows that see no key (also every row when seqlen_k == 0) give 0 and lse -inf.
    window_size=(left, right): sliding-window (local) attention, query i sees keys j with
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded on
    that side); causal=True sets right to 0; (-1, -1) is no window. Served by the spec's local
    variants (the window is a runtime argument). softcap > 0: scores become
    softcap * tanh(scores * softmax_scale / softcap) before the softmax (Gemma 2), by the
    softcap variants. Both as in flash-attn.
    softmax_scale: default 1/sqrt(head_dim). variant: a variant name of the loaded library
    instead of the spec's default for the call's key (dtype, head_dim, causal, local, softcap)
    and its seqlen_k range defaults.
    Differentiable in q, k, v (the spec's default backward variant for the key; lse carries no
    gradient). deterministic: the backward accumulates dq in a fixed order, so gradients are
    bitwise reproducible (slower), also under torch.use_deterministic_algorithms(True); dk and
    dv are always deterministic.
    Returns out (batch, seqlen_q, heads_q, head_dim), plus lse (batch, heads_q, seqlen_q)
    float32 when return_lse (or return_attn_probs, FlashAttention-3's name for it).
    The positional order is FlashAttention-3's (q, k, v, softmax_scale, causal); the rest is
    keyword-only.
    FP8: q, k, v in torch.float8_e4m3fn run the e4m3 forward variants (forward only; causal or
    not): q_descale, k_descale, v_descale are fp32 factors per (batch, heads_kv) (or one value;
    None: 1) as in FlashAttention-3, or per (batch, heads, block of rows) for block quantization
    (what fa3gen.quantize_fp8 returns; the blocks are the serving variant's tiles,
    fa3gen.fp8.block_sizes), applied to the scores and the output; the output is bf16,
    or fp16 with out_dtype=torch.float16 (fa3gen.fp8).
    FlashAttention-3's other keywords: num_splits, pack_gqa and sm_margin are performance
    hints, accepted and not used (fa3gen's forward neither splits keys nor packs GQA heads,
    and its persistent grid takes every SM); qv and attention_chunk change the result and are
    not supported (only their defaults are accepted). flash-attn 2's dropout_p and
    alibi_slopes are accepted by keyword as 0.0 and None (no dropout, no ALiBi).
    """
    check_fa3_extras(qv, attention_chunk, num_splits, pack_gqa, sm_margin, dropout_p, alibi_slopes)
    return _attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                      returns_lse(return_lse, return_attn_probs), variant, q_descale, k_descale,
                      v_descale, out_dtype)


def _attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_lse,
               variant, q_descale, k_descale, v_descale, out_dtype, packed=None):
    """flash_attn_func's body. packed: (tensors, unpack) when q, k, v are unpack(tensors),
    views of packed inputs (fa3gen.packed): an eager call that autograd records then writes
    its gradients into one tensor per packed input."""
    softmax_scale = _check_fa3_arguments(softmax_scale)  # a tensor's value, read once
    mask = masking(causal, window_size, softcap)
    deterministic = deterministic_backward(deterministic)
    check_variant(variant)
    _check_tensors(q, k, v)
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if q_descale is not None or k_descale is not None or v_descale is not None or \
            out_dtype is not None:  # fp8's arguments (a check of 1 us the usual call skips)
        _fp8.check_descale_use(q, k, v, descales, out_dtype)
    fp8 = _fp8.FP8_DTYPE in (q.dtype, k.dtype, v.dtype)
    if _captured(q, k, v):  # the custom ops: the checks here, the launch when the graph runs
        check_device(q, k, v)
        dims = check_inputs(q, k, v)
        if fp8:
            out_dtype = _fp8.check_call(q, k, v, mask, out_dtype, descales)
        # Tracing only checks that the key (or the named variant) is built. A default call
        # leaves the choice to the op ("" below), which makes it when it runs, by the call's
        # length as eager calls do (the spec's seqlen_k range defaults; fp8 block descales are
        # made for those tiles): a traced length may be dynamic, and a name baked into the
        # graph would serve every length. The op also records the call for fa3gen.trace.
        name = resolve_variant(dims, mask, variant, by_length=False)
        op_variant = "" if variant is None else name
        check_layout(q=q, k=k, v=v)
        scale = _softmax_scale(softmax_scale, dims.head_dim)
        if fp8:
            out, lse = torch.ops.fa3gen.fwd_fp8(q, k, v, q_descale, k_descale, v_descale,
                                                mask.causal, scale, op_variant,
                                                out_dtype == torch.float16)
        else:
            # Under torch.func's transforms: the same op in a Function they accept.
            fwd = _TransformedAttention.apply if transforming() else torch.ops.fa3gen.fwd
            out, lse = fwd(q, k, v, mask.causal, scale, op_variant, bool(deterministic),
                           mask.window_left, mask.window_right, mask.softcap)
    elif fp8:
        out, lse, name, dims = _fp8.fp8_forward(q, k, v, mask, softmax_scale, variant, descales,
                                                out_dtype)
        if _trace._active:
            _trace_call(name, variant is None, dims)
    else:
        if _forward_ad._current_level >= 0:  # inside forward_ad.dual_level(): rarely
            refuse_tangents(q, k, v)
        plan = _eager_fwd_plan(q, k, v, mask, softmax_scale, variant)
        if _trace._active:
            _trace_call(plan.info.name, variant is None, plan.dims)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            if packed is None:
                out, lse = _eager_attention(q, k, v, plan, bool(deterministic))
            else:
                from fa3gen.packed import DenseRun, PackedAttention
                run = DenseRun(plan, bool(deterministic), packed[1])
                out, lse = PackedAttention.apply(run, *packed[0], *run.tensors)
        else:
            out, lse = _eager_forward(plan, q, k, v, with_lse=return_lse)
    return (out, lse) if return_lse else out
