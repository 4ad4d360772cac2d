"""Trace-to-spec: recording the variants calls resolve to, and the smallest spec that builds
them (round trip: the generated spec resolves every traced key to the traced variant)."""
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch
import yaml

import fa3gen
from fa3gen import cli, ops, tracing
from fa3gen.contract import parse_name
from generator.build import plan
from generator.paths import REPO_ROOT

D128 = "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"     # h100's default for its key
D128_OTHER = "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1"
BWD = "bwd_fp16_d64_causal_m128n128_s2_ws1_pp0_ov0"
BWD_FWD = "fwd_fp16_d64_causal_m192n128_s2_ws1_pp0_ov1_peel"  # the forward of BWD's key
# A call of D128 recorded in a subprocess's code, its seqlen_k to fill in with format().
RECORD_LINE = ("tracing.record(" + repr(D128) + ", True, batch=1, seqlen_q=2, seqlen_k={}, "
               "heads_q=4, heads_kv=4)")


def test_trace_records_counts_and_size_ranges(tmp_path):
    path = tmp_path / "used.yaml"
    with fa3gen.trace(path):
        tracing.record(D128, True, batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=16, heads_kv=4)
        tracing.record(D128, True, batch=1, seqlen_q=4096, seqlen_k=4000, heads_q=16, heads_kv=4)
        tracing.record(BWD, True, batch=3, seqlen_q=77, seqlen_k=99, heads_q=8, heads_kv=8)
    tracing.record(D128, True, batch=9, seqlen_q=9, seqlen_k=9, heads_q=9, heads_kv=9)  # after: not kept
    data = yaml.safe_load(path.read_text())
    assert data["format"] == tracing.FORMAT
    calls = {c["variant"]: c for c in data["calls"]}
    assert calls[D128]["count"] == 2 and calls[D128]["seqlen_q"] == [1024, 4096]
    assert calls[D128]["seqlen_k"] == [1024, 4000] and calls[D128]["batch"] == [1, 2]
    assert (calls[D128]["direction"], calls[D128]["head_dim"], calls[D128]["causal"]) == ("fwd", 128, False)
    assert calls[BWD]["count"] == 1 and calls[BWD]["default"] is True


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "custom_op"])
def test_flash_attn_func_records_what_it_dispatches(tmp_path, fake_launches, monkeypatch,
                                                    captured):
    """The ops hook, eager and through the custom op (as under torch.compile, where the op
    resolves a default call when it runs): the resolved name and the call's sizes reach the
    trace."""
    monkeypatch.setattr(ops, "_captured", lambda *t: captured)
    q = torch.zeros(2, 33, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16)
    with fa3gen.trace(tmp_path / "t.yaml"):
        ops.flash_attn_func(q, k, k)
        ops.flash_attn_func(q, k, k, variant="fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0")
    calls = yaml.safe_load((tmp_path / "t.yaml").read_text())["calls"]
    assert [(c["variant"], c["default"]) for c in calls] == [
        ("fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0", False), (D128, True)]
    assert calls[1]["seqlen_k"] == [40, 40] and calls[1]["heads_kv"] == [2, 2]
    assert [name for name, _ in fake_launches] == [D128, "fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0"]


def test_spec_from_trace_round_trip(tmp_path):
    """Every traced key resolves to the traced default; a second variant of a key (named with
    variant=) is built too, and a dispatch entry keeps the default."""
    path = tmp_path / "used.yaml"
    with fa3gen.trace(path):
        for name, default in ((D128, True), (D128_OTHER, False), (BWD_FWD, True), (BWD, True)):
            tracing.record(name, default, batch=1, seqlen_q=8, seqlen_k=8, heads_q=1, heads_kv=1)
    out = tmp_path / "mymodel.yaml"
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    p = plan(out)
    assert p.spec.name == "mymodel"
    assert sorted(v.name for v in p.variants) == sorted([D128, D128_OTHER, BWD_FWD, BWD])
    assert {k: v.name for k, v in p.defaults.items()} == {parse_name(D128).key: D128,
                                                          parse_name(BWD_FWD).key: BWD_FWD,
                                                          parse_name(BWD).key: BWD}


def test_a_trace_cut_short_at_any_line_is_an_error(tmp_path):
    """A copy cut at a line boundary still parses, without some call entries or decode pairs:
    it had made a spec without their variants, and no word (the trace's line count says)."""
    path = tmp_path / "t.yaml"
    t = tracing.Trace(path)
    for name in (D128, BWD_FWD, BWD):
        t.add(name, True, dict(batch=1, seqlen_q=8, seqlen_k=8, heads_q=1, heads_kv=1))
    t.decode |= {("bf16", 128), ("fp16", 64)}
    t.write()
    lines = path.read_text().splitlines(keepends=True)
    assert yaml.safe_load("".join(lines))["lines"] == len(lines)
    tracing.spec_from_trace(path, "x")  # whole: reads
    cut = tmp_path / "cut.yaml"
    for n in range(1, len(lines)):
        cut.write_text("".join(lines[:n]))
        with pytest.raises(fa3gen.TraceError):
            tracing.spec_from_trace(cut, "x")
    cut.write_text("".join(lines[:-1]))
    with pytest.raises(fa3gen.TraceError, match=rf"{len(lines) - 1} lines where the trace wrote "
                                                 rf"lines: {len(lines)} \(cut short\?"):
        tracing.spec_from_trace(cut, "x")
    cut.write_text("".join(lines).rstrip("\n"))  # a last newline lost in a copy: whole
    tracing.spec_from_trace(cut, "x")
    cut.write_text("".join(lines) + "\n\n")  # blank lines added (an editor, echo >>): whole
    tracing.spec_from_trace(cut, "x")


def test_spec_from_several_traces_builds_what_each_used(tmp_path, capsys):
    """Ranks (or nodes) traced to files of their own: `--from-trace a b` makes one spec with
    the variants of both, their decode pairs once; a file with no call is fine beside one
    with calls, and a bad entry is named by its file and place there."""
    ranks = [tmp_path / "rank0.yaml", tmp_path / "rank1.yaml", tmp_path / "rank2.yaml"]
    for path, names in zip(ranks, ((D128, BWD_FWD), (BWD_FWD, BWD), ())):
        with fa3gen.trace(path) as t:
            for name in names:
                tracing.record(name, True, batch=1, seqlen_q=8, seqlen_k=8, heads_q=1, heads_kv=1)
            t.decode.add(("bf16", 128))
    out = tmp_path / "job.yaml"
    assert cli.main(["spec", "--from-trace", *map(str, ranks), "-o", str(out)]) == 0
    assert sorted(v.name for v in plan(out).variants) == sorted([D128, BWD_FWD, BWD])
    assert yaml.safe_load(out.read_text())["decode"] == [["bf16", 128]]
    assert out.read_text().startswith(
        "# Generated by `fa3gen spec --from-trace rank0.yaml rank1.yaml rank2.yaml`")
    assert cli.main(["spec", "--from-trace", str(ranks[2]), "-o", str(out)]) == 2  # alone: no call
    assert "recorded no call but decode calls" in capsys.readouterr().err
    ranks[1].write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": ["not a mapping"]}))
    assert cli.main(["spec", "--from-trace", *map(str, ranks), "-o", str(out)]) == 2
    assert f"{ranks[1]}: bad call entry 0:" in capsys.readouterr().err


def test_spec_from_trace_keeps_the_choice_by_length(tmp_path):
    """A key the dispatch served with two variants by seqlen_k (h100's d256 causal): the
    longer lengths' variant is the key's default, the other one a range below the first length
    the default served; lengths that overlap (a graph baked in one name) fall back to no entry."""
    short, long = ("fwd_bf16_d256_causal_m128n64_s2_ws1_pp0_ov1",
                   "fwd_bf16_d256_causal_m128n80_s2_ws1_pp0_ov1_peel")
    path = tmp_path / "used.yaml"
    with fa3gen.trace(path):
        for name, seqlen in ((short, 512), (short, 1024), (long, 4096), (long, 16384)):
            tracing.record(name, True, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=8, heads_kv=8)
    out = tmp_path / "m.yaml"
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    p = plan(out)
    key = parse_name(long).key
    assert p.defaults[key].name == long
    assert p.seqlen_dispatch() == [[*key, 0, 4095, short]]
    with fa3gen.trace(path):  # the long variant also ran at 1024: no length rule fits
        tracing.record(short, True, batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_kv=8)
        tracing.record(long, True, batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_kv=8)
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    spec = yaml.safe_load(out.read_text())
    assert "dispatch" not in spec and spec["dispatch_required"] is False


@pytest.fixture(autouse=True)
def no_library_ranges(monkeypatch):
    """The dispatch ranges that loaded libraries registered: none unless a test notes some."""
    monkeypatch.setattr(tracing, "_dispatch_ranges", {})


SHORT, LONG = ("fwd_bf16_d256_causal_m128n64_s2_ws1_pp0_ov1",
               "fwd_bf16_d256_causal_m128n80_s2_ws1_pp0_ov1_peel")


def _trace_lengths(path, calls):
    with fa3gen.trace(path):
        for name, seqlen in calls:
            tracing.record(name, True, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=8,
                           heads_kv=8)


def test_spec_from_trace_keeps_the_librarys_own_bounds(tmp_path):
    """The library sent 0-2047 keys to SHORT: calls at 512-1024 and 4096-16384 used to give
    SHORT 0-4095 (up to the first length LONG served), so an untraced 3000 ran SHORT in the
    trimmed build and LONG in the full one. The trace now records the library's range."""
    tracing.note_dispatch_ranges({SHORT: [(0, 2047)]})
    path = tmp_path / "used.yaml"
    _trace_lengths(path, ((SHORT, 512), (SHORT, 1024), (LONG, 4096), (LONG, 16384)))
    calls = {c["variant"]: c for c in yaml.safe_load(path.read_text())["calls"]}
    assert calls[SHORT]["dispatch_seqlen_k"] == [[0, 2047]]
    assert "dispatch_seqlen_k" not in calls[LONG]
    p = plan(_spec_of(path, tmp_path))
    key = parse_name(LONG).key
    assert p.defaults[key].name == LONG and p.seqlen_dispatch() == [[*key, 0, 2047, SHORT]]
    # named calls (variant=) carry no range: the dispatch did not choose them
    with fa3gen.trace(path):
        tracing.record(SHORT, False, batch=1, seqlen_q=8, seqlen_k=8, heads_q=8, heads_kv=8)
    assert "dispatch_seqlen_k" not in yaml.safe_load(path.read_text())["calls"][0]


def test_library_bounds_where_every_traced_variant_had_a_range(tmp_path):
    """Both traced variants were range defaults (the key's own default never ran): the one
    reaching furthest serves the longer lengths, the other keeps its library range."""
    tracing.note_dispatch_ranges({SHORT: [(0, 1500)], LONG: [(1501, 8191)]})
    p, key = _traced_plan(tmp_path, ((SHORT, 1024), (LONG, 2048)))
    assert p.defaults[key].name == LONG and p.seqlen_dispatch() == [[*key, 0, 1500, SHORT]]


def test_library_ranges_survive_a_merge_and_disagreeing_libraries_record_none(tmp_path):
    path = tmp_path / "used.yaml"
    tracing.note_dispatch_ranges({SHORT: [(0, 2047)]})
    t = tracing.Trace(path)
    t.add(SHORT, True, {"seqlen_k": 512})
    data = t.to_dict()
    tracing._dispatch_ranges.clear()  # a later process, no library with the range loaded
    merged = tracing.Trace(path)
    merged.merge(data)
    assert merged.to_dict()["calls"][0]["dispatch_seqlen_k"] == [[0, 2047]]
    tracing.note_dispatch_ranges({SHORT: [(0, 1023)]})
    tracing.note_dispatch_ranges({SHORT: [(0, 2047)]})  # two libraries, two bounds: neither
    assert tracing._dispatch_ranges[SHORT] is None


def test_a_variant_ranged_in_one_library_and_default_in_another_records_no_range(tmp_path):
    """Ranges are noted by variant name: LONG, the default in the library that served the
    calls and ranged 0-100 in another one loaded beside it, gave a spec where LONG served only
    0-100 (the traced 16384 call included). Now the clash records no range for LONG."""
    tracing.note_dispatch_ranges({LONG: [], SHORT: [(512, 2047)]})   # the serving library
    tracing.note_dispatch_ranges({LONG: [(0, 100)]})                 # another one
    p, key = _traced_plan(tmp_path, ((SHORT, 1024), (LONG, 16384)))
    assert p.defaults[key].name == LONG and p.seqlen_dispatch() == [[*key, 512, 2047, SHORT]]


def test_library_ranges_that_do_not_reproduce_the_traced_choice_fall_back(tmp_path):
    """A merged trace whose recorded range misses one of the variant's own traced lengths (two
    libraries with other bounds): the old rule, from the traced lengths."""
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [
        {"variant": SHORT, "default": True, "seqlen_k": [100, 3000],
         "dispatch_seqlen_k": [[0, 2047]]},
        {"variant": LONG, "default": True, "seqlen_k": [4096, 8192]}]}))
    spec = yaml.safe_load(tracing.spec_from_trace(path, "m"))
    assert [e.get("seqlen_k") for e in spec["dispatch"]] == [None, [0, 4095]]


def test_a_bad_library_range_in_a_trace_is_one_error(tmp_path):
    path = tmp_path / "bad.yaml"
    for bad in ([[5, 1]], "0-10", [[0, True]], [], [[0, 2**31]]):
        path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [
            {"variant": SHORT, "default": True, "seqlen_k": [1, 2], "dispatch_seqlen_k": bad}]}))
        with pytest.raises(fa3gen.errors.TraceError, match="dispatch_seqlen_k must be"):
            tracing.spec_from_trace(path, "m")


def _traced_plan(tmp_path, calls):
    """The build plan of the spec made from a trace of `calls`, and LONG's key."""
    path = tmp_path / "used.yaml"
    _trace_lengths(path, calls)
    return plan(_spec_of(path, tmp_path)), parse_name(LONG).key


def _spec_of(trace, tmp_path):
    out = tmp_path / "m.yaml"
    assert cli.main(["spec", "--from-trace", str(trace), "-o", str(out)]) == 0
    return out


def test_entries_of_one_variant_merge_their_lengths(tmp_path):
    """A merged trace (two runs' entries) with V1 at 10-20 and 100-200, V0 at 30-40: V1's
    lengths are 10-200, which overlap V0's, so no length rule; before, V1's last entry alone
    counted and the spec sent 0-99 to V0, V1's traced calls at 10-20 included."""
    v1, v0 = ("fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1", "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov1")
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [
        {"variant": v1, "default": True, "seqlen_k": [10, 20]},
        {"variant": v0, "default": True, "seqlen_k": [30, 40]},
        {"variant": v1, "default": True, "seqlen_k": [100, 200]}]}))
    spec = yaml.safe_load(tracing.spec_from_trace(path, "m"))
    assert "dispatch" not in spec and spec["dispatch_required"] is False


def test_spec_from_trace_will_not_overwrite_the_trace(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [{"variant": BWD, "default": True}]}))
    before = path.read_text()
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(path)]) == 2
    assert "is the trace itself" in capsys.readouterr().err and path.read_text() == before


def test_deeply_nested_yaml_is_one_error(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 2000 + "]" * 2000)
    assert cli.main(["spec", "--from-trace", str(deep), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "nested too deeply" in capsys.readouterr().err
    from fa3gen.runtime import spec_name_of_file
    assert spec_name_of_file(deep) == "deep"


def test_spec_from_a_bad_trace_says_what_is_wrong(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("calls: []\n")
    assert cli.main(["spec", "--from-trace", str(bad), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "not an fa3gen trace" in capsys.readouterr().err
    empty = tmp_path / "empty.yaml"
    with fa3gen.trace(empty):
        pass
    assert cli.main(["spec", "--from-trace", str(empty), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "recorded no call" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"  # invalid YAML: one line that says where, as a spec's
    broken.write_text("format: 1\ncalls:\n- {variant: x\n")
    assert cli.main(["spec", "--from-trace", str(broken), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fa3gen: error: {broken}:4:1: not a trace (invalid YAML: ") and err.count("\n") == 1


def test_whole_program_trace_from_the_environment(tmp_path):
    path = tmp_path / "prog.yaml"
    code = ("from fa3gen import tracing\n"
            f"tracing.record({D128!r}, True, batch=1, seqlen_q=2, seqlen_k=3, heads_q=4, heads_kv=4)\n")
    env = {**os.environ, "FA3GEN_TRACE": str(path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO_ROOT)
    calls = yaml.safe_load(path.read_text())["calls"]
    assert calls[0]["variant"] == D128 and calls[0]["seqlen_k"] == [3, 3]
    # A process that makes no call (here: fa3gen spec reading this trace, under the same
    # variable) leaves the file as it was; a relative path is the one at import.
    recorded = path.read_text()
    subprocess.run([sys.executable, "-m", "fa3gen.cli", "spec", "--from-trace", str(path), "-o",
                    str(tmp_path / "s.yaml")], env=env, check=True, cwd=REPO_ROOT)
    assert path.read_text() == recorded
    moved = ("import os; from fa3gen import tracing\n"
             f"os.chdir({str(tmp_path / 'elsewhere')!r})\n" + code.split("\n", 1)[1])
    (tmp_path / "elsewhere").mkdir()
    subprocess.run([sys.executable, "-c", moved], env={**env, "FA3GEN_TRACE": "rel.yaml"},
                   check=True, cwd=tmp_path)
    assert (tmp_path / "rel.yaml").is_file() and not (tmp_path / "elsewhere" / "rel.yaml").exists()


def test_a_trace_path_that_cannot_be_written_is_said_at_the_start(tmp_path):
    import pytest

    with pytest.raises(fa3gen.TraceError, match="is a folder"):
        with fa3gen.trace(tmp_path):
            raise AssertionError("the block must not run")
    p = subprocess.run([sys.executable, "-c", "import fa3gen.tracing"], cwd=REPO_ROOT,
                       env={**os.environ, "FA3GEN_TRACE": str(tmp_path)}, capture_output=True,
                       text=True)
    assert p.returncode == 0 and "FA3GEN_TRACE ignored" in p.stderr and "Traceback" not in p.stderr


def test_decode_calls_put_their_kernels_in_the_spec(tmp_path, monkeypatch):
    """flash_attn_with_kvcache calls are traced as (dtype, head_dim) pairs, and the spec
    written from the trace lists exactly those under `decode:`."""
    import torch
    from fa3gen import contract, kvcache, ops
    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: None)
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))
    path = tmp_path / "serve.yaml"
    with fa3gen.trace(path):
        tracing.record(D128, True, batch=1, seqlen_q=8, seqlen_k=8, heads_q=1, heads_kv=1)
        for _ in range(2):
            kc = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
            kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16), kc, kc,
                                            cache_seqlens=10)
        kc = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
        kvcache.flash_attn_with_kvcache(torch.zeros(1, 1, 4, 64, dtype=torch.float16), kc, kc)
    assert yaml.safe_load(path.read_text())["decode"] == [["bf16", 128], ["fp16", 64]]
    out = tmp_path / "serve_spec.yaml"
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    assert plan(out).spec.decode == (("bf16", 128), ("fp16", 64))


def test_named_calls_neither_undo_a_default_nor_move_its_lengths(tmp_path):
    """A variant traced both as its key's default and by name stays the default, and the
    lengths of named calls do not enter the choice by length (T4, T5 of the mutation audit)."""
    short, long = ("fwd_bf16_d256_causal_m128n64_s2_ws1_pp0_ov1",
                   "fwd_bf16_d256_causal_m128n80_s2_ws1_pp0_ov1_peel")
    path = tmp_path / "used.yaml"
    with fa3gen.trace(path):
        sizes = dict(batch=1, heads_q=8, heads_kv=8)
        tracing.record(D128, True, seqlen_q=8, seqlen_k=8, **sizes)
        tracing.record(D128, False, seqlen_q=8, seqlen_k=8, **sizes)   # also named
        tracing.record(D128_OTHER, False, seqlen_q=8, seqlen_k=8, **sizes)
        for name, seqlen in ((short, 512), (short, 1024), (long, 4096), (long, 16384)):
            tracing.record(name, True, seqlen_q=seqlen, seqlen_k=seqlen, **sizes)
        tracing.record(long, False, seqlen_q=512, seqlen_k=512, **sizes)  # named, short length
    out = tmp_path / "m.yaml"
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    p = plan(out)
    assert p.defaults[parse_name(D128).key].name == D128
    assert p.seqlen_dispatch() == [[*parse_name(long).key, 0, 4095, short]]


def test_a_trace_of_decode_calls_alone_is_written_at_exit(tmp_path):
    t = tracing.Trace(tmp_path / "decode_only.yaml")
    tracing._write_if_recorded(t)
    assert not t.path.exists()  # nothing recorded: the file is left alone
    t.decode.add(("bf16", 128))
    tracing._write_if_recorded(t)
    assert yaml.safe_load(t.path.read_text())["decode"] == [["bf16", 128]]


@pytest.mark.parametrize("entry, message", [
    ({"variant": "not-a-variant", "default": True}, "bad call entry"),
    ({"variant": D128, "default": True, "seqlen_k": [10, 5]}, "seqlen_k must be"),
    (5, "expected a mapping with a variant"),
    ({"default": True}, "expected a mapping with a variant"),
    ({"variant": D128, "default": "no"}, "default must be true or false"),
    ({"variant": D128}, r"default must be true or false \(a trace cut short\?\)"),
    ({"variant": D128, "default": True, "direction": "fwd", "head_dim": 64},
     "its key axes do not match variant"),
])
def test_bad_call_entries_are_errors_not_skipped(tmp_path, entry, message):
    path = tmp_path / "t.yaml"
    good = {"variant": BWD, "default": True}
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [good, entry]}))
    with pytest.raises(fa3gen.TraceError, match=message):
        tracing.spec_from_trace(path, "x")


def test_a_training_step_records_its_backward_too(tmp_path, fake_launches):
    """A traced forward and backward put both variants in the trace (a spec made from it must
    build the backward as well), each once, with the call's sizes."""
    q = torch.zeros(2, 40, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(2, 56, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(2, 56, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    with fa3gen.trace(tmp_path / "t.yaml"):
        ops.flash_attn_func(q, k, v).float().sum().backward()
    calls = {c["direction"]: c for c in yaml.safe_load((tmp_path / "t.yaml").read_text())["calls"]}
    launched = [name for name, _ in fake_launches]
    assert [calls["fwd"]["variant"], calls["bwd"]["variant"]] == launched
    assert calls["bwd"]["count"] == 1 and calls["bwd"]["default"] is True
    assert (calls["bwd"]["seqlen_q"], calls["bwd"]["seqlen_k"], calls["bwd"]["heads_kv"]) == ([40, 40], [56, 56], [2, 2])


def test_an_output_file_name_that_is_no_spec_name_asks_for_name(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [{"variant": BWD_FWD, "default": True}]}))
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(tmp_path / ".yaml")]) == 2
    assert "pass --name" in capsys.readouterr().err
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(tmp_path / ".yaml"), "--name", "ok"]) == 0


def test_copies_of_the_runtime_in_one_program_keep_each_others_calls(tmp_path, monkeypatch):
    """Under FA3GEN_TRACE, fa3gen and a packaged fa3gen_<spec> in one program each write their
    trace at exit: the later keeps what the earlier wrote since the run began, but not what an
    earlier run wrote there, nor (a copy writing again) its own earlier write."""
    path = tmp_path / "prog.yaml"
    sizes = dict(batch=1, seqlen_q=2, seqlen_k=3, heads_q=4, heads_kv=4)
    stale = tracing.Trace(path)
    stale.add(D128.replace("d128", "d64"), True, sizes)
    with monkeypatch.context() as m:  # an earlier run: another process, another copy
        m.setattr(tracing, "_process_id", lambda: "1:1")
        m.setattr(tracing, "_COPY", "1:earlier")
        stale.write(whole_program=True)
    time.sleep(0.01)
    first, second = tracing.Trace(path), tracing.Trace(path)
    first.add(D128, True, sizes)
    first.add(D128, True, {**sizes, "seqlen_k": 9})
    with monkeypatch.context() as m:
        m.setattr(tracing, "_COPY", "packaged copy")
        first.write(whole_program=True)
    second.add(D128, True, {**sizes, "seqlen_k": 5})
    second.decode.add(("bf16", 128))
    second.write(whole_program=True)
    second.write(whole_program=True)  # its own write: not merged again
    data = yaml.safe_load(path.read_text())
    assert [(c["variant"], c["count"], c["seqlen_k"]) for c in data["calls"]] == [(D128, 3, [3, 9])]
    assert data["decode"] == [["bf16", 128]] and data["written"] >= second.began
    assert data["writer"] == tracing._COPY and data["process"] == tracing._process_id()
    assert "fa3gen spec --from-trace prog.yaml -o specs/NAME.yaml" in path.read_text()


def test_a_runtime_from_before_the_timestamps_is_merged_by_its_process(tmp_path):
    """A packaged runtime built before traces had `written` marks its trace with the process
    only: the same process's is merged (and this one writes `process` for such a runtime)."""
    path = tmp_path / "prog.yaml"
    sizes = dict(batch=1, seqlen_q=2, seqlen_k=3, heads_q=4, heads_kv=4)
    old = {"format": tracing.FORMAT, "process": tracing._process_id(),
           "calls": [{"variant": D128, "default": True, "count": 2, "seqlen_k": [7, 8]}]}
    path.write_text(yaml.safe_dump(old))
    t = tracing.Trace(path)
    t.add(D128, True, sizes)
    t.write(whole_program=True)
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 3 and call["seqlen_k"] == [3, 8]
    path.write_text(yaml.safe_dump({**old, "process": "1:1"}))  # another process's: replaced
    t = tracing.Trace(path)
    t.add(D128, True, sizes)
    t.write(whole_program=True)
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 1


def test_a_trace_block_keeps_only_its_own_calls(tmp_path):
    """`with fa3gen.trace(path)` blocks on one path, nested or beside FA3GEN_TRACE's: each call
    counted once (every trace active in this copy saw it, so none merges another's)."""
    path = tmp_path / "t.yaml"
    sizes = dict(batch=1, seqlen_q=2, seqlen_k=3, heads_q=4, heads_kv=4)
    with fa3gen.trace(path):
        with fa3gen.trace(path):
            tracing.record(D128, True, **sizes)
    assert yaml.safe_load(path.read_text())["calls"][0]["count"] == 1
    code = ("import fa3gen\nfrom fa3gen import tracing\n"
            f"with fa3gen.trace({str(path)!r}):\n"
            "    " + RECORD_LINE.format(3) + "\n")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "FA3GEN_TRACE": str(path)},
                   check=True, cwd=REPO_ROOT)
    assert yaml.safe_load(path.read_text())["calls"][0]["count"] == 1


@pytest.mark.parametrize("parent_first", [False, True])
def test_a_forked_child_writes_only_its_own_calls(tmp_path, parent_first):
    """os.fork() copies the runtime and its exit handler: the child had kept the parent's token
    (so whichever wrote second took the other's trace for its own and replaced it) and the
    parent's calls from before the fork (counted twice). Either may exit first."""
    path = tmp_path / "fork.yaml"
    code = "\n".join([
        "import os, sys, time", "from fa3gen import tracing", RECORD_LINE.format(1),
        "pid = os.fork()",
        "if pid == 0:",
        f"    time.sleep({1.0 if parent_first else 0.0})",
        "    " + RECORD_LINE.format(2),
        "    sys.exit(0)",
        RECORD_LINE.format(3),
        "" if parent_first else "os.waitpid(pid, 0)", ""])
    env = {**os.environ, "FA3GEN_TRACE": str(path)}
    env.pop(tracing.BEGAN_ENV, None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO_ROOT)
    deadline = time.time() + 30
    while True:  # a child that outlives its parent writes after the parent's exit
        calls = yaml.safe_load(path.read_text())["calls"] if path.exists() else []
        if (calls and calls[0]["count"] == 3) or time.time() > deadline:
            break
        time.sleep(0.1)
    (call,) = calls
    assert call["count"] == 3 and call["seqlen_k"] == [1, 3]


def test_a_fork_while_another_thread_records_does_not_hang_the_child(tmp_path):
    """The lock a thread of the parent held at the fork is never freed in the child: the
    child's trace gets a new one instead of waiting on it."""
    path = tmp_path / "fork.yaml"
    code = "\n".join([
        "import os, signal, sys, time", "from fa3gen import tracing",
        "tracing._program_traces[0]._lock.acquire()  # as a thread recording at the fork",
        "pid = os.fork()",
        "if pid == 0:",
        "    " + RECORD_LINE.format(2),
        "    sys.exit(0)",
        "tracing._program_traces[0]._lock.release()",
        RECORD_LINE.format(3),
        "for _ in range(200):",
        "    if os.waitpid(pid, os.WNOHANG)[0]:",
        "        break",
        "    time.sleep(0.1)",
        "else:",
        "    os.kill(pid, signal.SIGKILL)",
        "    sys.exit('the child hung')", ""])
    env = {**os.environ, "FA3GEN_TRACE": str(path)}
    env.pop(tracing.BEGAN_ENV, None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO_ROOT, timeout=60)
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 2 and call["seqlen_k"] == [2, 3]


def test_the_run_start_is_taken_only_for_the_same_path_and_a_real_time(monkeypatch, tmp_path):
    path = tmp_path / "t.yaml"
    for value, want in ((f"12.5 {path}", 12.5), (f"12.5 {tmp_path / 'other.yaml'}", None),
                        (f"nan {path}", None), (f"inf {path}", None), (f"-inf {path}", None),
                        (f"{time.time() + 3600} {path}", None), ("", None), ("x", None)):
        monkeypatch.setenv(tracing.BEGAN_ENV, value)
        assert tracing._inherited_start(path) == want, value


def test_the_trace_path_expands_environment_variables(tmp_path):
    """FA3GEN_TRACE='trace_$RANK.yaml' (quoted for the shell that starts torchrun, which has
    no RANK): each rank expands it in its own environment."""
    code = "from fa3gen import tracing\n" + RECORD_LINE.format(3) + "\n"
    env = {**os.environ, "FA3GEN_TRACE": str(tmp_path / "trace_$RANK.yaml"), "RANK": "3"}
    env.pop(tracing.BEGAN_ENV, None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO_ROOT)
    assert (tmp_path / "trace_3.yaml").is_file() and not (tmp_path / "trace_$RANK.yaml").exists()


def test_an_unreadable_trace_of_this_run_is_replaced_with_a_warning(tmp_path, monkeypatch, capsys):
    """A trace of this run whose entries do not merge (edited, cut) had raised at exit and
    written nothing, so every later writer failed the same way."""
    path = tmp_path / "t.yaml"
    t = tracing.Trace(path)
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "written": time.time(), "writer": "other",
                                    "calls": [{"variant": D128, "default": True, "count": "x"}]}))
    t.add(D128, True, dict(batch=1, seqlen_q=2, seqlen_k=3, heads_q=4, heads_kv=4))
    tracing._write_if_recorded(t)
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 1 and "a trace of this run that does not merge, replaced" in capsys.readouterr().err
    for bad in ({"variant": "no_such_variant", "default": True, "count": 1},  # fails at to_dict
                {"variant": D128, "default": True, "count": 1, "seqlen_k": ["a", "b"]}):
        path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "written": time.time(),
                                        "writer": "other", "calls": [bad]}))
        tracing._write_if_recorded(t)
        (call,) = yaml.safe_load(path.read_text())["calls"]
        assert call["count"] == 1 and call["seqlen_k"] == [3, 3], bad
        assert "does not merge, replaced" in capsys.readouterr().err
    monkeypatch.setattr(tracing, "write_atomically", lambda *a: (_ for _ in ()).throw(OSError(28, "full")))
    tracing._write_if_recorded(t)  # one line at exit, no traceback
    assert capsys.readouterr().err.startswith(f"fa3gen: warning: FA3GEN_TRACE: could not write {path}")


def test_a_path_that_is_no_regular_file_is_not_read_for_merging(tmp_path):
    """A FIFO (or /dev/stdout on a pipe) would wait for input if read before the write."""
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    assert tracing._this_runs(fifo, 0.0) is None


def test_processes_running_at_once_keep_each_others_calls(tmp_path):
    """A distributed job's ranks trace into one FA3GEN_TRACE file: each writes at exit, and
    none loses another's calls, even when they all exit at once (the writers take turns)."""
    path = tmp_path / "ranks.yaml"
    code = ("import sys, time\n"
            "from fa3gen import tracing\n"
            "rank = int(sys.argv[1])\n"
            + RECORD_LINE.format("100 + rank") + "\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # exit together\n")
    env = {**os.environ, "FA3GEN_TRACE": str(path)}
    env.pop(tracing.BEGAN_ENV, None)
    at = time.time() + 3.0
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r), str(at)], env=env, cwd=REPO_ROOT)
             for r in range(4)]
    assert [p.wait(timeout=60) for p in ranks] == [0] * 4
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 4 and call["seqlen_k"] == [100, 103]


def test_children_run_one_after_another_keep_each_others_calls(tmp_path):
    """A traced program that runs two children in turn: the second child began after the
    first wrote, but the run began with the parent (the children inherit its start), so the
    file holds all three processes' calls; a later run replaces them."""
    path = tmp_path / "prog.yaml"
    record = "from fa3gen import tracing\n" + RECORD_LINE + "\n"
    parent = (record.format(50) + "import subprocess, sys\n" +
              "".join(f"subprocess.run([sys.executable, '-c', {record.format(n)!r}], check=True)\n"
                      for n in (10, 20)))
    env = {**os.environ, "FA3GEN_TRACE": str(path)}
    env.pop(tracing.BEGAN_ENV, None)
    subprocess.run([sys.executable, "-c", parent], env=env, check=True, cwd=REPO_ROOT)
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 3 and call["seqlen_k"] == [10, 50]
    subprocess.run([sys.executable, "-c", record.format(30)], env=env, check=True, cwd=REPO_ROOT)
    (call,) = yaml.safe_load(path.read_text())["calls"]
    assert call["count"] == 1 and call["seqlen_k"] == [30, 30]


def test_a_backward_traced_without_its_forward_is_refused(tmp_path):
    """A spec of the backward alone builds a library whose backward never runs (autograd calls
    it after fa3gen's forward of the key): one error naming the key."""
    path = tmp_path / "t.yaml"
    bwd = "bwd_bf16_d128_causal_m64n128_s2_ws1_pp0_ov0"
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [
        {"variant": bwd, "default": True, "count": 1}]}))
    with pytest.raises(fa3gen.TraceError, match=r"backward of \(bwd, bf16, d128, causal\) without its forward"):
        tracing.spec_from_trace(path, "x")
    fwd = "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1"
    path.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": [
        {"variant": bwd, "default": True, "count": 1}, {"variant": fwd, "default": True, "count": 1}]}))
    assert "name: x" in tracing.spec_from_trace(path, "x")


def test_a_backward_traced_by_length_gets_one_default(tmp_path):
    """A backward key chooses without a length (the spec refuses its ranges): a trace where it
    ran two variants at disjoint lengths (an older library chose by length) gives the longest
    lengths' variant as the default, not a spec that fails to resolve."""
    other = "bwd_fp16_d64_causal_m64n64_s2_ws1_pp0_ov0"
    path = tmp_path / "used.yaml"
    with fa3gen.trace(path):
        tracing.record(BWD_FWD, True, batch=1, seqlen_q=512, seqlen_k=512, heads_q=8, heads_kv=8)
        for name, seqlen in ((other, 512), (BWD, 4096)):
            tracing.record(name, True, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=8, heads_kv=8)
    out = tmp_path / "m.yaml"
    assert cli.main(["spec", "--from-trace", str(path), "-o", str(out)]) == 0
    p = plan(out)
    assert p.defaults[parse_name(BWD).key].name == BWD and p.seqlen_dispatch() == []
    assert sorted(v.name for v in p.variants) == sorted([BWD_FWD, BWD, other])


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_trace_of_compiled_training_steps_whose_sizes_turn_dynamic(fake_launches, tmp_path,
                                                                    dynamic):
    """A compiled backward is recorded when the graph runs it, as the forward is, with the
    sizes of each run. (It was recorded while torch.compile traced it: with dynamic shapes its
    sizes were SymInts, left out of the trace, and a graph compiled before the trace began,
    a warm-up step, recorded no backward at all.)"""
    torch._dynamo.reset()
    step = torch.compile(lambda q: ops.flash_attn_func(q, q, q), backend="aot_eager",
                         dynamic=dynamic)
    path = tmp_path / "t.yaml"
    with fa3gen.trace(path):
        for b, s in ((2, 40), (3, 50)):
            q = torch.zeros(b, s, 2, 128, dtype=torch.bfloat16, requires_grad=True)
            step(q).float().sum().backward()
    calls = {c["direction"]: c for c in yaml.safe_load(path.read_text())["calls"]}
    assert calls["fwd"]["count"] == 2 and calls["fwd"]["seqlen_q"] == [40, 50]
    assert calls["bwd"]["count"] == 2 and calls["bwd"]["seqlen_q"] == [40, 50]
    assert tracing.spec_from_trace(path, "x")  # and it makes a spec
    warm = tmp_path / "warm.yaml"  # the graphs compiled above, before this trace began
    with fa3gen.trace(warm):
        q = torch.zeros(3, 50, 2, 128, dtype=torch.bfloat16, requires_grad=True)
        step(q).float().sum().backward()
    calls = {c["direction"]: c for c in yaml.safe_load(warm.read_text())["calls"]}
    assert calls["bwd"]["count"] == 1 and calls["fwd"]["count"] == 1


def test_a_trace_written_while_threads_record_into_it(tmp_path):
    """to_dict walked the entries while another thread's first calls of variants added to
    them: 'dictionary changed size during iteration', and no file written."""
    import sys
    import threading
    names = [f"fwd_bf16_d128_nocausal_m{m}n{n}_s{st}_ws1_pp0_ov0" for m in (64, 128, 192)
             for n in range(16, 257, 16) for st in (2, 3, 4)]
    errors = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the race shows in a few rounds
    try:
        for _ in range(20):
            t = tracing.Trace(tmp_path / "t.yaml")
            adder = threading.Thread(target=lambda: [t.add(n, d, {"batch": 1})
                                                     for n in names for d in (True, False)])
            adder.start()
            while adder.is_alive():
                try:
                    t.to_dict()
                except RuntimeError as e:
                    errors.append(e)
            adder.join()
            assert len(t.to_dict()["calls"]) == 2 * len(names)
    finally:
        sys.setswitchinterval(interval)
    assert not errors


def test_a_backward_op_called_with_a_named_variant_is_not_recorded_as_the_default():
    """fa3gen::bwd records when it runs; bench calls it with every candidate by name, which
    the trace took for the key's default (it records what resolve() names as the default)."""
    from fa3gen.errors import VariantNotBuiltError
    assert ops._is_default("bwd_a", lambda: "bwd_a")
    assert not ops._is_default("bwd_b", lambda: "bwd_a")

    def missing():
        raise VariantNotBuiltError("key", [], "hint")
    assert not ops._is_default("bwd_b", missing)


def test_a_chunked_prefill_that_appends_keeps_the_append_kernels(tmp_path, monkeypatch,
                                                                  fake_launches):
    """A chunked prefill runs the forward kernels, but its append runs the append kernel, which
    a build has only with the decode kernels: a trace of prefills alone had given a spec
    without `decode:`, whose library took the PyTorch append (slower, unannounced)."""
    import torch
    from fa3gen import contract, kvcache
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib=None: None)
    for append in (False, True):
        path = tmp_path / f"prefill_{append}.yaml"
        with fa3gen.trace(path):
            kc, vc = (torch.zeros(1, 128, 2, 128, dtype=torch.bfloat16) for _ in range(2))
            new = dict(k=torch.zeros(1, 40, 2, 128, dtype=torch.bfloat16),
                       v=torch.zeros(1, 40, 2, 128, dtype=torch.bfloat16)) if append else {}
            kvcache.flash_attn_with_kvcache(torch.zeros(1, 40, 4, 128, dtype=torch.bfloat16),
                                            kc, vc, cache_seqlens=60, **new)
        data = yaml.safe_load(path.read_text())
        assert data["calls"] and data.get("decode") == ([["bf16", 128]] if append else None)


def test_a_relative_trace_path_is_one_file_for_every_runtime_copy(tmp_path):
    """A packaged fa3gen_<spec> loads its own tracing module at its first call, maybe after a
    chdir: the relative FA3GEN_TRACE had then named another file for it."""
    (tmp_path / "elsewhere").mkdir()
    record = "record({!r}, True, batch=1, seqlen_q=2, seqlen_k=3, heads_q=4, heads_kv=4)\n"
    code = ("import importlib.util, os, sys\n"
            "from fa3gen import tracing\n"
            "tracing." + record.format(D128) +
            f"os.chdir({str(tmp_path / 'elsewhere')!r})\n"
            "spec = importlib.util.spec_from_file_location('copy_tracing', tracing.__file__)\n"
            "copy = sys.modules['copy_tracing'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(copy)\n"
            "copy." + record.format(D128_OTHER))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path,
                   env={**os.environ, "FA3GEN_TRACE": "rel.yaml", "PYTHONPATH": str(REPO_ROOT)})
    assert not (tmp_path / "elsewhere" / "rel.yaml").exists()
    variants = {c["variant"] for c in yaml.safe_load((tmp_path / "rel.yaml").read_text())["calls"]}
    assert variants == {D128, D128_OTHER}
