"""Write build.ninja and run ninja.

One compile edge per translation unit, a compile unit of variants (generator/units.py),
through generator/compile_one.py, which checks ptxas resources; plus one link edge. Every
edge depends on fingerprint.txt, so a toolchain or Jinja template change rebuilds everything;
kernel headers come from nvcc's per-TU depfiles, so a header edit rebuilds only the units that
include it.
"""
from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jinja2

from fa3gen.contract import Variant, library_name
from fa3gen.files import stdout_to_devnull

from .errors import GeneratorError, ToolchainError
from .lock import BUILD_PID_ENV, COMPILES_LOCK_ENV, COMPILES_LOCK_NAME
from .paths import KERNELS_DIR, REPO_ROOT
from .progress import Progress
from .render import PLAIN_UNIT_HEADERS, environment, plain_units, write_if_changed
from .toolchain import Toolchain
from .units import partition, traits_mangled


def find_ninja() -> str:
    """The ninja from the `ninja` pip package, else one on PATH."""
    try:
        import ninja as ninja_pkg  # the pip package: a binary in ninja.BIN_DIR
        cand = Path(ninja_pkg.BIN_DIR) / "ninja"
        if cand.is_file():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise ToolchainError("ninja not found: pip install ninja")
    return found


def _path(p) -> str:
    """Escape a path for a ninja build line."""
    return re.sub(r"([$ :])", r"$\1", str(p))


def _split_launcher(launcher: str) -> list[str]:
    try:
        return shlex.split(launcher)
    except ValueError as e:  # an unclosed quote
        raise GeneratorError(f"compiler launcher {launcher!r} (--launcher or "
                             f"$FA3GEN_COMPILER_LAUNCHER): {e}") from e


def check_launcher(launcher: str) -> None:
    """The launcher's program is on PATH (else every compile fails, and a dry run says nothing)."""
    args = _split_launcher(launcher)
    if args and shutil.which(args[0]) is None:
        raise GeneratorError(f"compiler launcher {launcher!r} (--launcher or "
                             f"$FA3GEN_COMPILER_LAUNCHER): {args[0]!r} is not a program on PATH")


def _cmd(args) -> str:
    """Shell-quote arguments and escape them for a ninja variable."""
    return " ".join(shlex.quote(str(a)) for a in args).replace("$", "$$")


def _without_ptxas_v(flags) -> list[str]:
    """The dispatch TU has no kernel: its ptxas report would only be noise."""
    out, flags = [], list(flags)
    for i, f in enumerate(flags):
        if f == "-v" and i and flags[i - 1] == "-Xptxas":
            out.pop()
            continue
        out.append(f)
    return out


def _interpreter() -> str:
    """The Python that runs compile_one (stdlib only), as one stable path. `python3 build.py`
    and `fa3gen build` start the same venv interpreter through different names (python3,
    python); spelled differently in build.ninja, every compile command "changed" and ninja
    rebuilt the whole spec when a user switched between the two."""
    return os.path.realpath(sys.executable)


def render_build_ninja(spec_name: str, variants: list[Variant], tc: Toolchain,
                       launcher: str | None = None, kernels_dir: Path = KERNELS_DIR,
                       env: jinja2.Environment | None = None,
                       units: list | None = None, linked: list | None = None,
                       decode: tuple = ()) -> str:
    """build.ninja linking the compile units `linked` (generator/units.py; default: one per
    variant of `variants`), with a compile edge for each of `units` (default: `linked`; they
    include `linked`): a filtered build lists the spec's units too, so that it leaves their
    records."""
    env = env or environment()
    implicit = "fingerprint.txt"  # kernel headers: per-TU depfiles (build.ninja.j2)
    linked = list(linked) if linked is not None else partition(variants, 1)
    # ninja starts edges in file order on a clean build (later it weighs them by the times in
    # .ninja_log): the slow TUs (extended WGMMA shapes, about twice the others; then the units
    # of more variants) go first, so that none of them starts last and stretches the build.
    compiled = sorted(units if units is not None else linked,
                      key=lambda u: (not u.extended_mma_shapes, -len(u.variants), u.name))
    kernels = {u.name: " ".join(f"--kernel {v.name}={traits_mangled(v)}" for v in u.variants)
               for u in compiled}
    return env.get_template("build.ninja.j2").render(
        spec_name=spec_name, variants=variants, linked=linked, compiled=compiled, kernels=kernels,
        repo_root=_cmd([REPO_ROOT]), python=_cmd([_interpreter()]), nvcc=_cmd([tc.nvcc]),
        launcher=_cmd(_split_launcher(launcher)) if launcher else "",
        cflags=_cmd(tc.flags), cflags_plain=_cmd(_without_ptxas_v(tc.flags)),
        ldflags=_cmd(tc.link_flags),
        implicit=implicit, abi_header=_path(Path(kernels_dir) / "fa3gen_abi.h"),
        plain_units={unit: " ".join(_path(Path(kernels_dir) / h) for h in plain_unit_headers(unit))
                     for unit in plain_units(variants, decode)},
        library=library_name(spec_name))


def plain_unit_headers(unit: str) -> tuple[str, ...]:
    """The headers in templates/kernels a CuTe-free unit includes, directly or not (its rule
    has no depfile, so its edges name them; a test follows the includes to hold this true)."""
    return (*PLAIN_UNIT_HEADERS[unit], "launch_common.cuh", "simt_common.cuh",
            "rescale_threshold.cuh", "fa3gen_abi.h")


def write_build_ninja(out_dir: Path, text: str) -> bool:
    return write_if_changed(Path(out_dir) / "build.ninja", text)


def _ninja_cmd(out_dir: Path, jobs: int, dry_run: bool, build_file: Path | None = None) -> list[str]:
    # -k 0: keep going, so one build reports every failing variant, not just the first.
    return ([find_ninja(), "-C", str(out_dir), "-j", str(jobs), "-k", "0"]
            + (["-f", str(build_file)] if build_file else []) + (["-n"] if dry_run else []))


def _ninja_env(allow_spills: bool, out_dir: Path) -> dict:
    env = dict(os.environ)
    if allow_spills:
        env["FA3GEN_ALLOW_SPILLS"] = "1"
    # compile_one holds it while it compiles (generator/lock.py); not in the command lines,
    # whose change would rebuild everything
    env[COMPILES_LOCK_ENV] = str(Path(out_dir).absolute() / COMPILES_LOCK_NAME)
    env[BUILD_PID_ENV] = str(os.getpid())
    # finished/total and elapsed seconds: the progress line and planned_edges parse this format
    env["NINJA_STATUS"] = "[%f/%t %es] "
    return env


def run_ninja(out_dir: Path, jobs: int, dry_run: bool = False, allow_spills: bool = False,
              capture: bool = False, progress_every: float = 10.0,
              build_file: Path | None = None) -> subprocess.CompletedProcess:
    """Run ninja in out_dir. Captured (`capture`), or streamed to stdout with a progress line
    (generator/progress.py) whenever ninja has been silent for `progress_every` seconds; a
    reader that leaves (`| head`) or a closed stdout stops the echo, not the build."""
    cmd, env = _ninja_cmd(out_dir, jobs, dry_run, build_file), _ninja_env(allow_spills, out_dir)
    if capture:
        return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    # The total comes with ninja's first status line.
    progress = Progress(Path(out_dir) / "obj", jobs,
                        others=_other_edges(build_file or Path(out_dir) / "build.ninja"))
    lines: queue.Queue = queue.Queue()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    echo = _Echo()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            try:
                line = lines.get(timeout=progress_every)
            except queue.Empty:
                echo(progress.report() + "\n")
                continue
            if line is None:
                break
            progress.feed(line)
            echo(line)
    finally:
        # Interrupted (Ctrl-C, SIGTERM through the CLI, an error): ninja stops its compiles
        # before this returns, so the build lock is never released with them still running.
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(cmd, proc.wait())


def _other_edges(build_file: Path) -> int:
    """The edges of build.ninja that are not a unit's compile: the plain TUs and the link."""
    try:
        text = build_file.read_text()
    except OSError:
        return 0
    return len(re.findall(r"^build [^:]+: (?!nvcc_variant\b)\w+", text, re.M))


class _Echo:
    """Writes a build's output to stdout until stdout is gone: closed (`>&-`: sys.stdout is
    None) or its reader left (`| head`: a broken pipe, after which stdout goes to /dev/null so
    that later prints and the exit flush do not fail). The build itself goes on either way."""

    def __init__(self):
        self.on = sys.stdout is not None

    def __call__(self, text: str) -> None:
        if not self.on:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):  # ValueError: a stdout closed under us
            self.on = False
            stdout_to_devnull()


def objects_without_deps(out_dir: Path) -> list[str]:
    """Objects that ninja recorded with no dependencies at all. nvcc's depfile always lists at
    least the source, so such a record means the depfile was lost; ninja would then never
    rebuild the object for a kernel-header edit (a stale backward kernel was linked that way
    on 2026-11-30). The build deletes them so that they compile again."""
    proc = subprocess.run([find_ninja(), "-C", str(out_dir), "-t", "deps"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:  # no build log yet
        return []
    return re.findall(r"^(obj/[^\s:]+\.o): #deps 0\b", proc.stdout, re.M)


def planned_edges(ninja_output: str) -> list[str]:
    """Descriptions of the edges in `ninja -n` output (e.g. 'NVCC fwd_bf16_...')."""
    return [m.group(1) for m in re.finditer(r"^\[[^\]]*\]\s*(.+)$", ninja_output, re.M)]
