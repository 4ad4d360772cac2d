"""The build pipeline end to end with a fake nvcc: ninja, incrementality, manifest, filters."""
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fa3gen.contract import ABI_VERSION
from generator import build as B
from generator.errors import BuildError, FilterError, GeneratorError
from generator.paths import REPO_ROOT
from generator.toolchain import Toolchain, compile_flags

FAKE = Path(__file__).parent / "fake_nvcc.py"

SPEC = """\
name: t
axes: {direction: fwd, dtype: bf16, head_dim: 128, stages: 2, warp_specialized: true,
       pingpong: false, intra_wg_overlap: false}
groups:
  - name: a
    axes: {causal: false, tile: [128, 128]}
  - name: b
    axes: {causal: true, tile: [128, 128]}
"""
A = "fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0"
B_ = "fwd_bf16_d128_causal_m128n128_s2_ws1_pp0_ov0"
B2 = "fwd_bf16_d128_causal_m128n176_s2_ws1_pp0_ov0"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(spec path, toolchain, calls file) with outputs under tmp_path/gen."""
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "gen"))
    monkeypatch.delenv("FA3GEN_COMPILER_LAUNCHER", raising=False)
    monkeypatch.delenv("FA3GEN_ALLOW_SPILLS", raising=False)
    # One variant a TU: these tests follow single TUs (the units' own tests set another size).
    monkeypatch.setenv("FA3GEN_UNIT_SIZE", "1")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!{sys.executable}\n" + FAKE.read_text())
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_NVCC_CALLS", str(calls))
    inc = Path("/opt/cutlass/include")
    tc = Toolchain(nvcc, "fake nvcc 1", inc, "4.2.0", tuple(compile_flags(inc)))
    spec = tmp_path / "t.yaml"
    spec.write_text(SPEC)
    return spec, tc, calls


def take_calls(calls: Path) -> list[str]:
    if not calls.exists():
        return []
    out = sorted(calls.read_text().split())
    calls.unlink()
    return out


def quiet(*_):
    pass


def test_build_then_noop_then_one_change(fake, capfd):
    spec, tc, calls = fake
    res = B.build(spec, toolchain=tc, jobs=2, log=quiet)
    out = res.plan.out_dir
    assert res.library == out / "lib" / "libfa3gen_t.so" and res.library.exists()
    assert take_calls(calls) == sorted([f"{A}.cu", f"{B_}.cu", "dispatch.cu", "link"])
    assert (out / "obj" / f"{A}.log").exists()

    m = json.loads((out / "manifest.json").read_text())
    assert m["spec"] == "t" and m["fingerprint"] == tc.fingerprint()
    assert m["library"] == "lib/libfa3gen_t.so" and m["abi_version"] == ABI_VERSION
    rows = {r["name"]: r for r in m["variants"]}
    assert set(rows) == {A, B_}
    assert rows[A]["is_default"] and rows[A]["key"] == ["fwd", "bf16", 128, False, False, False, False,
                                                      False]
    r = rows[A]["resources"]
    assert r["registers"] == 168 and r["spill_stores"] == 0 and r["ok"] is True
    assert "compile_seconds" in r

    # Nothing changed: ninja has nothing to do.
    assert B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned == []
    B.build(spec, toolchain=tc, log=quiet)
    assert take_calls(calls) == []

    # One variant changes: one TU, the dispatch table and the link.
    spec.write_text(SPEC.replace("causal: true, tile: [128, 128]", "causal: true, tile: [128, 176]"))
    planned = B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned
    assert sorted(planned) == sorted([f"NVCC {B2}", "NVCC obj/dispatch.o", "LINK lib/libfa3gen_t.so"])
    B.build(spec, toolchain=tc, log=quiet)
    assert take_calls(calls) == sorted([f"{B2}.cu", "dispatch.cu", "link"])
    assert not (out / "src" / f"{B_}.cu").exists()  # stale source removed
    assert not (out / "obj" / f"{B_}.o").exists()


def test_header_change_rebuilds_only_the_tus_that_include_it(fake, monkeypatch):
    """Kernel headers come from each TU's depfile (nvcc -MD -MF), not from the fingerprint:
    touching a header that only A includes rebuilds A and the link, nothing else."""
    spec, tc, calls = fake
    header = spec.parent / "only_a.cuh"
    header.write_text("// v1\n")
    monkeypatch.setenv("FAKE_NVCC_DEP", str(header))
    monkeypatch.setenv("FAKE_NVCC_DEP_FOR", "_nocausal_")
    B.build(spec, toolchain=tc, log=quiet)
    take_calls(calls)
    out = spec.parent / "gen" / "t"
    assert (out / "build.ninja").read_text().count("depfile = $out.d") == 1
    assert B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned == []
    later = time.time() + 10
    os.utime(header, (later, later))
    planned = B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned
    assert sorted(planned) == sorted([f"NVCC {A}", "LINK lib/libfa3gen_t.so"])
    B.build(spec, toolchain=tc, log=quiet)
    assert take_calls(calls) == sorted([f"{A}.cu", "link"])


def test_object_recorded_without_deps_is_compiled_again(fake, monkeypatch):
    """An object whose depfile listed nothing would never be rebuilt for a header edit; the
    next build deletes and recompiles it (once: the new record has its dependencies)."""
    spec, tc, calls = fake
    monkeypatch.setenv("FAKE_NVCC_NO_DEPS", "_nocausal_")
    B.build(spec, toolchain=tc, log=quiet)
    take_calls(calls)
    monkeypatch.delenv("FAKE_NVCC_NO_DEPS")
    logged = []
    B.build(spec, toolchain=tc, dry_run=True, log=logged.append)
    assert any(f"obj/{A}.o has no recorded header dependencies" in m for m in logged)
    B.build(spec, toolchain=tc, log=quiet)
    assert take_calls(calls) == sorted([f"{A}.cu", "link"])
    B.build(spec, toolchain=tc, log=quiet)
    assert take_calls(calls) == []


def test_fingerprint_change_rebuilds_everything(fake):
    spec, tc, calls = fake
    B.build(spec, toolchain=tc, log=quiet)
    take_calls(calls)
    tc2 = Toolchain(tc.nvcc, "fake nvcc 2", tc.cutlass_include, tc.cutlass_version, tc.flags)
    planned = B.build(spec, toolchain=tc2, dry_run=True, log=quiet).planned
    assert len(planned) == 4


def test_spilling_variant_fails_unless_allowed(fake, monkeypatch, capfd):
    spec, tc, calls = fake
    monkeypatch.setenv("FAKE_NVCC_SPILL", "_causal_")
    with pytest.raises(BuildError, match="failed"):
        B.build(spec, toolchain=tc, log=quiet)
    err = capfd.readouterr()
    assert f"variant {B_} failed the resource check" in err.out + err.err
    out = spec.parent / "gen" / "t"
    assert not (out / "obj" / f"{B_}.o").exists()
    assert json.loads((out / "obj" / f"{B_}.resources.json").read_text())["ok"] is False

    res = B.build(spec, toolchain=tc, allow_spills=True, log=quiet)
    m = json.loads(res.manifest.read_text())
    row = next(r for r in m["variants"] if r["name"] == B_)
    assert row["resources"]["spill_stores"] == 8

    # The allowance travels in the environment, which ninja does not track: the next strict
    # build compiles the spilling object again (and fails), never links it as it is.
    assert B.objects_built_with_spills(out) == [f"obj/{B_}.o"]
    with pytest.raises(BuildError, match="failed"):
        B.build(spec, toolchain=tc, log=quiet)
    assert not (out / "obj" / f"{B_}.o").exists()


def test_compiler_launcher(fake, monkeypatch, tmp_path):
    """The launcher runs every compile (a script that records its calls, then runs them)."""
    spec, tc, calls = fake
    log = tmp_path / "launched.txt"
    launcher = tmp_path / "record"
    launcher.write_text(f"#!/bin/sh\necho \"$1\" >> {log}\nexec \"$@\"\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FA3GEN_COMPILER_LAUNCHER", str(launcher))
    res = B.build(spec, toolchain=tc, log=quiet)
    assert f"launcher = {launcher}" in (res.plan.out_dir / "build.ninja").read_text()
    assert res.library.exists()
    compiled = [c for c in take_calls(calls) if c.endswith(".cu")]
    assert compiled and log.read_text().split().count(str(tc.nvcc)) == len(compiled)
    monkeypatch.setenv("FA3GEN_COMPILER_LAUNCHER", "no-such-ccache -x")  # a dry run said nothing
    with pytest.raises(GeneratorError, match="'no-such-ccache' is not a program on PATH"):
        B.build(spec, toolchain=tc, dry_run=True, log=quiet)
    # --launcher "" is none, over the environment's (it used to fall back to it)
    B.build(spec, toolchain=tc, compiler_launcher="", log=quiet)
    assert "launcher = \n" in (res.plan.out_dir / "build.ninja").read_text()


def test_filters(fake):
    spec, tc, calls = fake
    res = B.build(spec, only=["*_causal_*"], toolchain=tc, dry_run=True, log=quiet)
    assert [v.name for v in res.plan.variants] == [B_]
    res = B.build(spec, exclude=["*_causal_*"], toolchain=tc, dry_run=True, log=quiet)
    assert [v.name for v in res.plan.variants] == [A]


def test_filter_matching_nothing_lists_names(fake):
    spec, tc, _ = fake
    with pytest.raises(FilterError, match=rf"--only '\*d99\*' matches no variant; available: .*{A}"):
        B.plan(spec, only=["*d99*"])
    with pytest.raises(FilterError, match="--exclude 'nope'"):
        B.plan(spec, exclude=["nope"])
    with pytest.raises(FilterError, match="nothing left"):
        B.plan(spec, exclude=["*"])


def test_filter_matching_only_pruned_says_why(tmp_path, monkeypatch):
    # Every knob value is realized today: narrow the table so pp1 is pruned by knob_realized.
    from generator import variants as V
    monkeypatch.setattr(V, "REALIZED_KNOBS", {("warp_specialized", True), ("pingpong", False),
                                              ("intra_wg_overlap", False), ("peel_masked", False), ("p_in_smem", False),
                                              ("o_tma_store", False)})
    spec = tmp_path / "p.yaml"
    spec.write_text(SPEC.replace("pingpong: false", "pingpong: [false, true]")
                    + "dispatch_required: false\n")
    with pytest.raises(FilterError, match="matches only pruned variants: .*pruned by knob_realized"):
        B.plan(spec, only=["*pp1*"])


def snapshot(root: Path) -> dict:
    """Every file under root with its bytes and mtime."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_dry_run_writes_nothing(fake):
    spec, tc, calls = fake
    B.build(spec, toolchain=tc, log=quiet)
    out = B.plan(spec).out_dir
    take_calls(calls)
    before = snapshot(out)
    # A variant leaves the spec (its files would be removed), flags change (the fingerprint
    # would change): the dry runs say so and touch nothing.
    spec.write_text(SPEC.replace("causal: true, tile: [128, 128]", "causal: true, tile: [128, 176]"))
    lines = []
    planned = B.build(spec, toolchain=tc, dry_run=True, log=lines.append).planned
    assert f"NVCC {B2}" in planned
    assert any("would remove: obj/" + B_ in ln for ln in lines)
    lineinfo = Toolchain(tc.nvcc, tc.nvcc_version, tc.cutlass_include, tc.cutlass_version,
                         tuple(compile_flags(tc.cutlass_include, lineinfo=True)))
    lines = []
    planned = B.build(spec, toolchain=lineinfo, dry_run=True, log=lines.append).planned
    assert any("every unit compiles" in ln for ln in lines) and f"NVCC {A}" in planned
    assert snapshot(out) == before
    assert take_calls(calls) == []


def test_filtered_build_keeps_the_other_objects(fake):
    spec, tc, calls = fake
    B.build(spec, toolchain=tc, log=quiet)
    out = B.plan(spec).out_dir
    take_calls(calls)
    lines = []
    B.build(spec, only=[A], toolchain=tc, log=lines.append)
    assert any("1 variant(s) of 2 (filtered) in 1 compile unit(s) of up to 1, 1 dispatch default(s)"
               in ln for ln in lines)
    text = (out / "build.ninja").read_text()
    assert f"build obj/{B_}.o" in text  # its records stay with ninja
    assert f": link obj/{A}.o obj/dispatch.o" in text  # the library links the selection
    assert (out / "obj" / f"{B_}.o").exists() and (out / "src" / f"{B_}.cu").exists()
    assert take_calls(calls) == ["dispatch.cu", "link"]  # nothing compiled again
    m = json.loads((out / "manifest.json").read_text())
    assert [r["name"] for r in m["variants"]] == [A] and m["filters"]["only"] == [A]
    # The full library again: one link, no compile.
    B.build(spec, toolchain=tc, log=quiet)
    assert take_calls(calls) == ["dispatch.cu", "link"]


def test_library_is_replaced_not_rewritten(fake):
    spec, tc, calls = fake
    lib = B.build(spec, toolchain=tc, log=quiet).library
    with open(lib) as loaded:  # a process that has the old library open
        inode = lib.stat().st_ino
        spec.write_text(SPEC.replace("causal: true, tile: [128, 128]", "causal: true, tile: [128, 176]"))
        B.build(spec, toolchain=tc, log=quiet)
        assert lib.stat().st_ino != inode  # a new file renamed over the path
        assert loaded.read() == "fake object of link\n"
    assert not list(lib.parent.glob("*.tmp"))


def test_concurrent_builds_compile_once(fake, monkeypatch):
    import threading

    spec, tc, calls = fake
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    logs: list[list[str]] = [[], []]
    errors = []

    def run(i):
        try:
            B.build(spec, toolchain=tc, jobs=2, log=logs[i].append)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # the first holds the lock when the second arrives
    for t in threads:
        t.join()
    assert not errors
    assert take_calls(calls) == sorted([f"{A}.cu", f"{B_}.cu", "dispatch.cu", "link"])
    assert any("waiting for it to finish" in ln for ln in logs[1])


def test_jobs_out_of_range_rejected(fake):
    spec, tc, _ = fake
    for bad in (0, -3, 1025, 2**31):
        with pytest.raises(GeneratorError, match=rf"-j/--jobs must be at least 1 and at most 1024 \(got {bad}\)"):
            B.build(spec, toolchain=tc, jobs=bad, log=quiet)


def test_jobs_beyond_what_memory_fits_are_noted(fake, monkeypatch):
    """-j above default_jobs() (cores, free GiB / 4) builds (up to 1024), with a note that it may
    run out of memory; within it, or on a dry run, no note."""
    spec, tc, _ = fake
    monkeypatch.setattr(B, "default_jobs", lambda: 3)
    for jobs, noted, dry in ((4, True, False), (3, False, False), (4, False, True), (1024, True, False)):
        logs = []
        B.build(spec, toolchain=tc, jobs=jobs, log=logs.append, dry_run=dry)
        assert any(f"-j {jobs} is more than this machine's cores and free memory fit (3, at 4 GiB "
                   "a compile)" in ln for ln in logs) == noted


def test_all_pruned_names_the_file_and_every_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "gen"))
    spec = tmp_path / "pruned.yaml"
    spec.write_text(SPEC.replace("head_dim: 128", "head_dim: 80"))
    with pytest.raises(GeneratorError) as e:
        B.plan(spec)
    text = str(e.value)
    assert str(spec) in text and "each one is pruned" in text
    for name in (A, B_):
        assert f"{name.replace('d128', 'd80')}: head_dim_supported: head_dim 80 not in" in text


def test_progress_names_the_running_variants(tmp_path):
    from generator.progress import Progress

    obj = tmp_path / "obj"
    obj.mkdir()
    (obj / f"{A}.compiling").touch()
    os.utime(obj / f"{A}.compiling", (time.time() - 30, time.time() - 30))
    p = Progress(obj, jobs=2, total=6)
    p.feed(f"[1/6 40.0s] NVCC {B_}\n")
    p.feed(f"{B_}: 168 regs, spill 0/0 B, stack 0 B, 40.0 s\n")
    report = p.report()
    assert "1/6 done" in report and f"compiling {A} (30s)" in report
    # 4 queued at 40 s, 10 s left on the running one, over 2 jobs: 85 s.
    assert "about 1m25s left" in report


def test_progress_does_not_count_the_plain_units_and_the_link_as_compile_units(tmp_path):
    """dispatch.o, quantize.o, decode.o and the link are short: the edges left that are not
    units are not estimated at a unit's mean time (a build's last minute read 100 s too long)."""
    from generator.ninja import _other_edges
    from generator.progress import Progress

    obj = tmp_path / "obj"
    obj.mkdir()
    (tmp_path / "build.ninja").write_text(
        "build obj/u1.o | obj/u1.resources.json: nvcc_variant src/u1.cu | x\n"
        "build obj/u2.o | obj/u2.resources.json: nvcc_variant src/u2.cu | x\n"
        "build obj/dispatch.o: nvcc_plain src/dispatch.cu | fingerprint.txt\n"
        "build obj/decode.o: nvcc_plain src/decode.cu | fingerprint.txt\n"
        "build lib/libfa3gen_t.so: link obj/u1.o obj/u2.o obj/dispatch.o obj/decode.o\n")
    others = _other_edges(tmp_path / "build.ninja")
    assert others == 3
    p = Progress(obj, jobs=1, total=5, others=others)
    p.feed("[1/5 2.0s] NVCC obj/dispatch.o\n")
    p.feed("[2/5 42.0s] NVCC u1\n")
    p.feed("u1: 168 regs, spill 0/0 B, stack 0 B, 40.0 s\n")
    # One unit (u2) queued at 40 s; decode.o and the link are not units.
    assert p.remaining_seconds([]) == 40.0


def test_long_build_reports_progress(fake, monkeypatch, capfd):
    spec, tc, _ = fake
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1.0")
    from generator import ninja

    real = ninja.run_ninja
    monkeypatch.setattr(B, "run_ninja", lambda *a, **k: real(*a, **{**k, "progress_every": 0.3}))
    B.build(spec, toolchain=tc, jobs=1, log=quiet)
    assert "; compiling fwd_bf16_d128_" in capfd.readouterr().out


def test_dry_run_lists_the_decode_translation_unit(fake):
    """A spec with `decode: true` compiles src/decode.cu beside the variants; the dry run says
    so before the first build and is empty after it."""
    spec, tc, calls = fake
    spec.write_text("decode: true\n" + SPEC)
    planned = B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned
    assert "NVCC obj/decode.o" in planned and planned[-1] == "LINK lib/libfa3gen_t.so"
    B.build(spec, toolchain=tc, log=quiet)
    assert "decode.cu" in take_calls(calls)
    assert B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned == []


def test_dry_run_sees_what_the_build_file_would_change(fake, monkeypatch):
    """The dry run asks ninja about the build file the build would write: a compiler launcher
    or nvcc path it has not run with yet recompiles every variant, and so it says."""
    spec, tc, calls = fake
    B.build(spec, toolchain=tc, log=quiet)
    take_calls(calls)
    assert B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned == []
    monkeypatch.setenv("FA3GEN_COMPILER_LAUNCHER", "env")
    planned = B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned
    assert f"NVCC {A}" in planned and f"NVCC {B_}" in planned
    B.build(spec, toolchain=tc, log=quiet)
    assert sorted(take_calls(calls)) == sorted([*(f"{v}.cu" for v in (A, B_, "dispatch")), "link"])


def test_dry_run_and_strict_build_after_spills_were_allowed(fake, monkeypatch):
    spec, tc, calls = fake
    monkeypatch.setenv("FAKE_NVCC_SPILL", "_causal_")
    B.build(spec, toolchain=tc, allow_spills=True, log=quiet)
    assert B.build(spec, toolchain=tc, allow_spills=True, dry_run=True, log=quiet).planned == []
    planned = B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned
    assert f"NVCC {B_}" in planned and f"NVCC {A}" not in planned


def test_a_filtered_build_keeps_the_specs_quantizer(fake):
    """A filter that selects no e4m3 variant leaves src/quantize.cu and its object to the next
    full build (it used to remove them as 'variants no longer in the spec')."""
    spec, tc, calls = fake
    spec.write_text(SPEC + "  - name: c\n    axes: {dtype: e4m3, causal: false, tile: [128, 128],"
                    " pingpong: false}\n")
    B.build(spec, toolchain=tc, log=quiet)
    out = B.plan(spec).out_dir
    assert (out / "obj" / "quantize.o").exists()
    lines = []
    B.build(spec, only=[A], toolchain=tc, log=lines.append)
    assert (out / "src" / "quantize.cu").exists() and (out / "obj" / "quantize.o").exists()
    assert not any("removed" in ln for ln in lines)


def test_a_killed_builds_markers_do_not_show_as_compiling(fake):
    spec, tc, calls = fake
    B.build(spec, toolchain=tc, log=quiet)
    out = B.plan(spec).out_dir
    (out / "obj" / f"{B_}.compiling").touch()  # left by a SIGKILLed build
    B.build(spec, only=[A], toolchain=tc, log=quiet)
    assert not list((out / "obj").glob("*.compiling"))


def test_nvccs_own_flag_variables_are_in_the_fingerprint(monkeypatch):
    from generator.toolchain import fingerprint

    base = fingerprint("v", ["-O3"], [], "4.2")
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DX")
    assert fingerprint("v", ["-O3"], [], "4.2") != base


def test_ninja_status_is_the_format_the_build_parses(monkeypatch):
    """A user's NINJA_STATUS made the dry run read 'up to date' (it parses '[f/t s] ' lines)."""
    from generator.ninja import _ninja_env, planned_edges

    monkeypatch.setenv("NINJA_STATUS", "ninja: ")
    status = _ninja_env(False, Path("out"))["NINJA_STATUS"]
    assert planned_edges(status.replace("%f", "1").replace("%t", "2").replace("%e", "0.1")
                         + "NVCC x\n") == ["NVCC x"]


def test_a_terminated_build_stops_its_compiles(fake, tmp_path):
    """SIGTERM to the build's Python process (as the CLI handles it): ninja and the compiles it
    started stop before the build lets go of its lock, instead of running on as orphans."""
    import signal
    import time

    spec, tc, calls = fake
    script = tmp_path / "build_it.py"
    script.write_text(
        "import signal, sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from pathlib import Path\n"
        "from generator import build as B\n"
        "from generator.toolchain import Toolchain\n"
        "from fa3gen import cli\n"
        "signal.signal(signal.SIGTERM, cli._terminate)\n"
        f"tc = Toolchain(Path({str(tc.nvcc)!r}), {tc.nvcc_version!r}, Path({str(tc.cutlass_include)!r}),"
        f" {tc.cutlass_version!r}, {tc.flags!r})\n"
        "try:\n"
        f"    B.build(Path({str(spec)!r}), toolchain=tc, jobs=2, log=print)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n")
    env = {**os.environ, "FAKE_NVCC_SLEEP": "60"}
    child = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    obj = tmp_path / "gen" / "t" / "obj"
    deadline = time.monotonic() + 60
    while not list(obj.glob("*.compiling")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(obj.glob("*.compiling")), "the compiles never started"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=40) == 130
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(tc.nvcc)], capture_output=True, text=True).stdout
    assert left.strip() == "", f"compiles still running: {left}"


def test_a_filtered_out_range_variant_is_noted(fake):
    """--only that leaves out the variant a seqlen_k range names: the key's default serves those
    lengths in that build, and the build says so (it dropped the range silently)."""
    spec, tc, calls = fake
    spec.write_text(SPEC.replace("    axes: {causal: true, tile: [128, 128]}",
                                 "    axes: {causal: true, tile: [[128, 128], [128, 176]]}")
                    + "dispatch:\n"
                    "  - {when: {causal: true}, use: {tile: [128, 176]}}\n"
                    "  - {when: {causal: true}, seqlen_k: [0, 1000], use: {tile: [128, 128]}}\n")
    lines = []
    B.build(spec, only=[B2, A], toolchain=tc, dry_run=True, log=lines.append)
    assert any(f"seqlen_k 0-1000 in this build ({B_}" in ln for ln in lines)


TWO_CAUSAL = SPEC.replace("    axes: {causal: true, tile: [128, 128]}",
                          "    axes: {causal: true, tile: [[128, 128], [128, 176]]}") + \
    "dispatch:\n  - {when: {causal: true}, use: {tile: [128, 176]}}\n"


def test_manifest_marks_only_the_defaults(fake):
    spec, tc, calls = fake
    spec.write_text(TWO_CAUSAL)
    res = B.build(spec, toolchain=tc, log=quiet)
    m = json.loads(res.manifest.read_text())
    assert {v["name"]: v["is_default"] for v in m["variants"]} == {A: True, B_: False, B2: True}


def test_manifest_records_nvccs_environment_flags(fake, monkeypatch):
    """NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS reach every compile without being fa3gen's flags:
    the manifest records them (fa3gen package refuses such a build unless --allow-switches)."""
    spec, tc, calls = fake
    monkeypatch.delenv("NVCC_PREPEND_FLAGS", raising=False)
    monkeypatch.delenv("NVCC_APPEND_FLAGS", raising=False)
    res = B.build(spec, toolchain=tc, log=quiet)
    assert "nvcc_env_flags" not in json.loads(res.manifest.read_text())["toolchain"]
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DFA3GEN_FP8_SKIP_TRANSPOSE")
    res = B.build(spec, toolchain=tc, log=quiet)
    assert json.loads(res.manifest.read_text())["toolchain"]["nvcc_env_flags"] == {
        "NVCC_APPEND_FLAGS": "-DFA3GEN_FP8_SKIP_TRANSPOSE"}


def test_manifest_records_the_commit_of_the_tree_it_built(fake, monkeypatch):
    """Reports that time a library elsewhere name the tree it came from (bench.library_commit
    reads this field); FA3GEN_COMMIT stands in for git here."""
    spec, tc, calls = fake
    monkeypatch.setenv("FA3GEN_COMMIT", "abc1234-dirty")
    res = B.build(spec, toolchain=tc, log=quiet)
    assert json.loads(res.manifest.read_text())["source_commit"] == "abc1234-dirty"


def test_manifest_records_what_the_spec_file_held(fake):
    """fa3gen package compares it with the file it is given (an edit since the build)."""
    import hashlib
    spec, tc, calls = fake
    res = B.build(spec, toolchain=tc, log=quiet)
    want = hashlib.sha256(Path(spec).read_bytes()).hexdigest()
    assert json.loads(res.manifest.read_text())["spec_sha256"] == want


def test_manifest_records_the_bytes_the_build_read(fake, monkeypatch):
    """The file was hashed when the manifest was written, at the build's end: an edit during a
    long build (fa3gen tune beside it) was recorded as built, and the runtime then took the
    edited file for its build."""
    import hashlib
    spec, tc, calls = fake
    read = hashlib.sha256(Path(spec).read_bytes()).hexdigest()
    real_plan = B.plan

    def plan_then_edit(*a, **k):
        p = real_plan(*a, **k)
        Path(spec).write_text(Path(spec).read_text() + "# edited during the build\n")
        return p

    monkeypatch.setattr(B, "plan", plan_then_edit)
    res = B.build(spec, toolchain=tc, log=quiet)
    assert json.loads(res.manifest.read_text())["spec_sha256"] == read


def test_a_filtered_out_default_is_noted(fake):
    spec, tc, calls = fake
    spec.write_text(TWO_CAUSAL)
    lines = []
    B.build(spec, only=[A, B_], toolchain=tc, dry_run=True, log=lines.append)
    assert any(f"has no default in this build ({B2} was filtered out)" in ln for ln in lines)


def test_dry_run_lists_a_variant_whose_source_would_be_rewritten(fake):
    spec, tc, calls = fake
    out = B.build(spec, toolchain=tc, log=quiet).plan.out_dir
    (out / "src" / f"{A}.cu").unlink()  # its object exists, its source would be written again
    assert f"NVCC {A}" in B.build(spec, toolchain=tc, dry_run=True, log=quiet).planned


def test_objects_built_with_spills_need_the_object(tmp_path):
    (tmp_path / "obj").mkdir()
    (tmp_path / "obj" / "x.resources.json").write_text(json.dumps({"problems": ["spill"]}))
    assert B.objects_built_with_spills(tmp_path) == []  # never compiled to the end: nothing to relink
    (tmp_path / "obj" / "x.o").write_bytes(b"")
    assert B.objects_built_with_spills(tmp_path) == ["obj/x.o"]


def test_default_jobs_leaves_four_gib_a_job(monkeypatch):
    class Meminfo:
        def __init__(self, *_):
            pass

        def read_text(self):
            return "MemTotal: 33554432 kB\nMemAvailable: 9437184 kB\n"  # 9 GiB free

    monkeypatch.setattr(B.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(B, "Path", Meminfo)
    assert B.default_jobs() == 2


def test_link_flags_and_ninja_keep_going():
    """A link flag change is a different build; ninja runs with -k 0 so that one build reports
    every failing variant."""
    from generator.ninja import _ninja_cmd
    from generator.toolchain import fingerprint

    assert fingerprint("v", ["-O3"], ["-lfoo"], "4.2") != fingerprint("v", ["-O3"], [], "4.2")
    cmd = _ninja_cmd(Path("/x"), 3, dry_run=False)
    assert cmd[cmd.index("-k") + 1] == "0"


def test_the_library_says_which_defines_built_it(fake):
    """--define lands in fa3gen_build_info ("defines"), which the GPU tests of a prepared switch
    read; a build without one keeps the build info (and so dispatch.cu) as it was."""
    spec, tc, _ = fake
    B.build(spec, toolchain=tc, log=quiet)
    dispatch = B.plan(spec).out_dir / "src" / "dispatch.cu"
    plain = dispatch.read_text()
    assert '\\"defines\\"' not in plain and "defines" not in plain
    B.build(spec, toolchain=tc, log=quiet, defines=["FA3GEN_FWD_NO_CLUSTER2"])
    assert '"defines": ["FA3GEN_FWD_NO_CLUSTER2"]'.replace('"', '\\"') in dispatch.read_text()


def test_a_generated_root_that_is_a_file_is_said_before_anything(fake, tmp_path, monkeypatch):
    """FA3GEN_GENERATED naming a file: the dry run reported success, the build failed later."""
    spec, tc, _ = fake
    not_a_folder = tmp_path / "gen_file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("FA3GEN_GENERATED", str(not_a_folder))
    for dry in (True, False):
        with pytest.raises(GeneratorError, match="is a file, not a folder"):
            B.build(spec, toolchain=tc, dry_run=dry, log=quiet)


def _ninja_project(folder: Path, command: str, outputs: int = 3) -> None:
    rules = f"rule run\n  command = {command}\n  description = RUN $out\n"
    edges = "".join(f"build out{i}: run\n" for i in range(outputs))
    (folder / "build.ninja").write_text(rules + edges)
    (folder / "obj").mkdir()


def test_a_reader_that_leaves_stops_the_echo_not_the_build(tmp_path, monkeypatch):
    """`fa3gen build | head -2`: the pipe breaks on the first lines, the build goes on (it used
    to stop, and the CLI took the broken pipe for success with nothing built); a closed stdout
    (`>&-`, sys.stdout None) builds silently."""
    import io

    from generator.ninja import run_ninja

    class LeftReader(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    for stdout in (LeftReader(), None):
        folder = tmp_path / ("pipe" if stdout else "closed")
        folder.mkdir()
        _ninja_project(folder, f"{sys.executable} -c \"print('x' * 80)\" && touch $out")
        monkeypatch.setattr(sys, "stdout", stdout)
        proc = run_ninja(folder, jobs=1)
        monkeypatch.undo()
        assert proc.returncode == 0 and all((folder / f"out{i}").is_file() for i in range(3))



def _build_in_a_process(spec, tc, env):
    """fa3gen's build of `spec` in its own process (session), stdout to a pipe as a terminal's."""
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path\n"
              "from generator import build as B; from generator.toolchain import Toolchain\n"
              "nvcc, spec = sys.argv[2:4]\n"
              "tc = Toolchain(Path(nvcc), 'fake nvcc 1', Path('/opt/cutlass/include'), '4.2.0', "
              "tuple(sys.argv[4:]))\n"
              "B.build(Path(spec), toolchain=tc, jobs=1)")
    return subprocess.Popen([sys.executable, "-c", script, str(REPO_ROOT), str(tc.nvcc),
                             str(spec), *tc.flags], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_killed_build_keeps_the_folder_locked_while_its_compiles_run(fake, tmp_path):
    """`kill -9` of fa3gen: its ninja dies at its next line, the compile already running goes
    on. That compile keeps the folder locked, so `fa3gen clean` refuses and the next build
    waits for it (the lock used to die with fa3gen, the compile going on unlocked)."""
    import signal

    from generator.lock import KILLED_BUILDS_COMPILES, _compiles_busy, lock_unless_busy

    spec, tc, _ = fake
    env = {**os.environ, "FAKE_NVCC_SLEEP": "5"}
    proc = _build_in_a_process(spec, tc, env)
    out = B.plan(spec).out_dir
    deadline = time.monotonic() + 60
    while not _compiles_busy(out):  # a variant's compile holds its lock
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    with lock_unless_busy(out) as holder:
        assert holder == KILLED_BUILDS_COMPILES
    said = []
    started = time.monotonic()
    res = B.build(spec, toolchain=tc, log=said.append)
    assert any("are still running; waiting for them" in m for m in said)
    assert time.monotonic() - started > 0.5 and res.library.exists()
    assert not list((out / "obj").glob("*.compiling"))
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)


def test_a_compile_a_newer_build_superseded_does_not_run(tmp_path, monkeypatch, capsys):
    """fa3gen killed while its ninja was still starting compiles: a compile that takes the
    compiles' lock only after the next build has taken the folder finds that build's pid in
    .build.lock and does not run (the next build's wait had let it through)."""
    from generator import compile_one
    from generator.lock import BUILD_PID_ENV, COMPILES_LOCK_ENV

    (tmp_path / "obj").mkdir()
    (tmp_path / ".build.lock").write_text("222\n")
    monkeypatch.setenv(COMPILES_LOCK_ENV, str(tmp_path / ".compiles.lock"))
    out = tmp_path / "obj" / "u.o"
    argv = ["--name", "u", "--out", str(out), "--resources", str(tmp_path / "obj" / "u.json"),
            "--", "touch", str(out)]
    monkeypatch.setenv(BUILD_PID_ENV, "111")  # started by a killed build
    assert compile_one.main(argv) == 1 and not out.exists()
    assert "build 222 holds the folder now" in capsys.readouterr().err
    monkeypatch.setenv(BUILD_PID_ENV, "222")  # the live build's own
    assert compile_one.main(argv) == 0 and out.exists()
    # a lock it cannot open (the folder gone): compiles, holding nothing
    monkeypatch.setenv(COMPILES_LOCK_ENV, str(tmp_path / "gone" / ".compiles.lock"))
    out.unlink()
    assert compile_one.main(argv) == 0 and out.exists()


def test_clean_claims_the_folder_before_it_checks_for_compiles(tmp_path):
    """lock_unless_busy writes its pid into .build.lock before it looks for running compiles,
    so a compile a killed build's ninja starts after that check does not run in a folder that
    `fa3gen clean` is deleting."""
    from generator.lock import lock_unless_busy

    (tmp_path / ".build.lock").write_text("111\n")  # the killed build's
    with lock_unless_busy(tmp_path) as holder:
        assert holder is None
        assert (tmp_path / ".build.lock").read_text() == f"{os.getpid()}\n"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_compiles_daemon_never_keeps_the_folder_locked(fake, monkeypatch, tmp_path):
    """The compiles' lock is close-on-exec: a daemon that a compiler launcher or nvcc leaves
    behind (sccache's server) does not inherit it, and the folder is free once the build ends."""
    import signal

    from generator.lock import lock_unless_busy

    spec, tc, _ = fake
    pids = tmp_path / "daemons.txt"
    launcher = tmp_path / "daemonize"
    # The daemon leaves stdio (or ninja would wait for its output's end) and keeps every other
    # descriptor it inherited, as a server forked from a launcher does.
    launcher.write_text(f"#!/bin/sh\nsleep 30 </dev/null >/dev/null 2>&1 &\necho $! >> {pids}\n"
                        "exec \"$@\"\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FA3GEN_COMPILER_LAUNCHER", str(launcher))
    try:
        res = B.build(spec, toolchain=tc, log=quiet)
        assert res.library.exists() and len(pids.read_text().split()) >= 2  # daemons running
        with lock_unless_busy(res.plan.out_dir) as holder:
            assert holder is None
    finally:
        for pid in (pids.read_text().split() if pids.exists() else []):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_another_spec_file_of_the_same_name_says_it_replaces_the_build(fake, tmp_path):
    """One output folder a spec name: a second spec file with the same `name:` replaces the
    first's library, and the build says so (it used to note only removed compile units)."""
    spec, tc, _ = fake
    B.build(spec, toolchain=tc, log=quiet)
    other = tmp_path / "elsewhere" / "t.yaml"
    other.parent.mkdir()
    other.write_text(SPEC)
    said = []
    B.build(other, toolchain=tc, log=said.append)
    assert any("warning:" in m and f"held the build of {spec.resolve()}" in m for m in said)
    said.clear()
    B.build(other, toolchain=tc, log=said.append)  # its own build again: nothing to say
    assert not any("warning:" in m for m in said)
