"""`fa3gen build` / `list` command-line behaviour: job counts, version, order, pipes."""
import subprocess
import sys

import pytest

from fa3gen import cli
from generator.paths import REPO_ROOT


@pytest.mark.parametrize("value, message", [("0", "must be at least 1, got 0"),
                                            ("-3", "must be at least 1, got -3"),
                                            ("abc", "expected a whole number of at least 1, got 'abc'")])
def test_jobs_below_one_is_a_usage_error(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["build", "--spec", "specs/tiny.yaml", "-j", value])
    assert e.value.code == 2
    assert f"argument -j/--jobs: {message}" in capsys.readouterr().err


def test_unit_size_reaches_the_build_and_below_one_is_a_usage_error(capsys, monkeypatch):
    got = {}
    monkeypatch.setattr("generator.build.build", lambda *a, **kw: got.update(kw))
    assert cli.main(["build", "--spec", "specs/tiny.yaml", "--unit-size", "3"]) == 0
    assert got["units"] == 3
    assert cli.main(["build", "--spec", "specs/tiny.yaml"]) == 0
    assert got["units"] is None  # the build's default: FA3GEN_UNIT_SIZE, else 16
    with pytest.raises(SystemExit) as e:
        cli.main(["build", "--spec", "specs/tiny.yaml", "--unit-size", "0"])
    assert e.value.code == 2 and "argument --unit-size: must be at least 1" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    from fa3gen import __version__
    assert capsys.readouterr().out.startswith(f"fa3gen {__version__} (C ABI ")


def test_list_orders_head_dims_by_value(capsys):
    assert cli.main(["list", "--spec", "h100", "--only", "fwd_bf16_*_nocausal_*"]) == 0
    dims = [int(line.split("_d")[1].split("_")[0]) for line in capsys.readouterr().out.splitlines()]
    assert dims == sorted(dims) and dims[0] == 64


def test_list_into_a_closed_pipe_is_quiet():
    proc = subprocess.run(f"{sys.executable} -m fa3gen.cli list --spec h100 | head -1", shell=True,
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and proc.stdout.startswith("*")


@pytest.mark.parametrize("command", ["bench", "ablate"])
@pytest.mark.parametrize("option, value, minimum", [("--iters", "0", 1), ("--warmup", "-1", 0),
                                                    ("--iters", "x", 1)])
def test_bench_counts_are_checked(command, option, value, minimum, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, option, value])
    assert e.value.code == 2
    assert f"expected a whole number of at least {minimum}, got '{value}'" in capsys.readouterr().err


def test_a_build_whose_output_reader_left_is_not_a_success(monkeypatch, capsys):
    """A broken pipe is success only for `list` (its reader has what it wanted): a build that
    could not finish says so and exits 1."""
    def leaves(*a, **kw):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr("generator.build.build", leaves)
    assert cli.main(["build", "--spec", "specs/tiny.yaml"]) == 1
    assert "stdout was closed before the command finished" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["build", "spec"])
def test_a_reader_that_leaves_stops_the_output_not_the_command(command, tmp_path, monkeypatch,
                                                               capsys):
    """`fa3gen build ... | head -1` with stdout unbuffered (PYTHONUNBUFFERED, CI): a print before
    ninja starts (a note, the spec's header) broke the build, and `spec` and `package` said
    "it did not complete" after their files were written. Now the output stops and the command
    goes on (`list` still stops: its output is what the reader wanted)."""
    import io

    class LeftReader(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    done = []

    def build(*a, **kw):  # prints first, as the real build's notes and header do
        print("spec tiny: 3 variants")
        done.append(True)

    monkeypatch.setattr("generator.build.build", build)
    monkeypatch.setattr("fa3gen.cli.stdout_to_devnull", lambda: None)
    monkeypatch.setattr("fa3gen.files.stdout_to_devnull", lambda: None)
    monkeypatch.setattr(sys, "stdout", LeftReader())
    if command == "build":
        assert cli.main(["build", "--spec", "specs/tiny.yaml"]) == 0 and done
    else:
        import yaml

        from fa3gen import tracing
        trace = tmp_path / "trace.yaml"
        calls = [{"variant": "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1", "default": True,
                  "calls": 1}]
        trace.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": calls}))
        out = tmp_path / "out.yaml"
        assert cli.main(["spec", "--from-trace", str(trace), "-o", str(out)]) == 0
        assert out.is_file() and "error" not in capsys.readouterr().err
    assert isinstance(sys.stdout, LeftReader)  # put back
    monkeypatch.setattr(sys, "stdout", LeftReader())
    assert cli.main(["list", "--spec", "specs/tiny.yaml"]) == 0


@pytest.mark.parametrize("argv, env", [(["-j", "5000", "--dry-run"], {}),
                                       (["--dry-run"], {"FA3GEN_UNIT_SIZE": "0"}),
                                       (["--dry-run"], {"FA3GEN_UNIT_SIZE": "abc"})])
def test_bad_build_options_exit_2_not_as_a_failed_build(argv, env, monkeypatch, capsys):
    """Exit 1 means the build failed; a bad option or setting is a usage error, 2."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["build", "--spec", "specs/tiny.yaml", *argv]) == 2
    assert capsys.readouterr().err.startswith("fa3gen: error: ")


@pytest.mark.parametrize("command", [["bench"], ["ablate"], ["tune", "--spec", "h100"], ["numerics"],
                                     ["tune", "--spec", "h100", "--window", "512,0"]])
def test_a_command_that_needs_torch_says_so_when_it_cannot_import_it(command, monkeypatch, capsys):
    """torch is imported when a GPU command runs: without it one line and exit 2, no traceback
    (tune's --window, checked by fa3gen.ops at parsing, was a traceback)."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "fa3gen.ops", raising=False)  # imported as it would be here
    assert cli.main(command) == 2
    command = command[0]
    err = capsys.readouterr().err
    assert err.startswith(f"fa3gen: error: `fa3gen {command}` needs torch") and "Traceback" not in err


# ---- `fa3gen bench` through cli.main with the GPU parts faked ---------------------------------


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """bench with CUDA, the library and each point's measurement faked; returns the points
    measured and a dict whose "fa3gen" entry is the time each point gets (None: not timed).
    The library has the variants of head dims 64 and 128."""
    torch = pytest.importorskip("torch")
    from fa3gen import bench, runtime
    from fa3gen.errors import Fa3genError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class FakeLib:
        path, build_info = tmp_path / "libfa3gen_fake.so", {}

        def find(self, direction, dtype, head_dim, causal, **kw):
            if head_dim not in (64, 128):
                raise Fa3genError(f"no variant for ({direction}, {dtype}, d{head_dim}) here")

    monkeypatch.setattr(runtime, "use_spec", lambda spec: FakeLib())
    monkeypatch.setattr(bench, "provenance", lambda lib: {"gpu": "fake", "command": "fa3gen bench"})
    monkeypatch.setattr(bench, "gemm_ceiling", lambda args: 700.0)
    measured, times = [], {"fa3gen": 1.0}

    def shape(lib, shape, causal, dtype, args, sampler=None):
        measured.append((shape["head_dim"], shape["seqlen"], causal))
        return bench.make_row("fwd", "bf16", shape, causal, "v", dict(times))

    monkeypatch.setattr(bench, "bench_fwd_shape", shape)
    monkeypatch.setattr(bench, "bench_bwd_shape", shape)
    monkeypatch.chdir(tmp_path)
    return measured, times


BENCH = ["bench", "--spec", "fake", "--no-power", "--head-dims", "64", "--seqlens", "512",
         "--direction", "fwd", "--causal", "false"]
OUTPUTS = ["--out", "b.json", "--markdown", "b.md", "--plot", "b.png"]


def test_bench_writes_its_outputs(fake_bench, tmp_path, capsys):
    assert cli.main(BENCH + OUTPUTS) == 0
    assert fake_bench[0] == [(64, 512, False)]
    assert all((tmp_path / f).is_file() for f in ("b.json", "b.md", "b.png"))
    assert "wrote b.json, b.md, b.png" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ({"--out": "adir"}, "--out 'adir' is a folder: give a file path"),
    ({"--markdown": "afile/b.md"}, "--markdown afile/b.md: afile is a file, not a folder"),
    ({"--markdown": "marked.md"}, "marked.md: expected one <!-- bench:begin --> before one"),
    ({"--plot": "b.pngg"}, "--plot b.pngg: not a file name of an image format matplotlib writes"),
    ({"--plot": "b"}, "--plot b: not a file name of an image format"),  # it would write b.png
])
def test_bench_outputs_are_checked_before_the_grid(fake_bench, tmp_path, capsys, change, message):
    """A folder --out failed after the whole grid naming a temporary file, and a --plot
    matplotlib does not write was a traceback after the JSON was written."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "marked.md").write_text("<!-- bench:end -->\n")
    argv = OUTPUTS.copy()
    for option, value in change.items():
        argv[argv.index(option) + 1] = value
    assert cli.main(BENCH + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fa3gen: error: ") and message in err and err.count("\n") == 1
    assert fake_bench[0] == [] and not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("option", ["--out", "--markdown", "--plot"])
def test_an_empty_bench_output_is_a_usage_error(fake_bench, capsys, option):
    """--out '' was Path('.'): a ValueError traceback after the grid."""
    argv = OUTPUTS.copy()
    argv[argv.index(option) + 1] = ""
    with pytest.raises(SystemExit) as e:
        cli.main(BENCH + argv)
    assert e.value.code == 2 and f"argument {option}: {option} is empty" in capsys.readouterr().err
    assert fake_bench[0] == []


@pytest.mark.parametrize("command", ["bench", "ablate"])
def test_without_matplotlib_the_plot_is_skipped_with_a_note(command, fake_bench, tmp_path, monkeypatch, capsys):
    """matplotlib comes with the [test] extra only: without it a full run ended in a traceback
    and ablate never updated its doc."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    if command == "bench":
        assert cli.main(BENCH + OUTPUTS) == 0
        written, plot = ("b.json", "b.md"), "b.png"
    else:
        from fa3gen import ablate as A
        monkeypatch.setattr(A, "check_cell", lambda lib, c: {"status": "ok", "max_err": 0.0, "detail": None})
        monkeypatch.setattr(A, "make_timer", lambda *a: lambda c, s: 4.0)
        monkeypatch.setattr(A, "provenance", lambda lib: {"gpu": "fake"})
        assert cli.main(["ablate", "--no-build", "--no-power", "--only", "*fp16*nocausal*m128n128_s2*",
                         "--out-dir", "out", "--doc", "A.md"]) == 0
        written, plot = ("out/ablation.json", "out/ablation.csv", "A.md"), "out/ablation.png"
    out, err = capsys.readouterr()
    assert all((tmp_path / f).is_file() for f in written) and not (tmp_path / plot).exists()
    notes = [line for line in err.splitlines() if "matplotlib" in line]
    assert notes == [f"fa3gen: note: no plot written ({plot}): matplotlib cannot be imported "
                     "(import of matplotlib halted; None in sys.modules); pip install matplotlib "
                     "to draw it"] and "Traceback" not in err
    assert "png" not in out.splitlines()[-1]  # the closing line names what was written


def test_bench_with_no_fa3gen_variant_for_any_point_measures_nothing(fake_bench, tmp_path, capsys):
    """A library that has none of the asked points' variants: every fa3gen cell was empty, the
    report overwritten, exit 0."""
    assert cli.main(BENCH + OUTPUTS[:-2] + ["--plot", "b.png", "--head-dims", "96,256"]) == 2
    err = capsys.readouterr().err
    assert "has no fa3gen variant for any point asked for" in err and err.count("\n") == 1
    assert fake_bench[0] == [] and not (tmp_path / "b.json").exists()


def test_bench_that_timed_no_fa3gen_point_keeps_the_old_report(fake_bench, tmp_path, capsys):
    """Variants there, but every fa3gen call failed (no time): exit 1 and the report and the
    markdown of the last run stay."""
    (tmp_path / "b.json").write_text("old report")
    (tmp_path / "b.md").write_text("old markdown")
    fake_bench[1]["fa3gen"] = None
    assert cli.main(BENCH + OUTPUTS) == 1
    err = capsys.readouterr().err
    assert "fa3gen: error: fa3gen measured no point" in err and err.count("\n") == 1
    assert fake_bench[0] == [(64, 512, False)]
    assert (tmp_path / "b.json").read_text() == "old report" and (tmp_path / "b.md").read_text() == "old markdown"
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--burst", "--rounds", "5"], "--rounds is for the sustained timing, which --burst replaces"),
    (["--burst", "--min-ms", "50"], "--min-ms is for the sustained timing"),
    (["--burst", "--settle-ms", "0"], "--settle-ms is for the sustained timing"),
    (["--burst", "--order", "shuffle"], "--order is for the sustained timing"),
    (["--idle-s", "2"], "--idle-s is for --steady-s, which this run does not use"),
    (["--burst", "--idle-s", "2"], "--idle-s is for --steady-s"),
    (["--warmup", "2"], "--warmup is for --burst's timing, which this run does not use"),
    (["--steady-s", "3", "--iters", "9"], "--iters is for --burst's timing"),
    (["--steady-s", "3", "--rounds", "2"], "--rounds is for the sustained timing, which --steady-s replaces"),
])
def test_bench_refuses_timing_options_its_timing_ignores(fake_bench, capsys, argv, message):
    assert cli.main(BENCH + OUTPUTS + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fa3gen: error: ") and message in err and fake_bench[0] == []


@pytest.mark.parametrize("argv", [["--burst", "--warmup", "2", "--iters", "9"],
                                  ["--steady-s", "3", "--idle-s", "0"],
                                  ["--steady-s", "3", "--rounds", "2", "--all-variants"],
                                  ["--rounds", "2", "--min-ms", "5", "--settle-ms", "1", "--order", "shuffle"]])
def test_bench_takes_the_timing_options_its_timing_uses(fake_bench, argv):
    assert cli.main(BENCH + OUTPUTS + argv) == 0 and fake_bench[0] == [(64, 512, False)]
