"""flash_attn_func's signature: FlashAttention-3's positional order, flash-attn's meaning of
causal / window_size / softcap, and clear errors instead of a different result."""
import inspect

import pytest
import torch

from fa3gen import Fa3genError, InvalidInputError, ops

q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)


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
    with pytest.raises(InvalidInputError, match="softmax_scale must be positive, got 0.0: .*dropout_p"):
        ops.flash_attn_func(q, q, q, 0.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"window_size": (-2, 0)}, r"window_size left must be an int >= -1 \(-1: unbounded\), got -2"),
    ({"window_size": (5, 1.5)}, "window_size right must be an int >= -1 .*got 1.5"),
    ({"window_size": (5, True)}, "window_size right must be an int >= -1 .*got True"),
    ({"window_size": 5}, r"window_size must be a pair \(left, right\), got 5"),
    ({"window_size": (1, 2, 3)}, r"window_size must be a pair"),
    ({"softcap": -1.0}, r"softcap must be a finite number >= 0 \(0: none\), got -1.0"),
    ({"softcap": float("inf")}, "softcap must be a finite number >= 0"),
    ({"softcap": float("nan")}, "softcap must be a finite number >= 0"),
    ({"softcap": True}, "softcap must be a finite number >= 0"),
])
def test_bad_window_or_softcap_is_an_error(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        ops.flash_attn_func(q, q, q, **kwargs)


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
])
def test_masking_follows_flash_attn(causal, window, want):
    assert ops.masking(causal, window) == want
    assert want.local == (want.window_left >= 0 or want.window_right >= 0)


def test_window_and_softcap_select_the_feature_variant(stub_forward):
    """window_size/softcap pick the key with local/softcap, and reach the op as the kernels take
    them; a key the library lacks says which axes to add."""
    calls = []
    stub_forward(lambda *a: calls.append(a) or ("out", "lse"))
    k = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert ops.flash_attn_func(q, k, k, causal=True, window_size=(64, -1), softcap=30.0) == "out"
    name, window_left, window_right, softcap = calls[-1][5], *calls[-1][7:]
    assert name == "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1"
    assert (window_left, window_right, softcap, calls[-1][3]) == (64, 0, 30.0, False)
    with pytest.raises(Fa3genError, match="local: true\\) to a group of"):
        ops.flash_attn_func(q, k, k, window_size=(64, 64))  # no local variant without softcap
    with pytest.raises(Fa3genError, match="causal: true, softcap: true\\)"):
        ops.flash_attn_func(q, k, k, causal=True, softcap=5.0)


def test_return_attn_probs_returns_the_lse(stub_forward):
    stub_forward(lambda *a: ("out", "lse"))
    k = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert ops.flash_attn_func(q, k, k) == "out"
    assert ops.flash_attn_func(q, k, k, return_attn_probs=True) == ("out", "lse")
    assert ops.flash_attn_func(q, k, k, 0.1, False, return_lse=True) == ("out", "lse")
