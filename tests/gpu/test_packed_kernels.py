"""flash-attn's packed entry points on the GPU: each gives, bit for bit, what the unpacked call
on the same views gives (out, lse, and the gradients, which the packed backward writes into
one tensor per packed input; deterministic mode, so that dq is bitwise repeatable), dense and
varlen, MHA and FlashAttention-3's GQA layout."""
import pytest
import torch

from fa3gen import packed
from fa3gen.ops import flash_attn_func
from fa3gen.varlen import flash_attn_varlen_func

from test_forward import DTYPES

pytestmark = pytest.mark.gpu


def _grads_of(call, inputs, seed):
    out, lse = call()
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype,
                       generator=torch.Generator(device="cuda").manual_seed(seed))
    return out, lse, torch.autograd.grad(out, inputs, dout)


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("layout", ["qkv", "qkv_gqa", "kv"])
def test_dense_packed_is_the_unpacked_call(lib, bwd_default_key, layout):
    dtype, d, causal = bwd_default_key
    g = torch.Generator(device="cuda").manual_seed(3)
    b, s, hq, hkv = 2, 333, 4, (4 if layout == "qkv" else 2)
    if layout == "kv":
        q = torch.randn(b, 200, hq, d, device="cuda", dtype=DTYPES[dtype], generator=g)
        kv = torch.randn(b, s, 2, hkv, d, device="cuda", dtype=DTYPES[dtype], generator=g)
        pq, pkv = _leaf(q), _leaf(kv)
        got = _grads_of(lambda: packed.flash_attn_kvpacked_func(pq, pkv, causal=causal, deterministic=True, return_lse=True), (pq, pkv), 1)
        uq, uk, uv = _leaf(q), _leaf(kv[:, :, 0]), _leaf(kv[:, :, 1])
        want = _grads_of(lambda: flash_attn_func(uq, uk, uv, causal=causal, deterministic=True, return_lse=True), (uq, uk, uv), 1)
        want_grads = (want[2][0], torch.stack(want[2][1:], dim=2))
    else:
        heads = 3 * hq if layout == "qkv" else hq + 2 * hkv
        shape = (b, s, 3, hq, d) if layout == "qkv" else (b, s, heads, d)
        qkv = torch.randn(shape, device="cuda", dtype=DTYPES[dtype], generator=g)
        nq = None if layout == "qkv" else hq
        p = _leaf(qkv)
        got = _grads_of(lambda: packed.flash_attn_qkvpacked_func(p, causal=causal, num_heads_q=nq, deterministic=True, return_lse=True), (p,), 1)
        views = qkv.unbind(2) if layout == "qkv" else qkv.split([hq, hkv, hkv], dim=2)
        u = [_leaf(t) for t in views]
        want = _grads_of(lambda: flash_attn_func(*u, causal=causal, deterministic=True, return_lse=True), tuple(u), 1)
        want_grads = (torch.stack(want[2], dim=2) if layout == "qkv" else torch.cat(want[2], dim=2),)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, w in zip(got[2], want_grads):
        assert torch.equal(a, w)


@pytest.mark.parametrize("layout", ["qkv", "kv"])
def test_varlen_packed_is_the_unpacked_call(lib, bwd_varlen_key, layout):
    dtype, d, causal = bwd_varlen_key
    g = torch.Generator(device="cuda").manual_seed(4)
    cu = torch.tensor([0, 200, 200, 533, 600], dtype=torch.int32, device="cuda")
    if layout == "qkv":
        qkv = torch.randn(600, 3, 4, d, device="cuda", dtype=DTYPES[dtype], generator=g)
        p = _leaf(qkv)
        got = _grads_of(lambda: packed.flash_attn_varlen_qkvpacked_func(p, cu, 333, causal=causal, deterministic=True, return_lse=True), (p,), 2)
        u = [_leaf(t) for t in qkv.unbind(1)]
        want = _grads_of(lambda: flash_attn_varlen_func(*u, cu, cu, 333, 333, causal=causal, deterministic=True, return_lse=True), tuple(u), 2)
        want_grads = (torch.stack(want[2], dim=1),)
    else:
        q = torch.randn(600, 4, d, device="cuda", dtype=DTYPES[dtype], generator=g)
        kv = torch.randn(600, 2, 2, d, device="cuda", dtype=DTYPES[dtype], generator=g)
        pq, pkv = _leaf(q), _leaf(kv)
        got = _grads_of(lambda: packed.flash_attn_varlen_kvpacked_func(pq, pkv, cu, cu, 333, 333, causal=causal, deterministic=True, return_lse=True), (pq, pkv), 2)
        uq, uk, uv = _leaf(q), _leaf(kv[:, 0]), _leaf(kv[:, 1])
        want = _grads_of(lambda: flash_attn_varlen_func(uq, uk, uv, cu, cu, 333, 333, causal=causal, deterministic=True, return_lse=True), (uq, uk, uv), 2)
        want_grads = (want[2][0], torch.stack(want[2][1:], dim=1))
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, w in zip(got[2], want_grads):
        assert torch.equal(a, w)
