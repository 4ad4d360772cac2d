#!/usr/bin/env python3
"""Stands in for nvidia-smi in the CPU tests of fa3gen.timing.PowerSampler. With -lms=N it prints
a header-free sample line every N milliseconds (values from FAKE_SMI_VALUES, cycled: "power,
clock" or "power, clock, reasons mask"), with an "[N/A]" line first, until terminated. Without
-lms it is a one-shot query (PowerSampler's probe for the clock-event reasons field): it answers
one line and exits 0, or exits 2 when FAKE_SMI_NO_REASONS is set (a driver without the field)."""
import os
import sys
import time

lms = [a for a in sys.argv if a.startswith("-lms=")]
if not lms:
    if os.environ.get("FAKE_SMI_NO_REASONS"):
        sys.exit(2)
    print("0x0000000000000000")
    sys.exit(0)
period = int(lms[0].split("=")[1])
values = os.environ.get("FAKE_SMI_VALUES", "300.0, 1980").split(";")
print("[N/A], [N/A]", flush=True)
i = 0
while True:
    print(values[i % len(values)], flush=True)
    i += 1
    time.sleep(period / 1000)
