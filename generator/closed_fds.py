"""Run a command with only stdin, stdout and stderr open, and exit with its status.

ninja holds the build lock's descriptor (run_ninja's hold_fds) so that its compiles keep the
output folder locked even past a killed `fa3gen`. A compiler launcher's daemon (sccache's
server, forked by the first compile) would inherit it too and keep the folder locked for
good, so build.ninja runs a launcher through this (ninja.render_build_ninja's `launcher`).
Stdlib only: it runs once per compile.
"""
import subprocess
import sys


def main(argv: list) -> int:
    if not argv:
        print("usage: python -m generator.closed_fds COMMAND [ARG ...]", file=sys.stderr)
        return 2
    return subprocess.run(argv, close_fds=True).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
