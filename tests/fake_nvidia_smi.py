#!/usr/bin/env python3
"""Stands in for nvidia-smi in the CPU tests of fa3gen.timing.PowerSampler: prints a header-free
"power, clock" line every -lms milliseconds (values from FAKE_SMI_VALUES, cycled), with an
"[N/A]" line first, until terminated."""
import os
import sys
import time

period = next(int(a.split("=")[1]) for a in sys.argv if a.startswith("-lms="))
values = os.environ.get("FAKE_SMI_VALUES", "300.0, 1980").split(";")
print("[N/A], [N/A]", flush=True)
i = 0
while True:
    print(values[i % len(values)], flush=True)
    i += 1
    time.sleep(period / 1000)
