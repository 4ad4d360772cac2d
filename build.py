#!/usr/bin/env python3
"""Thin wrapper over `fa3gen build`: python build.py --spec specs/h100.yaml [-j N] [--check]

--check: after a successful build, run fa3gen.checks.quick_check() on the new library when
a CUDA device is present (skipped with a message otherwise).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # usable without `pip install -e .`

from fa3gen.cli import build_parser, main as cli_main  # noqa: E402
from fa3gen.errors import Fa3genError  # noqa: E402
from generator.errors import GeneratorError  # noqa: E402


def quick_check(spec: str) -> int:
    try:
        import torch
    except ImportError:
        print("build.py: --check skipped: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("build.py: --check skipped: no CUDA device")
        return 0
    from fa3gen import checks
    from fa3gen.cli import _spec_name
    checks.quick_check(spec=_spec_name(spec))  # the library just built, by its spec's name
    return 0


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)  # --check is build.py's own; fa3gen build's options follow
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    rc = cli_main(["build", *argv])
    if rc == 0 and check:
        # What the build took (abbreviations such as --sp too): its parser reads argv again.
        args = build_parser().parse_args(["build", *argv])
        if args.dry_run:
            return rc
        try:
            rc = quick_check(args.spec)
        except (Fa3genError, GeneratorError) as e:
            # A failing check or a missing library: the message says what to do, no traceback.
            print(f"build.py: error: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
