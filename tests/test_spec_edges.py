"""Edges of the spec language and the pruning constraints that a mutation audit found unpinned:
each test fails if the boundary or the check it names moves."""
import dataclasses
import textwrap

import pytest

from generator import variants as V
from generator.build import plan
from generator.errors import SpecError
from generator.spec import SEQLEN_MAX, parse_spec
from test_seqlen_dispatch import spec_file
from test_variants import BASE

AXES = """\
axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: false, tile: [128, 128], stages: 2,
       warp_specialized: true, pingpong: false, intra_wg_overlap: true}
"""


def error(text: str) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(textwrap.dedent(text), "s.yaml")
    return str(e.value)


def seqlen_entry(rng: str) -> str:
    return AXES + f"dispatch:\n  - when: {{head_dim: 128}}\n    seqlen_k: {rng}\n    use: {{tile: [128, 128]}}\n"


@pytest.mark.parametrize("text, message", [
    (AXES.replace("stages: 2", "stages: 0"), "stages: expected a positive integer, got 0"),
    (AXES.replace("tile: [128, 128]", "tile: [0, 128]"), "expected a tile [M, N] of two positive"),
    (AXES + "groups:\n  - {name: a}\n  - {name: a}\n", "groups[1].name: duplicate group name"),
    (AXES + "dispatch:\n  - when: {head_dim: 128}\n", "dispatch[0].use: missing"),
    (AXES + "dispatch:\n  - when: {head_dim: 128}\n    use: {}\n", "dispatch[0].use: empty"),
    (AXES + "exclude:\n  - {}\n", "exclude[0]: empty exclude entry"),
    (AXES + "dispatch_required: 'yes'\n", "dispatch_required: expected true or false"),
    (AXES + "1: x\n", "keys must be strings"),
    (seqlen_entry(f"[0, {SEQLEN_MAX + 1}]"), "seqlen_k: expected [lo, hi]"),
    (seqlen_entry("[true, 5]"), "seqlen_k: expected [lo, hi]"),
    (seqlen_entry("[-5, 100]"), "seqlen_k: expected [lo, hi]"),
    (seqlen_entry("[0, 100, 200]"), "seqlen_k: expected [lo, hi]"),
    # every knob but the optional ones must be given: a missing one is not silently false
    (AXES.replace("causal: false, ", ""), "axes.causal: missing"),
    (AXES.replace("pingpong: false, ", ""), "axes.pingpong: missing"),
    # a name becomes a folder and a file name: no path, no trailing newline
    (AXES + 'name: "x/../../y"\n', "name: expected a name of letters"),
    (AXES + 'name: "tiny\\n"\n', "name: expected a name of letters"),
    (AXES + "groups: []\n", "groups: empty list"),
    (AXES + "groups:\n", "groups: empty list"),
    (AXES + "groups:\n  - {name: ''}\n", "groups[0].name: expected a string"),
    (AXES + "dispatch: false\n", "dispatch: expected a list, got false"),
    (AXES.replace("tile: [128, 128]", "tile: [true, 128]"), "axes.tile: expected a tile [M, N]"),
    (AXES.replace("tile: [128, 128]", "tile: []"), "axes.tile: expected a tile [M, N]"),
    # a float head dim is refused in `decode:` as in the axes
    (AXES + "decode: {head_dim: 128.0}\n", "decode.head_dim: expected one of"),
    (AXES + "decode: [[bf16, 128.0]]\n", "decode[0]: expected"),
])
def test_malformed_specs_say_what_is_wrong(text, message):
    assert message in error(text)


def test_yaml_errors_give_one_based_line_and_column():
    assert error("name: x\naxes: [1,\n").startswith("s.yaml:3:1: invalid YAML")


def test_a_one_length_range_and_a_merge_key_are_valid():
    text = AXES.replace("tile: [128, 128]", "tile: [[128, 128], [128, 176]]") + (
        "dispatch:\n  - when: {head_dim: 128}\n    use: {tile: [128, 176]}\n"
        "  - when: {head_dim: 128}\n    seqlen_k: [100, 100]\n    use: {tile: [128, 128]}\n")
    assert parse_spec(text, "s.yaml").dispatch[1].seqlen_k == (100, 100)
    merged = parse_spec(AXES + "groups:\n  - {name: a, axes: &g {head_dim: 64}}\n"
                        "  - {name: b, axes: {<<: *g}}\n", "s.yaml")
    assert [dict(g.axes)["head_dim"] for g in merged.groups] == [(64,), (64,)]


def test_a_key_beside_a_merge_key_overrides_it_but_a_repeated_key_is_refused():
    merged = parse_spec(AXES + "groups:\n  - {name: a, axes: &g {head_dim: 64, causal: true}}\n"
                        "  - {name: b, axes: {<<: *g, head_dim: 128}}\n", "s.yaml")
    assert [(dict(g.axes)["head_dim"], dict(g.axes)["causal"]) for g in merged.groups] == [
        ((64,), (True,)), ((128,), (True,))]
    assert "duplicate key 'head_dim'" in error(
        AXES + "groups:\n  - {name: a, axes: &g {head_dim: 64}}\n"
        "  - {name: b, axes: {<<: *g, head_dim: 128, head_dim: 256}}\n")
    # two merge keys: the last won silently; a list of mappings is YAML's way to merge several
    assert "duplicate key '<<' (merge several mappings with `<<: [*a, *b]`)" in error(
        AXES + "groups:\n  - {name: a, axes: &g {head_dim: 64}}\n  - {name: c, axes: &h {head_dim: 128}}\n"
        "  - {name: b, axes: {<<: *g, <<: *h}}\n")
    both = parse_spec(AXES + "groups:\n  - {name: a, axes: &g {head_dim: 64}}\n"
                      "  - {name: c, axes: &h {causal: true}}\n  - {name: b, axes: {<<: [*g, *h]}}\n",
                      "s.yaml")
    assert (dict(both.groups[2].axes)["head_dim"], dict(both.groups[2].axes)["causal"]) == ((64,), (True,))


def test_seqlen_max_itself_is_a_valid_bound():
    text = AXES.replace("tile: [128, 128]", "tile: [[128, 128], [128, 176]]") + (
        "dispatch:\n  - when: {head_dim: 128}\n    use: {tile: [128, 176]}\n"
        f"  - when: {{head_dim: 128}}\n    seqlen_k: [0, {SEQLEN_MAX}]\n    use: {{tile: [128, 128]}}\n")
    assert parse_spec(text, "s.yaml").dispatch[1].seqlen_k == (0, SEQLEN_MAX)


def test_budgets_accept_exactly_the_limit(monkeypatch):
    v = dataclasses.replace(BASE, head_dim=256, tile_n=80)
    monkeypatch.setattr(V, "SMEM_LIMIT", V.smem_bytes(v))
    assert V.smem_budget(v) is None
    monkeypatch.setattr(V, "SMEM_LIMIT", V.smem_bytes(v) - 1)
    assert V.smem_budget(v) is not None
    need, cap = V.consumer_registers(v)
    monkeypatch.setattr(V, "REG_OVERHEAD", V.REG_OVERHEAD + cap - need)  # need == cap
    assert V.consumer_registers(v) == (cap, cap) and V.register_budget(v) is None
    monkeypatch.setattr(V, "REG_OVERHEAD", V.REG_OVERHEAD + 1)
    assert V.register_budget(v) is not None


@pytest.mark.parametrize("change, constraint", [
    (dict(dtype="e4m3", local=True, intra_wg_overlap=True), "fp8_scope"),
    (dict(direction="bwd", tile_m=64, peel_masked=True), "peel_needs_overlap"),
    (dict(p_in_smem=True, intra_wg_overlap=True, peel_masked=True), "p_in_smem_scope"),
])
def test_more_constraints_prune(change, constraint):
    assert V.check(dataclasses.replace(BASE, **change))[0] == constraint


def test_peel_needs_the_forward():
    """peel_needs_overlap also refuses a backward variant on its own (backward_knobs prunes
    it first in the table, so the function is called directly)."""
    v = dataclasses.replace(BASE, direction="bwd", tile_m=64, peel_masked=True, intra_wg_overlap=True)
    assert V.peel_needs_overlap(v) is not None
    assert V.peel_needs_overlap(dataclasses.replace(BASE, peel_masked=True, intra_wg_overlap=True)) is None


def test_forward_tile_n_from_64():
    """WGMMA takes N = 16, but a forward below 64 keys does not compile (the paged loads'
    64-key chunk layouts, which every forward instantiates): pruned with that reason."""
    assert V.mma_n_shape(dataclasses.replace(BASE, tile_n=64)) is None
    for n in (16, 48):
        assert "64-key chunk" in V.mma_n_shape(dataclasses.replace(BASE, tile_n=n))


def test_backward_split_head_dim_smem_by_hand():
    """d256 64x64, two stages, head_dim split over two warpgroups: K, V 64 KiB; Q, dO two stages
    128 KiB; dS^T and P^T two buffers each, 32 KiB; LSE and D 1 KiB; the reserve; no fp32 dQ tile
    (it would not fit: dQ is handed over in the Q and dO buffers)."""
    v = dataclasses.replace(BASE, direction="bwd", head_dim=256, tile_m=64, tile_n=64)
    assert V.smem_bytes(v) == 65536 + 131072 + 32768 + 8 * 2 * 64 + V.SMEM_RESERVED


RANGED = """\
name: ranged
axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: false, stages: 2,
       warp_specialized: true, pingpong: [false, true], intra_wg_overlap: true,
       tile: [[128, 128], [128, 176]]}
dispatch:
  - when: {head_dim: 128}
    use: {tile: [128, 176], pingpong: true}
"""


def test_ranges_that_touch_overlap(tmp_path):
    text = RANGED + ("  - when: {head_dim: 128}\n    seqlen_k: [0, 100]\n    use: {tile: [128, 128], pingpong: true}\n"
                     "  - when: {head_dim: 128}\n    seqlen_k: [100, 200]\n    use: {tile: [128, 128], pingpong: false}\n")
    with pytest.raises(SpecError, match=r"overlaps \[0, 100\]"):
        plan(spec_file(tmp_path, text))


def test_one_range_split_over_entries_resolves_together_and_ranges_sort(tmp_path):
    """Two entries with the same range combine (tile from one, pingpong from the other); the
    ranges of a key come out in ascending order whatever the spec's order."""
    text = RANGED + ("  - when: {head_dim: 128}\n    seqlen_k: [4096, 8192]\n    use: {tile: [128, 128]}\n"
                     "  - when: {head_dim: 128}\n    seqlen_k: [4096, 8192]\n    use: {pingpong: false}\n"
                     "  - when: {head_dim: 128}\n    seqlen_k: [0, 1024]\n    use: {tile: [128, 176], pingpong: false}\n")
    [(key, ranges)] = plan(spec_file(tmp_path, text)).seqlen_defaults.items()
    assert [(lo, hi, v.name) for lo, hi, v in ranges] == [
        (0, 1024, "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp0_ov1"),
        (4096, 8192, "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov1")]


def test_a_group_of_too_many_combinations_is_refused_before_enumerating():
    """200 tiles x 200 stage counts x 2 x 2 is 160,000 combinations: refused at once (a typo's
    product once ran for minutes)."""
    tiles = ", ".join(f"[128, {n}]" for n in range(16, 3216, 16))
    stages = ", ".join(str(n) for n in range(1, 201))
    text = AXES.replace("tile: [128, 128]", f"tile: [{tiles}]").replace(
        "stages: 2", f"stages: [{stages}]").replace("causal: false", "causal: [false, true]").replace(
        "pingpong: false", "pingpong: [false, true]")
    with pytest.raises(SpecError, match="expands to 160,000 combinations"):
        V.enumerate_variants(parse_spec(text, "s.yaml"))


def test_groups_together_are_capped_too():
    """Groups each under the cap passed however many there were (five of 90,000: 20 s)."""
    tiles = ", ".join(f"[128, {n}]" for n in range(16, 3216, 16))
    stages = ", ".join(str(n) for n in range(1, 201))
    text = AXES + "groups:\n" + "".join(
        f"  - {{name: g{i}, axes: {{tile: [{tiles}], stages: [{stages}]}}}}\n" for i in range(3))
    with pytest.raises(SpecError, match="with group 'g2' the groups expand to 120,000 combinations"):
        V.enumerate_variants(parse_spec(text, "s.yaml"))


MULTI = AXES.replace("tile: [128, 128]", "tile: [[128, 128], [128, 176], [128, 192]]")


@pytest.mark.parametrize("extra, warning", [
    ("exclude:\n  - {tile: [[128, 128], [182, 192]]}\n",
     "s.yaml: exclude[0]: tile [182, 192] matches no variant of the spec"),
    ("dispatch:\n  - when: {head_dim: [128, 1288]}\n    use: {tile: [128, 176]}\n",
     "s.yaml: dispatch[0].when: head_dim 1288 matches no kept variant of the spec"),
    ("dispatch:\n  - when: {head_dim: 128}\n    use: {tile: [[128, 176], [182, 176]], stages: 2}\n",
     "s.yaml: dispatch[0].use: tile [182, 176] matches no kept variant of the spec"),
])
def test_a_list_value_that_matches_nothing_is_a_warning(extra, warning):
    """The entry matches through its other values, so the typo would pass unnoticed."""
    spec = parse_spec(MULTI + extra, "s.yaml")
    assert V.unmatched_values(spec, V.enumerate_variants(spec)) == [warning]


def test_every_value_matching_warns_nothing():
    spec = parse_spec(MULTI + "exclude:\n  - {tile: [[128, 128], [128, 192]]}\n", "s.yaml")
    assert V.unmatched_values(spec, V.enumerate_variants(spec)) == []


def test_a_group_the_constraints_empty_is_a_warning():
    """d256 at 128x176 with 4 stages needs more shared memory than an SM has: its key would
    have no variant, found only by a call."""
    text = AXES + ("groups:\n  - {name: d128}\n"
                   "  - {name: d256, axes: {head_dim: 256, tile: [128, 176], stages: 4}}\n"
                   "  - {name: gone, axes: {head_dim: 64}}\nexclude:\n  - {head_dim: 64}\n")
    [warning] = V.enumerate_variants(parse_spec(text, "s.yaml")).warnings
    assert warning.startswith("s.yaml: group 'd256' keeps no variant: each is pruned (e.g. "
                              "fwd_bf16_d256_nocausal_m128n176_s4_ws1_pp0_ov1: smem_budget: ")


def test_fa3gen_list_prints_the_unmatched_value_warning(tmp_path, capsys):
    from fa3gen import cli
    path = tmp_path / "s.yaml"
    path.write_text(MULTI + "exclude:\n  - {tile: [[128, 128], [182, 192]]}\ndispatch_required: false\n")
    assert cli.main(["list", "--spec", str(path)]) == 0
    assert "exclude[0]: tile [182, 192] matches no variant of the spec" in capsys.readouterr().err
