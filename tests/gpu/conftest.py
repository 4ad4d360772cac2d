"""GPU test setup: parametrize over the variants of the loaded fa3gen library.

Names are read from the library's variant table at collection time, so every built forward
variant gets its own test ids. Without a CUDA device, or if the library cannot be loaded, a
single skipped parameter stands in (tests/conftest.py then skips the gpu-marked tests with its
reason, which comes first).
"""

import pytest

from fa3gen.contract import key_str


def _library():
    from fa3gen import runtime
    from fa3gen.errors import Fa3genError

    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():  # tests/conftest.py skips the gpu tests for this reason
        return None, "no CUDA device"
    try:
        return runtime.get_library(), None
    except Fa3genError as e:
        return None, str(e).splitlines()[0]


def pytest_generate_tests(metafunc):
    for direction in ("fwd", "bwd"):
        # Variants of padded batches (the dense C ABI); tests/gpu/test_varlen.py has the others.
        for fixture, varlen in ((f"{direction}_variant", False),
                                (f"{direction}_varlen_variant", True)):
            if fixture in metafunc.fixturenames:
                lib, why = _library()
                # e4m3 variants have their own tests (test_fp8.py).
                names = [v.name for v in lib.variants if v.direction == direction
                         and v.varlen == varlen and v.dtype != "e4m3"] if lib else []
                params = names or [pytest.param(None, marks=pytest.mark.skip(
                    reason=why or f"the library has no such {direction} variants"))]
                metafunc.parametrize(fixture, params)
        if f"{direction}_varlen_key" in metafunc.fixturenames:
            # (dtype, head_dim, causal) of each default varlen variant
            lib, why = _library()
            keys = [(v.dtype, v.head_dim, v.causal) for v in lib.defaults(direction)
                    if v.varlen and not (v.paged or v.local or v.softcap)] if lib else []
            params = [pytest.param(k, id=f"{k[0]}-d{k[1]}-{'causal' if k[2] else 'nocausal'}")
                      for k in keys]
            params = params or [pytest.param(None, marks=pytest.mark.skip(
                reason=why or f"the library has no default varlen {direction} variants"))]
            metafunc.parametrize(f"{direction}_varlen_key", params)
        if f"{direction}_default_key" in metafunc.fixturenames:
            lib, why = _library()
            # Keys without the local/softcap/varlen features (test_features.py, test_varlen.py).
            keys = [(v.dtype, v.head_dim, v.causal) for v in lib.defaults(direction)
                    if not (v.local or v.softcap or v.varlen) and v.dtype != "e4m3"] if lib else []
            params = [pytest.param(k, id=f"{k[0]}-d{k[1]}-{'causal' if k[2] else 'nocausal'}")
                      for k in keys]
            params = params or [pytest.param(None, marks=pytest.mark.skip(
                reason=why or f"the library has no default {direction} variants"))]
            metafunc.parametrize(f"{direction}_default_key", params)
        # (dtype, head_dim, causal, local, softcap) of each default with local or softcap,
        # padded (test_features.py) or varlen (test_varlen_features.py)
        for fixture, varlen in ((f"{direction}_feature_key", False),
                                (f"{direction}_varlen_feature_key", True)):
            if fixture in metafunc.fixturenames:
                lib, why = _library()
                keys = [v.key for v in lib.defaults(direction) if (v.local or v.softcap)
                        and v.varlen == varlen and not v.paged] if lib else []
                params = [pytest.param(k[1:6], id=key_str(k)[1:-1].replace(", ", "-")) for k in keys]
                params = params or [pytest.param(None, marks=pytest.mark.skip(reason=why or (
                    f"the library has no {'varlen ' if varlen else ''}local/softcap {direction} variants")))]
                metafunc.parametrize(fixture, params)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output and gradient the public API allocates (flash_attn_func, the varlen and
    KV-cache calls, the fp8 forward) starts as NaN: torch.empty often hands back an earlier
    test's finite values, so an element a kernel leaves unwritten could pass against them. The
    kernel-level tests poison their own buffers (test_forward.py's guards)."""
    from fa3gen import ops, varlen

    def poisoning(make):
        def made(*args, **kwargs):
            tensors = make(*args, **kwargs)
            for t in tensors:
                if t is not None and t.is_floating_point() and t.numel():  # lse None: none asked
                    t.fill_(float("nan"))
            return tensors
        return made

    for module, name in ((ops, "_empty_outputs"), (ops, "_empty_grads"), (varlen, "_empty_outputs")):
        monkeypatch.setattr(module, name, poisoning(getattr(module, name)))


@pytest.fixture
def poison_bwd_workspace(monkeypatch):
    """poison(): the backward's workspace (ops._bwd_workspace, which the dense and the varlen
    backward take it from) holds NaN and nonzero semaphores instead of what torch.empty gives.
    The preprocess writes all of it itself (ABI 3), so a row it misses shows: NaN gradients,
    or a deterministic writer that waits on a semaphore that never matches."""
    from fa3gen import ops

    def poison():
        real = ops._bwd_workspace

        def poisoned_ws(layout, device):
            buffer = real(layout, device)
            for name in ("dq_accum", "lse_log2", "dsum"):
                layout.view(buffer, name).fill_(float("nan"))
            layout.view(buffer, "dq_semaphore").fill_(3)
            return buffer

        monkeypatch.setattr(ops, "_bwd_workspace", poisoned_ws)
    return poison


@pytest.fixture(scope="session")
def lib():
    import torch

    # The reference must be true fp32: no TF32 in its matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from fa3gen import runtime

    return runtime.get_library()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that needs a variant a filtered build (`--only`/`--exclude`) left out is reported
    skipped, naming the filter; the same miss in a full build's library is still a failure."""
    from fa3gen.errors import left_out_by_filter

    report = (yield).get_result()
    if call.when == "call" and call.excinfo is not None:
        flags = left_out_by_filter(call.excinfo.value)
        if flags:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                               f"Skipped: the library's build filter {flags} left out a variant this test needs")
