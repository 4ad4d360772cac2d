"""Compile units (generator/units.py): variants sharing a TU, and the attribution of a unit's
ptxas entries to its variants (generator/compile_one.py)."""
import json

import pytest

from fa3gen.contract import parse_name
from generator import build as B
from generator.compile_one import split_by_variant, summarize
from generator.errors import BuildError, GeneratorError
from generator.ptxas import parse_ptxas
from generator.units import partition, traits_mangled, unit_size
from tests.test_build import A, B_, fake, quiet, take_calls  # noqa: F401 (fake: fixture)

# Entry names from real ptxas output (nvcc 13.0, CUTLASS 4.2, 2026-12-04): a forward unit of
# twelve fwd bf16 d128 variants, a backward unit of five, an e4m3 and an fp16 TU; the forward
# names with the o_tma_store argument (2026-12-06; the _otma one from its build).
REAL = {
    "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass10bfloat16_tELi128ELi128ELi128ELi2ELb1ELb0ELb0"
        "ELb0ELb0ELb1ELb1ELb1ELb0ELb0ELb0EEEEEvNS_9FwdParamsIT_EE",
    "fwd_bf16_d128_causal_softcap_varlen_m128n128_s2_ws1_pp1_ov1":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass10bfloat16_tELi128ELi128ELi128ELi2ELb1ELb0ELb1"
        "ELb1ELb0ELb1ELb1ELb1ELb0ELb0ELb0EEEEEvNS_9FwdParamsIT_EE",
    "fwd_bf16_d128_causal_softcap_m128n128_s2_ws1_pp1_ov1_peel":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass10bfloat16_tELi128ELi128ELi128ELi2ELb1ELb0ELb1"
        "ELb0ELb0ELb1ELb1ELb1ELb1ELb0ELb0EEEEEvNS_9FwdParamsIT_EE",
    "fwd_bf16_d128_nocausal_varlen_m128n128_s2_ws1_pp1_ov1_paged":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass10bfloat16_tELi128ELi128ELi128ELi2ELb0ELb0ELb0"
        "ELb1ELb1ELb1ELb1ELb1ELb0ELb0ELb0EEEEEvNS_9FwdParamsIT_EE",
    "fwd_e4m3_d64_causal_m192n160_s2_ws1_pp0_ov1":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass12float_e4m3_tELi64ELi192ELi160ELi2ELb1ELb0ELb0"
        "ELb0ELb0ELb1ELb0ELb1ELb0ELb0ELb0EEEEEvNS_9FwdParamsIT_EE",
    "fwd_fp16_d256_causal_m128n80_s2_ws1_pp0_ov1_peel":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass6half_tELi256ELi128ELi80ELi2ELb1ELb0ELb0ELb0ELb0"
        "ELb1ELb0ELb1ELb1ELb0ELb0EEEEEvNS_9FwdParamsIT_EE",
    "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1_otma":
        "_ZN6fa3gen10fwd_kernelINS_9FwdTraitsIN7cutlass10bfloat16_tELi128ELi128ELi128ELi2ELb0ELb0ELb0"
        "ELb0ELb0ELb1ELb1ELb1ELb0ELb0ELb1EEEEEvNS_9FwdParamsIT_EE",
    "bwd_bf16_d128_causal_m64n128_s2_ws1_pp0_ov0":
        "_ZN6fa3gen10bwd_kernelINS_9BwdTraitsIN7cutlass10bfloat16_tELi128ELi64ELi128ELi2ELb1ELb0ELb0"
        "ELb0EEEEEvNS_9BwdParamsIT_EE",
    "bwd_bf16_d128_nocausal_local_softcap_varlen_m64n128_s2_ws1_pp0_ov0":
        "_ZN6fa3gen10bwd_kernelINS_9BwdTraitsIN7cutlass10bfloat16_tELi128ELi64ELi128ELi2ELb0ELb1ELb1"
        "ELb1EEEEEvNS_9BwdParamsIT_EE",
}
DQ = ("_ZN6fa3gen21bwd_convert_dq_kernelINS_9BwdTraitsIN7cutlass10bfloat16_tELi128ELi64ELi128ELi2"
      "ELb1ELb0ELb0ELb0EEEEEvNS_11BwdDqParamsE")  # bwd_bf16_d128_causal_m64n128's
PREPROCESS = "_ZN6fa3gen21bwd_preprocess_kernelIN7cutlass10bfloat16_tELi128ELb0EEEvNS_12BwdRowParamsE"
VARLEN_TILES = "_ZN6fa3gen19varlen_tiles_kernelILi128ELb0EEEvPKiiS2_iiiP4int2ibNS_11PaddingArgsE"


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_traits_mangling_is_in_the_real_kernel_names(name):
    mangled = traits_mangled(parse_name(name))
    assert mangled in REAL[name]
    # and in no other variant's kernel
    assert [n for n, entry in REAL.items() if mangled in entry] == [name]


def ptxas_log(entries):
    """ptxas -v text for (function, registers, spill bytes) entries."""
    out = []
    for fn, regs, spill in entries:
        out += [f"ptxas info    : Compiling entry function '{fn}' for 'sm_90a'",
                f"ptxas info    : Function properties for {fn}",
                f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads",
                f"ptxas info    : Used {regs} registers, used 16 barriers"]
    return "\n".join(out) + "\n"


def test_a_units_entries_go_to_their_variants_and_shared_ones_to_each():
    bwd_a, bwd_b = ("bwd_bf16_d128_causal_m64n128_s2_ws1_pp0_ov0",
                    "bwd_bf16_d128_nocausal_local_softcap_varlen_m64n128_s2_ws1_pp0_ov0")
    kernels = {v: traits_mangled(parse_name(v)) for v in (bwd_a, bwd_b)}
    log = ptxas_log([(REAL[bwd_a], 168, 0), (DQ, 40, 0), (REAL[bwd_b], 240, 8), (PREPROCESS, 30, 0)])
    parts = split_by_variant(parse_ptxas(log), kernels)
    assert sorted(e.name for e in parts[bwd_a].entries) == sorted([REAL[bwd_a], DQ, PREPROCESS])
    assert sorted(e.name for e in parts[bwd_b].entries) == sorted([REAL[bwd_b], PREPROCESS])
    res = summarize("bwd_bf16_d128_x2_0", log, 30.0, 0, kernels)
    assert res["variants"][bwd_a]["registers"] == 168 and not res["variants"][bwd_a]["problems"]
    assert res["variants"][bwd_b]["registers"] == 240 and res["variants"][bwd_b]["spill_stores"] == 8
    assert len(res["problems"]) == 1 and res["problems"][0].startswith(f"{bwd_b}: ")


def test_a_variant_without_a_kernel_is_a_problem_not_a_silent_gap():
    fwd = "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1"
    other = "fwd_bf16_d128_causal_softcap_varlen_m128n128_s2_ws1_pp1_ov1"
    kernels = {v: traits_mangled(parse_name(v)) for v in (fwd, other)}
    res = summarize("u", ptxas_log([(REAL[fwd], 168, 0), (VARLEN_TILES, 20, 0)]), 1.0, 0, kernels)
    assert any(f"no kernel of variant {other}" in p for p in res["problems"])


def test_partition_groups_by_direction_dtype_head_dim_and_extended_shapes(under_hash_seeds):
    names = ["fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1",
             "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1",
             "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1",     # extended WGMMA N: its own
             "fwd_fp16_d128_nocausal_m128n128_s2_ws1_pp1_ov1",     # another dtype
             "fwd_bf16_d64_nocausal_m192n128_s2_ws1_pp1_ov1",      # another head dim
             "bwd_bf16_d128_causal_m64n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d128_nocausal_local_m128n128_s2_ws1_pp1_ov1"]
    vs = [parse_name(n) for n in names]
    units = partition(vs, 8)
    members = sorted(sorted(v.name for v in u.variants) for u in units)
    assert members == sorted([sorted([names[0], names[1], names[6]]), [names[2]], [names[3]],
                              [names[4]], [names[5]]])
    for u in units:  # a unit of one is its variant; the others say what they hold
        single = len(u.variants) == 1
        assert u.name == u.variants[0].name if single else u.name.startswith("fwd_bf16_d128_x3_")
    # Chunks of at most `size`, near-equal; the same variants give the same names.
    assert sorted(len(u.variants) for u in partition(vs, 2)) == [1, 1, 1, 1, 1, 2]
    a, b = under_hash_seeds(  # names ninja sees in every process: not from hash()
        "from generator.units import partition; from fa3gen.contract import parse_name; "
        f"print([u.name for u in partition([parse_name(n) for n in {names!r}], 2)])")
    assert a == b == f"{[u.name for u in partition(vs, 2)]}\n"
    assert all(len(u.variants) == 1 for u in partition(vs, 1))
    # Another selection of the group is another unit.
    assert partition(vs[:2], 8)[0].name != next(u.name for u in units if len(u.variants) == 3)


def test_unit_size_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("FA3GEN_UNIT_SIZE", raising=False)
    assert unit_size() == 16 and unit_size(3) == 3
    monkeypatch.setenv("FA3GEN_UNIT_SIZE", "2")
    assert unit_size() == 2
    for bad in ("0", "x"):
        monkeypatch.setenv("FA3GEN_UNIT_SIZE", bad)
        with pytest.raises(GeneratorError, match="FA3GEN_UNIT_SIZE|at least 1"):
            unit_size()


def test_a_unit_compiles_its_variants_in_one_tu(fake, monkeypatch):
    """The fake spec's two variants (fwd bf16 d128, standard shapes) in one unit: one compile,
    both launchers in its source, each variant's resources from its own kernel; a spill in
    one fails the unit and names that variant; a filtered build compiles the selection as its
    own unit and keeps the spec's."""
    spec, tc, calls = fake
    monkeypatch.setenv("FA3GEN_UNIT_SIZE", "8")
    res = B.build(spec, toolchain=tc, log=quiet)
    out = res.plan.out_dir
    (unit,) = partition(res.plan.variants)
    assert sorted(take_calls(calls)) == sorted([f"{unit.name}.cu", "dispatch.cu", "link"])
    src = (out / "src" / f"{unit.name}.cu").read_text()
    assert f"fa3gen_launch_{A}(" in src and f"fa3gen_launch_{B_}(" in src
    rows = {r["name"]: r["resources"] for r in json.loads((out / "manifest.json").read_text())["variants"]}
    for name in (A, B_):
        assert rows[name]["unit"] == unit.name and traits_mangled(parse_name(name)) in rows[name]["kernel"]
    # A filtered build: A alone (a unit named after it); the spec's unit stays.
    B.build(spec, only=[A], toolchain=tc, log=quiet)
    assert sorted(take_calls(calls)) == sorted([f"{A}.cu", "dispatch.cu", "link"])
    assert (out / "obj" / f"{unit.name}.o").exists()
    B.build(spec, toolchain=tc, log=quiet)
    assert sorted(take_calls(calls)) == ["dispatch.cu", "link"]  # the full library: one link
    # A spill in one variant fails its unit, and says which variant.
    (out / "src" / f"{unit.name}.cu").unlink()
    monkeypatch.setenv("FAKE_NVCC_SPILL", "_causal_")
    lines = []
    with pytest.raises(BuildError):
        B.build(spec, toolchain=tc, log=lines.append)
    data = json.loads((out / "obj" / f"{unit.name}.resources.json").read_text())
    assert [p.split(":")[0] for p in data["problems"]] == [B_]


def test_a_dry_run_names_each_units_variants(fake, monkeypatch):
    spec, tc, calls = fake
    monkeypatch.setenv("FA3GEN_UNIT_SIZE", "8")
    lines = []
    res = B.build(spec, toolchain=tc, dry_run=True, log=lines.append)
    (unit,) = partition(res.plan.variants)
    (line,) = [ln for ln in lines if f"would run: NVCC {unit.name}" in ln]
    assert "(2 variants: " in line and A in line and B_ in line
    assert f"NVCC {unit.name}" in res.planned and take_calls(calls) == []


def test_a_unit_whose_log_has_no_entry_is_not_clean():
    """ptxas -v output lost (a compiler launcher that swallows it, say): nothing was checked,
    which is a problem for a unit of one variant as for a larger one."""
    res = summarize("u", "", 1.0, 0, {"fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0": "X"})
    assert any("no kernel entry" in p for p in res["problems"])
