"""Runs a command (ninja) while this process holds the descriptor it inherited (the build lock),
which the command does not get.

`fa3gen build` hands the lock to this holder rather than to ninja itself: the holder lives as
long as ninja does, even if fa3gen is killed, so a second build cannot start beside a running
ninja; and ninja's own children (compiles, a compiler launcher whose daemon, e.g. sccache's
server, would outlive the build) never hold the lock.

    python -m generator.hold_lock ninja -C ...
"""
from __future__ import annotations

import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    child = subprocess.Popen(argv, close_fds=True)  # the lock's descriptor stays here
    for sig in (signal.SIGTERM, signal.SIGINT):  # fa3gen stops ninja through this process
        signal.signal(sig, lambda number, frame: child.send_signal(number))
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
