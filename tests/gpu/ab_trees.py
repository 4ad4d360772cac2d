"""A/B of a kernel change in one GPU session: the same variants built from an earlier commit
and from this tree, then timed side by side by ab_libraries.py.

    python3 tests/gpu/ab_trees.py export REV          # where git has REV: its build inputs
                                                      # into ab_base/ (ignored by git)
    python3 tests/gpu/ab_trees.py run --spec h100 --only 'fwd_bf16_d128_*' [--only ...]
        [-j 16] [--seqlens 1024 4096 16384] [--rounds 3] [--min-ms 100] [--json ab.json]
    python3 tests/gpu/ab_trees.py run --quantizer --only 'fwd_e4m3_d64_nocausal*' [--json q.json]
    python3 tests/gpu/ab_trees.py run --decode --only 'fwd_bf16_d64_nocausal_m192n128*' [--no-peers ...]
    python3 tests/gpu/ab_trees.py run --a-tree --define NAME[=VALUE] --only 'fwd_e4m3_d128_*' ...
                                                      # a compile-time switch: A and B both from
                                                      # this tree, B built with the define
    python3 tests/gpu/ab_trees.py run --a-tree --b-defines 'X=1' --b-defines 'X=2 Y' --only ...
                                                      # several switches against one A build
    python3 tests/gpu/ab_trees.py run ... --check 'tests/gpu/test_backward.py -k reference' \
        [--build-only]                                # each B's tests first (a failing B is not
                                                      # timed); --build-only: build and check,
                                                      # time later with the same arguments
    python3 tests/gpu/ab_trees.py run --only VARIANT --ncu VARIANT [--json phases.json]
                                                      # where each build's warps wait (ncu)

`run` needs the GPU host to have ab_base/ (carry it with the tree when the host is another
machine) and builds both libraries at once, each into its own generated root under
--work (default /tmp/fa3gen_ab: A from ab_base, B from this tree; the tree's generated/ is
left alone), then runs ab_libraries.py on them; its JSON header names the base commit.
--quantizer runs bench_fp8_quantize.py instead (B's library loaded, A's quantizer called
through --baseline-so), --decode bench_kvcache.py the same way (A's decode kernels), --ncu
profiles one launch of the variant from each library (ncu_one_forward.py) and compares where
their warps wait (ncu_phases.py). A failed build names the failing variants and why (a
resource check: spills); --allow-spills passes build.py's flag to both builds.

Not a pytest module.
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from fa3gen.contract import library_name, parse_name
from generator.paths import resolve_spec_path
from generator.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
BASE_DIR = ROOT / "ab_base"
# What a build reads: the generator, the templates and specs, the runtime's contract.
BUILD_INPUTS = ("build.py", "pyproject.toml", "generator", "templates", "specs", "fa3gen")


def export(rev: str, dest: Path = BASE_DIR) -> str:
    """REV's build inputs into dest (replacing what was there); returns REV's full hash."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit, *BUILD_INPUTS],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} failed")
    (dest / "AB_BASE_COMMIT").write_text(commit + "\n")
    return commit


def b_sides(b_sets: list[tuple[str, ...]]) -> list[str]:
    """The B builds' names: B alone, or B1, B2, ... for several sets of defines."""
    return ["B"] if len(b_sets) <= 1 else [f"B{i}" for i in range(1, len(b_sets) + 1)]


def build_commands(spec: str, only: list[str], jobs: int, work: Path, base: Path = BASE_DIR,
                   b_sets: tuple[tuple[str, ...], ...] | list = ((),), allow_spills: bool = False):
    """[(cwd, env additions, argv)] of the builds: A in `base`, then one B in this tree per set
    of defines in b_sets (`--define` for each; B alone, or B1, B2, ...), the compile jobs split
    between them."""
    args = ["--spec", spec, "-j", str(max(1, jobs // (1 + len(b_sets)))),
            *(["--allow-spills"] if allow_spills else [])]
    for glob in only:
        args += ["--only", glob]
    sides = [(base, "A", ())] + [(ROOT, side, defines) for side, defines in zip(b_sides(b_sets), b_sets)]
    return [(tree, {"FA3GEN_GENERATED": str(work / side), "PYTHONPATH": str(tree)},
             [sys.executable, "build.py", *args, *(a for d in defines for a in ("--define", d))])
            for tree, side, defines in sides]


def json_for(ab_args: list[str], side: str) -> list[str]:
    """ab_args with --json's path suffixed by the side (a.json -> a_B2.json) for one of several
    B libraries, so that each keeps its own; unchanged for the only one (side "B")."""
    if side == "B" or "--json" not in ab_args[:-1]:
        return list(ab_args)
    i = ab_args.index("--json") + 1
    path = Path(ab_args[i])
    return [*ab_args[:i], str(path.with_name(f"{path.stem}_{side}{path.suffix}")), *ab_args[i + 1:]]


def build_failures(log_text: str, limit: int = 8) -> list[str]:
    """The lines of a build log that say which variant failed and why (a resource check, a
    compile error), so that a failed A/B says it in its own output."""
    lines = [line.strip() for line in log_text.splitlines()
             if "failed the resource check" in line or ": error" in line or line.startswith("FAILED:")]
    return [line[:300] for line in lines[:limit]]


def library(work: Path, side: str, spec: str) -> Path:
    """Where side's build of `spec` (a name in specs/ or a path from the root) puts its library."""
    path = resolve_spec_path(spec)
    name = load_spec(path if path.is_absolute() else ROOT / path).name
    return work / side / name / library_name(name)


NCU_SECTIONS = ("--section", "WarpStateStats", "--section", "SourceCounters", "--metrics",
                "gpu__time_duration.sum,smsp__inst_executed.max,smsp__inst_executed.min")


def ncu_profiles(variant: str, seqlen: int, libs: dict, work: Path, phases_args: list[str]) -> int:
    """One launch of `variant` from each side's library under ncu (ncu_one_forward.py: batch x
    seqlen = 16k tokens, hidden 2048), its source page as CSV, then ncu_phases.py on both."""
    info = parse_name(variant)
    here = Path(__file__).parent
    csvs = []
    for side, lib in libs.items():
        env = {**os.environ, "FA3GEN_LIB": lib}
        report = work / f"ncu_{side}"
        profile = ["ncu", "--profile-from-start", "off", "--clock-control", "none", *NCU_SECTIONS,
                   "-f", "-o", str(report), sys.executable, str(here / "ncu_one_forward.py"),
                   "fa3gen", str(info.head_dim), str(int(info.causal)), str(seqlen), info.dtype,
                   variant]
        if subprocess.run(profile, env=env).returncode != 0:
            raise SystemExit(f"ncu failed on side {side}")
        csvs.append(work / f"ncu_{side}.csv")
        with open(csvs[-1], "w") as out:
            page = ["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"]
            if subprocess.run(page, env=env, stdout=out).returncode != 0:
                raise SystemExit(f"ncu could not read {report}.ncu-rep")
    return subprocess.run([sys.executable, str(here / "ncu_phases.py"), *map(str, csvs),
                           *phases_args]).returncode


def run(args, ab_args: list[str]) -> int:
    defines = tuple(getattr(args, "define", None) or ())
    b_sets = [tuple(group.split()) for group in getattr(args, "b_defines", None) or ()]
    a_tree = getattr(args, "a_tree", False)
    if b_sets and (defines or not a_tree or not all(b_sets)):
        raise SystemExit("--b-defines takes the place of --define, with --a-tree: one B library "
                         "per use, each a non-empty set of defines")
    if len(b_sets) > 1 and any(getattr(args, flag, None) for flag in ("ncu", "quantizer", "decode")):
        raise SystemExit("--ncu, --quantizer and --decode compare A with one B: give one set of defines")
    b_sets = b_sets or [defines]
    if a_tree:  # a compile-time switch: both sides from this tree
        if not any(b_sets):
            raise SystemExit("--a-tree builds A and B from this tree: name the switch B gets "
                             "with --define")
        base, commit = ROOT, "this tree without " + " ".join(dict.fromkeys(d for s in b_sets for d in s))
    else:
        base = BASE_DIR
        if not (base / "AB_BASE_COMMIT").is_file():
            raise SystemExit(f"{base} is missing: run `python3 {Path(__file__).name} export REV` "
                             "where git has REV, and bring ab_base/ along")
        commit = (base / "AB_BASE_COMMIT").read_text().strip()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    builds = []
    sides = ["A", *b_sides(b_sets)]
    for (cwd, extra, argv), side in zip(build_commands(args.spec, args.only, args.jobs, work, base, b_sets,
                                                       getattr(args, "allow_spills", False)),
                                        sides):
        log = open(work / f"build_{side}.log", "w")
        builds.append((cwd, log, subprocess.Popen(argv, cwd=cwd, env={**os.environ, **extra},
                                                  stdout=log, stderr=subprocess.STDOUT)))
    failed = []
    for cwd, log, proc in builds:
        if proc.wait() != 0:
            log.close()
            why = build_failures(Path(log.name).read_text(errors="replace"))
            failed.append(f"{cwd}: see {log.name}" + "".join(f"\n  {line}" for line in why))
    if failed:
        raise SystemExit("build failed: " + "\n".join(failed) +
                         "\n(--allow-spills times variants that spill too; or leave them out of --only)")
    b_names = ", ".join(f"{side} (this tree" + (" with " + " ".join(d) if d else "") + ")"
                        for side, d in zip(sides[1:], b_sets))
    print(f"built A ({commit if a_tree else commit[:10]}) and {b_names} under {work}", flush=True)
    if getattr(args, "check", None):  # a switch's kernels checked before they are timed: a wrong one is dropped
        passed = []
        for side in sides[1:]:
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   *shlex.split(args.check)]
            env = {**os.environ, "FA3GEN_LIB": str(library(work, side, args.spec))}
            ok = subprocess.run(cmd, env=env, cwd=ROOT).returncode == 0
            print(f"check {side}: {'passed' if ok else 'FAILED, not timed'}", flush=True)
            if ok:
                passed.append(side)
        sides = ["A", *passed]
    if getattr(args, "build_only", False):
        for side in sides:
            print(f"{side}: {library(work, side, args.spec)}")
        return 0
    if len(sides) < 2:
        return 1
    lib_a, lib_b = str(library(work, "A", args.spec)), str(library(work, sides[1], args.spec))
    if getattr(args, "ncu", None):
        return ncu_profiles(args.ncu, args.ncu_seqlen, {"A": lib_a, "B": lib_b}, work, ab_args)
    bench = {"quantizer": "bench_fp8_quantize.py", "decode": "bench_kvcache.py"}
    for flag, script in bench.items():  # one kind of kernel of both, in one process
        if getattr(args, flag, False):
            cmd = [sys.executable, str(Path(__file__).with_name(script)), "--baseline-so", lib_a, *ab_args]
            return subprocess.run(cmd, env={**os.environ, "FA3GEN_LIB": lib_b}).returncode
    # each B against the same A, one after another
    return max(subprocess.run([sys.executable, str(Path(__file__).with_name("ab_libraries.py")), lib_a,
                               str(library(work, side, args.spec)), "--commit-a", commit,
                               *json_for(ab_args, side)]).returncode
               for side in sides[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_export = sub.add_parser("export", help="REV's build inputs into ab_base/")
    p_export.add_argument("rev")
    p_run = sub.add_parser("run", help="build A and B, then ab_libraries.py (other arguments "
                                       "go to it)")
    p_run.add_argument("--spec", default="h100")
    p_run.add_argument("--only", action="append", required=True,
                       help="variants to build on both sides (repeatable glob)")
    p_run.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2,
                       help="compiles in all, split between the two builds")
    p_run.add_argument("--work", default="/tmp/fa3gen_ab")
    p_run.add_argument("--quantizer", action="store_true",
                       help="time the two builds' fp8 quantizers (bench_fp8_quantize.py "
                            "--baseline-so A) instead of their attention variants; --only then "
                            "names one e4m3 variant, which brings the quantizer along")
    p_run.add_argument("--define", action="append", metavar="NAME[=VALUE]",
                       help="build B with this preprocessor definition (repeatable; build.py "
                            "--define)")
    p_run.add_argument("--time-only", action="append", default=[], metavar="GLOB",
                       help="time only the variants matching (ab_libraries.py --only; "
                            "repeatable): e.g. with --all-variants, the backward candidates "
                            "and not the forwards built for their inputs")
    p_run.add_argument("--b-defines", action="append", metavar="'NAME[=VALUE] ...'",
                       help="with --a-tree, instead of --define: one B library per use, built "
                            "with these space-separated definitions (B1, B2, ...: one A build "
                            "for several switches); each is timed against A in turn, --json "
                            "getting the side's name (ab.json -> ab_B1.json)")
    p_run.add_argument("--a-tree", action="store_true",
                       help="build A from this tree too (no export): with --define, an A/B of "
                            "a compile-time switch")
    p_run.add_argument("--allow-spills", action="store_true",
                       help="pass --allow-spills to both builds: a switch that makes one variant "
                            "spill then costs that variant's clean timing, not the whole A/B")
    p_run.add_argument("--check", metavar="'PYTEST ARGS'",
                       help="before timing, run pytest with these arguments (e.g. "
                            "\"tests/gpu/test_backward.py -k matches_reference\") against each B "
                            "library; a B that fails is reported and not timed")
    p_run.add_argument("--build-only", action="store_true",
                       help="build (and --check), print the libraries' paths, time nothing: "
                            "a later run with the same arguments finds the builds up to date")
    p_run.add_argument("--ncu", metavar="VARIANT",
                       help="instead of timing: one launch of VARIANT from each side under ncu "
                            "(warp-state sampling), then ncu_phases.py on both (other arguments "
                            "go to it, e.g. --json)")
    p_run.add_argument("--ncu-seqlen", type=int, default=16384,
                       help="--ncu's sequence length (batch x seqlen = 16k tokens)")
    p_run.add_argument("--decode", action="store_true",
                       help="time the two builds' decode kernels (bench_kvcache.py --baseline-so "
                            "A); any --only brings them along")
    args, rest = parser.parse_known_args()
    rest += [a for glob in getattr(args, "time_only", []) for a in ("--only", glob)]
    if args.command == "export":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        print(f"ab_base/ holds {export(args.rev)}")
        return 0
    return run(args, rest)


if __name__ == "__main__":
    sys.exit(main())
