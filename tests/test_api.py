"""flash_attn_func's signature: FlashAttention-3's positional order, its names for the
features fa3gen lacks, and clear errors instead of a different result."""
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
    ({"window_size": (256, 0)}, r"window_size=\(256, 0\): sliding-window .* not supported yet"),
    ({"softcap": 30.0}, "softcap=30.0: logit softcapping is not supported yet"),
])
def test_unsupported_fa3_features_raise(kwargs, message):
    with pytest.raises(Fa3genError, match=message):
        ops.flash_attn_func(q, q, q, **kwargs)


def test_return_attn_probs_returns_the_lse(stub_forward):
    stub_forward(lambda *a: ("out", "lse"))
    k = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    assert ops.flash_attn_func(q, k, k) == "out"
    assert ops.flash_attn_func(q, k, k, return_attn_probs=True) == ("out", "lse")
    assert ops.flash_attn_func(q, k, k, 0.1, False, return_lse=True) == ("out", "lse")
