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


@pytest.mark.parametrize("command", [["bench"], ["ablate"], ["tune", "--spec", "h100"], ["numerics"]])
def test_a_command_that_needs_torch_says_so_when_it_cannot_import_it(command, monkeypatch, capsys):
    """torch is imported when a GPU command runs: without it one line and exit 2, no traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ModuleNotFoundError
    assert cli.main(command) == 2
    command = command[0]
    err = capsys.readouterr().err
    assert err.startswith(f"fa3gen: error: `fa3gen {command}` needs torch") and "Traceback" not in err
