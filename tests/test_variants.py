"""Enumeration, pruning constraints and dispatch (generator/variants.py); names and parsing are
fa3gen/contract.py's (tests/test_contract.py)."""
import dataclasses
import re
import textwrap

import pytest

from fa3gen.contract import KEY_AXES, Variant, make_key, parse_name
from generator import variants as V
from generator.errors import SpecError
from generator.paths import KERNELS_DIR, SPECS_DIR
from generator.render import wgmma_n_sizes
from generator.spec import load_spec, parse_spec
from generator.variants import CONSTRAINTS, check, enumerate_variants, knobs_of, resolve_dispatch

BASE = Variant("fwd", "bf16", 128, False, False, False, False, 128, 128, 2, True, False, False)

# Every knob value is realized today; the knob_realized tests narrow the table to the state
# before pingpong/overlap/non-ws landed, so the mechanism stays proven for future knobs.
NARROW_KNOBS = {("warp_specialized", True), ("pingpong", False), ("intra_wg_overlap", False),
                ("peel_masked", False), ("p_in_smem", False),
                ("o_tma_store", False)}


@pytest.fixture
def narrow_knobs(monkeypatch):
    monkeypatch.setattr(V, "REALIZED_KNOBS", set(NARROW_KNOBS))


def spec_of(text, name="t.yaml"):
    return parse_spec(textwrap.dedent(text), name, default_name=name.split(".")[0])


AXES = """\
axes:
  direction: fwd
  dtype: [bf16, fp16]
  head_dim: 128
  causal: [false, true]
  tile: [[128, 128], [128, 176]]
  stages: 2
  warp_specialized: true
  pingpong: false
  intra_wg_overlap: false
"""


def test_cartesian_expansion_sorted():
    en = enumerate_variants(spec_of(AXES))
    assert len(en.kept) == 2 * 2 * 2 and not en.pruned
    assert [v.name for v in en.kept] == sorted(v.name for v in en.kept)


def test_groups_dedupe_and_exclude():
    spec = spec_of(AXES + """\
groups:
  - name: a
    axes: {dtype: bf16}
  - name: b
    axes: {dtype: [bf16, fp16]}
exclude:
  - {causal: true, tile: [128, 176]}
""")
    en = enumerate_variants(spec)
    names = [v.name for v in en.kept]
    assert len(names) == len(set(names)) == 2 * 3  # bf16 from both groups counted once
    assert not any(v.causal and v.tile_n == 176 for v in en.kept)
    assert {p.constraint for p in en.pruned} == {"exclude[0]"}
    assert len(en.pruned) == 2
    # ... and says so, naming them.
    repeated = sorted(v.name for v in en.kept + [p.variant for p in en.pruned]
                      if v.dtype == "bf16")
    assert en.warnings == [f"t.yaml: group 'b' repeats 4 variant(s) of group 'a' (each is kept "
                           f"once): {', '.join(repeated)}"]


def test_many_repeated_variants_are_counted():
    spec = spec_of(AXES.replace("stages: 2", "stages: [1, 2, 3]") + """groups:
  - name: a
    axes: {}
  - name: b
    axes: {}
""")
    (warning,) = enumerate_variants(spec).warnings
    assert "group 'b' repeats 24 variant(s) of group 'a'" in warning
    assert warning.endswith(" and 14 more") and warning.count("fwd_") == 10


def test_repeated_value_warns_in_the_spec_not_per_variant():
    spec = spec_of(AXES.replace("dtype: [bf16, fp16]", "dtype: [bf16, bf16]"))
    en = enumerate_variants(spec)
    assert len(en.kept) == 4 and not en.warnings
    assert spec.warnings == ('t.yaml: axes.dtype[1]: "bf16" repeats axes.dtype[0]; '
                             "the value is used once",)


def test_exclude_matching_nothing_is_error():
    spec = spec_of(AXES + """exclude:
  - {causal: true, tile: [128, 176]}
  - {causal: true}
  - {head_dim: 80}
""")
    with pytest.raises(SpecError, match=r"t.yaml: exclude\[2\] \{head_dim: 80\} matches no "
                                        r"variant of the spec"):
        enumerate_variants(spec)
    # exclude[1] also covers what exclude[0] drops: both match, whichever names the prune.
    en = enumerate_variants(spec_of(AXES + "exclude:\n  - {causal: true, tile: [128, 176]}\n"
                                    "  - {causal: true}\n"))
    assert {p.constraint for p in en.pruned} == {"exclude[0]", "exclude[1]"}


def test_exclude_matching_only_variants_a_constraint_prunes_is_fine():
    en = enumerate_variants(spec_of(AXES.replace("stages: 2", "stages: [2, 5]") +
                                    "exclude:\n  - {stages: 5, causal: true}\n"))
    assert {p.constraint for p in en.pruned} == {"exclude[0]", "stages_range"}


def test_shipped_specs_enumerate_without_warnings():
    for name in ("tiny", "h100", "ablation"):
        en = enumerate_variants(load_spec(SPECS_DIR / f"{name}.yaml"))
        assert en.kept and not en.warnings


def test_variants_sort_head_dims_as_numbers():
    """Variant's own order (its fields: direction, dtype, head_dim, ...), which `fa3gen list`
    uses; name order would put d128 before d64."""
    names = ["fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_nocausal_m192n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_nocausal_m64n128_s2_ws1_pp0_ov0",
             "fwd_fp16_d64_nocausal_m128n128_s2_ws1_pp0_ov0",
             "bwd_bf16_d256_nocausal_m64n64_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_causal_m128n128_s2_ws1_pp0_ov0"]
    assert [v.name for v in sorted(map(parse_name, names))] == [
        "bwd_bf16_d256_nocausal_m64n64_s2_ws1_pp0_ov0",
        "fwd_bf16_d64_nocausal_m64n128_s2_ws1_pp0_ov0",
        "fwd_bf16_d64_nocausal_m192n128_s2_ws1_pp0_ov0",
        "fwd_bf16_d64_causal_m128n128_s2_ws1_pp0_ov0",
        "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0",
        "fwd_fp16_d64_nocausal_m128n128_s2_ws1_pp0_ov0"]


@pytest.mark.parametrize("change,constraint", [
    (dict(head_dim=80), "head_dim_supported"),
    (dict(direction="bwd", tile_m=64, pingpong=True), "backward_knobs"),
    (dict(direction="bwd", tile_m=64, intra_wg_overlap=True), "backward_knobs"),
    (dict(direction="bwd", tile_m=192), "mma_m_shape"),
    (dict(direction="bwd", tile_m=72), "mma_m_shape"),                 # not a multiple of 16
    (dict(direction="bwd", head_dim=64, tile_m=80), "mma_m_shape"),    # dQ^T needs d == tile_n
    (dict(direction="bwd", tile_m=64, tile_n=176), "mma_n_shape"),
    (dict(direction="bwd", tile_m=128, tile_n=64), "mma_n_shape"),   # dQ rows cannot be split
    (dict(direction="bwd", tile_m=128), "smem_budget"),
    (dict(direction="bwd", head_dim=256, tile_m=64, tile_n=64, stages=3), "smem_budget"),
    (dict(direction="bwd", head_dim=256, tile_m=64, tile_n=128, stages=1), "mma_n_shape"),
    (dict(direction="bwd", head_dim=192, tile_m=128, tile_n=64), "mma_n_shape"),
    (dict(tile_m=96), "mma_m_shape"),
    (dict(tile_m=256), "mma_m_shape"),
    (dict(tile_n=120), "mma_n_shape"),
    (dict(tile_n=48), "mma_n_shape"),                                 # below one 64-key chunk
    (dict(tile_n=272), "mma_n_shape"),
    (dict(stages=5), "stages_range"),
    (dict(head_dim=256, tile_n=128), "smem_budget"),
    (dict(head_dim=256, tile_m=192, tile_n=64, stages=1), "register_budget"),
    (dict(tile_m=64, pingpong=True), "pingpong_needs_two_consumers"),
    (dict(warp_specialized=False, pingpong=True), "pingpong_needs_two_consumers"),
    (dict(warp_specialized=False), "knob_realized"),
    (dict(pingpong=True), "knob_realized"),
    (dict(intra_wg_overlap=True), "knob_realized"),
    (dict(paged=True), "paged_scope"),                              # not varlen
    (dict(paged=True, varlen=True, direction="bwd", tile_m=64), "paged_scope"),
    (dict(paged=True, varlen=True, tile_n=176), "paged_scope"),        # not whole 64-row chunks
    (dict(p_in_smem=True, direction="bwd", tile_m=64), "p_in_smem_scope"),
    (dict(p_in_smem=True, dtype="e4m3", intra_wg_overlap=True), "p_in_smem_scope"),
    (dict(p_in_smem=True), "p_in_smem_scope"),                      # no overlap: not tested
    (dict(p_in_smem=True, intra_wg_overlap=True, local=True), "p_in_smem_scope"),
    (dict(p_in_smem=True, head_dim=192, tile_n=112, intra_wg_overlap=True), "smem_budget"),
    (dict(o_tma_store=True, direction="bwd", tile_m=64), "o_tma_store_scope"),
    (dict(o_tma_store=True, dtype="e4m3"), "o_tma_store_scope"),
    (dict(o_tma_store=True, varlen=True), "o_tma_store_scope"),
    (dict(o_tma_store=True, warp_specialized=False), "o_tma_store_scope"),
    (dict(o_tma_store=True, head_dim=256, tile_n=128, stages=1), "smem_budget"),  # fits without O's tile
])
def test_each_constraint_prunes(change, constraint, monkeypatch):
    if constraint == "knob_realized":
        monkeypatch.setattr(V, "REALIZED_KNOBS", set(NARROW_KNOBS))
    v = dataclasses.replace(BASE, **change)
    failed = check(v)
    assert failed is not None and failed[0] == constraint, failed


def test_p_in_smem_counts_p_tile():
    """P's (tile_m x tile_n) 16-bit tile is in the shared-memory budget (FwdTraits::PStorage),
    and the GPU-tested case, d96 192x128 with pingpong and overlap, passes every constraint."""
    v = dataclasses.replace(BASE, head_dim=96, tile_m=192, pingpong=True, intra_wg_overlap=True)
    with_p = dataclasses.replace(v, p_in_smem=True)
    assert V.smem_bytes(with_p) - V.smem_bytes(v) == 2 * 192 * 128
    assert check(with_p) is None and with_p.name.endswith("_ov1_psmem")


def test_o_tma_store_counts_o_tile():
    """O's (tile_m x head_dim) tile is in the shared-memory budget (FwdTraits::OStorage)."""
    v = dataclasses.replace(BASE, head_dim=64, causal=True, pingpong=True, intra_wg_overlap=True,
                            peel_masked=True)
    with_o = dataclasses.replace(v, o_tma_store=True)
    assert V.smem_bytes(with_o) - V.smem_bytes(v) == 2 * 128 * 64
    assert check(with_o) is None and with_o.name.endswith("_ov1_peel_otma")


def test_paged_chunk_is_the_kernels_chunk():
    """The runtime routes pages of whole chunks to the paged kernels (varlen.paged_fits), the
    pruning asks tiles of whole chunks: one chunk, FwdTraits::kPageChunk's."""
    import re
    from fa3gen.contract import PAGED_CHUNK_ROWS
    from generator.paths import KERNELS_DIR
    text = (KERNELS_DIR / "fwd_traits.cuh").read_text()
    assert int(re.search(r"constexpr int kPageChunk = (\d+);", text).group(1)) == PAGED_CHUNK_ROWS


def test_smem_limit_is_the_kernels_limit():
    """The pruning budget and the kernels' static_asserts (smem_atoms.cuh) name one limit."""
    import re
    from generator.paths import KERNELS_DIR
    text = (KERNELS_DIR / "smem_atoms.cuh").read_text()
    assert int(re.search(r"constexpr int kSmemPerBlockLimit = (\d+);", text).group(1)) == V.SMEM_LIMIT


@pytest.mark.parametrize("head_dim,stages", [(192, 3), (256, 2)])
def test_backward_above_128_splits_head_dim_over_64_keys(head_dim, stages):
    """Two consumer warpgroups over one 64-key block, half of head_dim each: fits the
    registers and, with dQ handed over in the Q and dO buffers where its tile does not fit,
    the shared memory (d256 two stages, d192 three)."""
    v = dataclasses.replace(BASE, direction="bwd", head_dim=head_dim, tile_m=64, tile_n=64,
                            stages=stages)
    assert check(v) is None
    assert V.consumer_warpgroups(v) == 2 and V.smem_bytes(v) <= V.SMEM_LIMIT
    assert wgmma_n_sizes(v) == {32, head_dim // 2}


def test_backward_d192_64x96_transposes_dkv_over_three_warpgroups():
    """tile_n 96 is not whole 64-key warpgroups: dK^T and dV^T with head_dim on WGMMA M, one
    consumer warpgroup per 64 head_dim rows (160 registers with three), S and dP split over the
    keys (32 each), dQ over head_dim (64 each); the fp32 dQ tile does not fit beside two stages."""
    v = dataclasses.replace(BASE, direction="bwd", head_dim=192, tile_m=64, tile_n=96, pingpong=False,
                            intra_wg_overlap=False)
    assert check(v) is None
    assert V.bwd_transposes_dkv(v) and not V.bwd_splits_head_dim(v)
    assert V.consumer_warpgroups(v) == 3
    assert V.consumer_registers(v) == (96 + 32 + V.REG_OVERHEAD, 160)
    # K, V 72 KiB; Q, dO two stages 96 KiB; P and dS two buffers each 48 KiB; LSE and D; no dQ tile
    assert V.smem_bytes(v) == 73728 + 98304 + 49152 + 8 * 2 * 64 + V.SMEM_RESERVED
    assert wgmma_n_sizes(v) == {32, 96, 64}


@pytest.mark.parametrize("change,constraint", [
    (dict(head_dim=128), "mma_n_shape"), (dict(tile_n=80), "mma_n_shape"), (dict(tile_m=128), "mma_m_shape")])
def test_backward_transposed_dkv_is_d192_64x96_only(change, constraint):
    axes = dict(direction="bwd", head_dim=192, tile_m=64, tile_n=96, pingpong=False, intra_wg_overlap=False)
    v = dataclasses.replace(BASE, **{**axes, **change})
    assert check(v)[0] == constraint


@pytest.mark.parametrize("change", [
    dict(warp_specialized=False), dict(pingpong=True), dict(intra_wg_overlap=True)])
def test_every_knob_value_is_realized_today(change):
    assert check(dataclasses.replace(BASE, **change)) is None


def test_constraint_table_order():
    assert [n for n, _ in CONSTRAINTS] == [
        "head_dim_supported", "fp8_scope", "one_mask", "paged_scope", "backward_knobs", "mma_m_shape",
        "mma_n_shape",
        "stages_range", "smem_budget", "register_budget", "pingpong_needs_two_consumers",
        "peel_needs_overlap", "p_in_smem_scope", "o_tma_store_scope", "knob_realized"]


def test_first_failing_constraint_reported():
    v = dataclasses.replace(BASE, direction="bwd", head_dim=80, tile_n=120)
    assert check(v)[0] == "head_dim_supported"


def test_reasons(narrow_knobs):
    assert check(dataclasses.replace(BASE, direction="bwd", pingpong=True))[1] == (
        "the backward template realizes warp_specialized: true, pingpong: false, "
        "intra_wg_overlap: false only")
    assert check(dataclasses.replace(BASE, pingpong=True))[1] == \
        "pingpong=true is not realized by the templates yet"
    assert check(dataclasses.replace(BASE, warp_specialized=False))[1] == \
        "warp_specialized=false is not realized by the templates yet"


def test_the_16_bit_overlap_keeps_p_beside_s():
    """With the intra-warpgroup overlap, P(i-1) (16-bit: tile_n / 4 registers a thread) lives
    beside S(i): kept without it, d64 128x256 spilled 144 bytes and d96 192x128 144; the same
    tiles without the overlap (or with P in shared memory) keep their count."""
    for tile_m, tile_n, head_dim in ((128, 256, 64), (192, 128, 96)):
        v = dataclasses.replace(BASE, head_dim=head_dim, tile_m=tile_m, tile_n=tile_n,
                                intra_wg_overlap=True)
        without = dataclasses.replace(v, intra_wg_overlap=False)
        assert V.consumer_registers(v)[0] == V.consumer_registers(without)[0] + tile_n // 4
        assert V.register_budget(v) is not None and V.register_budget(without) is None
        in_smem = dataclasses.replace(v, p_in_smem=True)
        assert V.consumer_registers(in_smem)[0] == V.consumer_registers(without)[0]


def test_the_e4m3_estimate_counts_the_raw_v_barriers():
    """VRawStorage's slot barriers pad its 1 KiB-aligned struct by 1 KiB: the estimate was that
    much below sizeof(SharedStorage) for every e4m3 forward (88064 here, the traits compiled
    on the host)."""
    v = dataclasses.replace(BASE, dtype="e4m3", head_dim=96, pingpong=True, intra_wg_overlap=True)
    assert V.smem_bytes(v) == 88064


def test_budgets_at_the_edges():
    # d256 128x80 s2: 230400 bytes <= 232448; registers 40 + 128 + 24 = 192 <= 240
    assert check(dataclasses.replace(BASE, head_dim=256, tile_n=80)) is None
    # d64 with three consumers: 64 + 32 + 24 = 120 <= 160
    assert check(dataclasses.replace(BASE, head_dim=64, tile_m=192)) is None
    assert V.smem_bytes(dataclasses.replace(BASE, head_dim=256, tile_n=80)) == 230400
    # backward d128 64x128 s2: K, V 64 KiB + Q, dO 64 KiB + dS 32 KiB + stats + fp32 dQ 32 KiB;
    # 128 + 64 + 24 regs
    bwd = dataclasses.replace(BASE, direction="bwd", tile_m=64)
    assert check(bwd) is None and V.smem_bytes(bwd) == 165888 + 32768
    # tile_m 80 (dQ^T): 128 + 80 + 24 = 232 registers; 80 KiB Q/dO, 40 KiB dS and dQ
    bwd80 = dataclasses.replace(BASE, direction="bwd", tile_m=80)
    assert check(bwd80) is None and V.smem_bytes(bwd80) <= 232448


def test_realized_knobs_are_one_table(narrow_knobs, monkeypatch):
    v = dataclasses.replace(BASE, pingpong=True)
    assert check(v)[0] == "knob_realized"
    monkeypatch.setattr(V, "REALIZED_KNOBS", V.REALIZED_KNOBS | {("pingpong", True)})
    assert check(v) is None


def test_knob_realized_prunes_in_enumeration(narrow_knobs):
    spec = spec_of(AXES.replace("pingpong: false", "pingpong: [false, true]"))
    en = enumerate_variants(spec)
    assert en.kept and not any(v.pingpong for v in en.kept)
    assert {(p.constraint, p.reason) for p in en.pruned} == {
        ("knob_realized", "pingpong=true is not realized by the templates yet")}
    assert len(en.pruned) == len(en.kept)


def test_h100_dispatch_resolves():
    # Derived from the spec, not hard-coded: the production set changes as defaults are tuned.
    spec = load_spec(SPECS_DIR / "h100.yaml")
    assert spec.dispatch_required
    en = enumerate_variants(spec)
    d = resolve_dispatch(spec, en.kept)
    keys = {v.key for v in en.kept}
    assert en.kept and set(d) == keys                  # every key served by exactly one default
    for key, default in d.items():
        assert default in en.kept and default.key == key
        # seqlen_k range entries pick a range's default, not the key's
        entries = [e for e in spec.dispatch if e.seqlen_k is None
                   and e.when.matches_flags_off(dict(zip(KEY_AXES, key)))]
        cands = [v for v in en.kept if v.key == key]
        # The default is what the key's `use` entries name, and they name only it.
        assert [v for v in cands if all(e.use.matches_flags_off(knobs_of(v)) for e in entries)] == [default]
        assert entries or len(cands) == 1


def test_tiny_is_one_variant_per_direction():
    en = enumerate_variants(load_spec(SPECS_DIR / "tiny.yaml"))
    assert [v.name for v in en.kept] == ["bwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0",
                                         "fwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0"]


def test_ablation_has_no_defaults_for_ambiguous_keys():
    spec = load_spec(SPECS_DIR / "ablation.yaml")
    en = enumerate_variants(spec)
    assert resolve_dispatch(spec, en.kept) == {}
    assert len(en.kept) > 4


def test_dispatch_ambiguous_default_is_error():
    spec = spec_of(AXES)
    with pytest.raises(SpecError, match=r"t\.yaml: ambiguous default for \(fwd, bf16, d128, "
                                        r"causal\): candidates .*m128n128.*m128n176"):
        resolve_dispatch(spec, enumerate_variants(spec).kept)


def test_dispatch_entry_leaving_several_is_error():
    spec = spec_of(AXES + """\
dispatch:
  - when: {head_dim: 128}
    use: {stages: 2}
""")
    with pytest.raises(SpecError, match=r"dispatch\[0\].*leaves 2"):
        resolve_dispatch(spec, enumerate_variants(spec).kept)


def test_dispatch_entry_leaving_none_is_error():
    spec = spec_of(AXES + """\
dispatch:
  - when: {head_dim: 128}
    use: {tile: [128, 64]}
""")
    with pytest.raises(SpecError, match=r"dispatch\[0\].*leaves 0 \(none\); candidates"):
        resolve_dispatch(spec, enumerate_variants(spec).kept)


def test_dispatch_entry_leaving_none_names_the_unnamed_flag():
    """A `use` that does not name an optional flag asks for it off: where only that stands
    between it and the key's variants (all peeled here), the error says so."""
    spec = spec_of("""\
axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: true, tile: [[128, 128], [128, 176]],
       stages: 2, warp_specialized: true, pingpong: false, intra_wg_overlap: true,
       peel_masked: true}
dispatch:
  - when: {head_dim: 128}
    use: {tile: [128, 128]}
""")
    assert len(enumerate_variants(spec).kept) == 2
    with pytest.raises(SpecError, match=r"leaves 0 \(none\).*have peel_masked: true: name it"):
        resolve_dispatch(spec, enumerate_variants(spec).kept)


def test_dispatch_entry_matching_no_key_is_error():
    spec = spec_of(AXES + """\
dispatch:
  - when: {head_dim: 128}
    use: {tile: [128, 176]}
  - when: {head_dim: 64}
    use: {tile: [128, 128]}
""")
    with pytest.raises(SpecError, match=r"dispatch\[1\].*matches no kept variant key"):
        resolve_dispatch(spec, enumerate_variants(spec).kept)


def test_dispatch_entries_intersect():
    spec = spec_of(AXES.replace("stages: 2", "stages: [1, 2]") + """\
dispatch:
  - when: {}
    use: {stages: 2}
  - when: {causal: true}
    use: {tile: [128, 128]}
  - when: {causal: false}
    use: {tile: [128, 176]}
""")
    d = resolve_dispatch(spec, enumerate_variants(spec).kept)
    assert d[make_key("fwd", "fp16", 128, True)].name == "fwd_fp16_d128_causal_m128n128_s2_ws1_pp0_ov0"
    assert all(v.stages == 2 for v in d.values()) and len(d) == 4


def test_dispatch_when_leaves_unnamed_features_off():
    """A `when` that does not name local/softcap matches only keys without them (so specs
    written before those axes keep their meaning); naming them reaches the feature keys."""
    spec = spec_of(AXES.replace("causal: [false, true]", "causal: false")
                   .replace("dtype: [bf16, fp16]", "dtype: bf16") + """groups:
  - axes: {tile: [[128, 128], [128, 176]]}
  - axes: {tile: [[128, 128], [128, 176]], local: true}
dispatch:
  - when: {causal: false}
    use: {tile: [128, 176]}
  - when: {local: true}
    use: {tile: [128, 128]}
""")
    d = resolve_dispatch(spec, enumerate_variants(spec).kept)
    assert d[make_key("fwd", "bf16", 128, False)].tile_n == 176
    assert d[make_key("fwd", "bf16", 128, False, local=True)].tile_n == 128


def test_causal_local_is_pruned_with_a_reason():
    v = dataclasses.replace(BASE, causal=True, local=True)
    name, reason = check(v)
    assert name == "one_mask" and "window_size=(left, 0)" in reason
    assert check(dataclasses.replace(BASE, local=True, softcap=True)) is None


def test_features_default_to_off():
    """A spec that does not name local/softcap builds no variant with them."""
    en = enumerate_variants(spec_of(AXES))
    assert en.kept and not any(v.local or v.softcap for v in en.kept + [p.variant for p in en.pruned])


def test_dispatch_not_required_leaves_ambiguous_keys_without_default():
    spec = spec_of(AXES.replace("causal: [false, true]", "causal: false")
                   .replace("dtype: [bf16, fp16]", "dtype: bf16") + """\
dispatch_required: false
groups:
  - axes: {}
  - axes: {head_dim: 64, tile: [128, 128]}
""")
    d = resolve_dispatch(spec, enumerate_variants(spec).kept)
    assert list(d) == [make_key("fwd", "bf16", 64, False)]  # the single-variant key still defaults


def _header_constant(header: str, pattern: str) -> str:
    text = (KERNELS_DIR / header).read_text()
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in {header}: update this test with the header"
    return match.group(1) if match.lastindex == 1 else match.groups()


def test_forward_register_and_smem_model_mirrors_the_kernel_headers():
    """generator/variants.py prunes with copies of FwdTraits' setmaxnreg caps, its raw V slots
    and the shared-memory limit, and which forwards run clustered (whose multicasting producers
    keep the fp8 forward's 40 registers, so their consumers 232): a change on one side only
    fails here, not on a GPU."""
    assert _header_constant("fwd_traits.cuh", r"kProducerNeeds40 = (kFp8 \|\| kClusterM > 1);")
    wgs3, fp8, wgs2 = _header_constant(
        "fwd_traits.cuh", r"kConsumerRegs = kConsumerWGs == 3 \? (\d+) : kProducerNeeds40 \? (\d+) : (\d+);")
    assert int(_header_constant("fwd_traits.cuh", r"kVRawSlots = (\d+);")) == V.FP8_V_RAW_SLOTS
    assert int(_header_constant("smem_atoms.cuh", r"kSmemPerBlockLimit = (\d+);")) == V.SMEM_LIMIT
    cases = {("bf16", 64, 128): int(wgs2), ("bf16", 128, 128): int(fp8), ("bf16", 64, 192): int(wgs3),
             ("e4m3", 128, 128): int(fp8), ("e4m3", 64, 192): int(wgs3)}
    for (dtype, d, tile_m), cap in cases.items():
        v = parse_name(f"fwd_{dtype}_d{d}_nocausal_m{tile_m}n128_s2_ws1_pp0_ov1")
        assert V.consumer_registers(v)[1] == cap, (dtype, d, tile_m)
    condition = _header_constant("fwd_traits.cuh", r"kClusterM =\s*\(([\s\S]*?)\)\s*\?\s*2 : 1;")
    assert re.sub(r"\s+", " ", condition) == (
        "!kFp8 && !Causal && !Local && !Softcap && !Varlen && !Paged && WarpSpecialized && !PInSmem && "
        "HeadDim >= 128")
    clustered = {"fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1": True,
                 "fwd_fp16_d256_nocausal_m128n80_s2_ws1_pp0_ov1": True,
                 "fwd_bf16_d96_nocausal_m128n128_s2_ws1_pp0_ov1": False,
                 "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1": False,
                 "fwd_bf16_d128_nocausal_softcap_m128n128_s2_ws1_pp1_ov1": False,
                 "fwd_bf16_d128_nocausal_varlen_m128n176_s2_ws1_pp1_ov1": False,
                 "fwd_bf16_d128_nocausal_m128n176_s2_ws0_pp0_ov0": False,
                 "fwd_e4m3_d128_nocausal_m128n256_s2_ws1_pp0_ov0": False,
                 "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0": False}
    for name, want in clustered.items():
        v = parse_name(name)
        assert V.fwd_clustered(v) is want, name
        assert V.consumer_registers(v)[1] == (232 if want or v.dtype == "e4m3" else 240), name


def test_fp8_p_copy_counts_only_with_the_intra_warpgroup_overlap():
    """e4m3 P (tile_n / 8 registers) is live beside S only while S(i) runs with P(i-1) V(i-1);
    without the overlap it takes S's registers, so 128x256 (d128) fits (the shipped default)
    and the overlapped one is pruned."""
    no_overlap = parse_name("fwd_e4m3_d128_nocausal_m128n256_s2_ws1_pp0_ov0")
    overlap = parse_name("fwd_e4m3_d128_nocausal_m128n256_s2_ws1_pp0_ov1")
    assert V.consumer_registers(overlap)[0] == V.consumer_registers(no_overlap)[0] + 256 // 8
    assert V.register_budget(no_overlap) is None
    assert "registers per consumer thread" in V.register_budget(overlap)
