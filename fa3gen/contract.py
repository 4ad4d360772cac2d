"""The variant contract: what the generator (generator/) and the runtime (fa3gen/) agree on.

It owns the axes of a variant (order, type, allowed values, dispatch key or knob, spelling in
the canonical name), the `Variant` built from them, the dtype table, where a build puts its
outputs, and the C ABI of templates/kernels/fa3gen_abi.h as data: version, struct fields in
order, grid modes, and the kernel launchers' template parameters. tests/test_contract.py pins
that data to the C headers, so a drift fails on CPU.

Standard library only: the runtime imports it on machines without yaml, jinja2 or torch.

Adding an axis: one `Axis` row in AXIS_TABLE, then the kernel side that realizes it (a
template parameter in LAUNCHERS and the launcher, a field of fa3gen_variant_info and an ABI
version bump); the tests say which of those is missing.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, make_dataclass
from functools import cached_property
from operator import attrgetter
from pathlib import Path
from typing import Any, Optional

# --------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class Dtype:
    name: str    # in specs and variant names
    cpp: str     # the kernels' Element type
    torch: str   # attribute of the torch module
    bytes: int   # element size


DTYPES = {d.name: d for d in (
    Dtype("bf16", "cutlass::bfloat16_t", "bfloat16", 2),
    Dtype("fp16", "cutlass::half_t", "float16", 2),
    # fp8, forward only: q, k, v in e4m3 with descale factors; O in bf16 (or fp16).
    Dtype("e4m3", "cutlass::float_e4m3_t", "float8_e4m3fn", 1),
)}

# --------------------------------------------------------------------------- axes

NAME_SEP = "_"
_POSITIVE_INT = r"([1-9][0-9]*)"  # no leading zeros: a parsed name spells back the same
_PYTHON_TYPE = {"choice": str, "int": int, "bool": bool, "tile": int}


@dataclass(frozen=True)
class Axis:
    """One axis of the variant space: a spec key, a part of the canonical name and one or two
    Variant fields (a tile [M, N] is tile_m and tile_n)."""
    name: str
    kind: str                        # "choice" | "int" | "bool" | "tile"
    role: str                        # "key": what a caller asks for; "knob": how a variant runs
    tag: str = ""                    # prefix in the name: d128, s2, ws1
    choices: tuple[str, ...] = ()    # a choice's allowed values
    words: tuple[str, str] = ()      # a bool spelled as a word, (false, true); an empty
                                     # false word leaves the part (and its separator) out
    cpp: Optional[dict] = field(default=None, compare=False)  # a choice's C++ spelling

    @property
    def fields(self) -> tuple[str, ...]:
        return (f"{self.name}_m", f"{self.name}_n") if self.kind == "tile" else (self.name,)

    def value(self, variant) -> Any:
        """The axis value of a variant as specs write it (a tile is an (M, N) tuple)."""
        values = tuple(getattr(variant, f) for f in self.fields)
        return values if self.kind == "tile" else values[0]

    def split(self, value) -> tuple:
        """The field values of an axis value (inverse of `value`)."""
        return tuple(value) if self.kind == "tile" else (value,)

    def _part(self, *texts: str) -> str:
        """The name part around the text of each field."""
        return f"m{texts[0]}n{texts[1]}" if self.kind == "tile" else f"{self.tag}{texts[0]}"

    @property
    def _options(self) -> tuple[str, ...]:
        """The spellings of a choice or a bool (false, true)."""
        return self.choices if self.kind == "choice" else (self.words or ("0", "1"))

    def spell(self, value) -> str:
        """The axis's part of the canonical name ("" for an optional part left out)."""
        if self.kind == "bool":
            return self._part(self._options[bool(value)])
        return self._part(*map(str, self.split(value)))

    @property
    def placeholder(self) -> str:
        """The part as a format description, e.g. ws{0|1}, m{tile_m}n{tile_n} or [local]."""
        if self.optional:
            return f"[{self._options[1]}]"
        if self.kind == "bool":
            return self._part("{" + "|".join(self._options) + "}")
        return self._part(*(f"{{{f}}}" for f in self.fields))

    @property
    def optional(self) -> bool:
        """A flag whose false value is not spelled (names of variants without it stay as
        they were before the axis existed)."""
        return self.kind == "bool" and self._options[0] == ""

    @property
    def pattern(self) -> str:
        """A regex of the part, preceded by the separator, with one group per field."""
        sep = re.escape(NAME_SEP)
        if self.optional:
            return f"(?:{sep}({re.escape(self._options[1])}))?"
        if self.kind in ("choice", "bool"):
            return sep + self._part("(" + "|".join(map(re.escape, self._options)) + ")")
        return sep + self._part(*[_POSITIVE_INT] * len(self.fields))

    def parse(self, groups: tuple[str, ...]) -> tuple:
        """Field values from the pattern's groups (None: an optional part left out)."""
        if self.kind == "bool":
            return (groups[0] == self._options[1],)
        return tuple(_PYTHON_TYPE[self.kind](g) for g in groups)


# Canonical order: of the name, of the Variant fields, of the spec's cartesian product.
AXIS_TABLE = (
    Axis("direction", "choice", "key", choices=("fwd", "bwd")),
    Axis("dtype", "choice", "key", choices=tuple(DTYPES),
         cpp={d.name: d.cpp for d in DTYPES.values()}),
    Axis("head_dim", "int", "key", tag="d"),
    Axis("causal", "bool", "key", words=("nocausal", "causal")),
    # Sliding-window attention (window_size != (-1, -1)); the window is a runtime argument.
    Axis("local", "bool", "key", words=("", "local")),
    # Logit softcapping, cap * tanh(score / cap); the cap is a runtime argument.
    Axis("softcap", "bool", "key", words=("", "softcap")),
    # Variable-length sequences packed along the rows, bounded by cu_seqlens (runtime arguments).
    Axis("varlen", "bool", "key", words=("", "varlen")),
    Axis("tile", "tile", "knob"),
    Axis("stages", "int", "knob", tag="s"),
    Axis("warp_specialized", "bool", "knob", tag="ws"),
    Axis("pingpong", "bool", "knob", tag="pp"),
    Axis("intra_wg_overlap", "bool", "knob", tag="ov"),
    # Forward: the key blocks that need the mask peeled out of the steady-state loop (a second
    # copy of the loop body without mask code; templates/kernels/fwd_mainloop.cuh).
    Axis("peel_masked", "bool", "knob", words=("", "peel")),
    # Forward, 16-bit: P reaches the PV GEMM through shared memory (both operands from shared
    # memory) instead of registers, which frees P's registers while the GEMM runs: what lets
    # three consumer warpgroups (192-row tiles) hold d96's O accumulators without spilling.
    Axis("p_in_smem", "bool", "knob", words=("", "psmem")),
    # Varlen forward over a paged KV cache: keys and values read through a block table
    # (flash_attn_with_kvcache's chunked prefill); page size and table are runtime arguments.
    # After the knobs it joined (a key among knobs) so that names and Variant(...) calls of the
    # variants without it read as they did before.
    Axis("paged", "bool", "key", words=("", "paged")),
    # Forward, 16-bit, not varlen: O leaves through a shared-memory tile of its own and one TMA
    # store per consumer warpgroup instead of 16-byte stores from registers
    # (templates/kernels/fwd_epilogue.cuh). After paged, so that names and Variant(...) calls
    # of the variants without it read as they did before.
    Axis("o_tma_store", "bool", "knob", words=("", "otma")),
)
AXIS_BY_NAME = {a.name: a for a in AXIS_TABLE}
AXES = tuple(AXIS_BY_NAME)
KEY_AXES = tuple(a.name for a in AXIS_TABLE if a.role == "key")
KNOB_AXES = tuple(a.name for a in AXIS_TABLE if a.role == "knob")
DIRECTIONS = AXIS_BY_NAME["direction"].choices

# Head dims the kernel templates realize, forward and backward (generator/variants.py prunes
# any other; the runtime says so when a call asks for one).
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# Above this head dim the backward's two consumer warpgroups split head_dim over one block of
# 64 keys (templates/kernels/bwd_traits.cuh, kSplitHeadDim): dK and dV of a whole 64-key block
# would need head_dim fp32 registers per thread each.
BACKWARD_SPLIT_HEAD_DIM_ABOVE = 128

# (field, Python type) of a Variant, in order.
VARIANT_FIELDS = tuple((f, _PYTHON_TYPE[a.kind]) for a in AXIS_TABLE for f in a.fields)
# Optional flags after the last required axis default to false, so a Variant spelled with the
# fields of the axes before them still means the variant without them.
_TRAILING_OPTIONAL = len(VARIANT_FIELDS) - next(
    i for i, a in enumerate(reversed(AXIS_TABLE)) if not a.optional)
_AXIS_OF_FIELD = {f: a for a in AXIS_TABLE for f in a.fields}

# Key axes are scalars, so their fields are the key; attrgetter keeps it a ~0.1 us lookup.
_key_of = attrgetter(*(f for a in KEY_AXES for f in AXIS_BY_NAME[a].fields))

NAME_FORMAT = NAME_SEP.join(a.placeholder for a in AXIS_TABLE)
# The first part has no separator before it.
_NAME_RE = re.compile("".join(a.pattern for a in AXIS_TABLE)[len(re.escape(NAME_SEP)):])


class _VariantBehaviour:
    """What every Variant does; its fields are VARIANT_FIELDS (see Variant below)."""

    @cached_property
    def name(self) -> str:
        """Canonical name: file stem, symbol suffix, filter and bench label."""
        return NAME_SEP.join(filter(None, (a.spell(a.value(self)) for a in AXIS_TABLE)))

    @property
    def key(self) -> tuple:
        """Dispatch key: what a caller asks for (the runtime compares it on every call)."""
        return _key_of(self)

    def axes(self) -> dict:
        """Values by spec axis name (a tile as an (M, N) tuple), for matching spec rules."""
        return {a.name: a.value(self) for a in AXIS_TABLE}

    @classmethod
    def from_axes(cls, axes: dict):
        values: dict = {}
        for a in AXIS_TABLE:
            values.update(zip(a.fields, a.split(axes[a.name])))
        return cls(**values)


# Built from the axis table so that an axis is one edit. Frozen (hashable, a dict key) and
# ordered; e.g. Variant("fwd", "bf16", 128, False, False, False, False, 128, 176, 2, True, True, True).
Variant = make_dataclass("Variant", [(f, t, field(default=False)) if i >= _TRAILING_OPTIONAL else (f, t)
                                     for i, (f, t) in enumerate(VARIANT_FIELDS)],
                         bases=(_VariantBehaviour,), frozen=True, order=True)
Variant.__module__ = __name__  # make_dataclass leaves it elsewhere on Python < 3.12 (pickling)
Variant.__doc__ = f"One kernel configuration, named {NAME_FORMAT}."


def parse_name(name: str) -> Variant:
    """The Variant of a canonical name; ValueError for anything else."""
    m = _NAME_RE.fullmatch(name)
    if not m:
        raise ValueError(f"not a canonical variant name: {name!r} (expected {NAME_FORMAT})")
    groups, values = iter(m.groups()), {}
    for a in AXIS_TABLE:
        values.update(zip(a.fields, a.parse(tuple(next(groups) for _ in a.fields))))
    return Variant(**values)


def key_str(key: tuple) -> str:
    """A dispatch key as name parts, e.g. (fwd, bf16, d128, causal, local)."""
    parts = (AXIS_BY_NAME[a].spell(v) for a, v in zip(KEY_AXES, key))
    return "(" + ", ".join(filter(None, parts)) + ")"


def takes_seqlen_ranges(key: tuple) -> bool:
    """Whether a spec's seqlen_k ranges may choose among a key's variants: forward keys that
    are not paged (a compiled backward fixes its kernel when traced, before any length is
    known, and a paged call passes none; those run their key's default)."""
    axes = dict(zip(KEY_AXES, key))
    return axes["direction"] == "fwd" and not axes["paged"]


def make_key(direction: str, dtype: str, head_dim: int, causal: bool, local: bool = False,
             softcap: bool = False, varlen: bool = False, paged: bool = False) -> tuple:
    """The dispatch key of a call, in KEY_AXES order."""
    return (direction, dtype, int(head_dim), bool(causal), bool(local), bool(softcap),
            bool(varlen), bool(paged))


# --------------------------------------------------------------------------- output layout

REPO_ROOT = Path(__file__).resolve().parent.parent
# A checkout (or an editable install of one) has templates/ beside the packages; an installed
# wheel has them inside generator/ and builds into the user's cache instead of site-packages.
IN_CHECKOUT = (REPO_ROOT / "templates" / "kernels").is_dir() and (REPO_ROOT / "pyproject.toml").is_file()
SPEC_SUFFIXES = (".yaml", ".yml")  # a spec file, as against a spec name or a library
GENERATED_ENV = "FA3GEN_GENERATED"  # overrides the default root below
MANIFEST_NAME = "manifest.json"


def library_manifest_paths(lib_path) -> tuple[Path, Path]:
    """Where a library's build manifest may be, in the order to try: beside it (a copied build)
    and one folder up (generated/<spec>/lib/<library>)."""
    lib_dir = Path(lib_path).parent
    return lib_dir / MANIFEST_NAME, lib_dir.parent / MANIFEST_NAME


def read_manifest(path) -> dict | None:
    """A build manifest's data; None where there is none, it does not read, or is no mapping."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def package_name_of(spec_name: str) -> str:
    """The import package `fa3gen package` names a spec's wheel by default (--name: another)."""
    return "fa3gen_" + re.sub(r"[^0-9A-Za-z_]", "_", spec_name)


def spec_sha256(path) -> str:
    """The bytes of a spec file, as a build's manifest records them (`spec_sha256`)."""
    return spec_bytes_sha256(Path(path).read_bytes())


def spec_bytes_sha256(data: bytes) -> str:
    """spec_sha256 of bytes already read (load_spec's, which the build records)."""
    import hashlib
    return hashlib.sha256(data).hexdigest()


def other_spec_file(manifest: dict | None, spec_path) -> str | None:
    """The spec file a build's manifest records, where it is not spec_path (another spec file
    with the same `name:` builds into the same folder)."""
    recorded = (manifest or {}).get("spec_path")  # no manifest: no finished build
    here = str(Path(spec_path).resolve())
    return recorded if isinstance(recorded, str) and recorded != here else None


def spec_file_mismatch(manifest: dict | None, spec_file) -> tuple[str, str | None] | None:
    """How a spec file differs from the build a manifest records: None where the build was
    made from these bytes (at any path: a moved checkout, a copy) or nothing is recorded;
    ("other", that file) where it was made from another spec file with the same name;
    ("edited", None) where from this file before an edit (by hand, or fa3gen tune)."""
    if manifest is None:
        return None
    recorded = manifest.get("spec_sha256")
    known = isinstance(recorded, str)  # older builds record no sha
    if known and recorded == spec_sha256(spec_file):
        return None
    other = other_spec_file(manifest, spec_file)
    # another file only where it is there and still the build's bytes: a checkout moved and
    # then edited (its recorded path gone, or holding other bytes) is this file edited
    if other and Path(other).is_file() and (not known or spec_sha256(other) == recorded):
        return "other", other
    return ("edited", None) if known else None


def library_manifest(lib_path) -> dict | None:
    """The build manifest of a library: the first of library_manifest_paths that reads and
    names a library of this file name (a manifest.json beside a copied .so may be another
    build's: its commit and resources would then be reported as this one's)."""
    name = Path(lib_path).name
    for data in map(read_manifest, library_manifest_paths(lib_path)):
        recorded = (data or {}).get("library")
        if data is not None and (not isinstance(recorded, str) or Path(recorded).name == name):
            return data
    return None

_LIBRARY_RE = re.compile(r"libfa3gen_(.+)\.so")


def generated_root() -> Path:
    """Root of build outputs: $FA3GEN_GENERATED, else <checkout>/generated, else
    $XDG_CACHE_HOME/fa3gen/generated (~/.cache when unset). Read per call so tests can set it."""
    env = os.environ.get(GENERATED_ENV)
    if env:
        return Path(env).resolve()
    if IN_CHECKOUT:
        return REPO_ROOT / "generated"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fa3gen" / "generated"


def spec_out_dir(spec_name: str) -> Path:
    return generated_root() / spec_name


def library_name(spec_name: str) -> str:
    """The spec's library, relative to its output directory (as build.ninja names it)."""
    return f"lib/libfa3gen_{spec_name}.so"


def library_path(spec_name: str) -> Path:
    return spec_out_dir(spec_name) / library_name(spec_name)


def manifest_path(spec_name: str) -> Path:
    return spec_out_dir(spec_name) / MANIFEST_NAME


def spec_name_of_library(path: str | os.PathLike) -> Optional[str]:
    """`x` for a libfa3gen_x.so, else None."""
    m = _LIBRARY_RE.fullmatch(Path(path).name)
    return m.group(1) if m else None


# --------------------------------------------------------------------------- C ABI
# templates/kernels/fa3gen_abi.h as data: each struct is its (field, C type) list in order.

ABI_VERSION = 16

# The C ABI's sizes and lengths are int32: the largest value a call's length or window may take.
INT32_MAX = 2**31 - 1

# FA3GEN_GRID_*: the forward's grid policy (fa3gen_fwd_params.grid_mode).
GRID_MODES = {"auto": 0, "persistent": 1, "tiles": 2}


def _strides(*tensors: str) -> tuple:
    return tuple((f"{t}_{dim}_stride", "int64_t")
                 for t in tensors for dim in ("batch", "row", "head"))


_SIZES = tuple((n, "int32_t") for n in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
                                        "head_dim"))

# The runtime side of the local and softcap axes (-1 / 0.0: none).
_MASKING = (("window_left", "int32_t"), ("window_right", "int32_t"), ("softcap", "float"))
# The runtime side of the varlen axis.
_VARLEN = (("cu_seqlens_q", "const int32_t*"), ("cu_seqlens_k", "const int32_t*"),
           ("tile_list", "int32_t*"), ("total_q", "int32_t"), ("total_k", "int32_t"))


# Paged forwards load keys and values in TMA chunks of this many rows, each from its page:
# page_size and the variant's tile_n must be multiples of it (FwdTraits::kPageChunk). 64, not
# 16: at d128 the 16-row chunks (2 KB loads, 32 a key block) ran at 0.50-0.60x of the dense
# rate, the 64-row ones at 0.87-0.98x (H200, docs/BENCHMARKS.md "Chunked prefill").
PAGED_CHUNK_ROWS = 64

# FA3GEN_VARLEN_MAX_*: what the varlen tile list can hold (the runtime checks them first).
VARLEN_LIMITS = {"batch": 16384, "heads": 32767, "tiles_per_seq": 65535}


def varlen_tiles(total: int, batch: int, tile: int) -> int:
    """FA3GEN_VARLEN_TILES of the ABI: a bound of the tiles of `tile` rows over `batch`
    sequences of `total` rows in all (sizes the tile_list workspace)."""
    return (total + batch * (tile - 1)) // tile


FWD_PARAMS = (
    ("q", "const void*"), ("k", "const void*"), ("v", "const void*"), ("o", "void*"),
    ("lse", "float*"),
    *_strides("q", "k", "v", "o"),
    *_SIZES,
    ("softmax_scale", "float"), *_MASKING, ("num_sms", "int32_t"), ("grid_mode", "int32_t"),
    *_VARLEN, ("seqused_k", "const int32_t*"),
    # The runtime side of dtype e4m3: descale factors and the output dtype.
    ("q_descale", "const float*"), ("k_descale", "const float*"), ("v_descale", "const float*"),
    *((f"{t}_descale_{dim}_stride", "int64_t") for t in "qkv"
      for dim in ("batch", "head", "block")),
    ("q_descale_head_div", "int32_t"), ("o_fp16", "int32_t"),
    # The runtime side of the paged axis: the block table and the pages it points into.
    ("block_table", "const int32_t*"), ("block_table_batch_stride", "int64_t"),
    *((n, "int32_t") for n in ("page_size", "num_pages", "block_table_cols")),
)

BWD_PARAMS = (
    ("q", "const void*"), ("k", "const void*"), ("v", "const void*"), ("o", "const void*"),
    ("dout", "const void*"), ("lse", "const float*"),
    ("dq", "void*"), ("dk", "void*"), ("dv", "void*"),
    ("dq_accum", "float*"), ("lse_log2", "float*"), ("dsum", "float*"),
    ("dq_semaphore", "int32_t*"),
    *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
    *_SIZES,
    ("softmax_scale", "float"), *_MASKING, ("deterministic", "int32_t"), *_VARLEN,
    ("seqused_k", "const int32_t*"),
)


# fa3gen_quantize_params: the fp8 quantizer's (fa3gen_quantize_fp8, libraries with e4m3 variants).
QUANTIZE_PARAMS = (
    ("x", "const void*"), ("out", "void*"), ("descale", "float*"), ("signs", "const float*"),
    ("amax_workspace", "float*"), *((f"x_{dim}_stride", "int64_t") for dim in ("batch", "row", "head")),
    *((n, "int32_t") for n in ("batch", "seqlen", "heads", "head_dim", "block_rows", "x_fp16")),
    ("rotary_cos", "const float*"), ("rotary_sin", "const float*"),
    ("rotary_half", "int32_t"), ("rotary_interleaved", "int32_t"),
)
QUANTIZE_SYMBOL = "fa3gen_quantize_fp8"

# The decode kernels a spec's `decode:` may ask for (decode.cuh instantiates each pair).
DECODE_DTYPES = ("bf16", "fp16")
DECODE_HEAD_DIMS = (64, 128, 256)
DECODE_PAIRS = tuple((dt, d) for dt in DECODE_DTYPES for d in DECODE_HEAD_DIMS)

# fa3gen_decode_params: decode attention over a KV cache (fa3gen_decode_fwd, specs with `decode:`).
DECODE_PARAMS = (
    *((n, "const void*") for n in ("q", "k_cache", "v_cache")), ("out", "void*"), ("lse", "float*"),
    *((n, "const int32_t*") for n in ("cache_seqlens", "cache_batch_idx", "block_table")),
    ("o_accum", "float*"), ("lse_accum", "float*"),
    *_strides("q", "k", "v", "out"), ("block_table_batch_stride", "int64_t"), *_SIZES,
    *((n, "int32_t") for n in ("page_size", "num_splits", "causal", "fp16", "cache_rows",
                               "window_left", "window_right")),
    ("softmax_scale", "float"), ("softcap", "float"),
    # An e4m3 cache and its dequantization factors.
    ("k_scale", "const float*"), ("v_scale", "const float*"),
    ("kv_scale_batch_stride", "int64_t"), ("kv_scale_head_stride", "int64_t"),
    ("k_scale_value", "float"), ("v_scale_value", "float"), ("kv_fp8", "int32_t"),
)
DECODE_SYMBOL = "fa3gen_decode_fwd"

# fa3gen_append_params: new keys and values into a KV cache (fa3gen_kvcache_append, beside the
# decode kernels).
APPEND_PARAMS = (
    ("k_new", "const void*"), ("v_new", "const void*"), ("k_cache", "void*"), ("v_cache", "void*"),
    *((n, "const int32_t*") for n in ("cache_seqlens", "cache_batch_idx", "block_table")),
    *_strides("k_new", "v_new", "k", "v"), ("block_table_batch_stride", "int64_t"),
    *((n, "int32_t") for n in ("batch", "seqlen_new", "heads_kv", "head_dim", "element_bytes",
                               "seqlen", "capacity", "page_size", "cache_rows")),
)
APPEND_SYMBOL = "fa3gen_kvcache_append"

# fa3gen_rotary_params: flash_attn_with_kvcache's rotary embedding applied by the append
# (fa3gen_kvcache_append_rotary(append params, rotary params, stream)).
ROTARY_PARAMS = (
    ("q", "const void*"), ("q_out", "void*"), ("cos", "const void*"), ("sin", "const void*"),
    *_strides("q"),
    *((f"{t}_{dim}_stride", "int64_t") for t in ("cos", "sin") for dim in ("row", "col")),
    *((n, "int32_t") for n in ("seqlen_q", "heads_q", "rotary_half", "rows", "interleaved",
                               "q_per_row", "cos_type", "fp16")),
)
APPEND_ROTARY_SYMBOL = "fa3gen_kvcache_append_rotary"
ROTARY_COS_TYPES = {"float32": 0, "bfloat16": 1, "float16": 2}  # fa3gen_rotary_params.cos_type


@dataclass(frozen=True)
class Launcher:
    """A direction's kernel entry point (templates/kernels/fa3gen_<direction>.cuh) and how the
    variant table reaches it."""
    header: str                 # the kernel header that defines `function`
    function: str               # C++ function template, instantiated once per variant
    params: str                 # C struct of its params argument
    params_fields: tuple        # that struct's (field, C type) list
    fn_type: str                # C typedef of the exported launcher
    info_field: str             # fa3gen_variant_info field holding the launcher
    template_params: tuple      # (C++ template parameter, Variant field), in declaration order


_FWD_TEMPLATE = (("Element", "dtype"), ("HeadDim", "head_dim"), ("TileM", "tile_m"),
                 ("TileN", "tile_n"), ("Stages", "stages"), ("Causal", "causal"),
                 ("Local", "local"), ("Softcap", "softcap"), ("Varlen", "varlen"),
                 ("Paged", "paged"), ("WarpSpecialized", "warp_specialized"), ("Pingpong", "pingpong"),
                 ("IntraWgOverlap", "intra_wg_overlap"), ("PeelMasked", "peel_masked"),
                 ("PInSmem", "p_in_smem"), ("OTmaStore", "o_tma_store"))

LAUNCHERS = {
    "fwd": Launcher("fa3gen_fwd.cuh", "fa3gen::launch_fwd", "fa3gen_fwd_params", FWD_PARAMS,
                    "fa3gen_fwd_launch_fn", "launch_fwd", _FWD_TEMPLATE),
    # The backward has one schedule: no knob beyond the tile and stages.
    "bwd": Launcher("fa3gen_bwd.cuh", "fa3gen::launch_bwd", "fa3gen_bwd_params", BWD_PARAMS,
                    "fa3gen_bwd_launch_fn", "launch_bwd", _FWD_TEMPLATE[:9]),
}


def launch_symbol(v: Variant) -> str:
    """The exported C launcher of a variant (its TU defines it, the dispatch table points at it)."""
    return f"fa3gen_launch_{v.name}"


def template_args(v: Variant) -> list[str]:
    """C++ template arguments of v's launcher, in its declaration order."""
    def cpp(field: str) -> str:
        value, axis = getattr(v, field), _AXIS_OF_FIELD[field]
        if axis.kind == "choice":
            return axis.cpp[value]
        return ("true" if value else "false") if axis.kind == "bool" else str(value)
    return [cpp(f) for _, f in LAUNCHERS[v.direction].template_params]


# fa3gen_variant_info: the name, every Variant field (a choice as its C string, the rest as
# int32_t), is_default, then one launcher per direction (NULL but for the variant's own).
VARIANT_INFO = (
    ("name", "const char*"),
    *((f, "const char*" if t is str else "int32_t") for f, t in VARIANT_FIELDS),
    ("is_default", "int32_t"),
    *((launcher.info_field, launcher.fn_type) for launcher in LAUNCHERS.values()),
)

_FN_TYPES = {launcher.fn_type for launcher in LAUNCHERS.values()}


def is_pointer(c_type: str) -> bool:
    return c_type.endswith("*") or c_type in _FN_TYPES


def variant_info_values(v: Variant, is_default: bool) -> list[str]:
    """C initializer values of v's fa3gen_variant_info row, in VARIANT_INFO order."""
    def c(value) -> str:
        return f'"{value}"' if isinstance(value, str) else str(int(value))
    return [c(v.name), *(c(getattr(v, f)) for f, _ in VARIANT_FIELDS), c(is_default),
            *(f"&{launch_symbol(v)}" if d == v.direction else "nullptr" for d in LAUNCHERS)]


def variant_info_zero() -> list[str]:
    """An all-NULL/0 fa3gen_variant_info row (C++ rejects an empty array)."""
    return ["nullptr" if is_pointer(t) else "0" for _, t in VARIANT_INFO]

