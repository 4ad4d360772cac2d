"""Variants: enumerate a spec's cartesian product, prune what cannot work, pick defaults.

A variant that cannot work on sm_90a (or that the templates cannot realize yet) is not
an error: it is pruned by a named constraint so `fa3gen list --explain` can say why.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from fa3gen.contract import (AXES, AXIS_BY_NAME, BACKWARD_SPLIT_HEAD_DIM_ABOVE, DTYPES, KEY_AXES,
                             KNOB_AXES, PAGED_CHUNK_ROWS, SUPPORTED_HEAD_DIMS, Variant, key_str,
                             takes_seqlen_ranges)

from .spec import Spec, fmt_value


def consumer_warpgroups(v: Variant) -> int:
    """Forward: one per 64 query rows (WGMMA M = 64). Backward: one per 64 keys, or two that
    split head_dim over 64 keys (bwd_splits_head_dim), or one per 64 rows of head_dim
    (bwd_transposes_dkv)."""
    if v.direction == "bwd":
        if bwd_transposes_dkv(v):
            return v.head_dim // 64
        return 2 if bwd_splits_head_dim(v) else v.tile_n // 64
    return v.tile_m // 64


def bwd_transposes_dkv(v: Variant) -> bool:
    """Backward with a tile_n that is not whole 64-key warpgroups (d192: 64x96): dK^T and dV^T
    with head_dim on the WGMMA M axis, one consumer warpgroup per 64 rows of head_dim; S, dP,
    P and dS with the queries on M, P and dS through shared memory (BwdTraits::kTransposedDkv)."""
    return v.direction == "bwd" and v.tile_n % 64 != 0


def bwd_splits_head_dim(v: Variant) -> bool:
    """Backward above BACKWARD_SPLIT_HEAD_DIM_ABOVE (and 64-key tiles): two consumer warpgroups
    over 64 keys, each with half of head_dim's columns of dK, dV and dQ; P^T goes through
    shared memory."""
    return v.direction == "bwd" and v.head_dim > BACKWARD_SPLIT_HEAD_DIM_ABOVE and not bwd_transposes_dkv(v)


def knobs_of(v: Variant) -> dict:
    """A variant's knob values by axis (what a dispatch entry's `use` matches)."""
    axes = v.axes()
    return {a: axes[a] for a in KNOB_AXES}


# --------------------------------------------------------------------------- constraints
# Each returns None when the variant is fine, else a short reason.

# (knob, value) pairs the kernel templates implement today. The lead flips a knob on by
# adding its pair here once the feature lands in templates/kernels/.
REALIZED_KNOBS = {
    ("warp_specialized", True), ("warp_specialized", False),
    ("pingpong", False), ("pingpong", True),
    ("intra_wg_overlap", False), ("intra_wg_overlap", True),
    ("peel_masked", False), ("peel_masked", True),
    ("p_in_smem", False), ("p_in_smem", True),
    ("o_tma_store", False), ("o_tma_store", True),
}
# A new on/off knob is checked too: pruned until its values are added above.
_CHECKED_KNOBS = tuple(a for a in KNOB_AXES if AXIS_BY_NAME[a].kind == "bool")

SMEM_LIMIT = 232448              # 227 KiB: sm_90 max dynamic shared memory per block (smem_atoms.cuh)
SMEM_RESERVED = 1024             # barriers, alignment slack
REG_OVERHEAD = 24                # addresses, loop state, softmax stats per consumer thread
FP8_V_RAW_SLOTS = 2              # FwdTraits::kVRawSlots (tests/test_variants.py ties the copies)


def smem_bytes(v: Variant) -> int:
    """Forward: Q tile once + K and V tiles per pipeline stage. Backward: K and V once,
    Q and dO per stage, two dS buffers (tile_m x tile_n), LSE and D rows per stage, and one
    fp32 dQ tile (tile_m x head_dim) for the dQ writer; when the warpgroups split head_dim,
    two P^T buffers more, and no dQ tile if it does not fit (dQ is then handed over in the Q
    and dO buffers: BwdTraits::kDqInStages)."""
    elem = DTYPES[v.dtype].bytes
    if v.direction == "bwd":
        split = bwd_splits_head_dim(v) or bwd_transposes_dkv(v)  # P (or P^T) buffers too
        core = elem * (2 * v.tile_n * v.head_dim + 2 * v.stages * v.tile_m * v.head_dim
                       + (4 if split else 2) * v.tile_m * v.tile_n) + 8 * v.stages * v.tile_m \
            + SMEM_RESERVED
        dq_tile = 4 * v.tile_m * v.head_dim
        return core if split and core + dq_tile > SMEM_LIMIT else core + dq_tile
    # fp8 also lands V in FP8_V_RAW_SLOTS raw tiles, which the producers transpose; p_in_smem
    # adds P's tile, o_tma_store O's (the size of Q's).
    # (VRawStorage's slot barriers follow the slots and pad the 1 KiB-aligned struct by 1 KiB)
    raw_v = FP8_V_RAW_SLOTS * v.tile_n * v.head_dim + 1024 if v.dtype == "e4m3" else 0
    p_tile = v.tile_m * v.tile_n if v.p_in_smem else 0
    o_tile = v.tile_m * v.head_dim if v.o_tma_store else 0
    return elem * (v.tile_m * v.head_dim + 2 * v.stages * v.tile_n * v.head_dim + raw_v + p_tile
                   + o_tile) + SMEM_RESERVED


def fwd_clustered(v: Variant) -> bool:
    """Whether the forward runs as CTA pairs sharing K and V by multicast (FwdTraits::kClusterM,
    whose condition this mirrors): dense non-causal 16-bit warp-specialized forwards of head dim
    >= 128 without window, softcap or P in shared memory. Their producers keep 40 registers."""
    return (v.direction == "fwd" and v.dtype != "e4m3" and not v.causal and not v.local
            and not v.softcap and not v.varlen and not v.paged and v.warp_specialized
            and not v.p_in_smem and v.head_dim >= 128)


def consumer_registers(v: Variant) -> tuple[int, int]:
    """(needed, cap) fp32 registers per consumer thread.

    Forward: a consumer warpgroup (128 threads) owns 64 rows: S = 64 x tile_n and
    O = 64 x head_dim accumulators, i.e. tile_n/2 + head_dim/2 per thread. setmaxnreg gives
    consumers 240 with two consumer warpgroups but only 160 with three.
    Backward: a consumer warpgroup owns 64 keys: dK and dV (64 x head_dim each) live all the
    time, S^T and dP^T (64 x tile_m each) per query block: head_dim + tile_m per thread. When
    two warpgroups split head_dim, each holds half of dK and dV, of S^T and dP^T (half of the
    queries) and of dQ (tile_m x head_dim, live while S^T and dP^T are not). When each
    warpgroup owns 64 rows of head_dim (bwd_transposes_dkv), it holds dK^T and dV^T (64 x
    tile_n each), its share of the keys of S and dP, and its 64 columns of dQ; 160 registers
    with three consumer warpgroups."""
    if bwd_transposes_dkv(v):
        wgs = consumer_warpgroups(v)
        sdp = 2 * v.tile_m * (v.tile_n // wgs) // 128
        return v.tile_n + max(sdp, v.tile_m * 64 // 128) + REG_OVERHEAD, 240 if wgs <= 2 else 160
    if bwd_splits_head_dim(v):
        dq = v.tile_m * v.head_dim // 256
        return v.head_dim // 2 + max(v.tile_m // 2, dq) + REG_OVERHEAD, 240
    if v.direction == "bwd":
        return v.head_dim + v.tile_m + REG_OVERHEAD, 240
    need = v.tile_n // 2 + v.head_dim // 2 + REG_OVERHEAD
    cap = 240 if consumer_warpgroups(v) <= 2 else 160
    if v.dtype == "e4m3":  # the transposing producers keep 40, not 24 (FwdTraits)
        # P's e4m3 copy is live beside S only when S(i) runs with P(i-1) V(i-1) (the
        # intra-warpgroup overlap); otherwise it takes S's registers as they die.
        need, cap = need + (v.tile_n // 8 if v.intra_wg_overlap else 0), min(cap, 232)
    elif fwd_clustered(v):  # the multicasting producers keep 40 too
        cap = min(cap, 232)
    if v.dtype != "e4m3" and v.intra_wg_overlap and not v.p_in_smem:
        # P(i-1) in 16 bits stays live beside S(i) while P(i-1) V(i-1) runs (measured: d64
        # 128x256 spills 144 bytes with the overlap, none without; d96 192x128 / 192x144 144
        # and 288)
        need += v.tile_n // 4
    return need, cap


def head_dim_supported(v: Variant) -> Optional[str]:
    if v.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {v.head_dim} not in {list(SUPPORTED_HEAD_DIMS)}"
    return None


def fp8_scope(v: Variant) -> Optional[str]:
    """What the e4m3 forward realizes today."""
    if v.dtype != "e4m3":
        return None
    if v.direction == "bwd":
        return "e4m3 is forward only (fp8 training is not a goal of the kernels)"
    if v.local or v.softcap or v.varlen:
        return ("e4m3 with local, softcap or varlen is not realized yet (the descales are not "
                "folded into the softcap, and those paths are not tested with fp8)")
    if not v.warp_specialized:
        return "e4m3 needs warp_specialized: true (the producer warpgroup transposes V)"
    if v.tile_n % 32:
        return (f"e4m3 tile_n {v.tile_n} must be a multiple of 32 (the PV GEMM's K step)")
    return None


def one_mask(v: Variant) -> Optional[str]:
    if v.causal and v.local:
        return ("causal and local together: a local variant also serves causal windows "
                "(window_size=(left, 0)); use causal: false with local: true")
    return None


def backward_knobs(v: Variant) -> Optional[str]:
    # The backward template has one schedule: a producer warpgroup and consumers that run
    # their GEMMs in sequence. Pingpong/overlap axes stay in the name for one naming scheme.
    if v.direction == "bwd" and (not v.warp_specialized or v.pingpong or v.intra_wg_overlap):
        return ("the backward template realizes warp_specialized: true, pingpong: false, "
                "intra_wg_overlap: false only")
    return None


def mma_m_shape(v: Variant) -> Optional[str]:
    if v.direction == "bwd":
        # tile_m is the N of S^T = K Q^T and the K of dV / dK (multiples of 16). dQ is one or
        # two 64-row WGMMAs, or dQ^T = K^T dS^T (N = tile_m) when tile_m is not.
        if v.tile_m % 16 or not 16 <= v.tile_m <= 128:
            return f"backward tile_m {v.tile_m} must be a multiple of 16 in [16, 128] (query rows per block)"
        if bwd_transposes_dkv(v):  # mma_n_shape checks the rest
            return None if v.tile_m == 64 else (
                f"backward tile_n {v.tile_n} (dK^T / dV^T) takes tile_m 64, not {v.tile_m}")
        if v.tile_m % 64 and v.head_dim != v.tile_n:
            return (f"backward tile_m {v.tile_m} computes dQ^T, which needs head_dim == tile_n "
                    f"(64 head_dim rows per consumer warpgroup); head_dim is {v.head_dim}")
        return None
    # One consumer warpgroup per 64 rows (WGMMA M = 64), at most 3 consumers.
    if v.tile_m % 64 or not 1 <= v.tile_m // 64 <= 3:
        return f"tile_m {v.tile_m} must be 64, 128 or 192 (one consumer warpgroup per 64 rows)"
    return None


def mma_n_shape(v: Variant) -> Optional[str]:
    if v.direction == "bwd":
        if bwd_transposes_dkv(v):
            # GPU-tested at d192 only (three warpgroups of 64 head_dim rows, 32 keys each of S)
            if v.head_dim != 192 or v.tile_n != 96:
                return (f"backward tile_n {v.tile_n}: dK^T / dV^T with head_dim on WGMMA M is "
                        f"realized for head_dim 192 with tile 64x96 only (head_dim {v.head_dim})")
            return None
        if bwd_splits_head_dim(v):
            if v.tile_n != 64 or v.tile_m != 64:
                return (f"backward head_dim {v.head_dim} (above {BACKWARD_SPLIT_HEAD_DIM_ABOVE}) "
                        f"takes tile 64x64: two warpgroups split head_dim over 64 keys and "
                        f"64 query rows (tile {v.tile_m}x{v.tile_n})")
            return None
        if v.tile_n not in (64, 128):
            return f"backward tile_n {v.tile_n} must be 64 or 128 (one consumer warpgroup per 64 keys)"
        if v.tile_m % 64:  # dQ^T tiles: mma_m_shape checks their split
            return None
        wg_m, wgs = v.tile_m // 64, v.tile_n // 64
        if wgs % wg_m or (wgs // wg_m > 1 and v.head_dim % (64 * (wgs // wg_m))):
            return (f"backward dQ tile {v.tile_m}x{v.head_dim} cannot be split over "
                    f"{wgs} consumer warpgroups in whole 64-row / 64-column pieces")
        return None
    # Below 64 keys the K and V^T tiles do not hold one 64-key chunk, the unit of the paged
    # loads whose layouts every forward instantiates (a CuTe static assertion otherwise).
    if v.tile_n % 16 or not 64 <= v.tile_n <= 256:
        return (f"tile_n {v.tile_n} must be a multiple of 16 in [64, 256] (WGMMA N, and at least "
                "one 64-key chunk of K and V)")
    return None


def stages_range(v: Variant) -> Optional[str]:
    if not 1 <= v.stages <= 4:
        return f"stages {v.stages} not in [1, 4]"
    return None


def smem_budget(v: Variant) -> Optional[str]:
    need = smem_bytes(v)
    if need > SMEM_LIMIT:
        return f"needs {need} bytes of shared memory > {SMEM_LIMIT} (227 KiB)"
    return None


def register_budget(v: Variant) -> Optional[str]:
    need, cap = consumer_registers(v)
    if need > cap:
        return f"needs ~{need} registers per consumer thread > {cap}"
    return None


def peel_needs_overlap(v: Variant) -> Optional[str]:
    if v.peel_masked and (v.direction != "fwd" or not v.intra_wg_overlap):
        return "peel_masked is realized in the forward's overlapped loop (fwd, intra_wg_overlap: true) only"
    return None


def paged_scope(v: Variant) -> Optional[str]:
    """Paged: the varlen forward reading keys through a block table (chunked prefill)."""
    if not v.paged:
        return None
    if v.direction != "fwd" or not v.varlen:
        return ("paged is a varlen forward's (flash_attn_with_kvcache's chunked prefill is "
                "forward only and per sequence); set direction: fwd and varlen: true")
    if v.tile_n % PAGED_CHUNK_ROWS:
        return (f"paged tile_n {v.tile_n} must be a multiple of {PAGED_CHUNK_ROWS} (keys arrive in "
                "TMA chunks of that many rows, each from its page)")
    return None


def p_in_smem_scope(v: Variant) -> Optional[str]:
    """What p_in_smem is realized and GPU-tested for (2026-12-01: d96 dense forwards)."""
    if not v.p_in_smem:
        return None
    if v.direction != "fwd" or v.dtype == "e4m3":
        return ("p_in_smem is realized in the 16-bit forward only (the e4m3 P is permuted in "
                "registers into the PV GEMM's operand)")
    if not (v.warp_specialized and v.intra_wg_overlap) or v.local or v.softcap or v.varlen \
            or v.peel_masked:
        return ("p_in_smem is GPU-tested with warp_specialized and intra_wg_overlap, without "
                "local, softcap, varlen or peel_masked; other combinations are not built yet")
    return None


def o_tma_store_scope(v: Variant) -> Optional[str]:
    """Where O's TMA store is realized: one store per consumer warpgroup of its 64 rows of one
    (head, batch), so not across the varlen rows' sequence bounds; e4m3's O is converted to
    another type than its inputs and not staged this way."""
    if v.o_tma_store and (v.direction != "fwd" or v.dtype == "e4m3" or v.varlen
                          or not v.warp_specialized):
        return ("o_tma_store is realized in the 16-bit warp-specialized forward without varlen "
                "only")
    return None


def pingpong_needs_two_consumers(v: Variant) -> Optional[str]:
    if v.pingpong and (consumer_warpgroups(v) < 2 or not v.warp_specialized):
        return "pingpong needs warp specialization and at least 2 consumer warpgroups"
    return None


def knob_realized(v: Variant) -> Optional[str]:
    for knob in _CHECKED_KNOBS:
        value = getattr(v, knob)
        if (knob, value) not in REALIZED_KNOBS:
            return f"{knob}={fmt_value(value)} is not realized by the templates yet"
    return None


# Order matters: the first failing constraint is the one reported.
CONSTRAINTS: tuple[tuple[str, Callable[[Variant], Optional[str]]], ...] = (
    ("head_dim_supported", head_dim_supported),
    ("fp8_scope", fp8_scope),
    ("one_mask", one_mask),
    ("paged_scope", paged_scope),
    ("backward_knobs", backward_knobs),
    ("mma_m_shape", mma_m_shape),
    ("mma_n_shape", mma_n_shape),
    ("stages_range", stages_range),
    ("smem_budget", smem_budget),
    ("register_budget", register_budget),
    ("pingpong_needs_two_consumers", pingpong_needs_two_consumers),
    ("peel_needs_overlap", peel_needs_overlap),
    ("p_in_smem_scope", p_in_smem_scope),
    ("o_tma_store_scope", o_tma_store_scope),
    ("knob_realized", knob_realized),
)


def check(v: Variant) -> Optional[tuple[str, str]]:
    """(constraint name, reason) of the first constraint the variant fails, else None."""
    for cname, fn in CONSTRAINTS:
        reason = fn(v)
        if reason:
            return cname, reason
    return None


# --------------------------------------------------------------------------- enumeration

class Pruned(NamedTuple):
    variant: Variant
    constraint: str   # a CONSTRAINTS name, or "exclude[i]" for a spec exclude entry
    reason: str


@dataclass
class Enumeration:
    kept: list[Variant]
    pruned: list[Pruned]
    # Variants that several groups produce (each kept once), for `fa3gen build` and `fa3gen
    # list` to print with the spec's own warnings (Spec.warnings). Each "<spec file>: <message>".
    warnings: list[str] = field(default_factory=list)


_MAX_NAMED = 10  # duplicate variants named per warning


# More combinations than a spec means (h100.yaml: about 200): a typo's product (200 head dims x
# 39 tiles x 50 stages) would enumerate for minutes and gigabytes before any error.
MAX_COMBINATIONS = 100_000


def enumerate_variants(spec: Spec) -> Enumeration:
    first_group: dict[Variant, str] = {}             # variant -> first group that produced it
    repeated: dict[tuple[str, str], list[Variant]] = {}   # (first group, later group) -> variants
    produced: dict[str, set[Variant]] = {}
    total = 0
    for group in spec.groups:
        count = math.prod(len(group.values(a)) for a in AXES)
        total += count
        if count > MAX_COMBINATIONS or total > MAX_COMBINATIONS:
            what = (f"group {group.name!r} expands to {total:,} combinations of its axes' "
                    if count == total else f"with group {group.name!r} the groups expand to "
                    f"{total:,} combinations of their axes' ")
            raise spec.error(f"{what}values (at most {MAX_COMBINATIONS:,}): list fewer values "
                             "per axis")
        for combo in itertools.product(*(group.values(a) for a in AXES)):
            v = Variant.from_axes(dict(zip(AXES, combo)))
            produced.setdefault(group.name, set()).add(v)
            earlier = first_group.setdefault(v, group.name)
            if earlier != group.name:
                repeated.setdefault((earlier, group.name), []).append(v)
    warnings = []
    for (earlier, later), vs in repeated.items():
        names = sorted(v.name for v in vs)
        more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
        warnings.append(f"{spec.path}: group {later!r} repeats {len(names)} variant(s) of group "
                        f"{earlier!r} (each is kept once): "
                        f"{', '.join(names[:_MAX_NAMED])}{more}")
    kept, pruned = [], []
    matched: set[str] = set()
    for v in sorted(first_group, key=lambda v: v.name):
        axes = v.axes()
        rules = [r for r in spec.exclude if r.matches(axes)]
        matched.update(r.where for r in rules)
        if rules:
            rule = rules[0]
            pruned.append(Pruned(v, rule.where, f"excluded by the spec: {rule.describe()}"))
            continue
        failed = check(v)
        if failed:
            pruned.append(Pruned(v, *failed))
        else:
            kept.append(v)
    for rule in spec.exclude:
        if rule.where not in matched:
            raise spec.error(f"{rule.where} {rule.describe()} matches no variant of the spec")
    # A group the constraints empty leaves its keys without variants, which only a call
    # (VariantNotBuiltError) would otherwise reveal; one the spec's excludes empty is meant.
    kept_set = set(kept)
    by_constraint = {x.variant: x for x in pruned if not x.constraint.startswith("exclude[")}
    for group in spec.groups:
        vs = produced.get(group.name, set())
        lost = sorted((by_constraint[v] for v in vs if v in by_constraint), key=lambda x: x.variant.name)
        if lost and not vs & kept_set:
            warnings.append(f"{spec.path}: group {group.name!r} keeps no variant: each is pruned "
                            f"(e.g. {lost[0].variant.name}: {lost[0].constraint}: "
                            f"{lost[0].reason}); `fa3gen list --explain` names them all")
    return Enumeration(kept, pruned, warnings)


def unmatched_values(spec: Spec, en: Enumeration) -> list[str]:
    """Warnings for values in an exclude, `when` or `use` list that no variant has (a typo such
    as tile [182, 192] beside [128, 128]): the entry still matches through its other values,
    so nothing else would say so. exclude is over every enumerated variant, dispatch over the
    kept ones."""
    def values_by_axis(variants) -> dict:
        axes = [v.axes() for v in variants]
        return {a: {x[a] for x in axes} for a in AXES}

    every = values_by_axis([*en.kept, *(x.variant for x in en.pruned)])
    kept = values_by_axis(en.kept)
    out = []
    for match, seen, what in ([(r, every, "variant") for r in spec.exclude] +
                              [(m, kept, "kept variant") for e in spec.dispatch
                               for m in (e.when, e.use)]):
        out += [f"{spec.path}: {match.where}: {axis} {fmt_value(x)} matches no {what} of the spec"
                for axis, values in match.items for x in values if x not in seen[axis]]
    return out


# --------------------------------------------------------------------------- dispatch

def _left_by_use(entries, cands: list[Variant], key, spec: Spec) -> Variant:
    """The one candidate every entry's `use` keeps; none or several is the spec's error, which
    names the optional flags (peel_masked, ...) that a `use` leaves unnamed, and so asks off,
    where only those stand between it and a candidate."""
    left = [v for v in cands if all(e.use.matches_flags_off(knobs_of(v)) for e in entries)]
    if len(left) == 1:
        return left[0]
    what = "; ".join(e.describe() for e in entries)
    picked = ", ".join(v.name for v in left) or "none"
    msg = (f"{what}: must leave exactly one variant for {key_str(key)}, leaves {len(left)} "
           f"({picked}); candidates: {', '.join(v.name for v in cands)}")
    if not left:
        named = {k for e in entries for k, _ in e.use.items}
        flags = sorted({a for v in cands if all(e.use.matches(knobs_of(v)) for e in entries)
                        for a, on in knobs_of(v).items()
                        if on and a not in named and AXIS_BY_NAME[a].optional})
        if flags:
            msg += (f" (a `use` that does not name an optional flag asks for it off; the "
                    f"candidates it otherwise matches have {', '.join(f'{a}: true' for a in flags)}"
                    f": name it)")
    raise spec.error(msg)


def resolve_dispatch(spec: Spec, kept: list[Variant]) -> dict[tuple, Variant]:
    """Default variant per dispatch key (contract.KEY_AXES: direction, dtype, head_dim, causal, ...).

    All dispatch entries whose `when` matches a key apply together (their `use` rules
    intersect); exactly one variant of the key must survive them. A key that no entry
    covers defaults to its only variant; with several, that is an error unless the spec
    says `dispatch_required: false` (then the key simply has no default)."""
    by_key: dict[tuple, list[Variant]] = {}
    for v in sorted(kept, key=lambda v: v.name):
        by_key.setdefault(v.key, []).append(v)
    used: set[str] = set()
    defaults: dict[tuple, Variant] = {}
    for key, cands in sorted(by_key.items(), key=lambda kv: kv[1][0].name):
        key_axes = dict(zip(KEY_AXES, key))
        entries = [e for e in spec.dispatch if e.when.matches_flags_off(key_axes) and e.seqlen_k is None]
        names = ", ".join(v.name for v in cands)
        if entries:
            used.update(e.where for e in entries)
            defaults[key] = _left_by_use(entries, cands, key, spec)
        elif len(cands) == 1:
            defaults[key] = cands[0]
        elif spec.dispatch_required:
            raise spec.error(f"ambiguous default for {key_str(key)}: candidates {names}; "
                             "add a dispatch entry (or set dispatch_required: false)")
    for e in spec.dispatch:
        if e.where not in used and e.seqlen_k is None:
            keys = ", ".join(key_str(k) for k in sorted(by_key)) or "none"
            raise spec.error(f"{e.describe()} matches no kept variant key (kept keys: {keys})")
    return defaults


def resolve_seqlen_dispatch(spec: Spec, kept: list[Variant],
                            defaults: dict[tuple, Variant]) -> dict[tuple, list]:
    """Per key, [(lo, hi, variant)]: the dispatch entries with a seqlen_k range. Within a range
    its entries replace the key's others (their `use` rules intersect and must leave exactly
    one variant); distinct ranges of one key must not overlap; the key needs its default (the
    calls outside every range, and torch.compile with a dynamic seqlen, take it). Forward keys
    only, not paged: the other calls choose their variant without a length."""
    by_key: dict[tuple, list[Variant]] = {}
    for v in kept:
        by_key.setdefault(v.key, []).append(v)
    out: dict[tuple, list] = {}
    for e in (e for e in spec.dispatch if e.seqlen_k is not None):
        keys = [k for k in by_key if e.when.matches_flags_off(dict(zip(KEY_AXES, k)))]
        if not keys:
            raise spec.error(f"{e.describe()} matches no kept variant key")
        for key in keys:  # a varlen key's range is on the call's max_seqlen_k
            if not takes_seqlen_ranges(key):
                raise spec.error(
                    f"{e.describe()} matches {key_str(key)}: seqlen_k ranges choose among the "
                    "variants of forward keys that are not paged (a compiled backward fixes its "
                    "kernel before any length is known, and a paged call passes none), so these "
                    "keys run their default: drop the entry's seqlen_k, or keep its `when` to "
                    "`direction: fwd` keys without `paged`")
            if key not in defaults:
                raise spec.error(f"{e.describe()}: {key_str(key)} has no default for the calls "
                                 "outside the range; give it one")
            ranges = out.setdefault(key, [])
            if any(r[:2] == e.seqlen_k for r in ranges):
                continue  # the same range: its entries are resolved together below
            for lo, hi, _ in ranges:
                if lo <= e.seqlen_k[1] and e.seqlen_k[0] <= hi:
                    raise spec.error(f"{e.describe()}: its range overlaps [{lo}, {hi}] of "
                                     f"another entry for {key_str(key)}")
            same = [x for x in spec.dispatch if x.seqlen_k == e.seqlen_k
                    and x.when.matches_flags_off(dict(zip(KEY_AXES, key)))]
            ranges.append((*e.seqlen_k, _left_by_use(same, by_key[key], key, spec)))
    return {k: sorted(r, key=lambda x: x[0]) for k, r in out.items()}
