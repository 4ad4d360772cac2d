"""Load a generated fa3gen library with ctypes and read its variant table.

Mirrors templates/kernels/fa3gen_abi.h. No torch import: the library is plain C, so this module
(and the lookup logic, which works on plain lists of VariantInfo) is usable and testable anywhere.

Which library is loaded, first match wins:
  1. get_library(spec=...) argument, or the spec chosen with use_spec(...)  (explicit code)
  2. env FA3GEN_LIB: a path to a built .so
  3. <generated root>/<spec>/lib/libfa3gen_<spec>.so with spec "h100", where the generated root
     is env FA3GEN_GENERATED or <repo root>/generated.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fa3gen.errors import (
    AbiMismatchError,
    Fa3genError,
    LibraryNotBuiltError,
    VariantNotBuiltError,
)

# Must equal FA3GEN_ABI_VERSION in templates/kernels/fa3gen_abi.h (bump both together).
ABI_VERSION = 3
DEFAULT_SPEC = "h100"
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# ctypes mirror of the header. Field order and types must match it exactly.


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),  # float* in C; a void* has the same size and alignment
        ("q_batch_stride", ctypes.c_int64),
        ("q_row_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("k_batch_stride", ctypes.c_int64),
        ("k_row_stride", ctypes.c_int64),
        ("k_head_stride", ctypes.c_int64),
        ("v_batch_stride", ctypes.c_int64),
        ("v_row_stride", ctypes.c_int64),
        ("v_head_stride", ctypes.c_int64),
        ("o_batch_stride", ctypes.c_int64),
        ("o_row_stride", ctypes.c_int64),
        ("o_head_stride", ctypes.c_int64),
        ("batch", ctypes.c_int32),
        ("seqlen_q", ctypes.c_int32),
        ("seqlen_k", ctypes.c_int32),
        ("heads_q", ctypes.c_int32),
        ("heads_kv", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("num_sms", ctypes.c_int32),
        ("grid_mode", ctypes.c_int32),
    ]


# FA3GEN_GRID_* of the header: the forward's grid policy.
GRID_MODES = {"auto": 0, "persistent": 1, "tiles": 2}


def _strided(*names: str) -> list:
    return [(f"{n}_{w}_stride", ctypes.c_int64) for n in names for w in ("batch", "row", "head")]


class BwdParams(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_void_p) for n in ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv",
                                        "dq_accum", "lse_log2", "dsum", "dq_semaphore")]
        + _strided("q", "k", "v", "o", "do", "dq", "dk", "dv")
        + [(n, ctypes.c_int32) for n in ("batch", "seqlen_q", "seqlen_k", "heads_q",
                                         "heads_kv", "head_dim")]
        + [("softmax_scale", ctypes.c_float), ("deterministic", ctypes.c_int32)]
    )


FwdLaunchFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(FwdParams), ctypes.c_void_p)
BwdLaunchFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(BwdParams), ctypes.c_void_p)


class VariantInfoC(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("direction", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("head_dim", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("tile_m", ctypes.c_int32),
        ("tile_n", ctypes.c_int32),
        ("stages", ctypes.c_int32),
        ("warp_specialized", ctypes.c_int32),
        ("pingpong", ctypes.c_int32),
        ("intra_wg_overlap", ctypes.c_int32),
        ("is_default", ctypes.c_int32),
        ("launch_fwd", FwdLaunchFn),
        ("launch_bwd", BwdLaunchFn),
    ]


# ---------------------------------------------------------------------------------------------
# Python view of the variant table.


@dataclass(frozen=True)
class VariantInfo:
    name: str
    direction: str
    dtype: str
    head_dim: int
    causal: bool
    tile_m: int
    tile_n: int
    stages: int
    warp_specialized: bool
    pingpong: bool
    intra_wg_overlap: bool
    is_default: bool
    # The C launcher of the variant's direction (None in fabricated tables).
    launch: Callable[..., int] | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, str, int, bool]:
        """The dispatch key (direction, dtype, head_dim, causal)."""
        return (self.direction, self.dtype, self.head_dim, self.causal)


def _variant_from_c(c: VariantInfoC) -> VariantInfo:
    def s(b: bytes | None) -> str:
        return b.decode() if b is not None else ""

    return VariantInfo(
        name=s(c.name),
        direction=s(c.direction),
        dtype=s(c.dtype),
        head_dim=int(c.head_dim),
        causal=bool(c.causal),
        tile_m=int(c.tile_m),
        tile_n=int(c.tile_n),
        stages=int(c.stages),
        warp_specialized=bool(c.warp_specialized),
        pingpong=bool(c.pingpong),
        intra_wg_overlap=bool(c.intra_wg_overlap),
        is_default=bool(c.is_default),
        # a NULL function pointer is falsy
        launch=(c.launch_bwd if s(c.direction) == "bwd" else c.launch_fwd) or None,
    )


def describe_key(direction: str, dtype: str, head_dim: int, causal: bool) -> str:
    return f"direction={direction} dtype={dtype} head_dim={head_dim} causal={bool(causal)}"


def select_variant(
    variants: Sequence[VariantInfo],
    direction: str,
    dtype: str,
    head_dim: int,
    causal: bool,
    variant: str | None = None,
    *,
    spec_name: str | None = None,
    library: str = "",
) -> VariantInfo:
    """The variant serving a call: the named one, else the spec's default for the key.

    Pure (no ctypes) so tests can run it on fabricated tables. Never falls back to another key or
    to a non-default variant: a miss raises VariantNotBuiltError with a build hint.
    """
    causal = bool(causal)
    key = (direction, dtype, int(head_dim), causal)
    listing = [v.name + (" (default)" if v.is_default else "") for v in variants]
    spec_file = f"specs/{spec_name or '<spec>'}.yaml"
    build = f"fa3gen build --spec {spec_file}"

    if variant is not None:
        found = next((v for v in variants if v.name == variant), None)
        if found is None:
            raise VariantNotBuiltError(
                f"variant name {variant!r}",
                listing,
                f"check the name with `fa3gen list --spec {spec_file}`, add its configuration "
                f"to a group of {spec_file} and run: {build}",
                library,
            )
        if found.key != key:
            # Running a kernel on inputs of another dtype/head_dim would read garbage.
            raise Fa3genError(
                f"variant {variant!r} serves {describe_key(*found.key)}, but the call needs "
                f"{describe_key(*key)}; name a variant built for this key or pass variant=None"
            )
        return found

    for v in variants:
        if v.is_default and v.key == key:
            return v
    same_key = [v.name for v in variants if v.key == key]
    if same_key:
        hint = (
            f"the library has non-default variants for this key ({', '.join(same_key[:5])}); "
            f"pass one as variant=..., or give the key a default in the dispatch section of "
            f"{spec_file} and run: {build}"
        )
    else:
        hint = (
            f"add head_dim: {head_dim} (dtype {dtype}, causal: {str(causal).lower()}) to a group "
            f"of {spec_file} and run: {build}"
        )
    raise VariantNotBuiltError(describe_key(*key), listing, hint, library)


# ---------------------------------------------------------------------------------------------
# The loaded library.


class Library:
    """One loaded libfa3gen_<spec>.so and its variant table."""

    def __init__(self, path: str | os.PathLike, spec_name: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise LibraryNotBuiltError(self.path, spec_name)
        try:
            # RTLD_LOCAL: several spec libraries (h100, ablation) export the same symbol names.
            self._dll = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise Fa3genError(f"cannot load fa3gen library {self.path}: {e}") from e
        dll = self._dll
        try:
            dll.fa3gen_abi_version.restype = ctypes.c_int32
            dll.fa3gen_abi_version.argtypes = []
            found = dll.fa3gen_abi_version()
        except AttributeError:
            found = "none (no fa3gen_abi_version symbol)"
        if found != ABI_VERSION:
            raise AbiMismatchError(self.path, found, ABI_VERSION, spec_name)

        dll.fa3gen_num_variants.restype = ctypes.c_int32
        dll.fa3gen_num_variants.argtypes = []
        dll.fa3gen_variant.restype = ctypes.POINTER(VariantInfoC)
        dll.fa3gen_variant.argtypes = [ctypes.c_int32]
        dll.fa3gen_build_info.restype = ctypes.c_char_p
        dll.fa3gen_build_info.argtypes = []
        dll.fa3gen_last_error.restype = ctypes.c_char_p
        dll.fa3gen_last_error.argtypes = []

        self.build_info = _parse_build_info(dll.fa3gen_build_info())
        self.spec_name = spec_name or _spec_from_build_info(self.build_info)
        self.variants: list[VariantInfo] = []
        for i in range(dll.fa3gen_num_variants()):
            ptr = dll.fa3gen_variant(i)
            if not ptr:
                raise Fa3genError(f"{self.path}: fa3gen_variant({i}) returned NULL")
            self.variants.append(_variant_from_c(ptr.contents))
        self._by_name = {v.name: v for v in self.variants}

    def __repr__(self) -> str:
        return f"Library({str(self.path)!r}, {len(self.variants)} variants)"

    def names(self, direction: str | None = None) -> list[str]:
        return [v.name for v in self.variants if direction is None or v.direction == direction]

    def defaults(self, direction: str | None = None) -> list[VariantInfo]:
        return [v for v in self.variants if v.is_default and direction in (None, v.direction)]

    def get(self, name: str) -> VariantInfo | None:
        return self._by_name.get(name)

    def find(
        self, direction: str, dtype: str, head_dim: int, causal: bool, variant: str | None = None
    ) -> VariantInfo:
        if variant is not None:  # fast path: the op resolves by name on every call
            v = self._by_name.get(variant)
            if v is not None and v.key == (direction, dtype, int(head_dim), bool(causal)):
                return v
        return select_variant(
            self.variants, direction, dtype, head_dim, causal, variant,
            spec_name=self.spec_name, library=str(self.path),
        )

    def last_error(self) -> str:
        msg = self._dll.fa3gen_last_error()
        return msg.decode(errors="replace") if msg else "(no message)"

    def launch(self, info: VariantInfo, params: FwdParams | BwdParams, stream_handle: int) -> None:
        """Run info's launcher on a CUDA stream (a cudaStream_t as an int; 0 = legacy).
        params must be FwdParams for a forward variant, BwdParams for a backward one."""
        want = BwdParams if info.direction == "bwd" else FwdParams
        if info.launch is None or self._by_name.get(info.name) is not info:
            raise Fa3genError(f"variant {info.name} has no launcher in {self.path}")
        if not isinstance(params, want):
            raise Fa3genError(f"variant {info.name} takes {want.__name__}, got {type(params).__name__}")
        rc = info.launch(ctypes.byref(params), ctypes.c_void_p(stream_handle or None))
        if rc != 0:
            raise Fa3genError(f"fa3gen kernel {info.name} failed (code {rc}): {self.last_error()}")


def _parse_build_info(raw: bytes | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        info = json.loads(raw.decode(errors="replace"))
    except ValueError:
        return {"raw": raw.decode(errors="replace")}
    return info if isinstance(info, dict) else {"value": info}


def _spec_from_build_info(info: dict[str, Any]) -> str | None:
    for k in ("spec", "spec_name", "name"):
        if isinstance(info.get(k), str):
            return info[k]
    return None


# ---------------------------------------------------------------------------------------------
# Locating and caching libraries.

_lock = threading.Lock()
_libraries: dict[Path, Library] = {}  # loaded libraries by resolved path
# get_library's answers by request (spec, use_spec's choice, FA3GEN_LIB, FA3GEN_GENERATED): the
# per-call fast path, without resolving the path again.
_requests: dict[tuple, Library] = {}
_selected: str | None = None  # set by use_spec(); None = env FA3GEN_LIB or the default spec


def generated_root() -> Path:
    env = os.environ.get("FA3GEN_GENERATED")
    return Path(env) if env else REPO_ROOT / "generated"


def resolve_library(spec: str | os.PathLike | None = None) -> tuple[Path, str | None]:
    """(library path, spec name or None) for a spec name, a spec .yaml path or a .so path."""
    if spec is None:
        spec = _selected
    if spec is None:
        env = os.environ.get("FA3GEN_LIB")
        if env:
            return Path(env), _spec_from_lib_name(Path(env))
        spec = DEFAULT_SPEC
    s = os.fspath(spec)
    if s.endswith(".so"):
        return Path(s), _spec_from_lib_name(Path(s))
    if s.endswith((".yaml", ".yml")):
        s = _spec_name_of_file(Path(s))
    return generated_root() / s / "lib" / f"libfa3gen_{s}.so", s


def _spec_name_of_file(path: Path) -> str:
    """The spec's `name:` (what the build names generated/<name>/), else the file stem."""
    try:
        from generator.spec import load_spec  # the checkout's generator; absent when installed

        return load_spec(path).name
    except Exception:  # noqa: BLE001 - no generator, unreadable or invalid spec: use the stem
        return path.stem


def _spec_from_lib_name(path: Path) -> str | None:
    stem = path.name
    if stem.startswith("libfa3gen_") and stem.endswith(".so"):
        return stem[len("libfa3gen_"):-len(".so")]
    return None


def get_library(spec: str | os.PathLike | None = None) -> Library:
    """The library for spec (default: see module doc), loaded once per path.

    Every forward and backward call asks for the library; resolving the path (stat, realpath,
    maybe reading a spec) took ~75 us per call, so a request already answered is served from
    the cache keyed by what decides the answer: spec, use_spec's choice and the two env vars."""
    request = (None if spec is None else os.fspath(spec), _selected,
               os.environ.get("FA3GEN_LIB"), os.environ.get("FA3GEN_GENERATED"))
    lib = _requests.get(request)
    if lib is not None:
        return lib
    path, spec_name = resolve_library(spec)
    key = path.resolve() if path.exists() else path
    with _lock:
        lib = _libraries.get(key)
        if lib is None:
            lib = Library(path, spec_name)  # failures are not cached: a later build is picked up
            _libraries[key] = lib
        _requests[request] = lib
    return lib


def use_spec(name_or_path: str | os.PathLike | None) -> Library | None:
    """Make name_or_path (spec name, spec .yaml or .so) the default library and load it.

    Used by bench/ablate. None goes back to FA3GEN_LIB / the default spec (and loads nothing).
    """
    global _selected
    if name_or_path is None:
        _selected = None
        return None
    lib = get_library(name_or_path)  # load first: a missing library leaves the choice unchanged
    _selected = os.fspath(name_or_path)
    return lib
