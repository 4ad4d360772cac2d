"""fa3gen.timing and fa3gen.checks without a GPU: what they report when a backend or a kernel
fails, check_cell's verdict over its problems and quick_check's failure list. (That they
import without torch is in tests/test_cli.py.)"""
from pathlib import Path
from types import SimpleNamespace

import pytest

from fa3gen import checks, timing
from fa3gen.errors import Fa3genError


def test_tflops():
    assert timing.tflops(2e12, 1000.0) == 2.0
    assert timing.tflops(2e12, None) is None and timing.tflops(2e12, 0.0) is None


def test_report_failure_is_one_line_even_for_an_empty_message(capsys):
    timing.report_failure("cuDNN", RuntimeError("no kernel\nlong trace"))
    timing.report_failure("FA2 forward", RuntimeError(""))
    err = capsys.readouterr().err
    assert err == "  cuDNN failed: no kernel\n  FA2 forward failed: RuntimeError\n"


def test_time_or_none_turns_a_failing_backend_into_none(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def broken():
        raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")

    assert timing.time_or_none("cuDNN", broken, warmup=1, iters=1) is None
    assert capsys.readouterr().err == "  cuDNN failed: CUDNN_STATUS_NOT_SUPPORTED\n"


# ---- checks -----------------------------------------------------------------------------------


def variant(name, direction="fwd", causal=False):
    return SimpleNamespace(name=name, direction=direction, dtype="bf16", head_dim=64,
                           causal=causal)


class FakeLib:
    path = Path("/built/libfa3gen_x.so")

    def __init__(self, *variants):
        self.variants = list(variants)

    def get(self, name):
        return next((v for v in self.variants if v.name == name), None)

    def defaults(self, direction):
        return [v for v in self.variants if v.direction == direction]

    dispatched = defaults  # no seqlen_k ranges


@pytest.fixture
def cpu_generator(monkeypatch):
    """checks seed CUDA generators; a CPU one stands in (the kernel calls are faked)."""
    torch = pytest.importorskip("torch")
    cpu = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device: cpu())


def test_error_summary_forward_and_backward():
    fwd = {"out_err": 1e-3, "out_tol": 1e-2, "lse_err": 2e-6}
    assert checks.error_summary(fwd) == \
        "max|out-ref| 1.00e-03 (tol 1.00e-02), max|lse-ref| 2.00e-06"
    bwd = {"dq_err": 1e-3, "dq_tol": 2e-2, "dv_err": 3e-3, "dv_tol": 4e-2}
    assert checks.error_summary(bwd) == \
        "max|dq-ref| 1.00e-03 (tol 2.00e-02), max|dv-ref| 3.00e-03 (tol 4.00e-02)"


def test_cell_check_description_names_the_problems():
    square, fewer_q, large = checks.CELL_PROBLEMS[True]
    assert checks.CELL_PROBLEMS[False] == (square, large)
    assert fewer_q.seqlen_q < fewer_q.seqlen_k
    assert large == square._replace(scale_factor=checks.LARGE_SCORE_FACTOR)
    assert checks.CELL_CHECK_DESCRIPTION == (
        "batch 2, heads 4, seqlen 333 (causal also seqlen_q 200 / seqlen_k 333), "
        "seeded randn inputs at softmax scale 0.8 and 6 / sqrt(head_dim)")


def test_check_cell_not_built_is_an_error_without_a_launch(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(checks, "check_forward", lambda *a: pytest.fail("launched"))
    res = checks.check_cell(FakeLib(), variant("fwd_x"))
    assert res["status"] == "error" and res["max_err"] is None
    assert "not built in /built/libfa3gen_x.so" in res["detail"]


def test_check_cell_worst_error_and_the_failing_problem(monkeypatch, cpu_generator):
    cell = variant("fwd_causal", causal=True)
    errs = {333: 1e-3, 200: 4e-3}  # by seqlen_q: the square problem, then fewer queries
    seen = []

    def check_forward(lib, v, problem, gen):
        seen.append(problem)
        return {"ok": True, "why": "", "out_err": errs[problem.seqlen_q]}

    monkeypatch.setattr(checks, "check_forward", check_forward)
    res = checks.check_cell(FakeLib(cell), cell)
    assert res == {"status": "ok", "max_err": 4e-3, "detail": None}
    assert tuple(seen) == checks.CELL_PROBLEMS[True]

    def nan_on_fewer_queries(lib, v, problem, gen):
        if problem.seqlen_q == 200:
            return {"ok": False, "why": "NaN in out (7)", "out_err": float("nan")}
        return {"ok": True, "why": "", "out_err": 1e-3}

    monkeypatch.setattr(checks, "check_forward", nan_on_fewer_queries)
    res = checks.check_cell(FakeLib(cell), cell)
    assert res == {"status": "wrong", "max_err": None,  # NaN is not JSON
                   "detail": "seqlen_q=200 seqlen_k=333: NaN in out (7)"}

    def wrong_at_large_scores(lib, v, problem, gen):
        ok = problem.scale_factor == checks.CHECK_SCALE_FACTOR
        return {"ok": ok, "why": "" if ok else "max |out - ref| = 2", "out_err": 2.0}

    monkeypatch.setattr(checks, "check_forward", wrong_at_large_scores)
    res = checks.check_cell(FakeLib(cell), cell)
    assert res == {"status": "wrong", "max_err": 2.0,
                   "detail": "seqlen_q=333 seqlen_k=333 scale_factor=6: max |out - ref| = 2"}


def test_quick_check_lists_every_failure(monkeypatch, capsys, cpu_generator):
    import torch

    from fa3gen import runtime

    fwd, bwd = variant("fwd_a"), variant("bwd_a", direction="bwd")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "get_library", lambda spec: FakeLib(fwd, bwd))
    monkeypatch.setattr(checks, "check_forward", lambda lib, v, problem, gen: {
        "ok": True, "why": "", "out_err": 1e-3, "out_tol": 1e-2, "lse_err": 1e-6})

    def launch_fails(lib, v, problem, gen):
        assert problem in (checks.QUICK_PROBLEM, checks.QUICK_LARGE_SCORES)
        raise RuntimeError("fa3gen launch failed: too many resources")

    monkeypatch.setattr(checks, "check_backward", launch_fails)
    with pytest.raises(Fa3genError) as e:
        checks.quick_check("x")
    launch = "RuntimeError: fa3gen launch failed: too many resources"
    assert str(e.value) == ("quick_check failed:\n"
                            f"  bwd_a (seqlen_q 200, seqlen_k 333): {launch}\n"
                            f"  bwd_a (seqlen_q 200, seqlen_k 333, scale_factor 6): {launch}")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok   fwd_a (seqlen_q 200, seqlen_k 333): max|out-ref| 1.00e-03")
    assert out[1].startswith("ok   fwd_a (seqlen_q 200, seqlen_k 333, scale_factor 6): ")
    assert out[2].startswith("FAIL bwd_a (seqlen_q 200, seqlen_k 333):")
    assert "too many resources" in out[2]


def test_quick_check_runs_each_variant_on_its_problems_in_order(monkeypatch, capsys, cpu_generator):
    import torch

    from fa3gen import runtime

    plain, causal = variant("fwd_plain"), variant("fwd_causal", causal=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "get_library", lambda spec: FakeLib(plain, causal))
    seen = []
    monkeypatch.setattr(checks, "check_forward", lambda lib, v, problem, gen: seen.append(
        (v.name, problem)) or {"ok": True, "why": "", "out_err": 0.0, "out_tol": 1.0,
                               "lse_err": 0.0})
    results = checks.quick_check("x")
    large = checks.QUICK_LARGE_SCORES
    assert seen == [("fwd_plain", checks.QUICK_PROBLEM), ("fwd_plain", large),
                    ("fwd_causal", checks.QUICK_PROBLEM), ("fwd_causal", checks.QUICK_EMPTY_ROWS),
                    ("fwd_causal", large)]
    assert len(results) == 5
    assert "fwd_causal (seqlen_q 333, seqlen_k 200)" in capsys.readouterr().out


def test_quick_check_gives_masked_dense_variants_rows_that_see_no_key():
    """A dense causal or local variant is also checked with seqlen_q > seqlen_k, where the
    first query rows see no key; varlen variants have empty key sequences of their own."""
    import types

    def info(causal=False, local=False, varlen=False, paged=False):
        return types.SimpleNamespace(causal=causal, local=local, varlen=varlen, paged=paged)

    large = checks.QUICK_LARGE_SCORES
    assert checks.quick_problems(info()) == (checks.QUICK_PROBLEM, large)
    assert checks.quick_problems(info(varlen=True, causal=True)) == (checks.QUICK_PROBLEM, large)
    # paged variants are varlen in the key but run the dense problems (_check_paged)
    for masked in (info(causal=True), info(local=True), info(causal=True, varlen=True, paged=True)):
        problems = checks.quick_problems(masked)
        assert problems == (checks.QUICK_PROBLEM, checks.QUICK_EMPTY_ROWS, large)
        empty = problems[1]
        assert empty.seqlen_q > empty.seqlen_k  # bottom-right causal: rows 0.. see no key
        # and the probe window hides every key from some rows too
        left, right = checks.PROBE_WINDOW
        assert empty.seqlen_k - empty.seqlen_q + right < 0


def test_a_launch_that_writes_into_an_input_fails_the_check():
    """The references are computed from the inputs after the launch; an input the kernel wrote
    into (even with NaN, or with the same values in other bits) fails the check."""
    import torch

    def inputs():
        q = torch.randn(3, 4)
        q[1, 1] = 0.0
        return q, torch.full((2,), float("nan"))

    ok = {"ok": True, "why": ""}
    assert checks._Untouched(q=inputs()[0], lse=inputs()[1]).verdict(dict(ok)) == ok  # NaN == NaN
    for name, index, value in (("q", (0, 0), float("nan")), ("q", (1, 1), -0.0),
                               ("lse", 0, 1.0)):
        q, lse = inputs()
        untouched = checks._Untouched(q=q, lse=lse)
        untouched.inputs[name][index] = value
        res = untouched.verdict({"ok": False, "why": "max err 0.1 > tol"})
        assert not res["ok"]
        assert res["why"] == f"max err 0.1 > tol; the launch wrote into its input(s) {name}"


def test_all_variants_times_every_variant_of_the_call_key(monkeypatch):
    """bench --all-variants: the candidates of a key are its built variants, found with the
    contract's full key (a 4-entry key matched nothing once local/softcap joined it)."""
    import types

    from fa3gen import bench
    from fa3gen.contract import make_key, parse_name

    names = ["fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1",
             "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp1_ov1",
             "fwd_bf16_d128_nocausal_local_m128n128_s2_ws1_pp1_ov1",
             "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1"]
    lib = types.SimpleNamespace(variants=[parse_name(n) for n in names])
    timed = []
    monkeypatch.setattr(bench, "measure_backends", lambda fns, args: timed.append(
        (sorted(fns), args.steady_s, args.rounds)) or ({n: 2.0 for n in fns}, {}, {}))
    from fa3gen import cli
    args = cli.build_parser().parse_args(["bench", "--steady-s", "3", "--all-variants", "--rounds", "4"])
    got = bench._time_candidates(lib, make_key("fwd", "bf16", 128, False), 4e12, None, args)
    assert got == {names[0]: 2000.0, names[1]: 2000.0}
    # measured together in interleaved rounds, not one by one (--steady-s is the backends')
    assert timed == [(sorted(names[:2]), None, 4)] and args.steady_s == 3.0


def test_measure_backends_sustained_interleaved_with_power(monkeypatch, capsys):
    """Sustained (default): the backends that run are timed together, tagged for the power
    sampler; one that fails its first call is reported and left out."""
    import types

    import torch

    from fa3gen import bench

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    def fake_sustained(fns, rounds, min_ms, tag=None, settle_ms=None, order="rotate", per_round=None):
        calls.append((settle_ms, order))
        for i, _ in enumerate(fns):
            tag(i)
            calls.append(i)
            tag(None)
        per_round[:] = [[1.0 + i, 1.5 + i] for i in range(len(fns))]
        return [1.0 + i for i in range(len(fns))]

    monkeypatch.setattr(bench, "sustained_ms", fake_sustained)

    class Sampler:
        def reset(self):
            self.seen = []

        def tag(self, i):
            if i is not None:
                self.seen.append(i)

        def means(self, tags):
            return {i: (300.0 + i, 1980.0) for i in tags}

        def reasons(self, tags):
            return {i: [["sw_power_cap"], ["sw_thermal"]][i] for i in tags}

    def boom():
        raise RuntimeError("no kernel for this shape")

    sampler = Sampler()
    args = types.SimpleNamespace(burst=False, rounds=2, min_ms=5.0)
    reasons, per_round = {}, {}
    ms, power, clock = bench.measure_backends(
        {"fa3gen": lambda: None, "cudnn": boom, "flash": None, "fa4": lambda: None}, args, sampler,
        reasons, per_round)
    assert ms == {"fa3gen": 1.0, "fa4": 2.0} and sampler.seen == [0, 1]
    assert per_round == {"fa3gen": [1.0, 1.5], "fa4": [2.0, 2.5]}  # the backends that ran
    assert reasons == {"fa3gen": ["sw_power_cap"], "fa4": ["sw_thermal"]}
    assert calls[0] == (2.5, "rotate")  # settle: half of --min-ms unless --settle-ms says
    bench.measure_backends({"fa3gen": lambda: None}, types.SimpleNamespace(
        burst=False, rounds=1, min_ms=5.0, settle_ms=0.0, order="shuffle"), sampler)
    assert calls[-2] == (0.0, "shuffle")
    assert power == {"fa3gen": 300.0, "fa4": 301.0} and clock["fa4"] == 1980.0
    assert "cuDNN failed: no kernel for this shape" in capsys.readouterr().err
    monkeypatch.setattr(bench, "time_or_none", lambda label, fn, warmup, iters: 3.0)
    burst = types.SimpleNamespace(burst=True, warmup=1, iters=2)
    assert bench.measure_backends({"fa3gen": lambda: None}, burst) == ({"fa3gen": 3.0}, {}, {})
    steady_calls = []
    monkeypatch.setattr(bench, "steady_ms", lambda fns, run_s, idle_s, tag=None:
                        steady_calls.append((len(fns), run_s, idle_s)) or [7.0] * len(fns))
    steady = types.SimpleNamespace(burst=False, steady_s=3.0, idle_s=0.5)
    assert bench.measure_backends({"fa3gen": lambda: None, "fa4": lambda: None}, steady)[0] == \
        {"fa3gen": 7.0, "fa4": 7.0}
    assert steady_calls == [(2, 3.0, 0.5)]


def test_steady_ms_counts_each_run_from_the_settled_clock(monkeypatch):
    """timing.steady_ms: each fn alone, in order and then reversed; only the windows that end
    after from_s count; the mean of its two runs; the sampler's tag set from from_s to the run's
    end."""
    monkeypatch.setattr(timing, "batch_ms", lambda fn, n: 1.0)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    runs = []

    def fake_windows(fn, run_s, window_ms, at_s, on_time):
        runs.append(fn.__name__)
        on_time()
        # (seconds after the start, window ms, calls): a fast first window (the burst), then
        # fn.ms a call; the second run of `b` is slower
        slow = 2.0 if fn.__name__ == "b" and runs.count("b") == 2 else 1.0
        return 100.0, [(100.1, 1.0, 10), (101.5, 10.0 * fn.ms * slow, 10), (102.5, 20.0 * fn.ms * slow, 20)]

    monkeypatch.setattr(timing, "steady_windows", fake_windows)

    def a():
        pass

    def b():
        pass
    a.ms, b.ms = 2.0, 3.0
    tags = []
    assert timing.steady_ms([a, b], run_s=3.0, idle_s=0.0, tag=tags.append) == [2.0, 4.5]
    assert runs == ["a", "b", "b", "a"]
    assert tags == [0, None, 1, None, 1, None, 0, None]
    with pytest.raises(ValueError, match="must exceed"):
        timing.steady_ms([a], run_s=1.0)


def wait_for_sample(sampler, tag, timeout_s=30.0, count=1):
    """Until the sampler has `count` samples for tag: the fake nvidia-smi is a Python process
    whose start-up took more than a fixed sleep on a loaded CI machine."""
    import time

    deadline = time.monotonic() + timeout_s
    while len(sampler.samples.get(tag, ())) < count:
        assert time.monotonic() < deadline, f"fewer than {count} samples for tag {tag} in {timeout_s} s"
        time.sleep(0.01)


def test_power_sampler_names_the_board_by_its_uuid(monkeypatch):
    """nvidia-smi --id=<CUDA index> named another board where CUDA_VISIBLE_DEVICES or CUDA's
    fastest-first order renumber them: its power and clocks were reported as this GPU's."""
    import torch

    uuid = "ffc79498-8ff3-c2dc-3b0d-fafd804516ae"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=uuid if i == 3 else None))
    assert timing.PowerSampler(3).argv[-1] == f"--id=GPU-{uuid}"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    assert timing.PowerSampler(2).argv[-1] == "--id=2"  # no UUID to read: the index


def test_power_sampler_tags_samples_from_nvidia_smi(monkeypatch):
    import sys
    from pathlib import Path

    from fa3gen.timing import PowerSampler, joules_per_pflop

    fake = Path(__file__).parent / "fake_nvidia_smi.py"
    monkeypatch.setenv("FAKE_SMI_VALUES", "600.0, 1755")
    sampler = PowerSampler(0, period_ms=5, command=str(fake))
    assert Path(sys.executable).exists()
    with sampler:
        sampler.tag(1)
        wait_for_sample(sampler, 1)
        sampler.tag(None)
    means = sampler.means([0, 1])
    assert means[0] == (None, None) and means[1] == (600.0, 1755.0)
    assert sampler.argv[1].endswith(",clocks_event_reasons.active")  # the probe found the field
    assert sampler.reasons([0, 1]) == {0: None, 1: None}  # no reasons in these samples
    with PowerSampler(0, command="/nonexistent/nvidia-smi") as inert:
        inert.tag(0)
    assert inert.means([0]) == {0: (None, None)}
    # 600 W for 2 ms on 1e12 FLOPs: 1.2 J per 1e12 FLOPs, 1200 J per PFLOP
    assert joules_per_pflop(600.0, 2.0, 1e12) == pytest.approx(1200.0)
    assert joules_per_pflop(None, 2.0, 1e12) is None


def test_power_sampler_reports_the_clock_event_reasons(monkeypatch):
    from pathlib import Path

    from fa3gen.timing import PowerSampler, clock_reason_names

    fake = Path(__file__).parent / "fake_nvidia_smi.py"
    # a power-capped sample, then one held back by thermal slowdown and an unknown bit
    monkeypatch.setenv("FAKE_SMI_VALUES", "690.0, 1600, 0x0000000000000004;590.0, 1400, 0x0000000000010020;"
                       "500.0, 1500, [N/A]")  # unreadable reasons: the sample's power and clock count
    with PowerSampler(0, period_ms=5, command=str(fake)) as sampler:
        sampler.tag(0)
        wait_for_sample(sampler, 0, count=3)
        sampler.tag(None)
    assert sampler.reasons([0, 1]) == {0: ["0x10000", "sw_power_cap", "sw_thermal"], 1: None}
    assert (500.0, 1500.0, None) in sampler.samples[0]
    assert clock_reason_names(0) == [] and clock_reason_names(0x41) == ["idle", "hw_thermal"]
    monkeypatch.setenv("FAKE_SMI_NO_REASONS", "1")  # an nvidia-smi without the field: power and clock only
    monkeypatch.setenv("FAKE_SMI_VALUES", "600.0, 1755")
    with PowerSampler(0, period_ms=5, command=str(fake)) as plain:
        plain.tag(0)
        wait_for_sample(plain, 0)
        plain.tag(None)
    assert plain.argv[1] == PowerSampler.QUERY and plain.reasons([0]) == {0: None}
    assert plain.means([0])[0] == (600.0, 1755.0)


def test_markdown_has_the_fa4_column_best_peer_and_energy():
    from fa3gen import bench

    shape = {"batch": 4, "seqlen": 4096, "heads": 16, "head_dim": 128}
    row = bench.make_row("fwd", "bf16", shape, False, "v", {"fa3gen": 1.0, "cudnn": 1.1,
                                                          "fa4": 0.9},
                         power={"fa3gen": 650.0, "fa4": 690.0})
    assert row["j_per_pflop"]["fa3gen"] == pytest.approx(650.0 * 1e-3 / (row["flops"] / 1e15))
    assert bench.best_peer(row)[0] == "fa4"
    text = bench.render_markdown({"header": {"timing": "sustained: test"}, "rows": [row]})
    assert "| head_dim | seqlen | fa3gen | cuDNN | FA2 | FA4 | fa3gen / best peer |" in text
    assert "Clock-event reasons" not in text  # none sampled
    capped = bench.make_row("fwd", "bf16", shape, False, "v", {"fa3gen": 1.0},
                            reasons={"fa3gen": ["sw_power_cap"], "fa4": ["hw_slowdown"]})
    assert capped["clock_reasons"]["fa3gen"] == ["sw_power_cap"] and capped["clock_reasons"]["cudnn"] is None
    with_reasons = bench.render_markdown({"header": {}, "rows": [row, capped]})
    assert "- Clock-event reasons while fa3gen ran, over 1 rows: sw_power_cap in 1 " in with_reasons
    line = next(x for x in text.splitlines() if x.startswith("| 128 | 4096 |"))
    assert "| 0.90 (FA4) |" in line and "| 650 |" in line
    assert "Timing: sustained: test." in text


def test_provenance_names_the_command_that_ran(monkeypatch, tmp_path):
    """Reports say how to reproduce them: the CLI as `fa3gen ...`, a GPU script under tests/gpu
    as `python3 script ...`, with date, commit (FA3GEN_COMMIT wins) and the library's build."""
    import sys
    import types

    from fa3gen import bench

    torch = pytest.importorskip("torch")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setenv("FA3GEN_COMMIT", "abc1234")
    lib = types.SimpleNamespace(path=tmp_path / "libfa3gen_x.so", build_info={"spec": "x"})
    monkeypatch.setattr(sys, "argv", ["/site/fa3gen/cli.py", "bench", "--spec", "h100"])
    head = bench.provenance(lib)
    assert head["command"] == "fa3gen bench --spec h100"
    assert (head["gpu"], head["commit"], head["build_info"]) == ("fake GPU", "abc1234", {"spec": "x"})
    monkeypatch.setattr(sys, "argv", ["tests/gpu/bench_features.py", "--kinds", "softcap"])
    assert bench.provenance(lib)["command"] == "python3 tests/gpu/bench_features.py --kinds softcap"
    assert head["library_commit"] is None  # no manifest beside or above the library
    (tmp_path / "manifest.json").write_text('{"source_commit": "def5678"}')
    assert bench.provenance(lib)["library_commit"] == "def5678"


def test_library_commit_reads_the_manifest_beside_or_above_the_library(tmp_path):
    """A copied build keeps manifest.json beside the library; generated/<spec>/ has it one
    folder up from lib/. The one beside wins when it reads (one that predates the field gives
    None); a damaged one is passed over; none gives None."""
    from fa3gen import bench

    lib = tmp_path / "gen" / "lib" / "libfa3gen_x.so"
    lib.parent.mkdir(parents=True)
    assert bench.library_commit(lib) is None
    (tmp_path / "gen" / "manifest.json").write_text('{"source_commit": "up1234"}')
    assert bench.library_commit(lib) == "up1234"
    (lib.parent / "manifest.json").write_text('{"source_commit": "beside5"}')
    assert bench.library_commit(lib) == "beside5"
    (lib.parent / "manifest.json").write_text('{"spec": "x"}')
    assert bench.library_commit(lib) is None
    (lib.parent / "manifest.json").write_text("{not json")
    assert bench.library_commit(lib) == "up1234"
    # one that names another library (a copy beside another build's manifest) is passed over
    (lib.parent / "manifest.json").write_text('{"library": "lib/libfa3gen_y.so", '
                                              '"source_commit": "other9"}')
    assert bench.library_commit(lib) == "up1234"
    (lib.parent / "manifest.json").write_text('{"library": "lib/libfa3gen_x.so", '
                                              '"source_commit": "mine77"}')
    assert bench.library_commit(lib) == "mine77"


def _fake_batches(monkeypatch):
    """timing.batch_ms replaced by a log of (fn name, launches) that takes no time: each fn's
    launch costs its `ms` attribute. Untimed settle launches log as calls of the fn itself."""
    log = []

    def batch_ms(fn, launches):
        log.append(("timed", fn.__name__, launches))
        return fn.ms

    monkeypatch.setattr(timing, "batch_ms", batch_ms)

    def make(name, ms):
        def fn():
            log.append(("settle", name))
        fn.__name__, fn.ms = name, ms
        return fn
    return log, make


def test_sustained_rotates_and_sizes_each_batch_by_its_own_fn(monkeypatch):
    log, make = _fake_batches(monkeypatch)
    fast, slow = make("fast", 0.5), make("slow", 4.0)
    assert timing.sustained_ms([fast, slow], rounds=3, min_ms=20.0, settle_ms=0) == [0.5, 4.0]
    assert log[:4] == [("timed", "fast", 3), ("timed", "slow", 3), ("timed", "fast", 5), ("timed", "slow", 5)]
    # then 20 ms batches: 40 launches of the fast one, 5 of the slow one, order rotated a round
    assert log[4:] == [("timed", "fast", 40), ("timed", "slow", 5), ("timed", "slow", 5),
                       ("timed", "fast", 40), ("timed", "fast", 40), ("timed", "slow", 5)]
    assert not [e for e in log if e[0] == "settle"]  # settle_ms=0: none
    rounds = []
    timing.sustained_ms([fast, slow], rounds=2, min_ms=20.0, settle_ms=0, per_round=rounds)
    assert rounds == [[0.5, 0.5], [4.0, 4.0]]  # each fn's batch of every round
    log.clear()
    timing.sustained_ms([slow], rounds=1, min_ms=20.0)  # by default half of min_ms
    assert log[2:] == [("settle", "slow")] * 2 + [("timed", "slow", 5)]


def test_sustained_settles_each_fn_before_its_batch_and_can_shuffle(monkeypatch):
    log, make = _fake_batches(monkeypatch)
    fns = [make(f"f{i}", 1.0) for i in range(5)]
    tags = []
    timing.sustained_ms(fns, rounds=4, min_ms=10.0, settle_ms=6.0, order="shuffle", tag=tags.append)
    body = log[10:]  # after each fn's warm-up and sizing batches
    rounds = [body[r * 35:(r + 1) * 35] for r in range(4)]  # 5 fns x (6 settle + 1 timed)
    orders = []
    for chunk in rounds:
        order = [e[1] for e in chunk if e[0] == "timed"]
        assert sorted(order) == [f"f{i}" for i in range(5)]  # each fn once a round
        for j, name in enumerate(order):  # its own six settle launches right before it
            assert chunk[7 * j:7 * j + 7] == [("settle", name)] * 6 + [("timed", name, 10)]
        orders.append(order)
    assert len({tuple(o) for o in orders}) > 1  # not one fixed order
    assert tags[1::2] == [None] * 20 and sorted(tags[0::2]) == sorted(list(range(5)) * 4)
    with pytest.raises(ValueError, match="rotate"):
        timing.sustained_ms(fns, 1, 1.0, order="random")


def _rows_rescaling(problem, tile_n: int, head_dim: int = 128) -> float:
    """The fraction of the problem's query rows whose running maximum grows by more than the
    forward's rescale threshold when a later key block is visited (last block first, as the
    kernels do), for seeded randn inputs at the problem's softmax scale."""
    import math
    import re

    import torch

    from generator.paths import KERNELS_DIR

    header = (KERNELS_DIR / "rescale_threshold.cuh").read_text()
    threshold = float(re.search(r"#define FA3GEN_RESCALE_THRESHOLD ([0-9.]+)f", header).group(1))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(problem.batch, problem.heads_q, problem.seqlen_q, head_dim, generator=g)
    k = torch.randn(problem.batch, problem.heads_q, problem.seqlen_k, head_dim, generator=g)
    scores_log2 = q @ k.transpose(-1, -2) * problem.scale(head_dim) * math.log2(math.e)
    blocks = scores_log2.split(tile_n, dim=-1)
    running = blocks[-1].amax(-1)
    rescaled = torch.zeros_like(running, dtype=torch.bool)
    for block in reversed(blocks[:-1]):
        block_max = block.amax(-1)
        rescaled |= block_max - running > threshold
        running = torch.maximum(running, block_max)
    return rescaled.float().mean().item()


def test_the_large_score_problem_makes_rows_rescale():
    """At the checks' usual scale no row ever takes the 16-bit forward's rescale path; the
    large-score problem makes a share of rows take it at every tile width the specs use."""
    pytest.importorskip("torch")
    for tile_n in (64, 128, 176):
        assert _rows_rescaling(checks.QUICK_PROBLEM, tile_n) == 0.0
        assert _rows_rescaling(checks.QUICK_LARGE_SCORES, tile_n) > 0.02
