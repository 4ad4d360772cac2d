"""Render the compile units' translation units and the dispatch table from Jinja templates.

Files are written only when their text changes, so untouched files keep their mtime and
ninja recompiles exactly the variants whose source changed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import jinja2

from fa3gen.contract import (LAUNCHERS, Variant, launch_symbol, template_args,
                             variant_info_values, variant_info_zero)
from fa3gen.files import write_atomically

from .paths import TEMPLATES_DIR
from .variants import bwd_splits_head_dim, bwd_transposes_dkv, consumer_warpgroups


def c_string(text: str) -> str:
    """A C string literal for any text (JSON build info goes through here)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= ord(ch) < 127:
            out.append(ch)
        else:  # octal escapes cannot swallow following hex digits, unlike \x
            out.extend(f"\\{b:03o}" for b in ch.encode())
    return '"' + "".join(out) + '"'


def environment(templates_dir: Path = TEMPLATES_DIR) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,  # a typo in a template is an error, not ""
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
        autoescape=False)
    env.filters["cstring"] = c_string
    env.filters["cinit"] = lambda values: "{" + ", ".join(values) + "}"
    return env


# WGMMA N sizes CuTe selects without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
# (templates/kernels/gmma_shapes.cuh). The extended shapes are 76k lines of headers: about
# 35 s of a 70 s compile, so only the TUs that use another N define the macro.
STANDARD_GMMA_N = frozenset({8, 16, 32, 64, 96, 128, 192, 256})


def wgmma_n_sizes(v: Variant) -> set[int]:
    """N of every WGMMA the variant's kernel issues (the TiledMmas of fwd_traits.cuh and
    bwd_traits.cuh); the traits assert that each is available, so a drift fails to compile."""
    if v.direction == "fwd":
        return {v.tile_n, v.head_dim}            # S = Q K^T, O += P V
    if bwd_transposes_dkv(v):                    # S, dP: keys per warpgroup; dK^T, dV^T; dQ
        return {v.tile_n // consumer_warpgroups(v), v.tile_n, 64}
    if bwd_splits_head_dim(v):                   # two warpgroups: half the queries, half of d
        return {v.tile_m // 2, v.head_dim // 2}
    if v.tile_m % 64:                            # dQ^T = K^T dS^T: N = tile_m
        dq_n = v.tile_m
    else:                                        # dQ split over the consumer warpgroups
        dq_n = v.head_dim // (consumer_warpgroups(v) // (v.tile_m // 64))
    return {v.tile_m, v.head_dim, dq_n}          # S^T and dP^T, dK and dV, dQ


def needs_extended_mma_shapes(v: Variant) -> bool:
    return not wgmma_n_sizes(v) <= STANDARD_GMMA_N


def render_unit(name: str, variants: Sequence[Variant], env: jinja2.Environment | None = None) -> str:
    """The TU of a compile unit (generator/units.py): variants of one direction, dtype and head
    dim, and so one launcher header and one answer to needs_extended_mma_shapes."""
    env = env or environment()
    first = variants[0]
    assert all(LAUNCHERS[v.direction] == LAUNCHERS[first.direction]
               and needs_extended_mma_shapes(v) == needs_extended_mma_shapes(first) for v in variants)
    entries = [{"name": v.name, "symbol": launch_symbol(v), "template_args": template_args(v)}
               for v in variants]
    return env.get_template("variant.cu.j2").render(
        name=name, launcher=LAUNCHERS[first.direction], entries=entries,
        extended_mma_shapes=needs_extended_mma_shapes(first))


def render_variant(v: Variant, env: jinja2.Environment | None = None) -> str:
    """The TU of v alone (a unit of one, named after it)."""
    return render_unit(v.name, [v], env)


def render_dispatch(spec_name: str, variants: list[Variant], default_names: Iterable[str],
                    build_info: dict, env: jinja2.Environment | None = None) -> str:
    env = env or environment()
    defaults = set(default_names)
    info = json.dumps(build_info, sort_keys=True)
    return env.get_template("dispatch.cu.j2").render(
        spec_name=spec_name,
        launchers=[(launch_symbol(v), LAUNCHERS[v.direction].params) for v in variants],
        rows=[variant_info_values(v, v.name in defaults) for v in variants],
        empty_row=variant_info_zero(), build_info=info)


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` unless the file already holds it; True when the file was written."""
    path = Path(path)
    if holds(path, text):
        return False
    write_atomically(path, text)  # ninja never sees a half-written file
    return True


def holds(path: Path, text: str) -> bool:
    """True when the file exists and already holds `text`."""
    try:
        return Path(path).read_text() == text
    except (OSError, UnicodeDecodeError):
        return False


@dataclass
class RenderPlan:
    """What rendering a build would write and remove, computed without touching the disk (a
    dry run reports it; apply() carries it out)."""
    files: dict[Path, str]                 # path -> text, written when it differs
    stale: list[Path] = field(default_factory=list)   # build products of variants not in the spec

    @property
    def changed(self) -> list[Path]:
        return [p for p, text in self.files.items() if not holds(p, text)]

    def apply(self) -> "RenderResult":
        res = RenderResult()
        for path, text in self.files.items():
            (res.written if write_if_changed(path, text) else res.unchanged).append(path)
        for path in self.stale:
            path.unlink(missing_ok=True)
            res.removed.append(path)
        return res


@dataclass
class RenderResult:
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)


def has_quantizer(variants: Iterable[Variant]) -> bool:
    """A library with e4m3 variants also holds the fp8 quantizer (src/quantize.cu)."""
    return any(v.dtype == "e4m3" for v in variants)


# The CuTe-free translation units a library may hold beside its variants: src/<name>.cu from
# templates/<name>.cu.j2, its kernel headers in templates/kernels.
PLAIN_UNIT_HEADERS = {"quantize": ("quantize_fp8.cuh",), "decode": ("decode.cuh", "kvcache_append.cuh")}


def plain_units(variants: Iterable[Variant], decode: bool) -> tuple[str, ...]:
    """The names of the CuTe-free units a library of `variants` holds (decode: the spec's)."""
    return (("quantize",) if has_quantizer(variants) else ()) + (("decode",) if decode else ())


def plan_sources(out_dir: Path, spec_name: str, variants: list[Variant],
                 default_names: Iterable[str], fingerprint: str, build_info: dict,
                 units: Iterable, env: jinja2.Environment | None = None,
                 decode: tuple = ()) -> RenderPlan:
    """src/<unit>.cu per compile unit (generator/units.py: Unit, its .name and .variants),
    src/dispatch.cu (the table of `variants`, the ones linked, which the units include) and
    fingerprint.txt; as stale, the sources and build products of units not listed. A filtered
    build lists the spec's units beside its own, so that their sources and objects survive it and a later full build
    only links again."""
    env = env or environment()
    out_dir = Path(out_dir)
    units = list(units)
    files = {out_dir / "src" / f"{u.name}.cu": render_unit(u.name, u.variants, env) for u in units}
    files[out_dir / "src" / "dispatch.cu"] = render_dispatch(
        spec_name, variants, default_names, build_info, env)
    files[out_dir / "fingerprint.txt"] = fingerprint + "\n"
    keep = {u.name for u in units} | {"dispatch"}
    everything = [v for u in units for v in u.variants]  # the units hold `variants` too
    for unit in plain_units(everything, decode):  # as the variants: a filter keeps the spec's
        files[out_dir / "src" / f"{unit}.cu"] = env.get_template(f"{unit}.cu.j2").render(
            spec_name=spec_name, pairs=decode)  # decode.cu: the spec's (dtype, head_dim) pairs
        keep.add(unit)
    stale = [p for pattern in ("src/*.cu", "obj/*.o", "obj/*.resources.json", "obj/*.log")
             for p in sorted(out_dir.glob(pattern)) if p.name.split(".", 1)[0] not in keep]
    return RenderPlan(files, stale)
