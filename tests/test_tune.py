"""`fa3gen tune` on CPU: the choice, the rewritten dispatch section (valid, resolving to the
winners, the rest of the spec kept), and the command's flow with the GPU timing stubbed."""
import json
import types

import pytest

from fa3gen import checks, cli, tune
from fa3gen.contract import key_str, parse_name
from fa3gen.errors import Fa3genError
from tests.test_timing_checks import cpu_generator, wait_for_sample  # noqa: F401 (fixture)

SPEC = """\
# a comment that must survive
name: tunetest
axes:
  direction: fwd
  dtype: bf16
  causal: [false, true]
  stages: 2
  warp_specialized: true
  pingpong: true
  intra_wg_overlap: true
groups:
  - name: d128
    axes:
      head_dim: 128
      tile: [[128, 128], [128, 176]]
  - name: d64   # one candidate per key: nothing to choose
    axes: {head_dim: 64, tile: [192, 128], pingpong: false}
exclude:
  - {head_dim: 128, tile: [128, 176], causal: true}
dispatch:
  # the old choice
  - when: {direction: fwd, head_dim: 128, causal: false}
    use: {tile: [128, 176]}
"""
NC_128 = "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1"
NC_176 = "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"
NC_KEY = parse_name(NC_128).key


CHECK_VARIANT = checks.check_variant  # the real one, which the fixture below stands in for


@pytest.fixture(autouse=True)
def candidates_pass(monkeypatch):
    """The candidates' check against the reference needs a GPU: every candidate passes here
    unless a test says otherwise."""
    checked = []
    monkeypatch.setattr(checks, "check_variant",
                        lambda lib, v, seed=0: checked.append(v.name) or {"ok": True, "why": ""})
    return checked


@pytest.fixture
def spec_file(tmp_path):
    p = tmp_path / "tunetest.yaml"
    p.write_text(SPEC)
    return p


def test_choose_takes_the_best_geomean_and_skips_failures():
    # geomean, not the sum: a's 1.0 + 4.0 ms is faster in total than b's 1.9 + 2.0, not per shape
    best, rel = tune.choose({"a": [1.0, 4.0], "b": [1.9, 2.0], "c": [0.5, None]})
    assert best == "b" and rel["b"] == 1.0 and rel["a"] == pytest.approx(3.8 ** 0.5 / 2)
    assert "c" not in rel
    assert tune.choose({"a": [2.0], "b": [1.0]})[0] == "b"
    with pytest.raises(Fa3genError, match="no candidate ran on every shape"):
        tune.choose({"a": [None]})


def test_candidates_are_the_multi_variant_keys(spec_file):
    multi, current = tune.candidates(spec_file)
    assert list(multi) == [NC_KEY]
    assert [v.name for v in multi[NC_KEY]] == [NC_128, NC_176]
    assert current[NC_KEY].name == NC_176


def test_written_spec_resolves_to_the_winner_and_keeps_the_rest(spec_file):
    winner = parse_name(NC_128)
    text = tune.write_spec(spec_file, {NC_KEY: winner}, {NC_KEY: "measured: 1.03x"})
    assert text.startswith("# a comment that must survive\n")
    assert "exclude:\n  - {head_dim: 128, tile: [128, 176], causal: true}" in text
    assert "# the old choice" not in text and "# measured: 1.03x" in text
    assert ("  - when: {direction: fwd, dtype: bf16, head_dim: 128, causal: false}\n"
            "    use: {tile: [128, 128], stages: 2, warp_specialized: true, pingpong: true, "
            "intra_wg_overlap: true}") in text
    spec_file.write_text(text)
    assert tune.candidates(spec_file)[1][NC_KEY] == winner
    # Keys not timed keep their current default.
    again = tune.write_spec(spec_file, {}, {})
    spec_file.write_text(again)
    assert tune.candidates(spec_file)[1][NC_KEY] == winner


def test_feature_keys_name_their_flags_and_a_missing_block_is_appended():
    v = parse_name("fwd_bf16_d128_causal_softcap_varlen_m128n128_s2_ws1_pp1_ov1")
    block = tune.render_dispatch({v.key: v}, {})
    assert "when: {direction: fwd, dtype: bf16, head_dim: 128, causal: true, softcap: true, " \
           "varlen: true}" in block and "local" not in block
    assert tune.replace_dispatch("name: x\naxes: {}\n", block) == "name: x\naxes: {}\n" + block
    text = "name: x\ndispatch:\n  - when: {}\n    use: {}\ndispatch_required: false\n"
    assert tune.replace_dispatch(text, block) == "name: x\n" + block + "dispatch_required: false\n"


def test_tune_command_flow_with_the_timing_stubbed(spec_file, tmp_path, monkeypatch, capsys,
                                                  candidates_pass):
    """The command as on the GPU, with torch's CUDA check, the library and the timing faked:
    it writes the JSON and the new default."""
    import torch

    from fa3gen import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_lib = types.SimpleNamespace(variants=[parse_name(NC_128), parse_name(NC_176)],
                                     path=tmp_path / "libfa3gen_tunetest.so")
    monkeypatch.setattr(runtime, "use_spec", lambda spec: fake_lib)
    monkeypatch.setattr(tune, "provenance", lambda lib: {"gpu": "fake"})
    timed = []

    def measure(lib, key, names, shapes, rounds, min_ms, sampler=None, power=None,
                window=tune.LOCAL_WINDOW, reasons=None, per_round=None):
        timed.append((key, names, [s["seqlen"] for s in shapes], rounds, min_ms, window))
        per_round.update({NC_128: [[1.0, 1.0]] * 2, NC_176: [[1.25, 1.0], [1.1, 1.0]]})
        return {NC_128: [1.0, 1.0], NC_176: [1.1, 1.05]}

    monkeypatch.setattr(tune, "measure", measure)
    out = tmp_path / "tune.json"
    assert cli.main(["tune", "--spec", str(spec_file), "--seqlens", "1024,4096", "--rounds", "2",
                     "--min-ms", "5", "--out", str(out), "--no-power", "--window", "4096,0"]) == 0
    assert timed == [(NC_KEY, [NC_128, NC_176], [1024, 4096], 2, 5.0, (4096, 0))]
    assert candidates_pass == [NC_128, NC_176]  # each candidate checked before the timing
    printed = capsys.readouterr().out
    assert f"{key_str(NC_KEY)}: {NC_128} (was {NC_176})" in printed
    assert f"{NC_176}: 0.930 (rounds 0.800-1.000)" in printed  # the runner-up's spread
    report = json.loads(out.read_text())
    assert report["keys"][0]["winner"] == NC_128 and report["keys"][0]["previous_default"] == NC_176
    assert tune.candidates(spec_file)[1][NC_KEY].name == NC_128


def test_a_candidate_that_fails_its_check_is_not_timed(spec_file, tmp_path, monkeypatch, capsys):
    """A wrong candidate could be the fastest: it is checked against the reference first,
    reported, and left out of the timing; when every candidate of a key fails, the run stops
    before writing the spec."""
    import torch

    from fa3gen import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_lib = types.SimpleNamespace(variants=[parse_name(NC_128), parse_name(NC_176)],
                                     path=tmp_path / "libfa3gen_tunetest.so")
    monkeypatch.setattr(runtime, "use_spec", lambda spec: fake_lib)
    monkeypatch.setattr(tune, "provenance", lambda lib: {})
    why = "seqlen_q 200, seqlen_k 333, scale_factor 6: max |out - ref| = 0.5 > tolerance 0.01"
    monkeypatch.setattr(checks, "check_variant", lambda lib, v, seed=0: (
        {"ok": False, "why": why} if v.name == NC_128 else {"ok": True, "why": ""}))
    timed = []

    def measure(lib, key, names, shapes, rounds, min_ms, sampler=None, power=None,
                window=tune.LOCAL_WINDOW, reasons=None, per_round=None):
        timed.append(names)
        return {n: [1.0] for n in names}

    monkeypatch.setattr(tune, "measure", measure)
    out = tmp_path / "tune.json"
    args = ["tune", "--spec", str(spec_file), "--seqlens", "1024", "--out", str(out),
            "--no-power"]
    assert cli.main(args) == 0
    assert timed == [[NC_176]]
    assert f"{NC_128}: wrong, not timed: {why}" in capsys.readouterr().out
    report = json.loads(out.read_text())["keys"][0]
    assert report["winner"] == NC_176 and report["failed_check"] == {NC_128: why}

    monkeypatch.setattr(checks, "check_variant", lambda lib, v, seed=0: {"ok": False, "why": why})
    before = spec_file.read_text()
    assert cli.main(args) == 2
    assert "every candidate failed its check against the reference" in capsys.readouterr().err
    assert spec_file.read_text() == before
    report = json.loads(out.read_text())
    assert not report["header"]["complete"]
    assert report["keys"] == [{"key": list(NC_KEY), "failed_check": {NC_128: why, NC_176: why}}]
    timed.clear()  # --no-check: every candidate is timed, none checked
    assert cli.main(args + ["--no-check"]) == 0 and timed == [[NC_128, NC_176]]


def test_check_variant_runs_the_directions_check_on_each_problem(monkeypatch, cpu_generator):
    """check_variant: the backward check for backward variants, each of quick_problems, the
    first failure named with its problem; a launch error is a failure, not an exception."""
    seen = []

    def fwd(lib, v, problem, gen):
        seen.append(("fwd", problem))
        return {"ok": problem != checks.QUICK_LARGE_SCORES, "why": "max |out - ref| = 1"}

    def bwd(lib, v, problem, gen):
        seen.append(("bwd", problem))
        raise RuntimeError("fa3gen launch failed")

    monkeypatch.setattr(checks, "check_forward", fwd)
    monkeypatch.setattr(checks, "check_backward", bwd)
    plain = types.SimpleNamespace(name="f", direction="fwd", causal=False, local=False,
                                  varlen=False, paged=False)
    res = CHECK_VARIANT(None, plain)
    assert seen == [("fwd", checks.QUICK_PROBLEM), ("fwd", checks.QUICK_LARGE_SCORES)]
    assert not res["ok"] and res["why"] == "seqlen_q 200, seqlen_k 333, scale_factor 6: max |out - ref| = 1"
    seen.clear()
    res = CHECK_VARIANT(None, types.SimpleNamespace(**{**vars(plain), "direction": "bwd"}))
    assert seen == [("bwd", checks.QUICK_PROBLEM)]
    assert res["why"] == "seqlen_q 200, seqlen_k 333: RuntimeError: fa3gen launch failed"
    res = CHECK_VARIANT(None, types.SimpleNamespace(**{**vars(plain), "varlen": True}))
    assert res["why"].startswith("lengths VARLEN_LENGTHS, scale_factor 6: ")  # not the seqlens


def test_tune_without_candidates_or_gpu(spec_file, tmp_path, capsys, monkeypatch):
    tiny = tmp_path / "one.yaml"
    tiny.write_text(SPEC.replace("[[128, 128], [128, 176]]", "[128, 128]").split("exclude:")[0])
    assert cli.main(["tune", "--spec", str(tiny)]) == 0
    assert "no key with several candidates; nothing to tune" in capsys.readouterr().out
    # A --keys filter that matches no key is a usage error (a typo must not read as done).
    assert cli.main(["tune", "--spec", str(spec_file), "--keys", "zzz"]) == 2
    err = capsys.readouterr().err
    assert "no key with several candidates matches --keys 'zzz'" in err and key_str(NC_KEY) in err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--spec", str(spec_file)]) != 0
    assert "fa3gen tune needs a CUDA GPU" in capsys.readouterr().err


def test_seqlen_ranges_where_another_candidate_wins():
    times = {"a": [1.0, 2.0, 9.0, 30.0], "b": [1.5, 2.5, 8.0, 20.0]}
    # a wins at 1024 and 2048, b at 8192 and 16384; the fallback (geomean winner) is b
    assert tune.seqlen_ranges([1024, 2048, 8192, 16384], times, "b") == [(0, 4096, "a")]
    assert tune.seqlen_ranges([1024, 2048, 8192, 16384], times, "a") == [(4097, 2**31 - 1, "b")]
    assert tune.seqlen_ranges([1024, 4096], {"a": [1.0, 1.0], "b": [2.0, 2.0]}, "a") == []
    # an exact tie is the fallback's (it went to whichever candidate came first: a range
    # for a tile that is not faster)
    assert tune.seqlen_ranges([1024, 4096], {"a": [1.0, 2.0], "b": [1.0, 2.0]}, "b") == []


def test_list_options_measure_each_value_once():
    """--seqlens 1024,1024 measured the point twice (two rows; tune's ranges then overlapped)."""
    from fa3gen import bench

    assert bench.int_list("1,2")("1024,512,1024") == [1024, 512]
    assert bench._dtype_list("bf16,fp16,bf16") == ["bf16", "fp16"]


def test_tune_writes_ranges_that_resolve(spec_file, tmp_path, monkeypatch, capsys):
    import torch

    from fa3gen import runtime
    from generator.build import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "use_spec", lambda spec: types.SimpleNamespace(
        variants=[parse_name(NC_128), parse_name(NC_176)], path=tmp_path / "lib.so"))
    monkeypatch.setattr(tune, "provenance", lambda lib: {})
    # 128x128 faster at 1024, 128x176 at 4096 and 16384 (and in the geomean)
    monkeypatch.setattr(tune, "measure", lambda *a, **kw: {NC_128: [1.0, 4.0, 40.0],
                                                     NC_176: [1.2, 3.5, 30.0]})
    assert cli.main(["tune", "--spec", str(spec_file), "--ranges", "--no-power", "--out",
                     str(tmp_path / "t.json")]) == 0
    text = spec_file.read_text()
    assert "    seqlen_k: [0, 2048]\n    use: {tile: [128, 128]," in text
    p = plan(spec_file)
    assert p.defaults[NC_KEY].name == NC_176
    assert [(lo, hi, v.name) for lo, hi, v in p.seqlen_defaults[NC_KEY]] == [(0, 2048, NC_128)]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["keys"][0]["seqlen_ranges"] == [[0, 2048, NC_128]]


def test_a_run_that_dies_keeps_the_keys_it_measured(spec_file, tmp_path, monkeypatch):
    """The JSON is written after every key: an error in a later key (a bug, the GPU lost) leaves
    the earlier keys' measurements on disk, marked incomplete, and the spec untouched."""
    import torch

    from fa3gen import runtime

    two_keys = SPEC.replace("exclude:\n  - {head_dim: 128, tile: [128, 176], causal: true}\n", "")
    spec_file.write_text(two_keys.replace("name: tunetest\n", "name: tunetest\ndispatch_required: false\n"))
    c_128, c_176 = (n.replace("nocausal", "causal") for n in (NC_128, NC_176))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "use_spec", lambda spec: types.SimpleNamespace(
        variants=[parse_name(n) for n in (NC_128, NC_176, c_128, c_176)], path=tmp_path / "x.so"))
    monkeypatch.setattr(tune, "provenance", lambda lib: {})

    def measure(lib, key, names, shapes, rounds, min_ms, sampler=None, power=None, window=None,
                reasons=None, per_round=None):
        if NC_128 in names:  # keys go in name order: causal, then nocausal
            raise RuntimeError("second key fails")
        return {c_128: [1.0, 1.0, 1.0], c_176: [1.1, 1.1, 1.1]}

    monkeypatch.setattr(tune, "measure", measure)
    out = tmp_path / "tune.json"
    before = spec_file.read_text()
    with pytest.raises(RuntimeError, match="second key fails"):
        cli.main(["tune", "--spec", str(spec_file), "--out", str(out), "--no-power"])
    report = json.loads(out.read_text())
    assert report["header"]["complete"] is False
    assert [k["winner"] for k in report["keys"]] == [c_128]
    assert spec_file.read_text() == before


def test_round_spread_pairs_each_round_with_the_winners():
    """Per shape, the lowest and highest of best ms / candidate ms over rounds taken together
    (round r against round r), None where either side did not run; the printed range spans
    every shape's."""
    per_round = {"a": [[1.0, 2.0], [4.0, 4.0], None], "b": [[1.1, 1.9], [4.4, 3.6], [1.0]]}
    spread = tune.round_spread(per_round, "a")
    assert spread["a"] == [[1.0, 1.0], [1.0, 1.0], None]
    assert spread["b"] == [pytest.approx([1.0 / 1.1, 2.0 / 1.9]),
                           pytest.approx([4.0 / 4.4, 4.0 / 3.6]), None]
    assert tune._spread_text(spread["b"]) == " (rounds 0.909-1.111)"
    assert tune._spread_text([None]) == "" and tune._spread_text(None) == ""


def test_tune_records_power_and_clock_per_candidate(spec_file, tmp_path, monkeypatch):
    """Sampled (the default): each key's report holds every candidate's mean board power and
    SM clock per shape over its own timed batches, and the clock-event reasons (nvidia-smi
    faked at 600 W, 1700 MHz, power-capped); a candidate that fails a shape gets [None, None]
    and None there."""
    from pathlib import Path

    import torch

    from fa3gen import runtime, timing

    fake = Path(__file__).parent / "fake_nvidia_smi.py"
    real, samplers = timing.PowerSampler, []
    monkeypatch.setattr(timing, "PowerSampler",
                        lambda index: samplers.append(real(index, period_ms=2, command=str(fake))) or samplers[-1])
    monkeypatch.setenv("FAKE_SMI_VALUES", "600.0, 1700, 0x0000000000000004")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "use_spec", lambda spec: types.SimpleNamespace(
        variants=[parse_name(NC_128), parse_name(NC_176)], path=tmp_path / "lib.so"))
    monkeypatch.setattr(tune, "provenance", lambda lib: {})

    def call(key, shape, window=tune.LOCAL_WINDOW):
        def make(name):
            if name == NC_176 and shape["seqlen"] == 4096:
                raise RuntimeError("this candidate cannot run 4096")
            return lambda: None
        return make

    def sustained_ms(fns, rounds, min_ms, tag=None, settle_ms=None, order="rotate", per_round=None):
        for i in range(len(fns)):
            tag(i)
            wait_for_sample(samplers[-1], i)
            tag(None)
        per_round[:] = [[1.0 + i, 1.0 + 3 * i] for i in range(len(fns))]  # two rounds
        return [1.0 + i for i in range(len(fns))]

    from fa3gen import bench

    monkeypatch.setattr(tune, "_call", call)
    monkeypatch.setattr(bench, "sustained_ms", sustained_ms)  # tune times through the bench's
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "report_failure", lambda name, e: None)
    out = tmp_path / "t.json"
    assert cli.main(["tune", "--spec", str(spec_file), "--seqlens", "1024,4096", "--dry-run",
                     "--out", str(out)]) == 0
    key = json.loads(out.read_text())["keys"][0]
    assert key["ms"] == {NC_128: [1.0, 1.0], NC_176: [2.0, None]}
    assert key["power_w_sm_mhz"] == {NC_128: [[600.0, 1700.0]] * 2,
                                     NC_176: [[600.0, 1700.0], [None, None]]}
    assert key["clock_reasons"] == {NC_128: [["sw_power_cap"]] * 2, NC_176: [["sw_power_cap"], None]}
    # each round's times, and the runner-up's speed against the winner's batch of the same round
    assert key["round_ms"] == {NC_128: [[1.0, 1.0]] * 2, NC_176: [[2.0, 4.0], None]}
    assert key["round_relative"] == {NC_128: [[1.0, 1.0]] * 2, NC_176: [[0.25, 0.5], None]}


def test_keys_not_timed_keep_their_ranges_and_what_follows_the_block_stays(tmp_path):
    """Only the timed key changes: another key's seqlen_k range entry, a quoted top-level key
    and a column-0 comment after the dispatch block all survive the rewrite."""
    from generator.spec import load_spec
    from generator.variants import enumerate_variants, resolve_dispatch, resolve_seqlen_dispatch

    text = SPEC.replace("exclude:\n  - {head_dim: 128, tile: [128, 176], causal: true}\n", "") + (
        "  - when: {direction: fwd, head_dim: 128, causal: true}\n"
        "    use: {tile: [128, 176]}\n"
        "  - when: {direction: fwd, head_dim: 128, causal: true}\n"
        "    seqlen_k: [0, 2047]\n"
        "    use: {tile: [128, 128]}\n"
        "# --- kept comment ---\n"
        '"decode": {dtype: bf16, head_dim: 128}\n')
    path = tmp_path / "t.yaml"
    path.write_text(text)
    c_key = parse_name("fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1").key
    path.write_text(tune.write_spec(path, {NC_KEY: parse_name(NC_128)}, {}))
    spec = load_spec(path)
    kept = enumerate_variants(spec).kept
    defaults = resolve_dispatch(spec, kept)
    assert defaults[NC_KEY].name == NC_128
    assert [(lo, hi, v.name) for lo, hi, v in resolve_seqlen_dispatch(spec, kept, defaults)[c_key]] == [
        (0, 2047, "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1")]
    out = path.read_text()
    assert "# --- kept comment ---" in out and spec.decode == (("bf16", 128),)


def test_call_reads_every_key_axis_and_refuses_paged_keys(monkeypatch):
    """_call takes a whole dispatch key (it had unpacked seven axes and broke on the eighth,
    `paged`, on the GPU only): a plain and a varlen key give a candidate-maker; a paged key is
    refused by name."""
    torch = pytest.importorskip("torch")
    from fa3gen import ops, timing, varlen
    from fa3gen.contract import make_key

    shape = {"batch": 2, "seqlen": 8, "heads": 2}
    monkeypatch.setattr(timing, "random_inputs", lambda s, dt, n, seed=0: [
        torch.zeros(s["batch"], s["seqlen"], s["heads"], s["head_dim"], dtype=dt) for _ in range(n)])
    ran = []
    monkeypatch.setattr(ops, "flash_attn_func", lambda *a, **kw: ran.append(("dense", kw)))
    monkeypatch.setattr(varlen, "flash_attn_varlen_func", lambda *a, **kw: ran.append(("varlen", kw)))
    monkeypatch.setattr(torch, "arange", lambda *a, **kw: torch.tensor([0, 8, 16], dtype=torch.int32))
    tune._call(make_key("fwd", "bf16", 64, True, softcap=True), shape)("v1")()
    tune._call(make_key("fwd", "bf16", 64, False, varlen=True), shape)("v2")()
    assert [(k, kw["variant"], kw["causal"], kw["softcap"]) for k, kw in ran] == [
        ("dense", "v1", True, tune.SOFTCAP), ("varlen", "v2", False, 0.0)]
    with pytest.raises(Fa3genError, match="paged keys"):
        tune._call(make_key("fwd", "bf16", 64, True, varlen=True, paged=True), shape)
    ran.clear()  # local keys run at the window asked for (--window), else (1024, 0)
    tune._call(make_key("fwd", "bf16", 64, False, local=True), shape, (4096, 0))("v3")()
    tune._call(make_key("fwd", "bf16", 64, False, local=True), shape)("v4")()
    tune._call(make_key("fwd", "bf16", 64, True), shape, (4096, 0))("v5")()
    assert [kw["window_size"] for _, kw in ran] == [(4096, 0), tune.LOCAL_WINDOW, (-1, -1)]


@pytest.mark.parametrize("text", ["4096", "a,b", "-2,0", "-1,-1", "-1,0", "1,2,3"])
def test_tune_window_refuses_what_is_not_a_window(text, spec_file, capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--spec", str(spec_file), f"--window={text}"])  # = : "-1,0" is no option
    assert "--window" in capsys.readouterr().err


def test_tune_ranges_skip_backward_keys(tmp_path, monkeypatch):
    """A backward key chooses without a length (the spec refuses ranges there): --ranges writes
    its winner only, and the spec it writes still resolves."""
    import torch

    from fa3gen import runtime
    from generator.build import plan
    from tests.test_seqlen_dispatch import BWD_RANGED

    spec = tmp_path / "bwdtune.yaml"
    spec.write_text(BWD_RANGED.split("dispatch:")[0].replace("varlen: [false, true]", "varlen: false")
                    + "dispatch:\n  - {when: {direction: bwd}, use: {tile: [128, 128]}}\n")
    names = sorted(v.name for v in plan(spec).variants if v.direction == "bwd")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "use_spec", lambda s: types.SimpleNamespace(
        variants=[parse_name(n) for n in names], path=tmp_path / "lib.so"))
    monkeypatch.setattr(tune, "provenance", lambda lib: {})
    # each candidate the fastest at one length: a forward key would get a range
    monkeypatch.setattr(tune, "measure", lambda *a, **kw: {names[0]: [1.0, 4.0, 40.0],
                                                           names[1]: [1.2, 3.5, 30.0]})
    assert cli.main(["tune", "--spec", str(spec), "--ranges", "--no-power", "--out",
                     str(tmp_path / "t.json")]) == 0
    assert "seqlen_k" not in spec.read_text()
    assert plan(spec).defaults[parse_name(names[1]).key].name == names[1]
    assert json.loads((tmp_path / "t.json").read_text())["keys"][0]["seqlen_ranges"] == []


def _help_of(parser, command: str, option: str) -> str:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if option in a.option_strings).help


def test_the_keys_examples_take_one_key_alone():
    """--keys is searched (re.search): the help's example '(fwd, bf16, d128, causal)' also
    tuned that key's varlen, local and softcap keys. The help's and the README's examples take
    the key they spell alone, among the spec's keys and that key's feature siblings."""
    import re
    from pathlib import Path

    examples = re.findall(r"'(\^[^']+)'", _help_of(cli.build_parser(), "tune", "--keys"))
    root = Path(__file__).resolve().parent.parent
    examples += re.findall(r"`--keys '([^']+)'` takes that key alone", (root / "README.md").read_text())
    assert len(examples) == 2
    keys = [key_str(k) for k in tune.candidates(root / "specs/h100.yaml")[0]]
    for example in examples:
        spelled = re.sub(r"\\(.)", r"\1", example).strip("^$")  # the key it names
        siblings = [spelled[:-1] + f", {flag})" for flag in ("local", "softcap", "varlen")]
        assert spelled in keys
        assert [k for k in keys + siblings if re.search(example, k)] == [spelled], example


def test_keys_that_leave_out_a_key_without_default_are_refused_before_timing(tmp_path, monkeypatch, capsys):
    """A spec without dispatch defaults, --keys taking one of its two multi-candidate keys: the
    rewrite had no default for the other, which it said only after timing the first."""
    import torch

    from fa3gen import runtime

    spec = tmp_path / "nodefaults.yaml"
    spec.write_text(SPEC.split("exclude:")[0] + "dispatch_required: false\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "use_spec", lambda s: types.SimpleNamespace(
        variants=[parse_name(NC_128), parse_name(NC_176), parse_name(NC_128.replace("nocausal", "causal")),
                  parse_name(NC_176.replace("nocausal", "causal"))], path=tmp_path / "lib.so"))
    monkeypatch.setattr(tune, "provenance", lambda lib: {"gpu": "fake"})
    timed = []

    def measure(lib, key, names, shapes, rounds, min_ms, sampler=None, power=None,
                window=tune.LOCAL_WINDOW, reasons=None, per_round=None):
        timed.append(key)
        return {n: [1.0 + i] * len(shapes) for i, n in enumerate(names)}

    monkeypatch.setattr(tune, "measure", measure)
    argv = ["tune", "--spec", str(spec), "--keys", r"^\(fwd, bf16, d128, causal\)$", "--no-power",
            "--out", str(tmp_path / "t.json")]
    assert cli.main(argv) == 2 and timed == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "leaves out (fwd, bf16, d128, nocausal), which has several " \
        "candidates and no default in the spec's dispatch" in err
    assert "widen --keys" in err and not (tmp_path / "t.json").exists()
    assert cli.main(argv + ["--dry-run"]) == 0 and len(timed) == 1  # the spec is not rewritten
    assert cli.main(argv[:3] + argv[5:]) == 0 and len(timed) == 3  # every key: each gets its winner


def test_an_out_that_is_a_folder_is_refused_before_timing(spec_file, tmp_path, monkeypatch, capsys):
    """The JSON is first written after the first key's timing: a folder --out failed there."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("went on to the GPU"))
    monkeypatch.setattr(tune, "measure", lambda *a, **k: pytest.fail("timed"))
    assert cli.main(["tune", "--spec", str(spec_file), "--no-power", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"fa3gen: error: --out {str(tmp_path)!r} is a folder: give a file path\n"
