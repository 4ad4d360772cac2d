"""Load a generated fa3gen library with ctypes and read its variant table.

Mirrors templates/kernels/fa3gen_abi.h as fa3gen.contract describes it; never imports the
generator. No torch import: the library is plain C, so this module (and the lookup logic, which
works on plain lists of VariantInfo) is usable and testable anywhere.

Which library is loaded, first match wins:
  1. get_library(spec=...) argument, or the spec chosen with use_spec(...)  (explicit code)
  1b. in a packaged copy of this module (fa3gen package): the library bundled beside it
  2. env FA3GEN_LIB: a path to a built .so
  3. <generated root>/<spec>/lib/libfa3gen_<spec>.so with spec "h100", where the generated root
     is env FA3GEN_GENERATED, else <checkout>/generated, else $XDG_CACHE_HOME/fa3gen/generated
     (an install without a checkout).
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fa3gen import contract, tracing
from fa3gen.contract import (ABI_VERSION, KEY_AXES, LAUNCHERS, SUPPORTED_HEAD_DIMS, Variant,
                             make_key)
from fa3gen.errors import (
    AbiMismatchError,
    Fa3genError,
    LibraryNotBuiltError,
    VariantNotBuiltError,
    build_command,
    spec_file_of,
)

DEFAULT_SPEC = "h100"
_dlclose = getattr(_ctypes, "dlclose", None)  # POSIX (None elsewhere)


# ---------------------------------------------------------------------------------------------
# ctypes mirror of the header, built from the contract's struct field lists (which
# tests/test_contract.py pins to fa3gen_abi.h).

_SCALAR_CTYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
                  "const char*": ctypes.c_char_p}


def _ctypes_fields(c_fields: Sequence[tuple[str, str]], named: dict | None = None) -> list:
    """(field, ctypes type) for (field, C type). Data pointers become c_void_p, which takes the
    plain integers of torch's data_ptr(); `named` maps typedef names (launchers)."""
    def ctype(c_type: str):
        if named and c_type in named:
            return named[c_type]
        if c_type in _SCALAR_CTYPES:
            return _SCALAR_CTYPES[c_type]
        if c_type.endswith("*"):
            return ctypes.c_void_p
        raise TypeError(f"no ctypes type for the C type {c_type!r}")
    return [(name, ctype(c_type)) for name, c_type in c_fields]


class FwdParams(ctypes.Structure):
    _fields_ = _ctypes_fields(LAUNCHERS["fwd"].params_fields)


class BwdParams(ctypes.Structure):
    _fields_ = _ctypes_fields(LAUNCHERS["bwd"].params_fields)


PARAMS = {"fwd": FwdParams, "bwd": BwdParams}  # by direction


class QuantizeParams(ctypes.Structure):
    _fields_ = _ctypes_fields(contract.QUANTIZE_PARAMS)


class DecodeParams(ctypes.Structure):
    _fields_ = _ctypes_fields(contract.DECODE_PARAMS)


class AppendParams(ctypes.Structure):
    _fields_ = _ctypes_fields(contract.APPEND_PARAMS)


class RotaryParams(ctypes.Structure):
    _fields_ = _ctypes_fields(contract.ROTARY_PARAMS)


_LAUNCH_FN_TYPES = {
    launcher.fn_type: ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(PARAMS[d]), ctypes.c_void_p)
    for d, launcher in LAUNCHERS.items()
}


class VariantInfoC(ctypes.Structure):
    _fields_ = _ctypes_fields(contract.VARIANT_INFO, _LAUNCH_FN_TYPES)


# ---------------------------------------------------------------------------------------------
# Python view of the variant table.


@dataclass(frozen=True)
class VariantInfo(Variant):
    """A variant of a loaded library: the contract's Variant (fields, name, key) plus what the
    library's table says of it."""

    is_default: bool = False
    # The C launcher of the variant's direction (None in fabricated tables).
    launch: Callable[..., int] | None = field(default=None, repr=False, compare=False)


def _variant_from_c(c: VariantInfoC, where: str) -> VariantInfo:
    """The Python view of one table row; `where` names the row in errors."""
    def text(b: bytes | None) -> str:
        return b.decode(errors="replace") if b is not None else ""

    values = {f: text(getattr(c, f)) if t is str else t(getattr(c, f))
              for f, t in contract.VARIANT_FIELDS}
    launcher = LAUNCHERS.get(values["direction"])
    if launcher is None:
        raise Fa3genError(f"{where}: unknown direction {values['direction']!r}")
    info = VariantInfo(**values, is_default=bool(c.is_default),
                       launch=getattr(c, launcher.info_field) or None)  # NULL is falsy
    if info.name != text(c.name):
        # The name is how callers pick a variant: it must say what the fields run.
        raise Fa3genError(f"{where} is named {text(c.name)!r} but its fields make "
                          f"{info.name!r}; rebuild the library")
    return info


def describe_key(key: tuple) -> str:
    return " ".join(f"{axis}={value}" for axis, value in zip(KEY_AXES, key))


def select_variant(
    variants: Sequence[VariantInfo],
    direction: str,
    dtype: str,
    head_dim: int,
    causal: bool,
    variant: str | None = None,
    *,
    local: bool = False,
    softcap: bool = False,
    varlen: bool = False,
    paged: bool = False,
    spec_name: str | None = None,
    library: str = "",
    build_info: dict[str, Any] | None = None,
    rebuild: tuple[str, str] | None = None,
) -> VariantInfo:
    """The variant serving a call: the named one, else the spec's default for the key.

    Pure (no ctypes) so tests can run it on fabricated tables. Never falls back to another key or
    to a non-default variant: a miss raises VariantNotBuiltError with a build hint. build_info
    (the library's, see Library.build_info) lets the hint tell a key that the build's
    --only/--exclude filter left out from one the spec lacks; rebuild (Library.rebuild_hint):
    the spec file the library was built from and the command that rebuilds it.
    """
    causal = bool(causal)
    key = make_key(direction, dtype, head_dim, causal, local, softcap, varlen, paged)
    spec_file, build = rebuild or (spec_file_of(spec_name), build_command(spec_name))

    if variant is not None:
        found = next((v for v in variants if v.name == variant), None)
        if found is None:
            raise VariantNotBuiltError(
                f"variant name {variant!r}",
                _listing(variants),
                f"check the name with `fa3gen list --spec {spec_file}`, add its configuration "
                f"to a group of {spec_file} and run: {build}",
                library,
            )
        if found.key != key:
            # Running a kernel on inputs of another dtype/head_dim would read garbage.
            raise Fa3genError(
                f"variant {variant!r} serves {describe_key(found.key)}, but the call needs "
                f"{describe_key(key)}; name a variant built for this key or pass variant=None"
            )
        return found

    for v in variants:
        if v.is_default and v.key == key:
            return v
    same_key = [v.name for v in variants if v.key == key]
    filters = _filters_that_dropped(key, build_info)
    lead = "To build it: "
    if same_key:
        hint = (
            f"the library has non-default variants for this key ({', '.join(same_key[:5])}); "
            f"pass one as variant=..., or give the key a default in the dispatch section of "
            f"{spec_file} and run: {build}"
        )
        if filters:
            hint += (f" (if {spec_file} gives it a default, the build's filter {filters} left "
                     "it out: rebuild without the filter)")
    elif key[2] not in SUPPORTED_HEAD_DIMS:
        lead = "Not supported: "
        dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        hint = (f"head_dim {key[2]} is not supported by the fa3gen kernels (supported head "
                f"dims: {dims}); no spec can build it")
    elif filters:
        hint = (f"{spec_file} has this key, but the library was built with the filter "
                f"{filters}, which left it out; rebuild without the filter: {build}")
    else:
        features = "".join(f", {axis}: true" for axis, on in (
            ("local", local), ("softcap", softcap), ("varlen", varlen), ("paged", paged)) if on)
        wanted = (f"direction {direction}, dtype {dtype}, causal: {str(causal).lower()}"
                  f"{features}")
        if _groups_give_every_axis(spec_file):
            # a spec without top-level axes (fa3gen spec --from-trace writes them): adding
            # head_dim to a group would not build this key
            hint = (f"add a group to {spec_file} with head_dim: {head_dim} ({wanted}) and every "
                    "other axis (tile, stages, ...: its groups give them all), or, for a spec "
                    "trimmed from a trace, trace a run that makes this call and run `fa3gen spec "
                    f"--from-trace` again; then run: {build}")
        else:
            hint = f"add head_dim: {head_dim} ({wanted}) to a group of {spec_file} and run: {build}"
    raise VariantNotBuiltError(describe_key(key), _listing(variants), hint, library, lead,
                               no_default=bool(same_key), left_out_by=filters)


def _groups_give_every_axis(spec_file: str) -> bool:
    """Whether the spec file (read only here, for an error's hint) has groups but no top-level
    axes; False where it cannot be read."""
    try:
        import yaml  # a packaged runtime may lack it
    except ImportError:
        return False
    try:
        data = yaml.safe_load(Path(spec_file).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        return False
    return isinstance(data, dict) and "groups" in data and "axes" not in data


def _filters_that_dropped(key: tuple, build_info: dict[str, Any] | None) -> str:
    """The build's filter flags (e.g. "--only 'fwd_*'") when key is one of the spec's dispatch
    keys (build_info["spec_keys"]) and the build was filtered (build_info["filters"]), else "".
    Libraries built before these entries existed have neither: ""."""
    info = build_info or {}
    filters, spec_keys = info.get("filters"), info.get("spec_keys")
    if not isinstance(filters, dict) or not isinstance(spec_keys, list):
        return ""
    try:  # keys of libraries from before the local/softcap axes have 4 entries
        keys = {make_key(*k) for k in spec_keys}
    except (TypeError, ValueError):
        return ""
    flags = [f"--{flag} {glob!r}" for flag in ("only", "exclude")
             for glob in (filters.get(flag) or [])]
    return " ".join(flags) if key in keys else ""


def _listing(variants: Sequence[VariantInfo]) -> list[str]:
    """The table for an error message (built only on a miss: lookups run on every call)."""
    return [v.name + (" (default)" if v.is_default else "") for v in variants]


# ---------------------------------------------------------------------------------------------
# The loaded library.


class Library:
    """One loaded libfa3gen_<spec>.so and its variant table."""

    def __init__(self, path: str | os.PathLike, spec_name: str | None = None,
                 spec_file: str | None = None):
        self.path = Path(path).absolute()  # a relative one would name another file after a chdir
        if self.path.is_dir():
            raise Fa3genError(f"{self.path} is a folder, not an fa3gen library (libfa3gen_<spec>.so)")
        if not self.path.is_file():
            raise LibraryNotBuiltError(self.path, spec_name, spec_file)
        try:
            # RTLD_LOCAL: several spec libraries (h100, ablation) export the same symbol names.
            # The resolved path: a bare file name would make dlopen search the library paths,
            # not the working directory, and dlopen answers a path it has loaded (a symlink's,
            # say) with that object, even after the link points at another file.
            self._dll = ctypes.CDLL(str(self.path.resolve()), mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise Fa3genError(f"cannot load fa3gen library {self.path}: {e}") from e
        try:
            self._bind(spec_name)
        except BaseException:
            # A library that failed stays loaded under its path (dlopen would answer that path
            # with it again): closed, a rebuild there loads in this process.
            if _dlclose is not None:
                _dlclose(self._dll._handle)
            raise

    def _bind(self, spec_name: str | None) -> None:
        """The library's ABI, entry points and variant table."""
        dll = self._dll
        try:
            dll.fa3gen_abi_version.restype = ctypes.c_int32
            dll.fa3gen_abi_version.argtypes = []
            found = dll.fa3gen_abi_version()
        except AttributeError:
            found = "none (no fa3gen_abi_version symbol)"
        if found != ABI_VERSION:
            raise AbiMismatchError(self.path, found, ABI_VERSION, spec_name)

        try:
            dll.fa3gen_num_variants.restype = ctypes.c_int32
            dll.fa3gen_num_variants.argtypes = []
            dll.fa3gen_variant.restype = ctypes.POINTER(VariantInfoC)
            dll.fa3gen_variant.argtypes = [ctypes.c_int32]
            dll.fa3gen_build_info.restype = ctypes.c_char_p
            dll.fa3gen_build_info.argtypes = []
            dll.fa3gen_last_error.restype = ctypes.c_char_p
            dll.fa3gen_last_error.argtypes = []
        except AttributeError as e:  # its ABI number without the functions of that ABI
            raise Fa3genError(f"{self.path} is not a complete fa3gen library ({e}); rebuild it: "
                              "fa3gen build --spec <its spec>") from e
        # The fp8 quantizer: only in libraries of specs with e4m3 variants.
        self._quantize = getattr(dll, contract.QUANTIZE_SYMBOL, None)
        if self._quantize is not None:
            self._quantize.restype = ctypes.c_int
            self._quantize.argtypes = [ctypes.POINTER(QuantizeParams), ctypes.c_void_p]
        # Decode over a KV cache: libraries built before it lack the symbol.
        self._decode = getattr(dll, contract.DECODE_SYMBOL, None)
        if self._decode is not None:
            self._decode.restype = ctypes.c_int
            self._decode.argtypes = [ctypes.POINTER(DecodeParams), ctypes.c_void_p]
        self._append = getattr(dll, contract.APPEND_SYMBOL, None)  # beside it; older builds lack it
        if self._append is not None:
            self._append.restype = ctypes.c_int
            self._append.argtypes = [ctypes.POINTER(AppendParams), ctypes.c_void_p]
        self._append_rotary = getattr(dll, contract.APPEND_ROTARY_SYMBOL, None)  # the same
        if self._append_rotary is not None:
            self._append_rotary.restype = ctypes.c_int
            self._append_rotary.argtypes = [ctypes.POINTER(AppendParams), ctypes.POINTER(RotaryParams),
                                            ctypes.c_void_p]

        self.build_info = _parse_build_info(dll.fa3gen_build_info())
        self.decode_kernels = decode_pairs(self.build_info, self._decode is not None)
        self.spec_name = spec_name or _spec_from_build_info(self.build_info)
        self.variants: list[VariantInfo] = []
        for i in range(dll.fa3gen_num_variants()):
            ptr = dll.fa3gen_variant(i)
            if not ptr:
                raise Fa3genError(f"{self.path}: fa3gen_variant({i}) returned NULL")
            row = f"{self.path}: fa3gen_variant({i})"
            self.variants.append(_variant_from_c(ptr.contents, row))
        self._by_name = {v.name: v for v in self.variants}
        self.seqlen_dispatch = _seqlen_dispatch(self.build_info, self._by_name)
        # what a trace records of the calls these rows serve (fa3gen.tracing); a key's default
        # serves lengths outside every row: [] (no range)
        ranges: dict = {v.name: [] for v in self.variants if v.is_default}
        for rows in self.seqlen_dispatch.values():
            for lo, hi, v in rows:
                if not v.is_default:
                    ranges.setdefault(v.name, []).append((lo, hi))
        tracing.note_dispatch_ranges(ranges)

    def __repr__(self) -> str:
        return f"Library({str(self.path)!r}, {len(self.variants)} variants)"

    def names(self, direction: str | None = None) -> list[str]:
        return [v.name for v in self.variants if direction is None or v.direction == direction]

    def defaults(self, direction: str | None = None) -> list[VariantInfo]:
        return [v for v in self.variants if v.is_default and direction in (None, v.direction)]

    def dispatched(self, direction: str | None = None) -> list[VariantInfo]:
        """Every variant a call without `variant=` can reach: the key defaults, then the seqlen_k
        range defaults that are not key defaults (each once)."""
        out = self.defaults(direction)
        for rows in self.seqlen_dispatch.values():
            for _, _, v in rows:
                if direction in (None, v.direction) and v not in out:
                    out.append(v)
        return out

    def get(self, name: str) -> VariantInfo | None:
        return self._by_name.get(name)

    def find(
        self, direction: str, dtype: str, head_dim: int, causal: bool, variant: str | None = None,
        *, local: bool = False, softcap: bool = False, varlen: bool = False,
        paged: bool = False, seqlen_k: int | None = None,
    ) -> VariantInfo:
        """The named variant, else the key's default; seqlen_k (when given) picks the spec's
        range default for that length where the dispatch has one."""
        if variant is not None:  # fast path: the op resolves by name on every call
            v = self._by_name.get(variant)
            if v is not None and v.key == make_key(direction, dtype, head_dim, causal, local,
                                                   softcap, varlen, paged):
                return v
        elif seqlen_k is not None and self.seqlen_dispatch:
            key = make_key(direction, dtype, head_dim, causal, local, softcap, varlen, paged)
            for lo, hi, v in self.seqlen_dispatch.get(key, ()):
                if lo <= seqlen_k <= hi:
                    return v
        return select_variant(
            self.variants, direction, dtype, head_dim, causal, variant, local=local,
            softcap=softcap, varlen=varlen, paged=paged, spec_name=self.spec_name,
            library=str(self.path), build_info=self.build_info, rebuild=self.rebuild_hint,
        )

    @functools.cached_property
    def rebuild_hint(self) -> tuple[str, str]:
        """(the spec file this library was built from, the command that rebuilds it): the spec
        path its manifest records, else specs/<name>.yaml; a library bundled in a wheel is
        packaged and installed again after the build."""
        recorded = (contract.library_manifest(self.path) or {}).get("spec_path")
        spec_file = recorded if isinstance(recorded, str) and recorded else spec_file_of(self.spec_name)
        build = f"fa3gen build --spec {spec_file}"
        if BUNDLED_LIBRARY is not None and self.path == BUNDLED_LIBRARY.absolute():
            name = "" if PACKAGE == contract.package_name_of(self.spec_name or "") else \
                f" --name {PACKAGE}"  # a wheel packaged with --name is rebuilt with it
            build += f", then fa3gen package --spec {spec_file}{name} and install the new wheel"
        return spec_file, build

    def last_error(self) -> str:
        msg = self._dll.fa3gen_last_error()
        return msg.decode(errors="replace") if msg else "(no message)"

    @property
    def has_quantizer(self) -> bool:
        return self._quantize is not None

    def quantize_fp8(self, params: QuantizeParams, stream_handle: int) -> None:
        """Run the library's fp8 quantizer (fa3gen_quantize_fp8) on a CUDA stream."""
        self._call_optional(self._quantize, stream_handle, "fp8 quantizer",
                            "no fp8 quantizer (its spec has no e4m3 variant)", params)

    def decode(self, params: DecodeParams, stream_handle: int) -> None:
        """Run the library's decode attention (fa3gen_decode_fwd) on a CUDA stream."""
        self._call_optional(self._decode, stream_handle, "decode kernel",
                            f"no decode kernels: add `decode: true` to {self.rebuild_hint[0]} "
                            f"and build it again: {self.rebuild_hint[1]}", params)

    @property
    def has_append_kernel(self) -> bool:
        return self._append is not None

    def kvcache_append(self, params: AppendParams, stream_handle: int) -> None:
        """Write new keys and values into a KV cache (fa3gen_kvcache_append) on a CUDA stream."""
        self._call_optional(self._append, stream_handle, "KV-cache append",
                            "no KV-cache append kernel (built before it, or without decode "
                            "kernels)", params)

    @property
    def has_append_rotary(self) -> bool:
        return self._append_rotary is not None

    def kvcache_append_rotary(self, params: AppendParams, rotary: RotaryParams,
                              stream_handle: int) -> None:
        """The append with the rotary embedding of q and the new keys
        (fa3gen_kvcache_append_rotary) on a CUDA stream."""
        self._call_optional(self._append_rotary, stream_handle, "KV-cache append with rotary",
                            "no KV-cache append kernel with rotary (built before it, or without "
                            "decode kernels)", params, rotary)

    def _call_optional(self, fn, stream_handle: int, what: str, missing: str, *params) -> None:
        """Call an optional entry point (None when the library lacks it) with its param
        structs; raise on failure."""
        if fn is None:
            raise Fa3genError(f"{self.path} has {missing}")
        rc = fn(*(ctypes.byref(s) for s in params), ctypes.c_void_p(stream_handle or None))
        if rc != 0:
            raise Fa3genError(f"fa3gen {what} failed (code {rc}): {self.last_error()}")

    def launch(self, info: VariantInfo, params: FwdParams | BwdParams, stream_handle: int) -> None:
        """Run info's launcher on a CUDA stream (a cudaStream_t as an int; 0 = legacy).
        params must be FwdParams for a forward variant, BwdParams for a backward one."""
        want = PARAMS[info.direction]
        if info.launch is None or self._by_name.get(info.name) is not info:
            raise Fa3genError(f"variant {info.name} has no launcher in {self.path}")
        if not isinstance(params, want):
            raise Fa3genError(f"variant {info.name} takes {want.__name__}, got {type(params).__name__}")
        # The struct itself (ctypes passes it by reference, as its POINTER argtype says) and the
        # handle as an int: 0.3 us a call less than byref() and a c_void_p.
        rc = info.launch(params, stream_handle or None)
        if rc != 0:
            raise Fa3genError(f"fa3gen kernel {info.name} failed (code {rc}): {self.last_error()}")


def decode_pairs(build_info: dict, has_symbol: bool) -> frozenset:
    """The (dtype, head_dim) pairs of a library's decode kernels, from its build info (a list
    of pairs; true in libraries built before `decode:` took pairs: every pair)."""
    decode = build_info.get("decode", False) if has_symbol else False
    if decode is True:
        return frozenset(contract.DECODE_PAIRS)
    if not isinstance(decode, list):
        return frozenset()
    return frozenset(tuple(p) for p in decode if isinstance(p, list) and tuple(p) in contract.DECODE_PAIRS)


def _seqlen_dispatch(build_info: dict, by_name: dict) -> dict[tuple, list]:
    """key -> [(lo, hi, VariantInfo)] from the build info's seqlen_dispatch rows (the spec's
    dispatch entries with a seqlen_k range); rows naming a variant not in the table, or not
    of the right shape, are ignored (the key's default then serves)."""
    out: dict[tuple, list] = {}
    for row in build_info.get("seqlen_dispatch") or []:
        try:
            *key, lo, hi, name = row
            v = by_name.get(name)
            if v is not None and v.key == make_key(*key):
                out.setdefault(v.key, []).append((int(lo), int(hi), v))
        except (TypeError, ValueError):
            continue
    return out


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
# per-call fast path, without resolving the path again. A request with a relative path in it
# names another file after a chdir: those answers are kept apart with the directory they hold
# for (a getcwd per call for them only).
_requests: dict[tuple, Library] = {}
_relative_requests: dict[tuple, tuple[str, Library]] = {}
_selected: str | None = None  # set by use_spec(); None = env FA3GEN_LIB or the default spec


# A packaged runtime (fa3gen package) carries its library in lib/ beside this module; that
# library is then the default, whatever FA3GEN_LIB says (a variable meant for the tool).
_BUNDLED = sorted((Path(__file__).parent / "lib").glob("libfa3gen_*.so"))
BUNDLED_LIBRARY: Path | None = _BUNDLED[0] if len(_BUNDLED) == 1 else None
PACKAGE = __name__.rpartition(".")[0]  # this copy's import package (a wheel's: fa3gen_<spec>)


def resolve_library(spec: str | os.PathLike | None = None) -> tuple[Path, str | None]:
    """(library path, spec name or None) for a spec name, a spec .yaml path or a .so path."""
    if spec is None:
        spec = _selected
    if spec is None and BUNDLED_LIBRARY is not None:
        return BUNDLED_LIBRARY, contract.spec_name_of_library(BUNDLED_LIBRARY)
    if spec is None:
        env = os.environ.get(LIB_ENV)
        if env:
            return Path(env), contract.spec_name_of_library(env)
        spec = DEFAULT_SPEC
    s = os.fspath(spec)
    if s.endswith(".so"):
        return Path(s), contract.spec_name_of_library(s)
    if s.endswith(contract.SPEC_SUFFIXES):
        s = spec_name_of_file(Path(s))
    return contract.library_path(s), s


def spec_name_of_file(path: Path) -> str:
    """The spec's `name:` (what the build names generated/<name>/), else the file stem."""
    import yaml  # only for spec paths; the per-call lookups never come here

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        return path.stem  # the build fails on it too; the stem names the library to look for
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else path.stem


def env_reader(name: str) -> Callable[[], Any]:
    """A cheap os.environ.get(name) for per-call cache keys: the variable's value as the
    environment holds it (bytes on POSIX), None when unset; equal values read equal. Reading
    os.environ encodes the name and, for an unset variable, raises and catches a KeyError
    inside (0.3-0.7 us a read); on POSIX the dict of encoded names behind it answers in 0.1.
    That dict is looked up on every read: code that replaces os.environ (mock.patch) is seen."""
    if os.name != "posix":
        return functools.partial(os.environ.get, name)
    encoded = os.fsencode(name)

    def read():
        data = getattr(os.environ, "_data", None)
        return data.get(encoded) if type(data) is dict else os.environ.get(name)
    return read


LIB_ENV = "FA3GEN_LIB"  # a built .so to load (the module doc's order)
_lib_env = env_reader(LIB_ENV)
_generated_env = env_reader(contract.GENERATED_ENV)


def get_library(spec: str | os.PathLike | None = None) -> Library:
    """The library for spec (default: see module doc), loaded once per path.

    Every forward and backward call asks for the library; resolving the path (stat, realpath,
    maybe reading a spec) took ~75 us per call, so a request already answered is served from
    the cache keyed by what decides the answer: spec, use_spec's choice and the two env vars."""
    request = (None if spec is None else os.fspath(spec), _selected, _lib_env(),
               _generated_env())
    lib = _requests.get(request)
    if lib is not None:
        return lib
    relative = _relative_requests.get(request)
    if relative is not None and relative[0] == os.getcwd():
        return relative[1]
    asked = os.fspath(spec) if spec is not None else _selected  # what resolve_library starts from
    path, spec_name = resolve_library(asked)
    key = path.resolve() if path.exists() else path
    spec_file = asked if asked is not None and asked.endswith(contract.SPEC_SUFFIXES) else None  # for the hint
    if spec_file is not None and spec_name is not None:
        check_built_from(spec_file, spec_name)
    with _lock:
        lib = _libraries.get(key)
        if lib is None:
            # failures are not cached: a later build is picked up
            lib = Library(path, spec_name, spec_file=spec_file)
            _libraries[key] = lib
        if _names_relative_path(request):
            _relative_requests[request] = (os.getcwd(), lib)
        else:
            _requests[request] = lib
    return lib


def _names_relative_path(request: tuple) -> bool:
    """Whether a get_library request's answer depends on the working directory: a relative
    spec file or library path (asked for, or chosen by use_spec), or a relative FA3GEN_LIB or
    FA3GEN_GENERATED (bytes as env_reader gives them). A bare spec name is looked up under
    FA3GEN_GENERATED or the package's generated/, whose relativity the last part covers."""
    spec, selected, lib_env, generated_env = request

    def relative_file(s):
        return (s is not None and (s.endswith((".so", *contract.SPEC_SUFFIXES)) or os.sep in s)
                and not os.path.isabs(s))

    # FA3GEN_LIB counts only where it is read (nothing asked for); an empty variable is unset
    return (relative_file(spec) or relative_file(selected)
            or bool(spec is None and selected is None and lib_env and not os.path.isabs(lib_env))
            or bool(generated_env and not os.path.isabs(generated_env)))


_checked_spec_files: set = set()  # check_built_from's (resolved file, spec name) pairs


def check_built_from(spec_file: str, spec_name: str) -> None:
    """A spec asked for by its file is served by generated/<name>/'s build only if that build
    was made from this file's bytes (contract.spec_file_mismatch): the build of another spec
    file with the same `name:` is refused; a file edited since its build (by hand, or
    rewritten by fa3gen tune) runs the build as it was, with a warning."""
    checked = (str(Path(spec_file).resolve()), spec_name)
    if checked in _checked_spec_files:  # once a process (use_spec, then each call's lookup)
        return
    try:
        mismatch = contract.spec_file_mismatch(
            contract.read_manifest(contract.manifest_path(spec_name)), spec_file)
    except OSError:  # an unreadable file: loading says what is missing
        return
    if mismatch is None:
        _checked_spec_files.add(checked)
        return
    build = build_command(spec_name, spec_file)
    kind, other = mismatch
    if kind == "other":  # refused on every request
        raise Fa3genError(f"{spec_file}: the build of spec {spec_name!r} was made from {other}, "
                          f"another spec file with that name; build this one first: {build}")
    _checked_spec_files.add(checked)  # warned once
    print(f"fa3gen: warning: {spec_file} changed since the build of spec {spec_name!r} "
          f"(edited, or rewritten by fa3gen tune): its library runs the spec as it was "
          f"built; rebuild: {build}", file=sys.stderr)


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
