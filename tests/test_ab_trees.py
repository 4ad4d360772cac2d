"""tests/gpu/ab_trees.py without a GPU: `export` copies a commit's build inputs (and names the
commit), `run`'s two builds go to their own generated roots from their own trees."""
import importlib.util
import subprocess

import pytest

from generator.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("ab_trees", REPO_ROOT / "tests/gpu/ab_trees.py")
ab_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_trees)


def _head() -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="needs the git checkout")
def test_export_copies_the_commits_build_inputs(tmp_path):
    dest = tmp_path / "ab_base"
    (dest / "stale").mkdir(parents=True)  # an earlier export is replaced, not merged
    commit = ab_trees.export("HEAD", dest)
    assert commit == _head() and (dest / "AB_BASE_COMMIT").read_text().strip() == commit
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [*ab_trees.BUILD_INPUTS, "AB_BASE_COMMIT"])
    committed = subprocess.run(["git", "-C", str(REPO_ROOT), "show", "HEAD:templates/kernels/fwd_mainloop.cuh"],
                               check=True, capture_output=True, text=True).stdout
    assert (dest / "templates/kernels/fwd_mainloop.cuh").read_text() == committed
    with pytest.raises(subprocess.CalledProcessError):
        ab_trees.export("no-such-rev-anywhere", dest)


def test_run_builds_each_tree_into_its_own_root(tmp_path):
    base = tmp_path / "ab_base"
    (a_cwd, a_env, a_argv), (b_cwd, b_env, b_argv) = ab_trees.build_commands(
        "h100", ["fwd_bf16_d128_*", "bwd_*"], 16, tmp_path / "work", base)
    assert (a_cwd, b_cwd) == (base, ab_trees.ROOT)
    assert a_env == {"FA3GEN_GENERATED": str(tmp_path / "work/A"), "PYTHONPATH": str(base)}
    assert b_env["FA3GEN_GENERATED"] == str(tmp_path / "work/B")
    assert a_argv[1:] == b_argv[1:] == ["build.py", "--spec", "h100", "-j", "8",
                                        "--only", "fwd_bf16_d128_*", "--only", "bwd_*"]
    assert ab_trees.library(tmp_path, "A", "specs/peel.yaml") == \
        tmp_path / "A/peel/lib/libfa3gen_peel.so"


def test_run_without_an_export_says_how_to_make_one(monkeypatch, tmp_path):
    monkeypatch.setattr(ab_trees, "BASE_DIR", tmp_path / "ab_base")
    args = type("Args", (), {"spec": "h100", "only": ["x"], "jobs": 2, "work": str(tmp_path)})
    with pytest.raises(SystemExit, match="export REV"):
        ab_trees.run(args, [])


def test_run_times_the_two_libraries_with_the_base_commit(monkeypatch, tmp_path):
    base = tmp_path / "ab_base"
    base.mkdir()
    (base / "AB_BASE_COMMIT").write_text("abc123\n")
    monkeypatch.setattr(ab_trees, "BASE_DIR", base)
    started, ran = [], []

    class Build:
        def __init__(self, argv, cwd, env, stdout, stderr):
            started.append((cwd, env["FA3GEN_GENERATED"]))

        def wait(self):
            return 0

    monkeypatch.setattr(ab_trees.subprocess, "Popen", Build)
    monkeypatch.setattr(ab_trees.subprocess, "run",
                        lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    args = type("Args", (), {"spec": "h100", "only": ["fwd_*"], "jobs": 4,
                             "work": str(tmp_path / "w")})
    assert ab_trees.run(args, ["--seqlens", "1024"]) == 0
    assert started == [(base, str(tmp_path / "w/A")), (ab_trees.ROOT, str(tmp_path / "w/B"))]
    (cmd,) = ran
    assert cmd[1].endswith("tests/gpu/ab_libraries.py")
    assert cmd[2:] == [str(tmp_path / "w/A/h100/lib/libfa3gen_h100.so"),
                       str(tmp_path / "w/B/h100/lib/libfa3gen_h100.so"),
                       "--commit-a", "abc123", "--seqlens", "1024"]


def test_run_quantizer_times_the_two_quantizers(monkeypatch, tmp_path):
    base = tmp_path / "ab_base"
    base.mkdir()
    (base / "AB_BASE_COMMIT").write_text("abc123\n")
    monkeypatch.setattr(ab_trees, "BASE_DIR", base)
    ran = []
    monkeypatch.setattr(ab_trees.subprocess, "Popen", lambda *a, **kw: type(
        "Build", (), {"wait": lambda self: 0})())
    monkeypatch.setattr(ab_trees.subprocess, "run", lambda cmd, env=None: ran.append((cmd, env))
                        or subprocess.CompletedProcess(cmd, 0))
    args = type("Args", (), {"spec": "h100", "only": ["fwd_e4m3_d64_nocausal*"], "jobs": 4,
                             "work": str(tmp_path / "w"), "quantizer": True})
    assert ab_trees.run(args, ["--json", "q.json"]) == 0
    ((cmd, env),) = ran
    assert cmd[1].endswith("tests/gpu/bench_fp8_quantize.py")
    assert cmd[2:] == ["--baseline-so", str(tmp_path / "w/A/h100/lib/libfa3gen_h100.so"),
                       "--json", "q.json"]
    assert env["FA3GEN_LIB"] == str(tmp_path / "w/B/h100/lib/libfa3gen_h100.so")


def test_run_a_tree_times_a_compile_time_switch(monkeypatch, tmp_path):
    """--a-tree --define X: both builds from this tree (no export needed), only B with X."""
    monkeypatch.setattr(ab_trees, "BASE_DIR", tmp_path / "no_export_here")
    started, ran = [], []

    class Build:
        def __init__(self, argv, cwd, env, stdout, stderr):
            started.append((cwd, env["FA3GEN_GENERATED"], argv[2:]))

        def wait(self):
            return 0

    monkeypatch.setattr(ab_trees.subprocess, "Popen", Build)
    monkeypatch.setattr(ab_trees.subprocess, "run",
                        lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    args = type("Args", (), {"spec": "h100", "only": ["fwd_e4m3_*"], "jobs": 4, "a_tree": True,
                             "define": ["FA3GEN_FP8_SKIP_TRANSPOSE"], "work": str(tmp_path / "w")})
    assert ab_trees.run(args, []) == 0
    common = ["--spec", "h100", "-j", "2", "--only", "fwd_e4m3_*"]
    assert started == [(ab_trees.ROOT, str(tmp_path / "w/A"), common),
                       (ab_trees.ROOT, str(tmp_path / "w/B"),
                        [*common, "--define", "FA3GEN_FP8_SKIP_TRANSPOSE"])]
    (cmd,) = ran
    assert cmd[cmd.index("--commit-a") + 1] == "this tree without FA3GEN_FP8_SKIP_TRANSPOSE"
    args.define = []
    with pytest.raises(SystemExit, match="--define"):
        ab_trees.run(args, [])


def test_run_b_defines_times_several_switches_against_one_a(monkeypatch, tmp_path):
    """--a-tree --b-defines SET (repeatable): one A build and one B build per set, the jobs
    split among them, then ab_libraries.py for A against each B, each with its own JSON."""
    monkeypatch.setattr(ab_trees, "BASE_DIR", tmp_path / "no_export_here")
    started, ran = [], []

    class Build:
        def __init__(self, argv, cwd, env, stdout, stderr):
            started.append((env["FA3GEN_GENERATED"], argv[2:]))

        def wait(self):
            return 0

    monkeypatch.setattr(ab_trees.subprocess, "Popen", Build)
    monkeypatch.setattr(ab_trees.subprocess, "run",
                        lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    work = tmp_path / "w"
    args = type("Args", (), {"spec": "h100", "only": ["bwd_*"], "jobs": 16, "a_tree": True,
                             "define": [], "b_defines": ["X=2", "X=2  Y"], "work": str(work)})
    assert ab_trees.run(args, ["--rounds", "3", "--json", str(tmp_path / "ab.json")]) == 0
    common = ["--spec", "h100", "-j", "5", "--only", "bwd_*"]
    assert started == [(str(work / "A"), common),
                       (str(work / "B1"), [*common, "--define", "X=2"]),
                       (str(work / "B2"), [*common, "--define", "X=2", "--define", "Y"])]
    assert [cmd[2:4] for cmd in ran] == [
        [str(work / "A/h100/lib/libfa3gen_h100.so"), str(work / f"{side}/h100/lib/libfa3gen_h100.so")]
        for side in ("B1", "B2")]
    assert [cmd[cmd.index("--json") + 1] for cmd in ran] == [
        str(tmp_path / "ab_B1.json"), str(tmp_path / "ab_B2.json")]
    assert all(cmd[cmd.index("--commit-a") + 1] == "this tree without X=2 Y" for cmd in ran)
    args.define = ["Z"]  # --b-defines replaces --define
    with pytest.raises(SystemExit, match="--b-defines"):
        ab_trees.run(args, [])
    args.define, args.ncu = [], "bwd_x"  # ncu compares A with one B
    with pytest.raises(SystemExit, match="one set"):
        ab_trees.run(args, [])


def test_run_ncu_profiles_one_variant_from_each_side(monkeypatch, tmp_path):
    """--ncu VARIANT: each library's launch of the variant under ncu (its head dim, causality
    and dtype from the name), the source pages as CSV, then ncu_phases.py on both."""
    base = tmp_path / "ab_base"
    base.mkdir()
    (base / "AB_BASE_COMMIT").write_text("abc123\n")
    monkeypatch.setattr(ab_trees, "BASE_DIR", base)
    monkeypatch.setattr(ab_trees.subprocess, "Popen", lambda *a, **kw: type(
        "Build", (), {"wait": lambda self: 0})())
    ran = []
    monkeypatch.setattr(ab_trees.subprocess, "run", lambda cmd, env=None, stdout=None: ran.append(
        (cmd, (env or {}).get("FA3GEN_LIB"), stdout)) or subprocess.CompletedProcess(cmd, 0))
    variant = "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1"
    work = tmp_path / "w"
    args = type("Args", (), {"spec": "h100", "only": [variant], "jobs": 4, "work": str(work),
                             "ncu": variant, "ncu_seqlen": 4096})
    assert ab_trees.run(args, ["--json", "p.json"]) == 0
    (prof_a, lib_a, _), (page_a, _, out_a), (prof_b, lib_b, _), (page_b, _, _), (phases, _, _) = ran
    assert (lib_a, lib_b) == (str(work / "A/h100/lib/libfa3gen_h100.so"),
                              str(work / "B/h100/lib/libfa3gen_h100.so"))
    assert prof_a[0] == "ncu" and prof_a[-6:] == ["fa3gen", "128", "1", "4096", "bf16", variant]
    assert prof_a[-7].endswith("tests/gpu/ncu_one_forward.py")
    assert prof_a[prof_a.index("-o") + 1] == str(work / "ncu_A")
    assert page_a[:3] == ["ncu", "-i", f"{work / 'ncu_A'}.ncu-rep"] and out_a.name == str(work / "ncu_A.csv")
    assert phases[1].endswith("tests/gpu/ncu_phases.py")
    assert phases[2:] == [str(work / "ncu_A.csv"), str(work / "ncu_B.csv"), "--json", "p.json"]


def test_run_says_which_variant_failed_and_can_allow_spills(monkeypatch, tmp_path):
    """A build that fails names the variant and the reason in the A/B's own output (a switch
    that makes one variant spill used to cost a whole device call to find out), and
    --allow-spills reaches both builds."""
    monkeypatch.setattr(ab_trees, "BASE_DIR", tmp_path / "no_export_here")
    started = []
    spilled = ("fa3gen: variant fwd_bf16_d256_nocausal_m128n80_s2_ws1_pp0_ov1 failed the resource "
               "check: _ZN6fa3gen10fwd_kernel: 4 bytes spill stores, 4 bytes spill loads")

    class Build:
        def __init__(self, argv, cwd, env, stdout, stderr):
            started.append(argv[2:])
            self.side = env["FA3GEN_GENERATED"][-1]
            stdout.write("[1/3] NVCC fwd_bf16_d128_x\n" + (spilled + "\n" if self.side == "B" else ""))

        def wait(self):
            return 1 if self.side == "B" else 0

    monkeypatch.setattr(ab_trees.subprocess, "Popen", Build)
    args = type("Args", (), {"spec": "h100", "only": ["fwd_*"], "jobs": 4, "a_tree": True,
                             "define": ["FA3GEN_X"], "work": str(tmp_path / "w")})
    with pytest.raises(SystemExit) as failed:
        ab_trees.run(args, [])
    message = str(failed.value)
    assert "build_B.log" in message and spilled in message and "build_A.log" not in message
    assert "--allow-spills" in message
    assert all("--allow-spills" not in argv for argv in started)
    started.clear()
    args.allow_spills = True
    with pytest.raises(SystemExit):
        ab_trees.run(args, [])
    assert all(argv[4] == "--allow-spills" for argv in started) and len(started) == 2
    assert ab_trees.build_failures("ok\nFAILED: [code=1] obj/a.o\nx.cu(3): error: no\n") == [
        "FAILED: [code=1] obj/a.o", "x.cu(3): error: no"]


def test_time_only_reaches_ab_libraries_as_only(monkeypatch):
    """run's --only picks what both sides build; --time-only what ab_libraries.py times."""
    seen = []
    monkeypatch.setattr(ab_trees, "run", lambda args, ab_args: seen.append((args.only, ab_args)) or 0)
    monkeypatch.setattr(ab_trees.sys, "argv", ["ab_trees.py", "run", "--only", "bwd_x*", "--only",
                                               "fwd_y", "--time-only", "bwd_*", "--all-variants"])
    assert ab_trees.main() == 0
    assert seen == [(["bwd_x*", "fwd_y"], ["--all-variants", "--only", "bwd_*"])]


def test_check_drops_a_b_whose_tests_fail_before_timing(monkeypatch, tmp_path):
    """--check 'PYTEST ARGS': pytest against each B library first; a B that fails is not
    timed (its kernels could fault and take the A/B's process with them). --build-only then
    times nothing."""
    monkeypatch.setattr(ab_trees, "BASE_DIR", tmp_path / "no_export_here")
    ran = []

    class Build:
        def __init__(self, argv, cwd, env, stdout, stderr):
            pass

        def wait(self):
            return 0

    def fake_run(cmd, env=None, cwd=None):
        ran.append((cmd, env))
        failing = "pytest" in cmd and env["FA3GEN_LIB"].startswith(str(tmp_path / "w/B1/"))
        return subprocess.CompletedProcess(cmd, int(failing))

    monkeypatch.setattr(ab_trees.subprocess, "Popen", Build)
    monkeypatch.setattr(ab_trees.subprocess, "run", fake_run)
    args = type("Args", (), {"spec": "h100", "only": ["bwd_*"], "jobs": 16, "a_tree": True,
                             "define": [], "b_defines": ["X=1", "X=2"], "work": str(tmp_path / "w"),
                             "check": "tests/gpu/test_backward.py -k 'a or b'"})
    assert ab_trees.run(args, []) == 0
    checks = [cmd for cmd, _ in ran if "pytest" in cmd]
    assert len(checks) == 2 and checks[0][-3:] == ["tests/gpu/test_backward.py", "-k", "a or b"]
    timed = [cmd for cmd, _ in ran if "pytest" not in cmd]
    assert [cmd[3] for cmd in timed] == [str(tmp_path / "w/B2/h100/lib/libfa3gen_h100.so")]
    ran.clear()
    args.build_only = True
    assert ab_trees.run(args, []) == 0
    assert all("pytest" in cmd for cmd, _ in ran)
