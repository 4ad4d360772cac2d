"""flash_attn_func's signature: FlashAttention-3's positional order, flash-attn's meaning of
causal / window_size / softcap, and clear errors instead of a different result."""
import contextlib
import inspect

import pytest
import torch

import fa3gen
from fa3gen import Fa3genError, InvalidInputError, ops

q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
CU = torch.tensor([0, 8], dtype=torch.int32)


def test_positional_order_is_fa3s():
    params = inspect.signature(ops.flash_attn_func).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k", "v", "softmax_scale", "causal"]
    assert {"window_size", "softcap", "deterministic", "return_attn_probs", "return_lse",
            "variant"} <= {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


def test_old_fa3gen_order_is_an_error_not_a_silent_scale():
    # fa3gen's earlier order was (q, k, v, causal, softmax_scale): True would now be the scale.
    with pytest.raises(InvalidInputError, match=r"softmax_scale=True: .*order \(q, k, v, softmax_scale, causal\)"):
        ops.flash_attn_func(q, q, q, True)
    with pytest.raises(InvalidInputError, match="causal must be True or False, got 0.125"):
        ops.flash_attn_func(q, q, q, None, 0.125)
    # flash-attn 2's order (q, k, v, dropout_p, softmax_scale, causal): dropout_p 0.0 lands here.
    with pytest.raises(InvalidInputError, match="softmax_scale must be a finite number > 0 .*got 0.0: .*dropout_p"):
        ops.flash_attn_func(q, q, q, 0.0)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -1.0, "0.5", b"1", 1 + 0j,
                                   torch.tensor([0.5, 0.5])])
def test_a_scale_that_is_not_a_positive_finite_number_is_one_clear_error(scale):
    with pytest.raises(InvalidInputError, match="softmax_scale must be a finite number > 0"):
        ops.flash_attn_func(q, q, q, scale)


def test_a_tensor_passed_as_the_scale_is_named_by_its_shape_not_its_values():
    with pytest.raises(InvalidInputError, match=r"got a torch.bfloat16 tensor of shape \(1, 8, 2, 128\): "):
        ops.flash_attn_func(q, q, q, q)


def test_scalar_scales_are_taken():
    for scale in (0.5, 2, torch.tensor(0.5), 2.0**60, 2.0**-60):
        ops.check_softmax_scale(scale)


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_a_tensor_scale_under_compile_is_one_clear_error(fake_launches, name):
    """Eager calls take a 0-d tensor scale or softcap (its value read on the host); a compiled
    graph cannot (no value while tracing: torch failed on a guard): our error, in dynamo's."""
    torch._dynamo.reset()
    q = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16)
    call = torch.compile(lambda q, t: ops.flash_attn_func(q, q, q, **{name: t}), fullgraph=True,
                         backend="aot_eager")
    with pytest.raises(Exception, match="under torch.compile, softmax_scale and softcap must be "
                                        "Python numbers, not tensors"):
        call(q, torch.tensor(0.5))


def test_a_tensor_scale_that_requires_grad_is_refused_not_detached(fake_launches):
    """float() would read its value and drop the gradient a learnable temperature or cap
    expects, silently; without grad mode, or detached, it is a number as before."""
    q = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    t = torch.tensor(0.5, requires_grad=True)
    for call in (lambda s: ops.flash_attn_func(q, q, q, s),
                 lambda s: ops.masking(False, (-1, -1), s)):  # softcap's check
        with pytest.raises(InvalidInputError, match="softmax_scale and softcap take no gradient"):
            call(t)
        with torch.no_grad():
            call(t)
        call(t.detach())
    assert len(fake_launches) == 2


def test_a_tensor_scale_is_read_once_a_call(fake_launches, counted_scale):
    """Each read of a CUDA tensor's value is a device sync: the call reads it once."""
    q = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16)
    scale, reads = counted_scale(0.5)
    for call in (lambda: ops.flash_attn_func(q, q, q, scale),
                 lambda: fa3gen.flash_attn_varlen_func(q[0], q[0], q[0], CU.new_tensor([0, 40]),
                                                       CU.new_tensor([0, 40]), 40, 40,
                                                       softmax_scale=scale, causal=True)):
        reads.clear()
        call()
        assert len(reads) == 1
    assert [p.softmax_scale for _, p in fake_launches] == [0.5, 0.5]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")  # beta
def test_sparse_tensors_are_one_error(fake_launches):
    """A sparse q went on to a misleading lse error; sparse index tensors raised inside torch."""
    dense = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    for layout in ("to_sparse", "to_sparse_csr"):
        sparse = getattr(dense[0, :, 0], layout)()
        with pytest.raises(InvalidInputError, match=r"k is a sparse_\w+ tensor; .*k.to_dense\(\)"):
            ops.flash_attn_func(dense, sparse, dense)
    qkv = torch.zeros(1, 8, 3, 2, 128, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(InvalidInputError, match=r"qkv is a sparse_coo tensor; .*qkv.to_dense\(\)"):
        fa3gen.flash_attn_qkvpacked_func(qkv)
    with pytest.raises(InvalidInputError, match="cu_seqlens_k is a sparse_coo tensor"):
        fa3gen.flash_attn_varlen_func(q[0], q[0], q[0], CU, CU.to_sparse(), 8, 8)
    cache = torch.zeros(1, 16, 2, 128, dtype=torch.bfloat16)
    seqlens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="cache_seqlens is a sparse_coo tensor"):
        fa3gen.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=seqlens.to_sparse())
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="block_table is a sparse_coo tensor"):
        fa3gen.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=seqlens,
                                       block_table=table.to_sparse())
    assert not fake_launches


def test_the_fp32_range_keeps_what_the_kernels_derive_finite_and_normal():
    """The bounds hold for the kernels' derived values (scale * log2(e), scale / softcap,
    softcap * log2(e)) at their extremes, in fp32."""
    lo, hi = (torch.tensor(b, dtype=torch.float32) for b in ops.FP32_ARG_RANGE)
    log2e = torch.tensor(1.4426950408889634, dtype=torch.float32)
    info = torch.finfo(torch.float32)
    for derived in (hi * log2e, hi / lo, lo / hi, lo * log2e):
        assert info.tiny <= derived.item() <= info.max


def test_numpy_integer_windows_are_taken_as_flash_attn_takes_them():
    np = pytest.importorskip("numpy")
    assert ops.masking(False, (np.int64(3), np.int32(0)), 0.0) == ops.Masking(False, 3, 0)
    assert type(ops.masking(False, (np.int64(3), 0)).window_left) is int
    assert ops.masking(np.bool_(True)) == ops.Masking(causal=True)
    # a list or an array is a pair as flash-attn indexes it ([0], [1])
    assert ops.masking(False, np.array([3, 0])) == ops.Masking(False, 3, 0)
    assert ops.masking(False, [-1, 0]) == ops.Masking(causal=True)
    assert ops.masking(np.bool_(False), (np.int64(3), 0)) == ops.Masking(False, 3, 0)
    for bad in (np.float64(1.0), np.int64(2)):
        with pytest.raises(InvalidInputError, match="causal must be True or False"):
            ops.masking(bad)


def test_numpy_softcap_is_taken_as_softmax_scale_is():
    """np.float32 is no Python float: it was refused as softcap while taken as softmax_scale."""
    np = pytest.importorskip("numpy")
    for value in (np.float32(30.0), np.float64(30.0), np.int64(30)):
        got = ops.masking(False, (-1, -1), value)
        assert got == ops.Masking(softcap=30.0) and type(got.softcap) is float
    for bad in (np.bool_(True), np.float32("nan"), "30"):
        with pytest.raises(InvalidInputError, match="softcap must be a finite number >= 0"):
            ops.masking(False, (-1, -1), bad)


def test_softcap_takes_a_0d_tensor_as_softmax_scale_does():
    """A 0-d real tensor was taken as softmax_scale and refused as softcap."""
    got = ops.masking(False, (-1, -1), torch.tensor(30.0, dtype=torch.float64))
    assert got == ops.Masking(softcap=30.0) and type(got.softcap) is float
    for bad in (torch.tensor(True), torch.tensor(1 + 1j), torch.tensor([30.0])):
        with pytest.raises(InvalidInputError, match="softcap must be a finite number >= 0"):
            ops.masking(False, (-1, -1), bad)
    ops.check_softmax_scale(torch.tensor(0.5))
    with pytest.raises(InvalidInputError, match="softmax_scale must be a finite number > 0"):
        ops.check_softmax_scale(torch.tensor([0.5]))


@pytest.mark.parametrize("kwargs, message", [
    ({"window_size": (-2, 0)}, r"window_size left must be an int >= -1 \(-1: unbounded\), got -2"),
    ({"window_size": (5, 1.5)}, "window_size right must be an int >= -1 .*got 1.5"),
    ({"window_size": (5, True)}, "window_size right must be an int >= -1 .*got True"),
    ({"window_size": 5}, r"window_size must be a pair \(left, right\), got 5"),
    ({"window_size": (1, 2, 3)}, r"window_size must be a pair"),
    # unordered or one-pass pairs would unpack in an order of their own ({-1, 0} as (0, -1))
    ({"window_size": {-1, 0}}, r"window_size must be a pair \(left, right\), got \{"),
    ({"window_size": {128: 1, 0: 2}}, r"window_size must be a pair"),
    ({"window_size": iter([4, 4])}, r"window_size must be a pair"),
    ({"window_size": "ab"}, r"window_size must be a pair"),
    ({"softcap": -1.0}, r"softcap must be a finite number >= 0 \(0: none\), got -1.0"),
    ({"softcap": float("inf")}, "softcap must be a finite number >= 0"),
    ({"softcap": float("nan")}, "softcap must be a finite number >= 0"),
    ({"softcap": True}, "softcap must be a finite number >= 0"),
    # finite in Python but not once the kernel has it in fp32 (inf, denormal): never launched
    ({"softcap": 1e39}, r"softcap=1e\+39 is outside \[2\^-60, 2\^60\]"),
    ({"softcap": 1e-40}, r"softcap=1e-40 is outside \[2\^-60, 2\^60\]"),
    ({"softmax_scale": 1e40}, r"softmax_scale=1e\+40 is outside \[2\^-60, 2\^60\]"),
    ({"softmax_scale": 10**400}, "softmax_scale must be a finite number > 0"),  # no OverflowError
    # past 4300 digits repr() of an int raises ValueError: the message gives its size instead
    ({"softmax_scale": 10**5000}, r"softmax_scale must be .*got an int of about 10\^5000"),
    ({"softcap": 10**5000}, r"softcap must be .*got an int of about 10\^5000"),
    ({"softcap": torch.ones(2)}, r"softcap must be .*got a torch.float32 tensor of shape \(2,\)"),
    ({"softmax_scale": 2.0**-61}, r"softmax_scale=4.3\d*e-19 is outside"),
])
def test_bad_window_or_softcap_is_an_error(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        ops.flash_attn_func(q, q, q, **kwargs)


@pytest.mark.parametrize("variant", [["fwd_bf16_d64_nocausal"], {}, 7])
def test_a_variant_that_is_not_a_name_is_an_error(variant):
    """Was a bare TypeError (unhashable type) from the plan caches for a list or a dict."""
    import fa3gen

    cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    calls = [lambda: ops.flash_attn_func(q, q, q, variant=variant),
             lambda: fa3gen.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, q.shape[1],
                                                   q.shape[1], variant=variant),
             lambda: fa3gen.flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), variant=variant)]
    for call in calls:
        with pytest.raises(InvalidInputError, match=r"variant must be a variant name \(str\) "
                                                    r"or None, got"):
            call()


M = ops.Masking


@pytest.mark.parametrize("causal, window, want", [
    (False, (-1, -1), M()),
    (True, (-1, -1), M(causal=True)),
    (False, (-1, 0), M(causal=True)),          # the window of causal attention is causal
    (True, (128, -1), M(False, 128, 0)),       # causal sets the right side to 0 (flash-attn)
    (True, (128, 7), M(False, 128, 0)),
    (False, (128, 7), M(False, 128, 7)),
    (False, (-1, 7), M(False, -1, 7)),
    (False, (0, 0), M(False, 0, 0)),           # each query sees one key: local, not causal
    (False, (10**9, 10**9), M(False, 10**9, 10**9)),  # wider than any sequence: still local
    (False, (2**32 + 5, 0), M(causal=True)),   # past int32 (the kernels' lengths): unbounded,
    (False, (5, 2**31), M(False, 5, -1)),      # never wrapped into a small window
    (False, (2**31 - 1, 3), M(False, 2**31 - 1, 3)),
])
def test_masking_follows_flash_attn(causal, window, want):
    assert ops.masking(causal, window) == want
    assert want.local == (want.window_left >= 0 or want.window_right >= 0)


@pytest.mark.parametrize("window, softcap", [((-1.0, -1), 0.0), ((-1, -1.0), 0.0),
                                             ((-1, -1), True), ((-1, -1), -1.0)])
def test_masking_near_the_usual_call_still_checks(window, softcap):
    """masking()'s shortcut for the usual call (a bool, (-1, -1), 0) takes exactly that: a float
    side or a bool softcap, equal in value, still meets the checks."""
    with pytest.raises(InvalidInputError, match="window_size .*must be an int|softcap must be"):
        ops.masking(False, window, softcap)
    assert ops.masking(False, [-1, -1], 0) == M() and ops.masking(1, (-1, -1)) == M(True)


def test_env_reader_sees_every_change(monkeypatch):
    """The per-call cache keys read FA3GEN_LIB, FA3GEN_GENERATED and FA3GEN_GRID through
    runtime.env_reader: a set, changed or removed variable must read differently."""
    from fa3gen import runtime
    read = runtime.env_reader("FA3GEN_TEST_ENV_READER")
    monkeypatch.delenv("FA3GEN_TEST_ENV_READER", raising=False)
    assert read() is None
    seen = [None]
    for value in ("a", "b", ""):
        monkeypatch.setenv("FA3GEN_TEST_ENV_READER", value)
        seen.append(read())
    monkeypatch.delenv("FA3GEN_TEST_ENV_READER")
    seen.append(read())
    assert seen[-1] is None and len(set(seen[:4])) == 4
    import os  # an environment put in os.environ's place (mock.patch("os.environ", ...))
    monkeypatch.setattr(os, "environ", {"FA3GEN_TEST_ENV_READER": "c"})
    assert read() == "c"


def test_window_and_softcap_select_the_feature_variant(fake_launches, monkeypatch):
    """window_size/softcap pick the key with local/softcap, and reach the kernel as it takes
    them, through the custom op (as under torch.compile); a key the library lacks says, while
    tracing, which axes to add."""
    monkeypatch.setattr(ops, "_captured", lambda *t: True)
    k = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    ops.flash_attn_func(q, k, k, causal=True, window_size=(64, -1), softcap=30.0)
    [(name, p)] = fake_launches
    assert name == "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1"
    assert (p.window_left, p.window_right, p.softcap) == (64, 0, 30.0)
    with pytest.raises(Fa3genError, match="local: true\\) to a group of"):
        ops.flash_attn_func(q, k, k, window_size=(64, 64))  # no local variant without softcap
    with pytest.raises(Fa3genError, match="causal: true, softcap: true\\)"):
        ops.flash_attn_func(q, k, k, causal=True, softcap=5.0)
    assert len(fake_launches) == 1


def test_return_attn_probs_returns_the_lse(stub_forward):
    stub_forward(lambda *a: ("out", "lse"))
    k = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert ops.flash_attn_func(q, k, k) == "out"
    assert ops.flash_attn_func(q, k, k, return_attn_probs=True) == ("out", "lse")
    assert ops.flash_attn_func(q, k, k, 0.1, False, return_lse=True) == ("out", "lse")


_EAGER_SCRIPT = r"""
import sys, torch
from fa3gen import ops
ops.check_device = lambda *a: None       # CPU tensors stand in for CUDA ones
ops._num_sms = lambda index: 132
launched = []
ops._launch = lambda lib, info, device, make: launched.append((info.name, make()))
q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
k = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
v = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
out = ops.flash_attn_func(q, k, v, 0.25)
out.float().sum().backward()
capped = ops.flash_attn_func(q.detach(), k.detach(), v.detach(), window_size=(64, 7), softcap=30.0)
(fwd, p), (bwd, bp), (local, lp) = launched
print(fwd, bwd, local, p.softmax_scale, bp.softmax_scale, lp.window_left, lp.window_right,
      lp.softcap, q.grad is not None and k.grad is not None and v.grad is not None,
      out.requires_grad, any(m.startswith("torch._dynamo") for m in sys.modules))
"""


def test_eager_path_runs_without_dynamo(tmp_path):
    """Outside graph capture, flash_attn_func and its backward reach the launchers through
    _EagerAttention, never importing torch._dynamo (the custom ops' first call imports it:
    3-4 s of a fresh process's first call). The window and softcap reach the params."""
    import os
    import subprocess
    import sys

    from tests.test_runtime_errors import build_fake_lib

    env = {**os.environ, "FA3GEN_LIB": str(build_fake_lib(tmp_path))}
    res = subprocess.run([sys.executable, "-c", _EAGER_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [
        "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1",
        "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0",
        "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1",
        "0.25", "0.25", "64", "7", "30.0", "True", "True", "False"]


def test_captured_calls_take_the_custom_op(monkeypatch):
    assert not ops._captured(q, q, q)
    assert ops._captured(torch.nn.Parameter(q), q, q) is False  # a Parameter is plain memory
    fake = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16, device="meta")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        assert ops._captured(mode.from_tensor(fake), q, q)
    seen = []  # torch.func's wrappers look like plain tensors but have no storage
    torch.func.vmap(lambda x: seen.append(ops._captured(x)) or x)(torch.zeros(2, 3))
    assert seen == [True]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert ops._captured(q, q, q)


def test_constant_mark_is_torchs():
    """ops marks _lookup_variant_name for torch.compile the way torch.compiler.assume_constant_result
    does, without importing torch._dynamo at import time: if torch changes the decorator, this
    fails instead of torch.compile silently tracing into the library lookup."""
    def mine():
        pass

    def torchs():
        pass

    ops._assume_constant_result(mine)
    torch.compiler.assume_constant_result(torchs)
    assert vars(mine) == vars(torchs) == {"_dynamo_marked_constant": True}
    assert vars(ops._lookup_variant_name).get("_dynamo_marked_constant") is True


@pytest.fixture
def eager(fake_launches, monkeypatch):
    """fake_launches, and a count of the full checks (plans) the calls ran."""
    checks = []
    for plan in ("_fwd_plan", "_bwd_plan"):
        real = getattr(ops, plan)
        monkeypatch.setattr(ops, plan, lambda *a, real=real: checks.append(1) or real(*a))
    return fake_launches, checks


def test_eager_attention_is_function_apply_without_its_python_layer(monkeypatch):
    """ops._c_apply: the eager forward enters autograd at Function.apply's C entry; the same
    graph and gradients as .apply, and .apply itself on a torch without that entry."""
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, factor):
            ctx.factor = factor
            return q * factor + k * v

        @staticmethod
        def backward(ctx, g):
            return g * ctx.factor, None, None, None

    x = torch.ones(3, requires_grad=True)
    y = ops._c_apply(Scale)(x, torch.ones(3), torch.ones(3), 2.0)
    assert type(y.grad_fn).__name__ == "ScaleBackward" and y.tolist() == [3.0] * 3
    y.sum().backward()
    assert x.grad.tolist() == [2.0] * 3
    monkeypatch.delattr(torch._C, "_FunctionBase")
    assert ops._c_apply(Scale) == Scale.apply


def test_a_repeated_signature_skips_the_checks(eager, monkeypatch):
    launched, checks = eager
    base = torch.zeros(1, 8, 2, 136, dtype=torch.bfloat16)
    a, b = base[..., :128], base[..., 8:136]  # same strides, pointers 16 bytes apart
    ops.flash_attn_func(a, a, a)
    ops.flash_attn_func(b, b, b)
    assert len(checks) == 1 and len(launched) == 2
    (_, p0), (_, p1) = launched
    assert p1.q - p0.q == 16 and p1.q_row_stride == p0.q_row_stride == 2 * 136
    # What the signature holds re-plans: strides, masking, scale, variant, FA3GEN_GRID.
    ops.flash_attn_func(a.contiguous(), a, a)
    ops.flash_attn_func(a, a, a, window_size=(64, 7), softcap=30.0)
    ops.flash_attn_func(a, a, a, 0.5)
    ops.flash_attn_func(a, a, a, variant="fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0")
    monkeypatch.setenv("FA3GEN_GRID", "tiles")
    ops.flash_attn_func(a, a, a)
    assert len(checks) == 6
    names = [n for n, _ in launched]
    assert names[3] == "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1"
    assert names[5] == "fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0"
    assert launched[4][1].softmax_scale == 0.5 and launched[3][1].softcap == 30.0
    assert launched[6][1].grid_mode != launched[0][1].grid_mode


def test_lse_is_written_only_where_something_reads_it(eager):
    """The kernel writes lse only through a non-null pointer (ABI 16): an eager call without
    grad or return_lse passes null and allocates none; return_lse and a call autograd records
    (its backward reads lse) pass one."""
    launched, _ = eager
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert ops.flash_attn_func(x, x, x).shape == x.shape
    out, lse = ops.flash_attn_func(x, x, x, return_lse=True)
    ops.flash_attn_func(x.requires_grad_(), x, x)
    assert [p.lse for _, p in launched] == [None, lse.data_ptr(), launched[2][1].lse] and \
        launched[2][1].lse
    empty_keys = torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16)  # no launch: the fill's path
    assert (ops.flash_attn_func(x.detach(), empty_keys, empty_keys) == 0).all()
    assert ops.flash_attn_func(x.detach(), empty_keys, empty_keys, return_lse=True)[1].isneginf().all()


def test_a_cached_signature_still_checks_alignment(eager):
    base = torch.zeros(1, 8, 2, 136, dtype=torch.bfloat16)
    ops.flash_attn_func(base[..., :128], base[..., :128], base[..., :128])
    odd = base[..., 1:129]  # same strides, 2 bytes off
    with pytest.raises(InvalidInputError, match=r"q.data_ptr\(\) is not 16-byte aligned"):
        ops.flash_attn_func(odd, base[..., :128], base[..., :128])


def test_eager_backward_plans_once_and_copies_strided_grads(eager, monkeypatch):
    launched, checks = eager
    douts, run = [], ops._bwd_run
    monkeypatch.setattr(ops, "_bwd_run", lambda plan, dout, *a: douts.append(dout) or run(plan, dout, *a))
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        ops.flash_attn_func(q, q, q).sum().backward()  # dout: expanded, stride 0 (a bf16 sum's)
    # every call copies it (the plan was made once, on the first call's copy)
    assert [d.stride() for d in douts] == [(2048, 256, 128, 1)] * 2 and douts[0] is not douts[1]
    assert all(bool((d == 1).all()) for d in douts)
    assert [n for n, _ in launched] == ["fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1",
                                        "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0"] * 2
    assert len(checks) == 2  # one forward plan, one backward plan
    bwd = launched[3][1]
    assert (bwd.do_batch_stride, bwd.do_row_stride, bwd.do_head_stride) == (2048, 256, 128)
    assert bwd.dout not in (0, bwd.o) and bwd.dq_accum != 0


def test_second_derivatives_are_an_error_not_zeros(eager):
    """create_graph=True: the gradients come back, but differentiating them raises (the custom
    ops say "no autograd formula"; eager used to give a silent zero attention term)."""
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    (g,) = torch.autograd.grad(ops.flash_attn_func(q, q, q).float().sum(), q, create_graph=True)
    assert g.shape == q.shape and g.requires_grad
    k = torch.zeros_like(q, requires_grad=True)
    (gq, gk) = torch.autograd.grad(ops.flash_attn_func(q, k, k).float().sum(), (q, k),
                                   create_graph=True)
    gq.mul_(2)  # a first-order gradient is a tensor like any (it was a view: in place refused)
    with pytest.raises(Fa3genError, match="no second derivative"):
        g.float().sum().backward()
    (g,) = torch.autograd.grad(ops.flash_attn_func(q, q, q).float().sum(), q)  # the usual call
    assert not g.requires_grad


def test_an_empty_query_side_gives_empty_gradients(eager):
    """seqlen_q 0: autograd's dout is expanded and empty; contiguous() kept its zero strides."""
    launched, _ = eager
    q = torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.full((1, 8, 2, 128), 3.0, dtype=torch.bfloat16, requires_grad=True)
    v = torch.full((1, 8, 2, 128), 3.0, dtype=torch.bfloat16, requires_grad=True)
    ops.flash_attn_func(q, k, v).float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert (k.grad == 0).all() and (v.grad == 0).all()  # no query: no key contributes
    assert launched == []  # nothing to compute, in either direction


def test_no_grad_calls_skip_autograd(eager, monkeypatch):
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    monkeypatch.setattr(ops, "_eager_attention", None)  # would fail if called
    with torch.no_grad():
        assert not ops.flash_attn_func(q, q, q).requires_grad
    assert not ops.flash_attn_func(q.detach(), q.detach(), q.detach()).requires_grad


def test_compiled_backward_plans_once_per_call_signature(eager):
    """The fa3gen::bwd op body plans once per call signature, as the eager backward does: three
    compiled forward + backward steps check and plan each direction once. The gradient of a
    sum reaches it expanded (stride 0), which TMA cannot read: every call copies it, and the
    launch reads the copy's strides."""
    launched, checks = eager
    torch._dynamo.reset()
    x = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x: ops.flash_attn_func(x, x, x), fullgraph=True, backend="eager")
    for _ in range(3):
        f(x).sum().backward()
    bwd = [p for name, p in launched if name.startswith("bwd_")]
    assert len(bwd) == 3 and len(launched) == 6 and len(checks) == 2
    assert all(p.do_row_stride == 2 * 128 and p.do_head_stride == 128 for p in bwd)


def test_torch_compile_traces_the_captured_path_on_cpu(eager, monkeypatch):
    """torch.compile(fullgraph=True) through flash_attn_func and its custom op, the launch
    stubbed: a static length, then a length dynamo makes dynamic. The op picks the variant
    when it runs, so a seqlen_k range default serves compiled calls as it serves eager ones."""
    from fa3gen import runtime
    from fa3gen.contract import make_key

    launched, _ = eager
    lib = runtime.get_library()
    short = lib.find("fwd", "bf16", 128, False, variant="fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0")
    monkeypatch.setattr(lib, "seqlen_dispatch", {make_key("fwd", "bf16", 128, False): [(0, 250, short)]})
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: ops.flash_attn_func(q, k, v, 0.5), fullgraph=True,
                      backend="eager")
    for seqlen in (64, 200, 300):
        x = torch.zeros(1, seqlen, 2, 128, dtype=torch.bfloat16)
        assert f(x, x, x).shape == x.shape
    assert [n for n, _ in launched] == [short.name] * 2 + ["fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"]
    assert launched[0][1].softmax_scale == 0.5 and launched[2][1].seqlen_q == 300


def test_device_facts_trace_without_a_dynamo_warning(monkeypatch):
    """check_device runs while torch.compile traces; what it asks of the device (capability,
    and the SM count beside it) is cached without functools.lru_cache, which dynamo warns
    about on every compiled model; eager calls ask the device once."""
    import warnings

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or (9, 0))
    monkeypatch.setattr(ops, "_capabilities", {})
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * ops._capability(3)[0], fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert f(torch.ones(2)).tolist() == [9.0, 9.0]
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    before = len(asked)
    assert ops._capability(3) == ops._capability(3) == (9, 0) and len(asked) <= before + 1
    import collections
    props = collections.namedtuple("Props", "multi_processor_count")  # dynamo wraps a namedtuple
    counted = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: counted.append(i) or props(132))
    monkeypatch.setattr(ops, "_sm_counts", {})
    assert ops._num_sms(3) == ops._num_sms(3) == 132 and counted == [3]
    torch._dynamo.reset()
    g = torch.compile(lambda x: x * ops._num_sms(4), fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert g(torch.ones(2)).tolist() == [132.0, 132.0]
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_torch_compile_with_dynamic_shapes(fake_launches):
    """torch.compile(dynamic=True): sizes become SymInts and masking()'s numbers symbolic, which
    the variant lookup (a function dynamo runs as a constant) cannot take; the head dim and
    the key flags are decided while tracing instead. Forward, backward (window and softcap),
    varlen, fp8 and the quantizer, each with the eager launch's variant; a second shape runs
    the same graph."""
    from fa3gen import fp8, varlen

    bf = torch.bfloat16
    torch._dynamo.reset()
    dense = torch.compile(lambda q: ops.flash_attn_func(q, q, q), fullgraph=True,
                          backend="aot_eager", dynamic=True)
    for b, s in ((2, 40), (3, 50)):
        q = torch.zeros(b, s, 2, 128, dtype=bf, requires_grad=True)
        dense(q).float().sum().backward()
        assert q.grad.shape == q.shape
    fake_launches.clear()
    torch._dynamo.reset()
    cu = torch.tensor([0, 30, 40], dtype=torch.int32)
    call = torch.compile(lambda q, cu, m: varlen.flash_attn_varlen_func(q, q, q, cu, cu, m, m,
                                                                        causal=True),
                         fullgraph=True, backend="aot_eager", dynamic=True)
    q = torch.zeros(40, 2, 128, dtype=bf, requires_grad=True)
    call(q, cu, 30).float().sum().backward()
    assert [n for n, _ in fake_launches] == ["fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1",
                                            "bwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp0_ov0"]
    fake_launches.clear()
    torch._dynamo.reset()
    e4m3 = torch.zeros(2, 40, 2, 128, dtype=bf).to(torch.float8_e4m3fn)
    torch.compile(lambda q: ops.flash_attn_func(q, q, q, causal=True), fullgraph=True,
                  backend="aot_eager", dynamic=True)(e4m3)
    assert [n for n, _ in fake_launches] == ["fwd_e4m3_d128_causal_m128n128_s2_ws1_pp1_ov1"]
    torch._dynamo.reset()
    q8, *_ = torch.compile(lambda q: fp8.quantize_fp8(q, q, q, causal=True), fullgraph=True,
                           backend="aot_eager", dynamic=True)(torch.zeros(2, 40, 2, 128, dtype=bf))
    assert q8.dtype == torch.float8_e4m3fn
    torch._dynamo.reset()
    odd = torch.zeros(2, 40, 2, 72, dtype=bf)
    # a head dim no kernel serves: the eager call's message (in dynamo's error)
    with pytest.raises(Exception, match="head_dim 72 is not supported by the fa3gen kernels"):
        torch.compile(lambda q: ops.flash_attn_func(q, q, q), backend="aot_eager",
                      dynamic=True)(odd)


def test_static_head_dim_gives_every_value_back_as_an_int():
    """A symbolic head dim comes back as the int of its value, supported or not: the lookup
    (a constant function under torch.compile) names what the library has. Torch 2.11's
    dynamo failed on the SymInt (test_torch_compile_with_dynamic_shapes, on that torch)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    for d in (64, 128, 72, 2, 2**31 - 1):  # 0 and 1 the ShapeEnv specializes
        sym = env.create_symintnode(env.create_symbol(d, ConstantSource(f"d{d}")), hint=d)
        assert isinstance(sym, torch.SymInt)
        assert ops.static_head_dim(sym) == d and type(ops.static_head_dim(sym)) is int
    for d in (64, 72, 0, 2**31, -3):  # eager ints as they are
        assert ops.static_head_dim(d) == d and type(ops.static_head_dim(d)) is int


def test_flash_attention_3s_other_keywords(fake_launches):
    """FA3 code that passes its performance hints (num_splits, pack_gqa, sm_margin) runs, with
    the same launch; qv and attention_chunk, which change the result, are refused unless at
    their defaults; bad values are refused too. Both entry points."""
    from fa3gen import varlen
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    ops.flash_attn_func(q, q, q)
    ops.flash_attn_func(q, q, q, num_splits=0, pack_gqa=True, sm_margin=8, qv=None, attention_chunk=0)
    (n1, p1), (n2, p2) = fake_launches
    from fa3gen.contract import FWD_PARAMS
    values = [name for name, ctype in FWD_PARAMS if "*" not in ctype]  # the pointers differ
    assert n1 == n2 and [getattr(p1, f) for f in values] == [getattr(p2, f) for f in values]
    for kw, match in ((dict(qv=q), "qv"), (dict(attention_chunk=128), "attention_chunk"),
                      (dict(num_splits=-1), "num_splits"), (dict(sm_margin=1.5), "sm_margin"),
                      (dict(pack_gqa="yes"), "pack_gqa")):
        with pytest.raises(InvalidInputError, match=match):
            ops.flash_attn_func(q, q, q, **kw)
    x = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    varlen.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, causal=True, num_splits=1, pack_gqa=False,
                                  sm_margin=0, q_descale=None)
    with pytest.raises(InvalidInputError, match="attention_chunk"):
        varlen.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, attention_chunk=64)
    with pytest.raises(InvalidInputError, match="descales"):
        varlen.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, k_descale=torch.ones(1))
    assert len(fake_launches) == 3


def test_flash_attn_2s_dropout_and_alibi_keywords_at_their_defaults(fake_launches):
    """flash-attn 2 code passing dropout_p=0.0 and alibi_slopes=None by keyword runs the same
    launch; any dropout or ALiBi (and flash-attn 2's paged varlen block_table) is an
    InvalidInputError, never ignored."""
    from fa3gen import varlen
    from fa3gen.contract import FWD_PARAMS
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    x, cu = q[0], torch.tensor([0, 8], dtype=torch.int32)
    ops.flash_attn_func(q, q, q)  # the fake library's dense key: non-causal
    ops.flash_attn_func(q, q, q, dropout_p=0.0, alibi_slopes=None)
    (n1, p1), (n2, p2) = fake_launches
    values = [name for name, ctype in FWD_PARAMS if "*" not in ctype]
    assert n1 == n2 and [getattr(p1, f) for f in values] == [getattr(p2, f) for f in values]
    varlen.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, causal=True, dropout_p=0, alibi_slopes=None,
                                  block_table=None)
    for call in (lambda **kw: ops.flash_attn_func(q, q, q, **kw),
                 lambda **kw: varlen.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, **kw)):
        for kw, match in ((dict(dropout_p=0.1), r"dropout_p=0.1: attention dropout \(flash-attn 2\) "
                                                r"is not supported by fa3gen; only 0.0 is accepted"),
                          (dict(dropout_p=True), "dropout_p=True"), (dict(dropout_p="0"), "dropout_p='0'"),
                          (dict(dropout_p=False), "dropout_p=False"),
                          (dict(dropout_p=torch.tensor([0.0, 0.1])), "attention dropout"),
                          (dict(alibi_slopes=torch.ones(2)), r"alibi_slopes \(ALiBi, flash-attn 2\)")):
            with pytest.raises(InvalidInputError, match=match):
                call(**kw)
    with pytest.raises(InvalidInputError, match="block_table .* flash_attn_with_kvcache takes paged"):
        varlen.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, block_table=torch.zeros(1, 1, dtype=torch.int32))
    assert len(fake_launches) == 3


@pytest.mark.parametrize("flag", [True, "numpy", torch.tensor(True)])
def test_a_bool_of_any_kind_in_the_scales_place_is_the_order_error(flag):
    """float() takes numpy's and torch's bools as 1.0: they are refused as Python's is, in the
    dense, packed and KV-cache calls."""
    from fa3gen import kvcache
    if flag == "numpy":
        flag = pytest.importorskip("numpy").True_
    with pytest.raises(InvalidInputError, match=r"order \(q, k, v, softmax_scale, causal\)"):
        ops.flash_attn_func(q, q, q, flag)
    with pytest.raises(InvalidInputError, match="softmax_scale must be a finite number > 0"):
        kvcache.flash_attn_with_kvcache(q, q, q, softmax_scale=flag)


# The fake library's table with the windowed backward and the windowed varlen pair added.
WINDOW_ROWS = """
  {"bwd_bf16_d128_nocausal_local_softcap_m64n128_s2_ws1_pp0_ov0", "bwd", "bf16", 128, 0, 1, 1, 0,
   64, 128, 2, 1, 0, 0, 0, 0, 0, 0, 1, 0, launch_bwd},
  {"fwd_bf16_d128_nocausal_local_varlen_m128n128_s2_ws1_pp1_ov1", "fwd", "bf16", 128, 0, 1, 0, 1,
   128, 128, 2, 1, 1, 1, 0, 0, 0, 0, 1, launch, 0},
  {"bwd_bf16_d128_nocausal_local_varlen_m64n128_s2_ws1_pp0_ov0", "bwd", "bf16", 128, 0, 1, 0, 1,
   64, 128, 2, 1, 0, 0, 0, 0, 0, 0, 1, 0, launch_bwd},
"""


def test_a_window_that_varies_between_compiled_calls_with_gradients(fake_launches, tmp_path,
                                                                   monkeypatch):
    """torch.compile makes a window side that changes between calls a SymInt; the autograd
    context took the op's window through masking() again, which refuses a SymInt, so a training
    step with a varying window failed to compile (without gradients it worked)."""
    from fa3gen import varlen
    from tests.test_runtime_errors import FAKE_LIB_C, build_fake_lib

    source = FAKE_LIB_C.replace("\n};\n#define COUNT", WINDOW_ROWS + "};\n#define COUNT", 1)
    assert source != FAKE_LIB_C
    monkeypatch.setenv("FA3GEN_LIB", str(build_fake_lib(tmp_path, source=source, name="windows")))
    bf = torch.bfloat16
    torch._dynamo.reset()
    dense = torch.compile(lambda q, w: ops.flash_attn_func(q, q, q, window_size=(w, w), softcap=5.0),
                          fullgraph=True, backend="aot_eager")
    for w in (16, 24, 32):  # the second call recompiles with w dynamic
        q = torch.zeros(2, 40, 2, 128, dtype=bf, requires_grad=True)
        dense(q, w).float().sum().backward()
    fwd = [p for n, p in fake_launches if n.startswith("fwd")]
    bwd = [p for n, p in fake_launches if n.startswith("bwd")]
    assert [p.window_left for p in fwd] == [p.window_left for p in bwd] == [16, 24, 32]
    fake_launches.clear()
    torch._dynamo.reset()
    cu = torch.tensor([0, 30, 40], dtype=torch.int32)
    call = torch.compile(lambda q, w: varlen.flash_attn_varlen_func(q, q, q, cu, cu, 30, 30,
                                                                    window_size=(w, 0)),
                         fullgraph=True, backend="aot_eager")
    for w in (8, 12):
        q = torch.zeros(40, 2, 128, dtype=bf, requires_grad=True)
        call(q, w).float().sum().backward()
    assert [p.window_left for _, p in fake_launches] == [8, 8, 12, 12]


HUGE = 10 ** 5000  # str()/repr() of an int past 4300 digits raises ValueError


@pytest.mark.parametrize("kwargs", [
    {"causal": HUGE}, {"window_size": (-HUGE, 0)}, {"window_size": (0, HUGE, 1)},
    {"num_splits": -HUGE}, {"attention_chunk": HUGE}, {"sm_margin": -HUGE}, {"pack_gqa": HUGE},
    {"dropout_p": HUGE}, {"softmax_scale": -HUGE},
])
def test_an_int_too_long_to_print_is_still_one_clear_error(kwargs):
    with pytest.raises(InvalidInputError,
                       match="an int of about -?10\\^5000|holding an int too long"):
        ops.flash_attn_func(q, q, q, **kwargs)


@pytest.mark.parametrize("call", [
    lambda **kw: ops.flash_attn_func(q, q, q, **kw),
    lambda **kw: fa3gen.flash_attn_varlen_func(q[0], q[0], q[0], CU, CU, 8, 8, **kw),
    lambda **kw: fa3gen.flash_attn_qkvpacked_func(torch.zeros(1, 8, 3, 2, 128), **kw),
    lambda **kw: fa3gen.flash_attn_varlen_kvpacked_func(q[0], torch.zeros(8, 2, 2, 128), CU, CU,
                                                        8, 8, **kw),
], ids=["func", "varlen", "qkvpacked", "varlen_kvpacked"])
@pytest.mark.parametrize("name", ["deterministic", "return_lse", "return_attn_probs"])
@pytest.mark.parametrize("value", ["no", torch.ones(2, dtype=torch.bool), 2, None])
def test_a_flag_that_is_no_bool_is_an_error_not_truthiness(call, name, value):
    """return_lse="no" returned (out, lse) and a tensor of flags raised torch's "ambiguous"
    RuntimeError: flags take True/False (numpy bools, 0 and 1 too), as causal does."""
    with pytest.raises(InvalidInputError, match=f"{name} must be True or False"):
        call(**{name: value})


@pytest.mark.parametrize("name", ["return_lse", "return_softmax_lse", "rotary_interleaved"])
def test_kvcache_flags_are_checked_too(name):
    cos = torch.zeros(8, 64)
    extra = dict(rotary_cos=cos, rotary_sin=cos, k=q, v=q) if name == "rotary_interleaved" else {}
    with pytest.raises(InvalidInputError, match=f"{name} must be True or False"):
        fa3gen.flash_attn_with_kvcache(q, q, q, **extra, **{name: "no"})


def test_quantize_fp8_flags_are_checked():
    for name in ("block", "hadamard", "causal", "rotary_interleaved"):
        with pytest.raises(InvalidInputError, match=f"{name} must be True or False"):
            fa3gen.quantize_fp8(q, q, q, **{name: "no"})


def test_flags_take_numpy_bools_and_0_1():
    np = pytest.importorskip("numpy")
    for value, want in ((np.bool_(True), True), (0, False), (1, True), (False, False)):
        got = ops.flag("return_lse", value)
        assert got is want
    assert ops.returns_lse(False, np.bool_(True)) is True


def test_softmax_scale_takes_what_float_takes_but_bools_arrays_and_complex():
    """real_number replaced check_softmax_scale's float(): it must not narrow what was taken
    (a 0-d numpy array, a Decimal) nor let a meta tensor's RuntimeError through."""
    from decimal import Decimal
    np = pytest.importorskip("numpy")
    for ok in (np.array(0.5), Decimal("0.5"), np.float16(0.5), torch.tensor(0.5)):
        ops.check_softmax_scale(ok)
    for bad in (np.array(True), np.array([0.5]), torch.tensor(0.5, device="meta"), 1j,
                torch.tensor(0.5 + 0j)):
        with pytest.raises(InvalidInputError, match="softmax_scale must be a finite number > 0"):
            ops.check_softmax_scale(bad)
    with pytest.raises(InvalidInputError, match=r"softmax_scale=1e\+40 is outside"):
        ops.check_softmax_scale(torch.tensor(1e40, dtype=torch.float64))  # the value, not a tensor


def test_pack_gqa_takes_the_flags_flags_take():
    np = pytest.importorskip("numpy")
    for ok in (None, True, np.bool_(False), 0, 1):
        ops.check_fa3_extras(None, 0, 1, ok, 0)
    with pytest.raises(InvalidInputError, match="pack_gqa must be None, True or False"):
        ops.check_fa3_extras(None, 0, 1, 2, 0)


def test_packed_num_heads_q_too_long_to_print():
    with pytest.raises(InvalidInputError, match=r"num_heads_q=an int of about 10\^5000"):
        fa3gen.flash_attn_qkvpacked_func(torch.zeros(1, 8, 3, 2, 128), num_heads_q=HUGE)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache_seqlens=-HUGE), r"cache_seqlens an int of about -10\^5000 outside"),
    (dict(k=q, v=q, rotary_cos=torch.zeros(8, 64), rotary_sin=torch.zeros(8, 64),
          cache_seqlens=HUGE), r"cache_seqlens \+ 8 = an int of about 10\^5000"),
    (dict(rotary_interleaved="no"), "rotary_interleaved must be True or False"),  # no tables
])
def test_kvcache_huge_ints_and_flags_past_the_device_check(kwargs, message, monkeypatch):
    monkeypatch.setattr(ops, "check_device", lambda *a: None)  # the checks a GPU call reaches
    with pytest.raises(InvalidInputError, match=message):
        fa3gen.flash_attn_with_kvcache(q, q, q, **kwargs)


def test_real_numbers_only_and_never_another_exception():
    """Complex numpy scalars lost their imaginary part, text arrays, buffers, object and masked
    arrays were read as numbers, a __float__ or __repr__ that raised escaped, and a positive
    Fraction or Decimal too small for a double turned softcap off as 0.0."""
    import fractions
    from decimal import Decimal
    np = pytest.importorskip("numpy")

    class Raises:
        def __float__(self):
            raise ZeroDivisionError

        def __repr__(self):
            raise RuntimeError

    for bad in (np.complex128(1 + 5j), np.array("1.5"), bytearray(b"1"), memoryview(b"1"),
                np.array(True, dtype=object), np.ma.array(2.0), Raises(), Decimal("NaN")):
        for check in (ops.check_softmax_scale, lambda x: ops.masking(False, (-1, -1), x)):
            with pytest.raises(InvalidInputError, match="must be a finite number"):
                check(bad)
    for tiny in (fractions.Fraction(1, 10**400), Decimal("1e-400")):
        with pytest.raises(InvalidInputError, match="is outside"):
            ops.masking(False, (-1, -1), tiny)
    with pytest.raises(InvalidInputError, match="must be a finite number > 0"):  # not +5e-324
        ops.check_softmax_scale(fractions.Fraction(-1, 10**400))
    assert ops.masking(False, (-1, -1), np.array(2, dtype=np.uint8)).softcap == 2.0


def test_a_compiled_forward_whose_inputs_require_grad_needs_no_backward_variant(fake_launches):
    """AOT traces the backward with the forward when an input requires grad: a library with
    the forward variant only (a spec trimmed from an inference trace, the model in eval mode
    without no_grad) runs the compiled call as the eager one does, and a backward raises
    VariantNotBuiltError when it runs (the fake library has no windowed softcap backward)."""
    from fa3gen import VariantNotBuiltError

    torch._dynamo.reset()
    call = torch.compile(lambda q: ops.flash_attn_func(q, q, q, window_size=(3, 3), softcap=5.0),
                         fullgraph=True, backend="aot_eager")
    q = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    out = call(q)
    assert [n for n, _ in fake_launches] == [
        "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1"]
    with pytest.raises(VariantNotBuiltError, match="direction=bwd"):
        out.float().sum().backward()
    eager = ops.flash_attn_func(q, q, q, window_size=(3, 3), softcap=5.0)
    with pytest.raises(VariantNotBuiltError, match="direction=bwd"):
        eager.float().sum().backward()


@pytest.mark.parametrize("offload_first", [False, True])
@pytest.mark.parametrize("path", ["dense", "varlen"])
def test_backward_takes_the_saved_tensors_layout(fake_launches, path, offload_first):
    """A saved-tensor hook (save_on_cpu: activation offloading) gives q, k, v back contiguous.
    The eager backward's plan had been kept under the forward's plan alone, so a step with
    offloading and one without (the same call) shared params: the other's strides, read past
    q or the wrong rows of it."""
    from fa3gen import varlen

    def step(offload):
        shape = (64, 3, 2, 128) if path == "varlen" else (1, 64, 3, 2, 128)
        qkv = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
        q, k, v = qkv.unbind(-3)  # views: rows 3 x 2 x 128 apart
        # as save_on_cpu(pin_memory=True) does: a contiguous copy comes back
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: t.clone(memory_format=torch.contiguous_format), lambda t: t) \
            if offload else contextlib.nullcontext()
        with hooks:
            if path == "varlen":
                cu = torch.tensor([0, 30, 64], dtype=torch.int32)
                out = varlen.flash_attn_varlen_func(q, k, v, cu, cu, 34, 34, causal=True)
            else:
                out = fa3gen.flash_attn_func(q, k, v)
        out.float().sum().backward()
        name, p = fake_launches[-1]
        assert name.startswith("bwd_")
        return p.q_row_stride, p.k_row_stride, p.v_row_stride

    first, second = (True, False) if offload_first else (False, True)
    assert step(first) == ((256,) * 3 if first else (768,) * 3)
    assert step(second) == ((256,) * 3 if second else (768,) * 3)


def test_the_backward_runs_on_the_forwards_library(fake_launches, tmp_path, monkeypatch):
    """A backward's variant had been looked up in the library current when the backward ran
    (launched on the forward's): after a switch to a library without it, VariantNotBuiltError."""
    from tests.test_runtime_errors import FAKE_LIB_C, build_fake_lib
    bwd_row = ('  {"bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0", "bwd", "bf16", 128, 0, 0, 0, 0, '
               '64, 128, 2, 1, 0,\n   0, 0, 0, 0, 0, 1, 0, launch_bwd},\n')
    assert bwd_row in FAKE_LIB_C
    forward_only = build_fake_lib(tmp_path, source=FAKE_LIB_C.replace(bwd_row, ""), name="fwdonly")
    q = torch.zeros(1, 40, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    out = fa3gen.flash_attn_func(q, q, q)
    monkeypatch.setenv("FA3GEN_LIB", str(forward_only))
    out.float().sum().backward()
    assert [name for name, _ in fake_launches] == ["fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1",
                                                   "bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0"]


@pytest.fixture
def deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("compiled", [False, True])
def test_torch_deterministic_algorithms_make_the_backward_deterministic(
        fake_launches, deterministic_algorithms, compiled):
    """torch.use_deterministic_algorithms(True) asks every operation for reproducible results:
    the backward orders its dq additions whatever deterministic= says (it had run with
    atomics, silently non-reproducible), eager and under torch.compile."""
    torch._dynamo.reset()
    q = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    call = lambda q: ops.flash_attn_func(q, q, q)
    if compiled:
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    call(q).float().sum().backward()
    torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()
    ops.flash_attn_func(q, q, q).float().sum().backward()  # the flag off again
    bwd = [p.deterministic for name, p in fake_launches if name.startswith("bwd")]
    assert bwd == [1, 0]
