"""Compile units: the variants that share one translation unit.

Most of an nvcc of one variant is the same for every variant: parsing CuTe and CUTLASS
(cudafe++, the host compiler, cicc's front end) and instantiating the templates that all
kernels of a head dim share. Measured on a 2-core host (nvcc 13.0, 2026-12-04): a TU that
includes the forward header and instantiates nothing costs 12.6 s; one fwd bf16 d128 variant
27-29 s; twelve of them in one TU 56 s instead of about 324 s, each kernel's SASS identical
to the one it gets in a TU of its own. So variants of one (direction, dtype, head_dim) compile
together, in units of at most `size` variants: fewer parallel jobs than one per variant, but
a fraction of the work. Size 1 is one variant per TU; a unit of one variant is named after it.

Variants that need CuTe's extended WGMMA shapes (generator/render.py) form units of their own:
those headers cost the others 25-35 s.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterable, Optional

from fa3gen.contract import LAUNCHERS, Variant, template_args

from .errors import GeneratorError
from .render import needs_extended_mma_shapes

# specs/h100.yaml on the 2-core host: up to 16 (30 TUs) 647 s, up to 8 (42 TUs) 789 s; a TU of
# 16 variants takes 52-57 s and 2.4 GB (docs/BENCHMARKS.md, 2026-12-04 (tenth)).
DEFAULT_SIZE = 16
SIZE_ENV = "FA3GEN_UNIT_SIZE"


@dataclass(frozen=True)
class Unit:
    name: str
    variants: tuple[Variant, ...]

    @property
    def extended_mma_shapes(self) -> bool:
        return needs_extended_mma_shapes(self.variants[0])  # the same for the whole unit


def unit_size(size: Optional[int] = None) -> int:
    """The unit size: `size`, else env FA3GEN_UNIT_SIZE, else DEFAULT_SIZE."""
    if size is None:
        text = os.environ.get(SIZE_ENV, "")
        try:
            size = int(text) if text else DEFAULT_SIZE
        except ValueError:
            raise GeneratorError(f"{SIZE_ENV}={text!r}: expected a positive integer") from None
    if size < 1:
        raise GeneratorError(f"the unit size must be at least 1 (got {size})")
    return size


def _key(v: Variant) -> tuple:
    return (v.direction, v.dtype, v.head_dim, needs_extended_mma_shapes(v))


def unit_name(variants: tuple[Variant, ...]) -> str:
    """A one-variant unit: the variant's name; else direction, dtype, head dim, count and a
    digest of the members (which a different selection changes)."""
    if len(variants) == 1:
        return variants[0].name
    v = variants[0]
    digest = hashlib.sha1(" ".join(x.name for x in variants).encode()).hexdigest()[:8]
    return f"{v.direction}_{v.dtype}_d{v.head_dim}_x{len(variants)}_{digest}"


def partition(variants: Iterable[Variant], size: Optional[int] = None) -> list[Unit]:
    """`variants` in units of at most `size` sharing (direction, dtype, head_dim, extended
    shapes), in the order given; each group split into near-equal runs of neighbours (a spec
    lists a tile's variants together, and those share the most templates)."""
    size = unit_size(size)
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        groups.setdefault(_key(v), []).append(v)
    units = []
    for members in groups.values():
        chunks = -(-len(members) // size)
        bounds = [len(members) * i // chunks for i in range(chunks + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            part = tuple(members[lo:hi])
            units.append(Unit(unit_name(part), part))
    return units


# ---------------------------------------------------------------------------------- kernels
# Which of a unit's kernels belong to which variant: each variant's kernels take its Traits
# type, whose template arguments are the launcher's (templates/kernels/fa3gen_fwd.cuh and
# fa3gen_bwd.cuh), so the mangled name of fa3gen::FwdTraits<cutlass::bfloat16_t, 128, ...>
# identifies them in ptxas's entry names. tests/test_units.py holds real entry names.
_TRAITS = {"fwd": "FwdTraits", "bwd": "BwdTraits"}
assert set(_TRAITS) == set(LAUNCHERS)


def _mangle_arg(arg: str) -> str:
    if arg in ("true", "false"):
        return f"Lb{int(arg == 'true')}E"
    if arg.lstrip("-").isdigit():
        n = int(arg)
        return f"Li{'n' if n < 0 else ''}{abs(n)}E"
    parts = arg.split("::")  # a class type, e.g. cutlass::bfloat16_t
    nested = "".join(f"{len(p)}{p}" for p in parts)
    return f"N{nested}E" if len(parts) > 1 else nested


def traits_mangled(v: Variant) -> str:
    """The Itanium-mangled Traits type of v's kernels, as it appears inside their names."""
    traits = _TRAITS[v.direction]
    return f"{len(traits)}{traits}I{''.join(_mangle_arg(a) for a in template_args(v))}E"
