"""Dispatch entries with a seqlen_k range: the spec syntax and its checks, the build info that
carries the range defaults, and the runtime choosing by the call's seqlen_k (a fake library
stands in)."""
import dataclasses

import pytest
import torch

from fa3gen import ops, runtime
from fa3gen.contract import make_key
from generator.build import plan
from generator.errors import SpecError

SPEC = """\
name: ranged
axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: false, stages: 2,
       warp_specialized: true, pingpong: true, intra_wg_overlap: true,
       tile: [[128, 128], [128, 176]]}
dispatch:
  - when: {head_dim: 128}
    use: {tile: [128, 176]}
  - when: {head_dim: 128}
    seqlen_k: [0, 2048]
    use: {tile: [128, 128]}
"""
KEY = make_key("fwd", "bf16", 128, False)


def spec_file(tmp_path, text=SPEC):
    p = tmp_path / "ranged.yaml"
    p.write_text(text)
    return p


def test_range_defaults_resolve_and_reach_the_build_info(tmp_path):
    p = plan(spec_file(tmp_path))
    assert p.defaults[KEY].name == "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"
    [(lo, hi, v)] = p.seqlen_defaults[KEY]
    assert (lo, hi, v.name) == (0, 2048, "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1")
    assert p.seqlen_dispatch() == [[*KEY, 0, 2048, v.name]]


@pytest.mark.parametrize("extra, message", [
    ("  - when: {head_dim: 128}\n    seqlen_k: [1000, 4096]\n    use: {tile: [128, 176]}\n",
     r"overlaps \[0, 2048\]"),
    ("  - when: {head_dim: 64}\n    seqlen_k: [0, 10]\n    use: {tile: [128, 176]}\n",
     "matches no kept variant key"),
    ("  - when: {head_dim: 128}\n    seqlen_k: [4096, 8192]\n    use: {stages: 2}\n",
     "must leave exactly one variant"),
    ("  - when: {head_dim: 128}\n    seqlen_k: [10, 5]\n    use: {tile: [128, 176]}\n",
     r"seqlen_k: expected \[lo, hi\], ints with 0 <= lo <= hi"),
    ("  - when: {head_dim: 128}\n    seqlen_k: 100\n    use: {tile: [128, 176]}\n",
     r"seqlen_k: expected \[lo, hi\]"),
])
def test_bad_ranges_are_spec_errors(tmp_path, extra, message):
    with pytest.raises(SpecError, match=message):
        plan(spec_file(tmp_path, SPEC + extra))


def test_a_range_needs_the_keys_default(tmp_path):
    text = SPEC.replace("  - when: {head_dim: 128}\n    use: {tile: [128, 176]}\n", "") + \
        "dispatch_required: false\n"
    with pytest.raises(SpecError, match="has no default for the calls outside the range"):
        plan(spec_file(tmp_path, text))


def test_runtime_picks_by_seqlen(fake_launches, monkeypatch):
    """Library.find with seqlen_k, and flash_attn_func's eager path (the fake library's table
    has two candidates for the key; its build info gets a range for the other one)."""
    lib = runtime.get_library()
    other = "fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0"
    rows = [[*KEY, 0, 100, other], [*KEY, 5000, 4000, "not-a-variant"], "garbage"]
    monkeypatch.setattr(lib, "seqlen_dispatch", runtime._seqlen_dispatch(
        {"seqlen_dispatch": rows}, lib._by_name))
    assert [(lo, hi, v.name) for lo, hi, v in lib.seqlen_dispatch[KEY]] == [(0, 100, other)]
    default = "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"
    assert lib.find("fwd", "bf16", 128, False, seqlen_k=64).name == other
    assert lib.find("fwd", "bf16", 128, False, seqlen_k=101).name == default
    assert lib.find("fwd", "bf16", 128, False).name == default
    # quick_check and the A/B script walk the range defaults too
    assert [v.name for v in lib.dispatched("fwd") if v.key == lib.get(default).key] == [default, other]
    assert other not in [v.name for v in lib.dispatched("bwd")]
    for seqlen in (64, 300):
        q = torch.zeros(1, seqlen, 2, 128, dtype=torch.bfloat16)
        ops.flash_attn_func(q, q, q)
    assert [name for name, _ in fake_launches] == [other, default]
    # Graph capture bakes one name for every length: the key's default.
    dims = dataclasses.replace(ops.check_inputs(q, q, q), seqlen_k=64)
    assert ops.resolve_variant(dims, False, by_length=False) == default
    assert ops.resolve_variant(dims, False) == other


def test_range_bounds_are_inclusive_and_rows_of_another_key_are_ignored(tmp_path, monkeypatch):
    """A range [lo, hi] serves lo and hi themselves; a build-info row whose variant serves
    another key is dropped (its key's default serves); a variant named for another key is an
    error, never run (RT1-RT4 of the mutation audit)."""
    from fa3gen.errors import Fa3genError
    from tests.test_runtime_errors import build_fake_lib

    lib = runtime.Library(build_fake_lib(tmp_path))
    other = "fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0"
    default = "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"
    causal_key = make_key("fwd", "bf16", 128, True)
    rows = [[*KEY, 10, 100, other], [*causal_key, 0, 10**6, other]]  # the second: wrong key
    monkeypatch.setattr(lib, "seqlen_dispatch", runtime._seqlen_dispatch(
        {"seqlen_dispatch": rows}, lib._by_name))
    assert list(lib.seqlen_dispatch) == [KEY]
    found = {s: lib.find("fwd", "bf16", 128, False, seqlen_k=s).name for s in (9, 10, 100, 101)}
    assert found == {9: default, 10: other, 100: other, 101: default}
    with pytest.raises(Fa3genError, match="serves .* but the call needs"):
        lib.find("fwd", "bf16", 128, False, variant="fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1")


def test_varlen_forward_picks_by_max_seqlen_k(fake_launches, monkeypatch):
    """flash_attn_varlen_func's eager forward asks the dispatch with max_seqlen_k (a varlen
    key's ranges are on it), once: the plan is cached for the call signature."""
    from fa3gen import varlen

    lib = runtime.get_library()
    asked = []
    real_find = lib.find
    monkeypatch.setattr(lib, "find", lambda *a, **kw: asked.append((a[0], kw)) or real_find(*a, **kw))
    q = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    varlen.flash_attn_varlen_func(q, q, q, cu, cu, 5, 7, causal=True)
    varlen.flash_attn_varlen_func(q, q, q, cu, cu, 5, 7, causal=True)
    [(direction, kw)] = asked
    assert direction == "fwd" and kw["varlen"] and kw["seqlen_k"] == 7 and kw["variant"] is None
    assert [name for name, _ in fake_launches] == ["fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1"] * 2


def test_compiled_varlen_forward_picks_by_max_seqlen_k_when_it_runs(fake_launches, monkeypatch):
    """Under torch.compile(fullgraph=True) the varlen op picks a default call's variant when it
    runs, by that call's max_seqlen_k as the eager call does: also once dynamo has made
    max_seqlen_k dynamic (a SymInt, which passes isinstance(m, int) while tracing; handing it
    to the library lookup, whose arguments must be constants, crashed dynamo)."""
    from fa3gen import varlen

    lib = runtime.get_library()
    default = lib.find("fwd", "bf16", 128, True, varlen=True)
    short = dataclasses.replace(default, tile_n=96)  # a stand-in range default
    monkeypatch.setitem(lib._by_name, short.name, short)
    key = make_key("fwd", "bf16", 128, True, False, False, True, False)
    monkeypatch.setattr(lib, "seqlen_dispatch", {key: [(0, 100, short)]})
    torch._dynamo.reset()
    f = torch.compile(lambda q, cu, m: varlen.flash_attn_varlen_func(q, q, q, cu, cu, m, m,
                                                                     causal=True),
                      fullgraph=True, backend="eager")
    for m in (50, 90, 300, 70):  # the second call recompiles with m dynamic
        q = torch.zeros(m + 3, 2, 128, dtype=torch.bfloat16)
        f(q, torch.tensor([0, 3, m + 3], dtype=torch.int32), m)
    assert [name for name, _ in fake_launches] == [short.name, short.name, default.name,
                                                   short.name]


BWD_RANGED = """\
name: bwdranged
axes: {dtype: bf16, head_dim: 64, causal: true, stages: 2, warp_specialized: true,
       pingpong: false, intra_wg_overlap: false, varlen: [false, true]}
groups:
  - {name: fwd, axes: {direction: fwd, tile: [128, 128]}}
  - {name: bwd, axes: {direction: bwd, tile: [[64, 64], [128, 128]]}}
dispatch:
  - when: {direction: bwd, varlen: [false, true]}
    use: {tile: [128, 128]}
  - when: {direction: bwd, varlen: [false, true]}
    seqlen_k: [0, 1024]
    use: {tile: [64, 64]}
"""
PAGED_RANGED = """\
name: pagedranged
axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: true, stages: 2,
       warp_specialized: true, pingpong: true, intra_wg_overlap: true, varlen: true,
       paged: [false, true], tile: [[128, 128], [128, 64]]}
dispatch:
  - when: {varlen: true, paged: [false, true]}
    use: {tile: [128, 128]}
  - when: {varlen: true, paged: [false, true]}
    seqlen_k: [0, 1024]
    use: {tile: [128, 64]}
"""


@pytest.mark.parametrize("text, key", [(BWD_RANGED, r"\(bwd, bf16, d64, causal\)"),
                                       (PAGED_RANGED, r"\(fwd, bf16, d128, causal, varlen, paged\)")])
def test_ranges_on_keys_that_choose_without_a_length_are_refused(tmp_path, text, key):
    """The backward (a compiled one fixes its variant when traced; eager runs the same) and a
    paged forward choose without a length: a range there was accepted and listed, never used."""
    with pytest.raises(SpecError, match=key + ": seqlen_k ranges choose among the variants of "
                       "forward keys that are not paged"):
        plan(spec_file(tmp_path, text))
    fwd_only = text.replace("paged: [false, true]}\n    seqlen_k", "paged: false}\n    seqlen_k")
    if fwd_only != text:  # the unpaged varlen key alone takes the range
        p = plan(spec_file(tmp_path, fwd_only))
        assert [(lo, hi, v.tile_n) for r in p.seqlen_defaults.values() for lo, hi, v in r] == \
            [(0, 1024, 64)]
