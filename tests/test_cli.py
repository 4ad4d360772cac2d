"""The `fa3gen` command line (fa3gen/cli.py)."""
import subprocess
import sys
from pathlib import Path

import fnmatch

import pytest

from fa3gen import cli
from generator import variants as V
from generator.build import plan
from generator.paths import REPO_ROOT, SPECS_DIR
from generator.spec import load_spec
from generator.variants import enumerate_variants, resolve_dispatch


def run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def h100():
    """(enumeration, default names) of specs/h100.yaml: expectations follow the spec."""
    spec = load_spec(SPECS_DIR / "h100.yaml")
    en = enumerate_variants(spec)
    return en, {v.name for v in resolve_dispatch(spec, en.kept).values()}


def test_list_marks_defaults(capsys):
    rc, out, _ = run(["list", "--spec", str(SPECS_DIR / "h100.yaml")], capsys)
    assert rc == 0
    en, defaults = h100()
    ranges = {name: f"{lo}-{hi}" for *_, lo, hi, name in plan("h100").seqlen_dispatch()}
    assert ranges and not set(ranges) & defaults  # h100 has a seqlen_k range default

    def line(v):
        if v.name in defaults:
            return f"* {v.name}"
        return f"+ {v.name}  (seqlen_k {ranges[v.name]})" if v.name in ranges else f"  {v.name}"
    assert out.splitlines() == [line(v) for v in sorted(en.kept)]  # field order: d64 before d128
    assert defaults and len(defaults) + len(ranges) < len(en.kept)   # all three marks exercised


def test_list_names_the_kernels_beside_the_variants(capsys):
    """stdout stays one variant per line; the decode kernels and the quantizer go to stderr."""
    rc, out, err = run(["list", "--spec", "h100", "--only", "fwd_e4m3_*"], capsys)
    assert rc == 0 and all(line[2:].startswith("fwd_e4m3_") for line in out.splitlines())
    assert "KV-cache decode kernels" in err and "fp8 quantizer" in err
    rc, out, err = run(["list", "--spec", "h100", "--only", "fwd_bf16_*"], capsys)
    assert "decode kernels" in err and "quantizer" not in err


def test_list_by_bare_name_and_explain(capsys):
    rc, out, err = run(["list", "--spec", "h100", "--explain"], capsys)
    assert rc == 0
    en, _ = h100()
    lines = out.splitlines()
    assert len(lines) == len(en.kept) + len(en.pruned)
    assert lines[len(en.kept):] == [f"- {p.variant.name}  pruned by {p.constraint}: {p.reason}"
                                    for p in sorted(en.pruned, key=lambda p: p.variant)]
    assert f"# {len(en.kept)} variant(s), {len(en.pruned)} pruned" in err


def test_list_explain_says_which_knob_is_unrealized(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(V, "REALIZED_KNOBS", {("warp_specialized", True), ("pingpong", False),
                                              ("intra_wg_overlap", False), ("peel_masked", False), ("p_in_smem", False),
                                              ("o_tma_store", False)})
    spec = tmp_path / "k.yaml"
    spec.write_text("axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: true, "
                    "tile: [128, 128], stages: 2, warp_specialized: true, "
                    "pingpong: [false, true], intra_wg_overlap: false}\n")
    rc, out, _ = run(["list", "--spec", str(spec), "--explain"], capsys)
    assert rc == 0
    assert out.splitlines() == [
        "* fwd_bf16_d128_causal_m128n128_s2_ws1_pp0_ov0",
        "- fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov0  pruned by knob_realized: "
        "pingpong=true is not realized by the templates yet"]


def test_list_with_filter(capsys):
    rc, out, _ = run(["list", "--spec", "h100", "--only", "*fp16_d64*"], capsys)
    en, _ = h100()
    want = [v.name for v in sorted(en.kept) if fnmatch.fnmatchcase(v.name, "*fp16_d64*")]
    # a range default carries its range: "+ name  (seqlen_k 1536-2048)"
    assert rc == 0 and want and [l[2:].split("  (")[0] for l in out.splitlines()] == want
    assert "+ fwd_fp16_d64_causal_m128n128_s2_ws1_pp1_ov1_peel  (seqlen_k 1536-2048)" in out.splitlines()


def test_spec_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes: {direction: fwd, dtype: bf16, head_dim: 12.5}\n")
    rc, out, err = run(["list", "--spec", str(bad)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("fa3gen: error: ") and err.count("\n") == 1
    assert "axes.head_dim" in err and "12.5" in err and "Traceback" not in err


def test_filter_error(capsys):
    rc, _, err = run(["list", "--spec", "tiny", "--only", "nothing*"], capsys)
    assert rc == 2 and "matches no variant; available: bwd_bf16_d64" in err


def test_missing_spec_file(capsys):
    rc, _, err = run(["list", "--spec", "no_such_spec"], capsys)
    assert rc == 2 and "not found" in err


def _fake_build(folder: Path, finished: bool = True) -> None:
    (folder / "src").mkdir(parents=True)
    for name in (("manifest.json",) if finished else ("build.ninja", "fingerprint.txt")):
        (folder / name).write_text("x")


def test_clean(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    _fake_build(tmp_path / "tiny")
    _fake_build(tmp_path / "h100", finished=False)  # a build that failed is a build too
    rc, out, _ = run(["clean", "--spec", "tiny"], capsys)
    assert rc == 0 and not (tmp_path / "tiny").exists() and (tmp_path / "h100").exists()
    rc, out, _ = run(["clean", "--spec", "tiny"], capsys)
    assert rc == 0 and "nothing to clean" in out
    (tmp_path / "notes").mkdir()
    (tmp_path / "todo.txt").write_text("keep")
    rc, out, _ = run(["clean"], capsys)
    assert rc == 0 and not (tmp_path / "h100").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "todo.txt"]
    assert "left 2 entries" in out and "not builds" in out


def test_clean_of_a_spec_file_leaves_another_files_build(tmp_path, monkeypatch, capsys):
    """clean --spec FILE removed generated/<name>/ whatever file had built it (package and the
    runtime refuse another file's build); by name it goes."""
    import json
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "gen"))
    built, mine = tmp_path / "a" / "s.yaml", tmp_path / "b" / "s.yaml"
    for f, text in ((built, "name: same\n# a\n"), (mine, "name: same\n# b\n")):
        f.parent.mkdir()
        f.write_text(text)
    folder = tmp_path / "gen" / "same"
    _fake_build(folder)
    (folder / "manifest.json").write_text(json.dumps({"spec_path": str(built.resolve())}))
    rc, _, err = run(["clean", "--spec", str(mine)], capsys)
    assert rc == 2 and folder.exists() and f"it holds the build of {built.resolve()}" in err
    assert "fa3gen clean --spec same" in err
    rc, _, _ = run(["clean", "--spec", str(built)], capsys)  # its own file: removed
    assert rc == 0 and not folder.exists()


def test_clean_removes_nothing_but_builds(tmp_path, monkeypatch, capsys):
    """FA3GEN_GENERATED pointed at a folder of other things (".", /tmp): `clean` once removed
    it whole, and `clean --spec NAME` any folder of that name; a .yaml typo picked a build by
    its stem."""
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    (tmp_path / "projects").mkdir()
    (tmp_path / "projects" / "build.ninja").write_text("x")  # another tool's, no fingerprint
    _fake_build(tmp_path / "h100")
    rc, out, err = run(["clean", "--spec", "projects"], capsys)
    assert rc == 2 and "not an fa3gen build" in err and (tmp_path / "projects").is_dir()
    rc, out, err = run(["clean", "--spec", "spec/h100.yaml"], capsys)
    assert rc == 2 and "no such spec file" in err and (tmp_path / "h100").is_dir()
    rc, out, _ = run(["clean"], capsys)
    assert rc == 0 and (tmp_path / "projects").is_dir() and not (tmp_path / "h100").exists()


def test_extra_command_modules_listed_in_one_place():
    assert cli.COMMAND_MODULES[0] == "fa3gen.bench"


def test_cli_import_does_not_import_torch():
    # The command modules and the tools they share too: `fa3gen bench --help` imports them.
    code = ("import sys, fa3gen.cli, fa3gen.bench, fa3gen.ablate, fa3gen.timing, fa3gen.checks; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_entry_point_via_python_m(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fa3gen.cli", "build", "--spec",
                        str(tmp_path / "missing.yaml")], capture_output=True, text=True,
                       cwd=REPO_ROOT)
    assert p.returncode == 2
    assert p.stderr.startswith("fa3gen: error: spec file not found")


def load_build_py():
    import importlib.util
    spec = importlib.util.spec_from_file_location("fa3gen_build_py", REPO_ROOT / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_py_check_error_is_one_message_no_traceback(monkeypatch, capsys):
    from fa3gen.errors import Fa3genError, LibraryNotBuiltError
    build_py = load_build_py()
    calls = []
    monkeypatch.setattr(build_py, "cli_main", lambda argv: calls.append(argv) or 0)

    def failing(spec):
        raise Fa3genError(f"quick_check failed: {spec}")
    monkeypatch.setattr(build_py, "quick_check", failing)
    assert build_py.main(["--spec", "tiny", "--check"]) == 1
    assert calls == [["build", "--spec", "tiny"]]
    err = capsys.readouterr().err
    assert err == "build.py: error: quick_check failed: tiny\n"

    def missing(spec):
        raise LibraryNotBuiltError("/nowhere/libfa3gen_tiny.so", "tiny")
    monkeypatch.setattr(build_py, "quick_check", missing)
    assert build_py.main(["--spec=tiny", "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("build.py: error: fa3gen library not found: /nowhere/")
    assert "Traceback" not in err
    # No --check, or a dry run: the check does not run.
    assert build_py.main(["--spec", "tiny"]) == 0
    assert build_py.main(["--spec", "tiny", "--check", "--dry-run"]) == 0
    # The options as the build's parser took them: abbreviations included (--sp once reached
    # the check as None, a traceback; --dry ran the check after a dry run).
    checked = []
    monkeypatch.setattr(build_py, "quick_check", lambda spec: checked.append(spec) or 0)
    assert build_py.main(["--sp", "tiny", "--check"]) == 0
    assert build_py.main(["--spec", "tiny", "--dry", "--check"]) == 0
    assert checked == ["tiny"]


def test_clean_and_package_take_a_dotted_spec_name_as_given(tmp_path, monkeypatch, capsys):
    """Spec names may hold dots: `--spec h100.v2` names that build, not h100's (its stem)."""
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    _fake_build(tmp_path / "h100")
    _fake_build(tmp_path / "h100.v2")
    rc, out, _ = run(["clean", "--spec", "h100.v2"], capsys)
    assert rc == 0 and f"removed {tmp_path / 'h100.v2'}" in out
    assert (tmp_path / "h100").is_dir() and not (tmp_path / "h100.v2").exists()
    assert cli._spec_name("h100.v2") == "h100.v2" and cli._spec_name("specs/tiny.yaml") == "tiny"


def test_clean_leaves_a_build_that_is_running(tmp_path, monkeypatch, capsys):
    """clean takes the build lock: a folder whose build holds it is left as it is (an error
    for --spec, a note for every build), never deleted from under its compiles."""
    from generator.lock import build_lock
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    _fake_build(tmp_path / "tiny")
    _fake_build(tmp_path / "h100")
    with build_lock(tmp_path / "tiny", "spec tiny", log=lambda m: None):
        rc, out, err = run(["clean", "--spec", "tiny"], capsys)
        assert rc == 2 and "is being built (pid " in err and (tmp_path / "tiny").is_dir()
        rc, out, err = run(["clean"], capsys)
        assert rc == 0 and "is being built" in out and "left as it is" in out
        assert (tmp_path / "tiny").is_dir() and not (tmp_path / "h100").exists()
    rc, out, _ = run(["clean", "--spec", "tiny"], capsys)
    assert rc == 0 and not (tmp_path / "tiny").exists()


def test_clean_never_takes_a_spec_that_names_no_build_for_the_root(tmp_path, monkeypatch, capsys):
    """--spec "" (an unset $SPEC), ".", "/", a spec whose name is "." once removed every build."""
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "gen"))
    (tmp_path / "gen" / "h100").mkdir(parents=True)
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text('name: "."\n')
    for spec in ("", ".", str(dotted)):
        rc, out, err = run(["clean", "--spec", spec], capsys)
        assert rc == 2 and "names no spec build" in err and out == "", spec
    for spec, says in (("/", "is a folder, not a spec file"), ("h100/../..", "spec file not found")):
        rc, out, err = run(["clean", "--spec", spec], capsys)  # paths: build's error (below)
        assert rc == 2 and says in err and out == "", spec
    assert (tmp_path / "gen" / "h100").is_dir()


@pytest.mark.parametrize("command", ["clean", "package"])
def test_a_path_to_no_spec_file_is_builds_error_not_a_name(command, tmp_path, monkeypatch, capsys):
    """clean and package took the last part of a path that is no file (/nonexistent/dir/u) as a
    spec name, and cleaned or packaged build u; build says the file is not there."""
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "gen"))
    _fake_build(tmp_path / "gen" / "u")
    for spec, says in ((str(tmp_path / "dir" / "u"), "spec file not found"),
                       (str(tmp_path / "gen"), "is a folder, not a spec file")):
        rc, _, built_err = run(["build", "--spec", spec], capsys)
        rc2, out, err = run([command, "--spec", spec], capsys)
        assert rc == rc2 == 2 and says in err and err == built_err and out == "", spec
    assert (tmp_path / "gen" / "u" / "manifest.json").is_file()


def test_a_folder_named_like_a_spec_does_not_hide_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    rc, out, _ = run(["list", "--spec", "tiny"], capsys)
    assert rc == 0 and out


def test_unreadable_inputs_are_one_line_errors(tmp_path, monkeypatch, capsys):
    binary = tmp_path / "s.yaml"
    binary.write_bytes(b"\xff\xfe name: x\n")
    rc, _, err = run(["list", "--spec", str(binary)], capsys)
    assert rc == 2 and "not UTF-8" in err and "Traceback" not in err
    rc, _, err = run(["spec", "--from-trace", str(binary), "-o", str(tmp_path / "o.yaml")], capsys)
    assert rc == 2 and "not UTF-8" in err
    rc, _, err = run(["build", "--spec", "tiny", "--dry-run", "--launcher", 'ccache "'], capsys)
    assert rc == 2 and "compiler launcher" in err and "No closing quotation" in err
    (tmp_path / "out").mkdir()
    trace = tmp_path / "t.yaml"
    import fa3gen
    from fa3gen import tracing
    with fa3gen.trace(trace):
        tracing.record("fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1", True, batch=1, seqlen_q=8,
                       seqlen_k=8, heads_q=1, heads_kv=1)
    rc, _, err = run(["spec", "--from-trace", str(trace), "-o", str(tmp_path / "out")], capsys)
    assert rc == 2 and "out" in err and "Traceback" not in err  # a folder, not a file


def test_a_spec_written_from_a_trace_is_one_that_builds(tmp_path, capsys):
    """Checked before it is written: a bad name, or a traced variant no build holds."""
    import yaml

    trace = tmp_path / "t.yaml"
    calls = [{"variant": "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1", "default": True,
              "calls": 1}]
    trace.write_text(yaml.safe_dump({"format": "fa3gen-trace-1", "calls": calls}))
    from fa3gen import tracing
    trace.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": calls}))
    out = tmp_path / "o.yaml"
    rc, _, err = run(["spec", "--from-trace", str(trace), "-o", str(out), "--name", "../evil"], capsys)
    assert rc == 2 and "name" in err and not out.exists()
    calls[0]["variant"] = "fwd_bf16_d128_nocausal_m128n176_s9_ws1_pp1_ov1"  # 9 stages
    trace.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": calls}))
    rc, _, err = run(["spec", "--from-trace", str(trace), "-o", str(out)], capsys)
    assert rc == 2 and not out.exists() and "Traceback" not in err
    calls[0].update(variant="fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1", seqlen_k=[5])
    trace.write_text(yaml.safe_dump({"format": tracing.FORMAT, "calls": calls}))
    rc, _, err = run(["spec", "--from-trace", str(trace), "-o", str(out)], capsys)
    assert rc == 2 and "seqlen_k must be [shortest, longest]" in err


def test_spec_errors_do_not_grow_without_bound():
    """A value's rendering is cut (YAML aliases can expand a 1 KB spec into hundreds of MB)."""
    from generator.spec import _Validator

    message = str(_Validator("s.yaml").fail("axes.head_dim", "expected an int", [["x" * 10] * 50] * 50))
    assert len(message) < 400 and message.endswith("characters)")


def test_bad_option_values_are_argument_errors(capsys):
    import pytest

    for argv, message in ((["tune", "--spec", "h100", "--keys", "("], "not a regular expression"),
                          (["bench", "--min-ms", "inf"], "finite number of milliseconds"),
                          (["tune", "--min-ms", "-1"], "finite number of milliseconds"),
                          (["ablate", "--min-ms", "nan"], "finite number of milliseconds"),
                          (["bench", "--settle-ms", "-5"], "milliseconds >= 0"),
                          (["bench", "--settle-ms", "x"], "milliseconds >= 0"),
                          (["bench", "--order", "random"], "invalid choice"),
                          (["bench", "--steady-s", "1"], "more than 1 s"),
                          (["bench", "--steady-s", "inf"], "finite number of seconds"),
                          (["bench", "--idle-s", "-1"], "seconds >= 0"),
                          (["bench", "--burst", "--steady-s", "3"], "not allowed with argument")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_numerics_on_cuda_without_a_gpu_says_so(tmp_path, capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    rc, _, err = run(["numerics", "--device", "cuda", "--out", str(tmp_path / "n.json"),
                      "--doc", str(tmp_path / "N.md")], capsys)
    assert rc == 2 and "no CUDA GPU here" in err


def test_an_empty_or_folder_spec_is_named_as_such(tmp_path, capsys):
    """--spec '' (an unset $SPEC) read as the folder '.': 'cannot read spec .: Is a directory'."""
    for spec in ("", str(tmp_path)):
        rc, _, err = run(["list", "--spec", spec], capsys)
        assert rc == 2 and "is a folder, not a spec file" in err, spec


def test_an_empty_name_is_refused_not_defaulted(tmp_path, capsys):
    for argv in (["package", "--spec", "tiny", "--name", ""],
                 ["spec", "--from-trace", str(tmp_path / "t.yaml"), "-o", str(tmp_path / "s.yaml"), "--name", ""]):
        with pytest.raises(SystemExit) as e:  # argparse's usage error
            cli.main(argv)
        assert e.value.code == 2 and "--name is empty" in capsys.readouterr().err, argv


def test_a_spec_that_prunes_every_variant_names_each_constraint_once(tmp_path, capsys):
    """144 variants pruned by three constraints: one line a constraint (its count, a reason and
    an example), not one line a variant (a large spec printed 45k lines; up to ten variants
    are each named, tests/test_build.py)."""
    spec = tmp_path / "allpruned.yaml"
    spec.write_text("name: allpruned\naxes: {direction: fwd, dtype: bf16, head_dim: [64, 128, 256],"
                    " causal: [false, true], stages: [2, 3, 4, 5], warp_specialized: false,"
                    " pingpong: true, intra_wg_overlap: [false, true]}\n"
                    "groups:\n  - name: g\n    axes: {tile: [[128, 128], [128, 64], [64, 64]]}\n")
    assert cli.main(["list", "--spec", str(spec)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert "leaves no variant; each one is pruned (144)" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == [
        "pingpong_needs_two_consumers", "smem_budget", "stages_range"]
    assert sum(int(line.split()[1].strip("():")) for line in lines[1:]) == 144


def test_list_notes_what_a_filter_takes_from_the_dispatch(capsys):
    """list previews a filtered build, so it says what build says: a key left without its
    default (the range choice stays, so nothing looks wrong in the listing itself)."""
    rc, out, err = run(["list", "--spec", "h100", "--only",
                        "fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1_otma"], capsys)
    assert rc == 0 and "+ fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1_otma" in out
    assert ("fa3gen: note: (fwd, bf16, d128, causal) has no default in this build "
            "(fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1 was filtered out)") in err
    rc, out, err = run(["list", "--spec", "h100"], capsys)
    assert rc == 0 and "note:" not in err
