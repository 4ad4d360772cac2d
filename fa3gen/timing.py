"""GPU timing shared by `fa3gen bench` and `fa3gen ablate`: CUDA-event medians, the
"a failing backend is None" wrapper, the cuBLAS GEMM ceiling and seeded inputs.

torch is imported inside the functions, so importing this module (and the CLI) stays torch-free.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

# Spin the GPU this many cycles before a timed batch so the CPU enqueues every launch while
# the GPU is busy: per-launch event times then measure the kernels, not Python overhead.
_SLEEP_CYCLES = 100_000_000
WARMUP_SECONDS = 0.3
GEMM_N = 8192  # the GEMM ceiling's square size


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of `iters` launches of fn, each between its own CUDA events."""
    import torch

    # Warm up by time as well as by count: an idle H200 sits at 345 MHz and needs a sustained
    # load to reach its 1980 MHz clock. With only a few launches of warm-up, ablation cells
    # timed after an idle gap (their correctness check) came out 2-4x slow at random.
    deadline = time.perf_counter() + WARMUP_SECONDS
    n = 0
    while n < warmup or time.perf_counter() < deadline:
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()  # keep the queue short so the deadline means GPU time
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(_SLEEP_CYCLES)
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def batch_ms(fn, launches: int) -> float:
    """Milliseconds per launch of `launches` back-to-back launches between two events."""
    return batch_ms_and_host(fn, launches)[0]


def batch_ms_and_host(fn, launches: int) -> tuple[float, float]:
    """batch_ms, and the host's milliseconds per launch to issue them (the loop's wall time
    before the closing event): where that reaches the first, the calls are host-bound."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(launches):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / launches
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / launches, host


def graph_replay(fn, calls: int):
    """The replay of a CUDA graph holding `calls` captured calls of fn (warmed up once on a side
    stream, as torch's capture recipe does; replayed once before it is returned): a call's GPU
    time with the host work captured away."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def copy_roof_gbs(nbytes: int = 2 << 30) -> float:
    """The device-to-device copy's bandwidth in GB/s (bytes read plus written), sustained: the
    roof the memory-bound kernels (decode, the fp8 quantizer) are measured against."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = sustained_ms([lambda: dst.copy_(src)], 3, 100)[0]
    return 2 * nbytes / ms / 1e6


ORDERS = ("rotate", "shuffle")  # sustained_ms's orders of the fns in a round


def settle_for(min_ms: float, settle_ms: float | None = None) -> float:
    """The untimed lead-in before each timed batch of sustained_ms: settle_ms, or half of
    min_ms when None."""
    return min_ms / 2 if settle_ms is None else settle_ms


def sustained_ms(fns: list, rounds: int, min_ms: float, tag=None, settle_ms: float | None = None,
                 order: str = "rotate", per_round: list | None = None) -> list[float]:
    """Median ms per launch of each fn, measured sustained (what a power-capped board gives in
    steady use, not a burst): rounds of back-to-back launches lasting at least min_ms each, the
    fns alternating. order "rotate" starts each round one fn later (so a fn always follows the
    same one); "shuffle" draws each round's order (seeded by the round). Each fn runs untimed for
    settle_ms (default min_ms / 2; 0 for none) right before its timed batch, with no gap: under
    the 700 W cap a call timed right after a slower, lower-power one starts with headroom and
    read up to 9% fast (the same kernel 668 after a syncing call, 614 after a fast one).
    tag(i) is called before each timed batch of fns[i] and tag(None) after it (a
    PowerSampler's `tag`). per_round, when given, receives each fn's ms of every round, in round
    order (the fns of one round ran back to back, so their ratios pair up)."""
    import random

    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    tag = tag or (lambda i: None)
    settle_ms = settle_for(min_ms, settle_ms)
    for fn in fns:  # warm-up
        batch_ms(fn, 3)
    per_launch = [batch_ms(fn, 5) for fn in fns]
    launches = [max(3, int(min_ms / ms)) for ms in per_launch]
    settles = [int(settle_ms / ms) for ms in per_launch]
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        ids = list(range(len(fns)))
        if order == "rotate":
            ids = ids[r % len(fns):] + ids[:r % len(fns)]
        else:
            random.Random(r).shuffle(ids)
        for i in ids:
            for _ in range(settles[i]):
                fns[i]()
            tag(i)
            times[i].append(batch_ms(fns[i], launches[i]))
            tag(None)
    if per_round is not None:
        per_round[:] = times
    return [statistics.median(t) for t in times]


# Steady-state timing: the 700 W board's power controller brings the clock down to the cap in
# about 200 ms after a backend starts (tests/gpu/steady_state.py, 2026-12-03), so a backend's
# steady rate is read from this many seconds into its run.
STEADY_FROM_S = 1.0


def steady_windows(fn, run_s: float, window_ms: float = 20.0, at_s: float | None = None,
                   on_time=None):
    """Back-to-back calls of fn for run_s seconds, timed in windows of about window_ms (CUDA
    events; the next window is queued before the last one is waited on, so the GPU does not
    idle between them). on_time() is called once, when at_s seconds have passed. Returns the
    host time of the start and [(host time at the window's end, window ms, calls)]."""
    import torch

    n = max(1, int(window_ms / batch_ms(fn, 3)))
    windows, pending, fired = [], None, at_s is None
    t_start = time.perf_counter()
    while True:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        if pending is not None:
            pending[1].synchronize()
            windows.append((time.perf_counter(), pending[0].elapsed_time(pending[1]), n))
        pending = (e0, e1)
        elapsed = time.perf_counter() - t_start
        if not fired and elapsed >= at_s:
            fired = True
            on_time()
        if elapsed > run_s:
            break
    pending[1].synchronize()
    windows.append((time.perf_counter(), pending[0].elapsed_time(pending[1]), n))
    return t_start, windows


def ms_per_call(windows) -> float:
    """Ms per call over steady_windows' windows."""
    return sum(w[1] for w in windows) / sum(w[2] for w in windows)


def steady_runs(fns: list, run_s: float, idle_s: float = 1.0, window_ms: float = 20.0,
                from_s: float = STEADY_FROM_S, tag=None):
    """Each fn alone: idle_s of idle GPU, then run_s of back-to-back calls (steady_windows), in
    the given order and then reversed (neither side always on a warmer board). Yields (i, host
    time of the start, windows). tag(i) is called from_s into fns[i]'s run and tag(None) after
    it (a PowerSampler's `tag`)."""
    tag = tag or (lambda i: None)
    order = list(range(len(fns)))
    for i in order + order[::-1]:
        time.sleep(idle_s)
        t_start, windows = steady_windows(fns[i], run_s, window_ms, from_s, lambda i=i: tag(i))
        tag(None)
        yield i, t_start, windows


def steady_ms(fns: list, run_s: float, idle_s: float = 1.0, window_ms: float = 20.0,
              from_s: float = STEADY_FROM_S, tag=None) -> list[float]:
    """Ms per launch of each fn in steady use (steady_runs), counted over the windows that end
    after from_s; the mean of its two runs."""
    if run_s <= from_s:
        raise ValueError(f"run_s ({run_s:g} s) must exceed the {from_s:g} s the clock needs to settle")
    for fn in fns:  # warm-up (compilation, plan caches)
        batch_ms(fn, 3)
    runs: list[list[float]] = [[] for _ in fns]
    for i, t_start, windows in steady_runs(fns, run_s, idle_s, window_ms, from_s, tag):
        runs[i].append(ms_per_call([w for w in windows if w[0] - t_start >= from_s]))
    return [statistics.fmean(r) for r in runs]


# NVML's clock-event reasons (nvidia-smi clocks_event_reasons.active, a bit mask): why the SM
# clock was below its maximum while a sample was taken.
CLOCK_REASONS = {0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clock"}


def clock_reason_names(mask: int) -> list[str]:
    """The names of the reasons set in a clocks_event_reasons mask (unknown bits as hex)."""
    names = [name for bit, name in CLOCK_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_REASONS)
    return names + ([hex(rest)] if rest else [])


def reason_counts(reason_lists) -> str:
    """"name in N, ..." over lists of reason names (most frequent first), "none" when no list
    names one: how many timed batches or backends each clock-event reason held back."""
    counts: dict[str, int] = {}
    for names in reason_lists:
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} in {n}" for name, n in sorted(counts.items(), key=lambda c: -c[1])) or "none"


def smi_id(cuda_index: int) -> str:
    """nvidia-smi's --id of CUDA device cuda_index: the board's UUID. nvidia-smi numbers boards
    in PCI order and ignores CUDA_VISIBLE_DEVICES, so CUDA's index may name another board (its
    power and clocks then reported as this one's). The index itself where torch gives no UUID."""
    try:
        import torch
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:  # noqa: BLE001 - no CUDA, an older torch: the index, as before
        return str(cuda_index)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def reasons_field(command: str = "nvidia-smi", device_index: int | str = 0) -> str | None:
    """The name under which this nvidia-smi reports the clock-event reasons (older drivers:
    clocks_throttle_reasons), or None when neither answers."""
    import subprocess

    for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        try:
            done = subprocess.run([command, f"--query-gpu={field}", "--format=csv,noheader",
                                   f"--id={device_index}"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0:
            return field
    return None


class PowerSampler:
    """Board power (W), SM clock (MHz) and the clock-event reasons sampled every period_ms by
    `nvidia-smi -lms` in the background; samples taken while tag(i) is set count for i. means()
    gives each tag's mean (power, clock), None for a tag without samples; reasons() the reasons
    seen (a clock below the cap's with no power-cap reason is the board, not the kernel). Without
    nvidia-smi (or when it fails) the sampler is inert and every mean is None: the numbers are
    optional in a report."""

    QUERY = "--query-gpu=power.draw.instant,clocks.sm"
    PROBE_REASONS = True  # add the reasons field to QUERY when this nvidia-smi has it

    def __init__(self, device_index: int = 0, period_ms: int = 20, command: str = "nvidia-smi"):
        """device_index: CUDA's index of the GPU (torch.cuda.current_device())."""
        self.command, self.device_index = command, smi_id(device_index)
        self.argv = [command, self.QUERY, "--format=csv,noheader,nounits", f"-lms={period_ms}",
                     f"--id={self.device_index}"]
        self.current = None
        self.samples: dict = {}
        self.proc = None
        self.thread = None
        # The reader thread's (tag, sample) and tag() / reset() in turn: a sample read under
        # one tag must not land in the samples of the next tag or the next measurement.
        self.lock = threading.Lock()

    def __enter__(self):
        import subprocess

        if self.PROBE_REASONS and (field := reasons_field(self.command, self.device_index)):
            self.argv[1] = f"{self.QUERY},{field}"
        try:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split(",")
            try:
                power, clock = float(parts[0]), float(parts[1])
            except (ValueError, IndexError):
                continue  # "[N/A]" or a header: not a sample
            try:
                reasons = int(parts[2], 16) if len(parts) > 2 else None
            except ValueError:
                reasons = None  # the reasons alone unreadable: power and clock still count
            with self.lock:
                if self.current is not None:
                    self.samples.setdefault(self.current, []).append((power, clock, reasons))

    def tag(self, i) -> None:
        with self.lock:
            self.current = i

    def reset(self) -> None:
        """Forget the samples so far (a new measurement reuses the tags)."""
        with self.lock:
            self.current = None
            self.samples = {}

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=5)
        if self.thread is not None:
            self.thread.join(timeout=5)
        return False

    def means(self, tags) -> dict:
        out = {}
        for t in tags:
            got = self.samples.get(t)
            out[t] = (statistics.fmean(s[0] for s in got), statistics.fmean(s[1] for s in got)) \
                if got else (None, None)
        return out

    def reasons(self, tags) -> dict:
        """tag -> the clock-event reasons set in any of its samples (sorted names; [] when the
        clock was never held back), None without samples or without the reasons field."""
        out = {}
        for t in tags:
            masks = [s[2] for s in self.samples.get(t, ()) if s[2] is not None]
            mask = 0
            for m in masks:
                mask |= m
            out[t] = sorted(clock_reason_names(mask)) if masks else None
        return out


def joules_per_pflop(power_w: float | None, ms: float | None, flops: float) -> float | None:
    """Energy per 10^15 FLOPs at the measured mean board power."""
    if not power_w or not ms or not flops:
        return None
    return power_w * ms * 1e-3 / (flops / 1e15)


def report_failure(label: str, error: Exception) -> None:
    """One stderr line for a backend that failed: its label and the error's first line."""
    first = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"  {label} failed: {first[:200]}", file=sys.stderr)


def time_or_none(label: str, fn, warmup: int, iters: int) -> float | None:
    """time_ms(fn); a backend that fails on a shape gives None in the report, not a crash."""
    import torch

    try:
        return time_ms(fn, warmup, iters)
    except Exception as e:  # noqa: BLE001 - any backend failure is reported, not fatal
        torch.cuda.synchronize()
        report_failure(label, e)
        return None


def gemm_tflops(measure) -> float | None:
    """cuBLAS bf16 GEMM_N^3 TFLOP/s: the ceiling the attention numbers are read against.
    measure(fn) -> ms (or None): the caller's timing, so that the ceiling is timed as the rows
    are (a burst reads 5-12% above sustained use on a power-capped board)."""
    import torch

    try:
        a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
        ms = measure(lambda: torch.matmul(a, b))
    except Exception as e:  # noqa: BLE001 - the ceiling is optional in the report
        print(f"GEMM benchmark failed: {e}", file=sys.stderr)
        return None
    return tflops(2.0 * GEMM_N**3, ms)


def random_inputs(shape: dict, dtype, count: int, seed: int = 0) -> list:
    """count CUDA tensors (batch, seqlen, heads, head_dim) of seeded randn: every backend and
    every cell is timed on the same numbers."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dims = (shape["batch"], shape["seqlen"], shape["heads"], shape["head_dim"])
    if dtype.itemsize == 1:  # fp8: randn has no 8-bit kernels; round bf16 draws
        return [torch.randn(*dims, device="cuda", dtype=torch.bfloat16, generator=gen).to(dtype)
                for _ in range(count)]
    return [torch.randn(*dims, device="cuda", dtype=dtype, generator=gen) for _ in range(count)]
