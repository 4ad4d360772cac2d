"""The `fa3gen` command line: build, list, clean (+ commands from other modules).

Only generator.* (pure Python) is imported at module level: no torch, so the CLI starts
fast and runs on build machines without a GPU or a CUDA torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from fa3gen.contract import MANIFEST_NAME, SPEC_SUFFIXES, generated_root
from fa3gen.files import StdoutWithoutReader, stdout_to_devnull
from generator.errors import BuildError, GeneratorError
from generator.lock import KILLED_BUILDS_COMPILES, lock_unless_busy
from generator.paths import resolve_spec_path

# Modules that add subcommands through `register(subparsers)` (each sets `func`).
# Imported only when the command line asks for something that is not built in.
COMMAND_MODULES = ("fa3gen.bench", "fa3gen.ablate", "fa3gen.tune", "fa3gen.numerics")
BUILTIN_COMMANDS = ("build", "list", "clean", "package", "spec")
# Commands whose output is what the reader wants: when the reader leaves they stop. The
# others (their work is files: a build, a spec, a wheel, a measurement) go on without it.
OUTPUT_COMMANDS = ("list",)


def cmd_build(args: argparse.Namespace) -> int:
    from generator.build import build
    build(args.spec, only=args.only, exclude=args.exclude, jobs=args.jobs,
          dry_run=args.dry_run, compiler_launcher=args.launcher,
          allow_spills=args.allow_spills, debug=args.debug, lineinfo=args.lineinfo,
          defines=args.define, units=args.unit_size)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from generator.build import filter_notes, plan
    from generator.render import has_quantizer
    p = plan(args.spec, args.only, args.exclude)
    for warning in p.warnings:
        print(f"fa3gen: warning: {warning}", file=sys.stderr)
    for note in filter_notes(p):  # as `build` says them: list previews a filtered build
        print(f"fa3gen: note: {note}", file=sys.stderr)
    defaults = {v.name for v in p.defaults.values()}
    ranges: dict[str, list[str]] = {}  # range defaults: name -> ["lo-hi", ...]
    for *_, lo, hi, name in p.seqlen_dispatch():
        ranges.setdefault(name, []).append(f"{lo}-{hi}")
    for v in sorted(p.variants):  # field order: d64 before d128
        if v.name in defaults:
            print(f"* {v.name}")
        elif v.name in ranges:
            print(f"+ {v.name}  (seqlen_k {', '.join(ranges[v.name])})")
        else:
            print(f"  {v.name}")
    also = []  # the CuTe-free kernels the library holds beside the variants (not variants)
    if p.spec.decode:
        also.append("the KV-cache decode kernels for "
                    + ", ".join(f"{dtype} d{head_dim}" for dtype, head_dim in p.spec.decode))
    if has_quantizer(p.variants):
        also.append("the fp8 quantizer (fa3gen.quantize_fp8; e4m3 variants)")
    if also:
        print(f"# the library also holds {' and '.join(also)}", file=sys.stderr)
    if args.explain:
        for x in sorted(p.enumeration.pruned, key=lambda x: x.variant):
            print(f"- {x.variant.name}  pruned by {x.constraint}: {x.reason}")
        print(f"# {len(p.variants)} variant(s), {len(p.enumeration.pruned)} pruned; "
              "* = dispatch default, + = default for a seqlen_k range", file=sys.stderr)
    return 0


def _spec_name(spec: str) -> str:
    """Name of the generated/ subdirectory for --spec (a path, or a bare spec name). A spec
    file that exists but does not parse gives its stem (so a broken spec's build can be
    cleaned); a .yaml path to no file is an error (a typo must not pick a build by its stem)."""
    from fa3gen.runtime import spec_name_of_file

    path = resolve_spec_path(spec)
    if path.is_file():
        return spec_name_of_file(path)
    if path.suffix in SPEC_SUFFIXES:
        raise GeneratorError(f"--spec {spec!r}: no such spec file")
    if os.sep in spec:  # a path, as build reads it (not a name): build's error, not its basename
        from generator.spec import spec_file_error
        raise spec_file_error(path)
    return Path(spec).name  # a bare name as given: spec names may hold dots (h100.v2)


def _spec_file_mismatch(spec: str, manifest: Path) -> tuple[str, str | None] | None:
    """contract.spec_file_mismatch of --spec against the build `manifest` records, where --spec
    is a spec file (a bare name means that folder's build: None)."""
    from fa3gen.contract import read_manifest, spec_file_mismatch

    path = Path(spec)
    if resolve_spec_path(spec) != path or not path.is_file():
        return None
    return spec_file_mismatch(read_manifest(manifest), path)


def _check_built_from(spec: str, name: str) -> None:
    """--spec FILE must be the file whose build generated/<name> holds, as it is now: a wheel
    ships what its spec file says."""
    from fa3gen.contract import manifest_path

    mismatch = _spec_file_mismatch(spec, manifest_path(name))
    if mismatch and mismatch[0] == "other":
        raise GeneratorError(f"--spec {spec}: the build of spec {name!r} was made from "
                             f"{mismatch[1]}, another spec file with that name, not from "
                             f"{Path(spec).resolve()}; build it first (fa3gen build --spec "
                             f"{spec}), or package that build with --spec {mismatch[1]}")
    if mismatch:
        raise GeneratorError(f"--spec {spec} changed since the build of spec {name!r} (edited, "
                             f"or rewritten by fa3gen tune); build it again first: fa3gen build "
                             f"--spec {spec}")


# What a build folder holds: generator/build.py writes build.ninja and fingerprint.txt before
# compiling, manifest.json after. clean removes only folders that hold both or the manifest.
_BUILD_MARKERS = (("build.ninja", "fingerprint.txt"), (MANIFEST_NAME,))


def _is_build(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and \
        any(all((folder / m).is_file() for m in names) for names in _BUILD_MARKERS)


def cmd_clean(args: argparse.Namespace) -> int:
    root = generated_root()
    if args.spec is None:  # no --spec: every build under the root, nothing else
        entries = sorted(root.iterdir()) if root.is_dir() else []
        builds = [d for d in entries if _is_build(d)]
        others = [d.name for d in entries if d not in builds]
        for d in builds:
            _remove_build(d, skip_busy=True)
        if not builds:
            print(f"fa3gen: no builds to clean in {root}")
        if others:
            print(f"fa3gen: left {len(others)} entr{'y' if len(others) == 1 else 'ies'} of {root} "
                  f"that are not builds: {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}")
        return 0
    from generator.spec import _NAME_RE  # one spec's build: a spec name, strictly inside the root

    name = _spec_name(args.spec)
    if not _NAME_RE.match(name):
        raise GeneratorError(f"--spec {args.spec!r} names no spec build ({name!r} is not a "
                             "spec name); `fa3gen clean` without --spec removes every build")
    target = root / name
    if target.resolve().parent != root.resolve():
        raise GeneratorError(f"refusing to remove {target}: not inside {root}")
    if not target.exists():
        print(f"fa3gen: nothing to clean at {target}")
        return 0
    if not _is_build(target):
        raise GeneratorError(f"refusing to remove {target}: not an fa3gen build (no {MANIFEST_NAME}, "
                             "nor build.ninja with fingerprint.txt)")
    _check_not_another_files(args.spec, name, target)
    _remove_build(target, skip_busy=False)
    return 0


def _check_not_another_files(spec: str, name: str, target: Path) -> None:
    """clean --spec FILE removes FILE's build, not the build of another spec file with the same
    `name:` that holds the folder (its name says which folder is meant)."""
    mismatch = _spec_file_mismatch(spec, target / MANIFEST_NAME)
    if mismatch and mismatch[0] == "other":
        raise GeneratorError(f"refusing to remove {target}: it holds the build of {mismatch[1]}, "
                             f"another spec file named {name!r}; remove it by name: fa3gen clean "
                             f"--spec {name}")


def _remove_build(folder: Path, skip_busy: bool) -> None:
    """Remove a build folder under its build lock: a build running there is left alone (an
    error, or with skip_busy a note), never deleted from under its compiles."""
    with lock_unless_busy(folder) as holder:
        if holder is not None:
            busy = f"{folder} is being built ({holder})"
            if not skip_busy:
                them = "them" if holder == KILLED_BUILDS_COMPILES else "that build"
                raise GeneratorError(f"refusing to remove {busy}: wait for {them} to end")
            print(f"fa3gen: {busy}; left as it is")
            return
        shutil.rmtree(folder)
    print(f"fa3gen: removed {folder}")


def cmd_package(args: argparse.Namespace) -> int:
    from fa3gen.contract import manifest_path
    from fa3gen.package import package
    name = _spec_name(args.spec)
    with lock_unless_busy(manifest_path(name).parent) as holder:  # one build's library and manifest
        if holder is not None:
            raise GeneratorError(f"spec {name!r} is being built ({holder}); package it when "
                                 "that build ends")
        _check_built_from(args.spec, name)  # under the lock: a build may be writing the manifest
        wheel = package(name, args.out, args.name, args.allow_switches, spec_file=args.spec)
    print(f"fa3gen: wrote {wheel} ({wheel.stat().st_size / 1e6:.1f} MB); install it with: "
          f"pip install {wheel}")
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    from fa3gen.tracing import NO_DEFAULT_NOTE, spec_from_trace
    from generator.spec import _NAME_RE, SpecError, parse_spec
    from generator.variants import enumerate_variants, resolve_dispatch, resolve_seqlen_dispatch

    out = Path(args.output)
    traces = ", ".join(args.from_trace)
    if out.exists() and any(out.resolve() == Path(t).resolve() for t in args.from_trace):
        raise GeneratorError(f"-o {args.output} is the trace itself: write the spec elsewhere")
    name = args.name or out.stem
    if not args.name and not _NAME_RE.match(name):
        raise GeneratorError(f"-o {args.output}: the spec's name comes from the file name, and "
                             f"{name!r} is no spec name; pass --name")
    text = spec_from_trace(args.from_trace, name)  # a bad trace: TraceError, printed by main
    # What it writes must build: a bad name, or traced variants no build holds (a trace of
    # another fa3gen, an edited one), fail here and not at the build.
    spec = parse_spec(text, f"the spec from {traces}", name)
    enumeration = enumerate_variants(spec)
    if enumeration.pruned:
        raise SpecError(f"{traces}: traced variants no build holds: " + "; ".join(
            f"{x.variant.name} ({x.constraint}: {x.reason})" for x in enumeration.pruned))
    resolve_seqlen_dispatch(spec, enumeration.kept, resolve_dispatch(spec, enumeration.kept))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    for line in text.splitlines():
        if line.startswith(f"# {NO_DEFAULT_NOTE}"):
            print(f"fa3gen: warning: {line[2:]}", file=sys.stderr)
    print(f"fa3gen: wrote {args.output}; build it with: fa3gen build --spec {args.output}")
    return 0


def _non_empty(option: str):
    """An argparse type: the text, refused when empty (an unset $VAR would otherwise fall back
    to the default silently)."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{option} is empty")
        return text
    return parse


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="keep only variants whose name matches (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="drop variants whose name matches (repeatable)")


def _register_extra(sub) -> None:
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # not written yet: fine
            print(f"fa3gen: warning: commands of {name} unavailable: {e}", file=sys.stderr)
            continue
        except Exception as e:  # a broken extra must not break build/list/clean
            print(f"fa3gen: warning: commands of {name} unavailable: {e}", file=sys.stderr)
            continue
        if hasattr(mod, "register"):
            mod.register(sub)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser(extra: bool = True) -> argparse.ArgumentParser:
    from fa3gen import __version__
    from fa3gen.contract import ABI_VERSION

    ap = argparse.ArgumentParser(prog="fa3gen", description="FlashAttention-3-style kernel "
                                 "generator for Hopper (sm_90a)")
    ap.add_argument("--version", action="version",
                    version=f"fa3gen {__version__} (C ABI {ABI_VERSION})")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    b = sub.add_parser("build", help="render and compile a spec into a shared library")
    b.add_argument("--spec", required=True, help="spec YAML path or name in specs/ (e.g. h100)")
    _add_filters(b)
    b.add_argument("-j", "--jobs", type=positive_int, default=None,
                   help="parallel compiles (default: min(cores, free GiB / 4))")
    b.add_argument("--unit-size", type=positive_int, default=None, metavar="N",
                   help="variants of one direction, dtype and head dim compiled together in a "
                        "translation unit, at most N (default: $FA3GEN_UNIT_SIZE, else 16; 1: "
                        "one a TU, more parallel but several times the total work)")
    b.add_argument("--dry-run", action="store_true", help="show what would be rebuilt")
    b.add_argument("--allow-spills", action="store_true",
                   help="accept variants that spill or lose setmaxnreg (FA3GEN_ALLOW_SPILLS=1)")
    b.add_argument("--launcher", default=None,
                   help="compiler launcher, e.g. ccache (default: $FA3GEN_COMPILER_LAUNCHER; "
                        "\"\": none)")
    b.add_argument("--debug", action="store_true", help="device asserts on, -lineinfo")
    b.add_argument("--lineinfo", action="store_true", help="add -lineinfo")
    b.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a preprocessor definition for every compile (repeatable), for "
                        "debugging builds: FA3GEN_DECODE_TRACE stamps the decode split kernel's "
                        "phases (tests/gpu/trace_decode.py)")
    b.set_defaults(func=cmd_build)

    ls = sub.add_parser("list", help="list the variants a spec builds (* = dispatch default)")
    ls.add_argument("--spec", required=True, help="spec YAML path or name in specs/")
    _add_filters(ls)
    ls.add_argument("--explain", action="store_true",
                    help="also list pruned variants and the constraint that dropped each")
    ls.set_defaults(func=cmd_list)

    c = sub.add_parser("clean", help="remove the build of generated/<spec> (or every build in generated/)")
    c.add_argument("--spec", default=None, help="spec YAML path or name")
    c.set_defaults(func=cmd_clean)

    pk = sub.add_parser("package", help="write a built spec's library as a wheel that installs "
                        "and imports without nvcc or CUTLASS")
    pk.add_argument("--spec", required=True, help="spec YAML path or name (built already)")
    pk.add_argument("--out", type=Path, default=Path("dist"), help="directory for the wheel (default dist/)")
    pk.add_argument("--allow-switches", action="store_true",
                    help="package a library built with --define or --debug (refused otherwise; "
                         "its version says .switches)")
    pk.add_argument("--name", default=None, type=_non_empty("--name"),
                    help="import package and distribution name (default fa3gen_<spec name>)")
    pk.set_defaults(func=cmd_package)

    sp = sub.add_parser("spec", help="write the smallest spec that builds the variants a trace "
                        "recorded (fa3gen.trace / FA3GEN_TRACE)")
    sp.add_argument("--from-trace", required=True, nargs="+", metavar="TRACE",
                    help="trace YAML file(s): several (a job's ranks or nodes traced to files "
                    "of their own) make one spec")
    sp.add_argument("-o", "--output", required=True, help="spec YAML to write")
    sp.add_argument("--name", default=None, type=_non_empty("--name"),
                    help="the spec's name (default: the output file's stem)")
    sp.set_defaults(func=cmd_spec)

    if extra:
        _register_extra(sub)
    return ap


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def _error(message: str) -> None:
    print(f"fa3gen: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    # Built-in commands skip importing the extra modules (they may import torch).
    parser = build_parser(extra=first not in BUILTIN_COMMANDS)
    args = parser.parse_args(argv)
    on_main = threading.current_thread() is threading.main_thread()
    # SIGTERM as Ctrl-C while a command runs: a killed build stops ninja and its compiles
    # before it lets go of the build lock (generator/ninja.py: run_ninja), not orphaning them.
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    stdout = sys.stdout
    if stdout is not None and args.command not in OUTPUT_COMMANDS:
        sys.stdout = StdoutWithoutReader(stdout)
    try:
        return _run(args)
    finally:
        if sys.stdout is not stdout:
            sys.stdout.flush()  # here, where a reader that left is not an error
            sys.stdout = stdout
        if on_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except BuildError as e:
        _error(str(e))
        return 1
    except GeneratorError as e:
        _error(str(e))
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except ImportError as e:  # bench, ablate, tune, numerics import torch when they run
        if e.name != "torch":
            raise
        _error(f"`fa3gen {args.command}` needs torch, which cannot be imported here ({e}); "
               "install it (a CUDA build to run the kernels)")
        return 2
    except BrokenPipeError:  # the reader of stdout left (`| head`)
        stdout_to_devnull()
        if args.command in OUTPUT_COMMANDS:  # it only prints: what the reader wanted, it has
            return 0
        _error("stdout was closed before the command finished (its reader left); it did not "
               "complete")
        return 1
    except OSError as e:  # an output path that is a folder, a missing parent, a full disk
        _error(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
        return 2
    except Exception as e:
        # Errors of the runtime side (fa3gen.errors) are user-facing too: no traceback.
        if type(e).__module__ == "fa3gen.errors":
            _error(str(e))
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
