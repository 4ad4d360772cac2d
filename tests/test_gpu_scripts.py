"""The GPU-host scripts in tests/gpu (benchmarks, A/B, sanitizer drivers) run only where device
time is scarce: here, on the CPU, each must at least import (its module level, torch and
fa3gen imports included) and, when it has a command line, answer --help."""
import importlib.util
import json
import subprocess
import sys

import pytest

from generator.paths import REPO_ROOT

GPU_DIR = REPO_ROOT / "tests" / "gpu"
SCRIPTS = sorted(p for p in GPU_DIR.glob("*.py") if not p.name.startswith(("test_", "conftest")))

# Runs every script's main with --help in one interpreter (one torch import for all): prints
# {script: "ok" or what went wrong}.
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys
result = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        result[path] = "no exit: --help did not stop it"
    except SystemExit as e:
        text = out.getvalue().lower()
        result[path] = "ok" if e.code in (0, None) and "usage" in text else f"exit {e.code}: {text[:200]}"
    except BaseException as e:
        result[path] = f"{type(e).__name__}: {e}"
print(json.dumps(result))
"""


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"gpu_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(GPU_DIR))  # scripts import their siblings (sustained_backends)
    try:
        spec.loader.exec_module(module)  # each one's work runs only under __main__
    finally:
        sys.path.remove(str(GPU_DIR))


def test_gpu_scripts_answer_help():
    with_cli = [str(p) for p in SCRIPTS if "argparse" in p.read_text()]
    p = subprocess.run([sys.executable, "-c", _HELP_DRIVER, *with_cli], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": f"{REPO_ROOT}:{GPU_DIR}", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(result) == len(with_cli) >= 8
    assert {k: v for k, v in result.items() if v != "ok"} == {}


def test_every_gpu_script_is_found():
    assert {"bench_fp8_quantize.py", "sanitize_quantizer.py", "ab_trees.py"} <= {p.name for p in SCRIPTS}


def test_ncu_phases_splits_the_steady_loop():
    """ncu_phases.py on a small source-page CSV: the loop is the instructions executed as often
    as the most executed GEMM; its samples split by phase (predicates dropped)."""
    spec = importlib.util.spec_from_file_location("ncu_phases", GPU_DIR / "ncu_phases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    head = '"Kernel Name","k"\n"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
    rows = [("MOV R1, R2", 5, 1), ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], RZ", 7, 100),
            ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 11, 100), ("FMNMX R13, R88, R96, !PT", 13, 100),
            ("@P0 MUFU.EX2 R94, R94", 17, 100), ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 19, 100),
            ("UIADD3 UR4, UR4, 0x1, URZ", "1,000", 100), ("EXIT", 3, 1)]
    text = head + "".join(f'"0x{i}","{s}","{n}","{e}"\n' for i, (s, n, e) in enumerate(rows))
    result = module.phases(text.splitlines())
    assert result["all_samples"] == 1075 and result["steady_loop_warp_steps"] == 100
    assert result["steady_loop_samples"] == {"other": 1000, "softmax_math": 30, "wait_all_gemms": 19,
                                             "wait_S": 11, "gemm_issue": 7}


def test_ab_libraries_times_a_paged_variant_through_its_pages(fake_launches):
    """ab_libraries' paged points (the A/B of a paged variant ran into the varlen path, which
    refuses it): each library's call launches the paged variant with the block table, pages of
    PAGED_CHUNK_ROWS rows and every sequence's length, and the FLOPs are the dense shape's."""
    pytest.importorskip("torch")
    from fa3gen import bench, runtime
    from fa3gen.contract import PAGED_CHUNK_ROWS

    sys.path.insert(0, str(GPU_DIR))
    try:
        import ab_libraries
    finally:
        sys.path.remove(str(GPU_DIR))
    lib = runtime.get_library()
    info = lib.get("fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1_paged")
    assert info.paged and info.varlen  # what points() routes to paged_point, before varlen
    shape = {"batch": 2, "seqlen": 192, "heads": 2, "head_dim": 128}
    fns, flops = ab_libraries.paged_point([lib, lib], info, shape, device="cpu")
    assert flops == bench.attention_flops(2, 2, 192, 192, 128, True)
    for fn in fns:
        fn()
    assert [name for name, _ in fake_launches] == [info.name] * 2
    p = fake_launches[0][1]
    assert (p.page_size, p.num_pages, p.block_table_cols) == (PAGED_CHUNK_ROWS, 6, 3)
    assert p.block_table and p.seqused_k  # the table and the lengths reach the kernel


def test_bench_varlen_counts_the_visible_pairs():
    """bench_varlen.py's FLOPs: the (query, key) pairs a window (W, 0) causal or (W, W) shows,
    against a count of the mask itself."""
    spec = importlib.util.spec_from_file_location("bench_varlen", GPU_DIR / "bench_varlen.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(GPU_DIR))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GPU_DIR))
    from fa3gen.reference import window_mask

    for n, causal, w in [(1, True, 0), (5, False, 3), (37, True, 4), (37, False, 100), (40, True, -1),
                         (40, False, -1)]:
        window = (-1, 0 if causal else -1) if w < 0 else (w, 0 if causal else w)
        assert module.pairs(n, causal, w) == int(window_mask(n, n, window).sum()), (n, causal, w)


def test_few_key_rows_emulates_the_kernels_order():
    """few_key_rows.emulate on one query and two keys (scores 0 and -1.5, values 1 and -1):
    with the true maximum the small P, e^-1.5, is the one rounded to bf16; in the kernel's
    order (the key of score -1.5 in the last block, seen first, and a threshold of 8 log2
    units the other key does not pass) it is e^1.5 that is rounded, and the output moves by one
    bf16 step. With threshold -1 the order changes nothing."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(GPU_DIR))
    try:
        from few_key_rows import emulate
    finally:
        sys.path.remove(str(GPU_DIR))
    bf16 = torch.bfloat16
    q = torch.ones(1, 1, 1, 1, dtype=bf16)
    k = torch.tensor([0.0, -1.5], dtype=bf16).reshape(1, 2, 1, 1)
    v = torch.tensor([1.0, -1.0], dtype=bf16).reshape(1, 2, 1, 1)
    e = torch.tensor(1.5).exp()

    def by_hand(p0, p1):  # P rounded for P V, the row sum unrounded, out rounded
        return ((p0.to(bf16).float() - p1.to(bf16).float()) / (p0 + p1)).to(bf16).item()

    true_max = emulate(q, k, v, (-1, -1), 0.0).item()
    assert true_max == by_hand(torch.tensor(1.0), 1 / e) == 0.63671875
    assert emulate(q, k, v, (-1, -1), 0.0, block=1, threshold=-1.0).item() == true_max
    assert emulate(q, k, v, (-1, -1), 0.0, block=1, threshold=8.0).item() == \
        by_hand(e, torch.tensor(1.0)) == 0.6328125


def test_steady_state_splits_a_run_into_stretches():
    """steady_state.summarize: windows and power samples go to the stretch in which they ended
    (first 200 ms, 0.2-1 s, from 1 s), TFLOP/s over the stretch's launches, the reasons seen."""
    sys.path.insert(0, str(GPU_DIR))
    try:
        import steady_state
    finally:
        sys.path.remove(str(GPU_DIR))

    class Samples:
        rows = [(100.1, 500.0, 1900.0, 40.0, "0x1"), (100.5, 700.0, 1700.0, 50.0, "0x4"),
                (101.5, 690.0, 1600.0, 60.0, "0x4"), (102.5, 690.0, 1500.0, 60.0, "0x4")]

        def between(self, t0, t1):
            return [s for s in self.rows if t0 <= s[0] < t1]

    # (host time at the end, window ms, launches): 1 ms a launch early, 2 ms later
    windows = [(100.1, 10.0, 10), (100.6, 20.0, 10), (101.5, 20.0, 10), (102.5, 60.0, 20)]
    out = steady_state.summarize(100.0, windows, Samples(), flops=1e12)
    assert list(out) == ["0-0.2s", "0.2-1s", "1s-end"]
    assert out["0-0.2s"]["tflops"] == pytest.approx(1000.0)  # 1e12 FLOPs in 1 ms
    assert out["0.2-1s"]["tflops"] == pytest.approx(500.0)
    assert out["1s-end"]["tflops"] == pytest.approx(1e12 / (80.0 / 30) / 1e9)
    assert out["1s-end"]["windows"] == 2
    assert out["1s-end"]["sm_mhz"] == pytest.approx(1550.0)
    assert out["0-0.2s"]["reasons"] == ["0x1"] and out["1s-end"]["reasons"] == ["0x4"]


def test_host_time_summarizes_processes_by_in_process_ratios():
    """host_time.summarize: per backend and row, the median time over the processes and the
    median of each process's ratio to cuDNN's row (not the ratio of the medians); a row
    cuDNN lacks (FA4 only, say) has no ratio."""
    sys.path.insert(0, str(GPU_DIR))
    try:
        import host_time
    finally:
        sys.path.remove(str(GPU_DIR))
    runs = [{"fa3gen": {"fwd": 30.0}, "cudnn (sdpa)": {"fwd": 20.0}},   # 1.5x
            {"fa3gen": {"fwd": 40.0}, "cudnn (sdpa)": {"fwd": 50.0}},   # 0.8x
            {"fa3gen": {"fwd": 35.0, "only here": 9.0}, "cudnn (sdpa)": {"fwd": 45.0}}]  # 0.78x
    out = host_time.summarize(runs)
    assert out["fa3gen"]["fwd"] == {"us": 35.0, "ratio_to_cudnn": 0.8}  # medians' ratio: 0.78
    assert out["fa3gen"]["only here"] == {"us": 9.0}
    assert out["cudnn (sdpa)"]["fwd"] == {"us": 45.0, "ratio_to_cudnn": 1.0}


def test_host_time_processes_runs_fresh_processes_and_writes_the_medians(tmp_path, monkeypatch):
    """--processes N: N runs of the script itself (fresh interpreters, same --calls/--rounds),
    each one's --json read back; the --json written holds every process and the medians."""
    import argparse
    sys.path.insert(0, str(GPU_DIR))
    try:
        import host_time
    finally:
        sys.path.remove(str(GPU_DIR))
    calls = []

    def fake_run(cmd, check):
        calls.append(cmd)
        if len(calls) == 2:  # a process that failed (a CUDA error, say): left out
            return subprocess.CompletedProcess(cmd, 1)
        us = 20.0 + len(calls)
        with open(cmd[cmd.index("--json") + 1], "w") as fh:
            json.dump({"header": {"gpu": "x"}, "first_call_ms": 50.0, "shape": [1, 128, 1, 64],
                       "per_call_us": {"fa3gen": {"fwd": us}, "cudnn (sdpa)": {"fwd": 20.0}}}, fh)
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "h.json"
    args = argparse.Namespace(processes=4, calls=50, rounds=2, json=str(out))
    assert host_time.run_processes(args) == 0
    assert len(calls) == 4 and all(c[0] == sys.executable and c[1] == host_time.__file__ and
                                   c[2:6] == ["--calls", "50", "--rounds", "2"] for c in calls)
    got = json.loads(out.read_text())
    assert [r["fa3gen"]["fwd"] for r in got["processes"]] == [21.0, 23.0, 24.0]
    assert got["median"]["fa3gen"]["fwd"] == {"us": 23.0, "ratio_to_cudnn": 1.15}
    assert got["header"] == {"gpu": "x"} and got["first_call_ms"] == [50.0] * 3
    assert got["shape"] == [1, 128, 1, 64]
    calls.clear()
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: subprocess.CompletedProcess(cmd, 1))
    assert host_time.run_processes(args) == 1  # none finished


def test_host_time_interleaves_the_backends_round_by_round(monkeypatch):
    """interleaved_us: every round times one batch of each backend, the order rotated a place
    a round, each backend's context entered around its batch; the median per backend."""
    import contextlib
    sys.path.insert(0, str(GPU_DIR))
    try:
        import host_time
    finally:
        sys.path.remove(str(GPU_DIR))
    monkeypatch.setattr(host_time.torch.cuda, "synchronize", lambda: None)
    ran, entered, now = [], [], [0]
    monkeypatch.setattr(host_time.time, "perf_counter", lambda: now[0] * 1e-6)

    @contextlib.contextmanager
    def peer_context():
        entered.append(len(ran))
        yield

    def call(name, us):  # a call that takes us on the fake clock
        ran.append(name)
        now[0] += us
    fns = {"a": lambda: call("a", 1), "b": lambda: call("b", 2), "c": lambda: call("c", 3)}
    out = host_time.interleaved_us(fns, {"b": peer_context}, calls=2, rounds=3)
    timed = [name for name in ran[60:]][::2]  # after 20 warm-up calls each; a batch is 2 calls
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert entered == [20, 60 + 2, 60 + 6, 60 + 16]  # warm-up, then around b's batches only
    assert out == pytest.approx({"a": 1.0, "b": 2.0, "c": 3.0})


def test_bwd_kernel_times_sorts_kernels_into_phases():
    """bwd_kernel_times.py's phases, on kernel names fa3gen, FA4 and cuDNN launch: the main
    kernel is whatever is neither a preprocess nor a conversion (the longest such, per call)."""
    spec = importlib.util.spec_from_file_location("bwd_kernel_times", GPU_DIR / "bwd_kernel_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = {
        "void fa3gen::bwd_preprocess_kernel<cutlass::bfloat16_t, 64, 0>(fa3gen::BwdRowParams)": "pre",
        "void fa3gen::bwd_kernel<fa3gen::BwdTraits<cutlass::bfloat16_t, 64>>(fa3gen::BwdParams<T1>)": "main",
        "void fa3gen::bwd_convert_dq_kernel<fa3gen::BwdTraits<cutlass::bfloat16_t>>(fa3gen::BwdDqParams)": "post",
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_0": "pre",
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_0": "main",
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostprocess_0": "post",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3": "main",
        "cudnn::fusion::compute_dot_do_o": "pre",
        "cudnn::fusion::convert_dq_to_16bits": "post",
    }
    assert {n: module.phase_of(n) for n in names} == names


def test_ab_libraries_summary_reads_b_over_a_against_the_control():
    """ab_libraries --control: A timed twice, A' / A per point; the summary names the control's
    range and how many points' B / A leave it (a 1% change inside 2.4% of noise is a tie)."""
    sys.path.insert(0, str(GPU_DIR))
    try:
        spec = importlib.util.spec_from_file_location("ab_libraries", GPU_DIR / "ab_libraries.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GPU_DIR))
    rows = [dict(b_over_a=1.030, control=1.010), dict(b_over_a=1.005, control=0.990),
            dict(b_over_a=0.980, control=1.000)]
    text = module.summary(rows)
    assert "B / A median 1.005, min 0.980, max 1.030" in text
    assert "control A' / A median 1.000, min 0.990, max 1.010" in text
    assert "above the control's max on 1, below its min on 1" in text
    assert "control" not in module.summary([dict(b_over_a=1.0)])
