"""When do `nvidia-smi -lms` lines arrive through a pipe, as fa3gen.timing.PowerSampler reads
them (it tags each sample when its line is read)? Each line's own timestamp against its read
time, and the gaps between reads, for --seconds of a bf16 GEMM load on device 0.

    python3 tests/gpu/smi_pipe.py [--seconds 4]
"""
import argparse
import datetime
import json
import statistics
import subprocess
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    import torch

    argv = ["nvidia-smi", "--query-gpu=timestamp,power.draw.instant,clocks.sm",
            "--format=csv,noheader,nounits", "-lms=20", "--id=0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows = []

    def read():
        for line in proc.stdout:
            rows.append((time.time(), line.strip()))

    threading.Thread(target=read, daemon=True).start()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + args.seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    proc.terminate()
    proc.wait(5)
    time.sleep(0.2)
    lags, reads = [], [r for r, _ in rows]
    for read_at, line in rows:
        try:
            stamp = datetime.datetime.strptime(line.split(",")[0].strip(),
                                               "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        lags.append(read_at - stamp)
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    print(json.dumps({"lines": len(rows),
                      "lag_s_median": statistics.median(lags) if lags else None,
                      "lag_s_max": max(lags) if lags else None,
                      "read_gap_s_median": statistics.median(gaps) if gaps else None,
                      "read_gap_s_max": max(gaps) if gaps else None,
                      "first_lines": [line for _, line in rows[:3]]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
