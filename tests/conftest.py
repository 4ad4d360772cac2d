"""Shared pytest setup: markers, and skipping `gpu` tests where they cannot run.

gpu tests need a CUDA device of compute capability 9.0 (H100/H200) and a built fa3gen library;
anywhere else they are skipped with the reason, never errored.
"""

import functools
import types

import pytest


def pytest_configure(config):
    # Registered here too so the markers work before/without pyproject.toml's list.
    config.addinivalue_line("markers", "gpu: needs an sm_90 GPU and a built fa3gen library")
    config.addinivalue_line("markers", "compile: runs nvcc (slow)")


@functools.lru_cache(maxsize=1)
def gpu_skip_reason():
    """None when gpu tests can run here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (fa3gen kernels need an sm_90 GPU)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"fa3gen kernels need compute capability 9.0 (H100/H200), found {cap[0]}.{cap[1]}"
    from fa3gen import runtime
    from fa3gen.errors import Fa3genError

    try:
        runtime.get_library()
    except Fa3genError as e:
        return f"fa3gen library not available: {str(e).splitlines()[0]}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason:
        for it in gpu_items:
            # First, so it wins over a parameter's own skip mark (tests/gpu/conftest.py): the
            # first missing thing (torch, a CUDA device, an sm_90 one, the library) is the reason.
            it.add_marker(pytest.mark.skip(reason=reason), append=False)


@pytest.fixture
def stub_forward(tmp_path, monkeypatch):
    """flash_attn_func on CPU tensors up to its launch, on the custom-op path (as under graph
    capture): the fake C library answers the dispatch, and install(fwd) puts fwd in place of
    the fa3gen::fwd custom op. (tests/test_api.py drives the eager path.)"""
    import torch

    from fa3gen import ops
    from tests.test_runtime_errors import build_fake_lib

    monkeypatch.setenv("FA3GEN_LIB", str(build_fake_lib(tmp_path)))
    monkeypatch.setattr(ops, "check_device", lambda *a: None)  # CPU tensors stand in
    monkeypatch.setattr(ops, "_captured", lambda *a: True)

    def install(fwd):
        class TorchWithoutTheLaunch:  # torch, but its fa3gen::fwd is fwd
            ops = types.SimpleNamespace(fa3gen=types.SimpleNamespace(fwd=fwd))

            def __getattr__(self, name):
                return getattr(torch, name)

        monkeypatch.setattr(ops, "torch", TorchWithoutTheLaunch())

    return install


@pytest.fixture
def fake_launches(tmp_path, monkeypatch):
    """The eager path on CPU tensors up to the launch, against the fake C library (which has,
    among others, an e4m3 d128 causal and varlen variants), with every plan cache empty:
    returns the list of (variant name, params) that would have been launched."""
    from fa3gen import fp8, kvcache, ops, varlen
    from tests.test_runtime_errors import build_fake_lib

    monkeypatch.setenv("FA3GEN_LIB", str(build_fake_lib(tmp_path)))
    monkeypatch.setattr(ops, "check_device", lambda *a: None)  # CPU tensors stand in
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    for module, cache in ((ops, "_fwd_plans"), (ops, "_bwd_plans"), (ops, "_bwd_op_plans"),
                          (varlen, "_plans"), (varlen, "_bwd_op_plans"),
                          (varlen, "_bwd_plans"), (varlen, "_paged_plans"), (varlen, "_offsets"),
                          (varlen, "_paged_variants"),
                          (fp8, "_plans"), (kvcache, "_plans"), (kvcache, "_served_prefills")):
        monkeypatch.setattr(module, cache, type(getattr(module, cache))())
    launched = []
    monkeypatch.setattr(ops, "_launch", lambda lib, info, device, make: launched.append((info.name, make())))
    return launched


@pytest.fixture
def paged_forward_calls(monkeypatch):
    """The argument tuples of every fa3gen.varlen.paged_forward call (which still runs)."""
    from fa3gen import varlen
    calls = []
    real = varlen.paged_forward
    monkeypatch.setattr(varlen, "paged_forward", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


class FakeQuantizerLibrary:
    """A library with only the fused quantizer (hashable, as a loaded library: plan keys hold
    it)."""

    def __init__(self, launch):
        self.quantize_fp8 = launch


@pytest.fixture
def quantizer(fake_launches, monkeypatch):
    """Every tensor goes to a fake fused quantizer: returns the list of its launches, each the
    params' fields plus the first four fp32 values of each rotary table it was handed (read
    while the call runs: a table may be a temporary)."""
    import ctypes

    from fa3gen import fp8, ops

    launched = []

    def launch(p, stream):
        fields = {name: getattr(p, name) for name, _ in p._fields_}
        for table in ("cos", "sin"):
            if getattr(p, f"rotary_{table}"):
                fields[f"{table}_values"] = list((ctypes.c_float * 4).from_address(getattr(p, f"rotary_{table}")))
        launched.append(fields)

    lib = FakeQuantizerLibrary(launch)
    monkeypatch.setattr(fp8, "_quantizer_library", lambda x: lib)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call: call(0))
    monkeypatch.setattr(fp8, "_quantize_plans", {})
    return launched


@pytest.fixture
def under_hash_seeds():
    """run(code) -> the stdout of `python -c code` (repository root, its packages importable)
    under two PYTHONHASHSEEDs, as a pair: what must be the same in every process (unit names,
    fingerprints, rendered sources) compares equal only if it does not depend on hash()."""
    import os
    import subprocess
    import sys

    from generator.paths import REPO_ROOT

    def run(code: str) -> tuple[str, str]:
        outs = []
        for seed in ("1", "2"):
            env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
            proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                                  capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-2000:]
            outs.append(proc.stdout)
        assert outs[0], "the code printed nothing"
        return outs[0], outs[1]
    return run


@pytest.fixture
def counted_scale():
    """counted_scale(value) -> (a 0-d tensor of value, the list its float() reads append to):
    each read of a CUDA tensor's value is a device sync, which a call makes once."""
    import torch

    def make(value):
        reads = []

        class Counted(torch.Tensor):
            def __float__(self):
                reads.append(1)
                return super().__float__()

        return torch.tensor(value).as_subclass(Counted), reads
    return make
