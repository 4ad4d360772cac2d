"""fa3gen.reference is the GPU tests' ground truth, so it is checked here against a second,
naive implementation written from the documented semantics (float64, masks built element by
element, gradients by autograd): a reference bug would otherwise pass wherever a kernel has it
too."""
import math

import pytest
import torch

from fa3gen import reference

CASES = [  # (b, sq, sk, hq, hkv, d, causal, window, softcap)
    (2, 7, 7, 4, 4, 16, False, (-1, -1), 0.0),
    (1, 5, 9, 4, 2, 8, True, (-1, -1), 0.0),      # causal, seqlen_q < seqlen_k (bottom-right)
    (1, 9, 5, 2, 1, 8, True, (-1, -1), 0.0),      # first queries see no key
    (2, 8, 11, 6, 2, 8, False, (3, 1), 0.0),      # a window, GQA 3
    (1, 6, 6, 2, 2, 8, False, (0, 0), 0.0),       # one key a row
    (1, 10, 12, 2, 1, 8, True, (2, -1), 0.0),     # causal window
    (2, 6, 9, 4, 4, 16, False, (-1, -1), 2.5),    # softcap
    (1, 7, 7, 4, 2, 8, True, (4, -1), 1.5),       # softcap + causal window
]


def visible(i, j, sq, sk, causal, window):
    left, right = window
    if causal:
        right = 0
    diag = i + sk - sq
    return (right < 0 or j <= diag + right) and (left < 0 or j >= diag - left)


def naive(q, k, v, causal, window, softcap, scale):
    """(out, lse) in float64, differentiable, with the documented semantics spelled out."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    mask = torch.tensor([[visible(i, j, sq, sk, causal, window) for j in range(sk)]
                         for i in range(sq)])
    outs, lses = [], []
    for h in range(hq):
        kh, vh = k[:, :, h // (hq // hkv)], v[:, :, h // (hq // hkv)]  # (b, sk, d)
        s = torch.einsum("bid,bjd->bij", q[:, :, h], kh) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
        outs.append(torch.einsum("bij,bjd->bid", p, vh))
        lses.append(lse)
    return torch.stack(outs, 2), torch.stack(lses, 1)


def inputs(case, seed=0):
    b, sq, sk, hq, hkv, d = case[:6]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64)
            for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_reference_matches_the_naive_one(case):
    causal, window, softcap = case[6:]
    q, k, v, _ = inputs(case)
    scale = 0.7 / math.sqrt(q.shape[-1])
    want_out, want_lse = naive(q, k, v, causal, window, softcap, scale)
    out, lse = reference.attention_reference(q.float(), k.float(), v.float(), causal, scale,
                                             window_size=window, softcap=softcap)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    assert (out[torch.isneginf(want_lse).transpose(1, 2)] == 0).all()  # unseen rows: zeros


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradient_reference_matches_autograd(case):
    causal, window, softcap = case[6:]
    q, k, v, dout = inputs(case, seed=1)
    scale = 0.7 / math.sqrt(q.shape[-1])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = naive(*leaves, causal, window, softcap, scale)
    want = torch.autograd.grad((out * dout).sum(), leaves)
    got = reference.attention_grad_reference(q.float(), k.float(), v.float(), dout.float(), causal,
                                             scale, window_size=window, softcap=softcap)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5, msg=name)


def test_masks_follow_the_documented_diagonal():
    """causal_mask and window_mask against the element rule (bottom-right aligned)."""
    for sq, sk in ((5, 9), (9, 5), (6, 6)):
        for window in ((-1, 0), (2, 1), (0, 0), (3, -1), (-1, 2)):
            want = torch.tensor([[visible(i, j, sq, sk, False, window) for j in range(sk)]
                                 for i in range(sq)])
            assert torch.equal(reference.window_mask(sq, sk, window), want), (sq, sk, window)
        want = torch.tensor([[visible(i, j, sq, sk, True, (-1, -1)) for j in range(sk)]
                             for i in range(sq)])
        assert torch.equal(reference.causal_mask(sq, sk), want)


def test_hadamard_transform_is_the_orthonormal_matrix():
    """hadamard_transform(x) == x @ H_d / sqrt(d) with H_d Sylvester's matrix, and it is its
    own inverse (orthonormal and symmetric)."""
    d = 16
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = reference.hadamard_transform(x)
    torch.testing.assert_close(y, x @ h / math.sqrt(d))
    torch.testing.assert_close(reference.hadamard_transform(y), x)


def test_the_tolerance_rule_rejects_three_times_plain_low_precision_error():
    """compare_to_reference / compare_grads_to_reference: the fp32 reference and plain PyTorch
    in bf16 pass; one element off by 3x the low-precision error (plus twice the absolute floor)
    fails, for out, lse and each gradient."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 33, 4, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    ref_out, ref_lse = reference.attention_reference(q, k, v, True)
    low_out, _ = reference.attention_reference(q, k, v, True, upcast=False)
    assert reference.compare_to_reference(ref_out, ref_lse, q, k, v, True)["ok"]
    res = reference.compare_to_reference(low_out, ref_lse, q, k, v, True)
    assert res["ok"] and res["lowprec_err"] > 0
    bad = ref_out.clone()
    bad[1, 7, 2, 5] += 3 * res["lowprec_err"] + 2 * reference.OUT_ATOL
    assert not reference.compare_to_reference(bad, ref_lse, q, k, v, True)["ok"]
    bad_lse = ref_lse.clone()
    bad_lse[0, 1, 9] += 2 * reference.LSE_ATOL + 2 * reference.LSE_RTOL * abs(float(ref_lse[0, 1, 9]))
    assert not reference.compare_to_reference(ref_out, bad_lse, q, k, v, True)["ok"]

    grads = reference.attention_grad_reference(q, k, v, dout, True)
    low = reference.attention_grad_reference(q, k, v, dout, True, upcast=False)
    assert reference.compare_grads_to_reference(grads, q, k, v, dout, True)["ok"]
    for i in range(3):
        off = list(grads)
        err = float((low[i].float() - grads[i]).abs().max())
        off[i] = grads[i].clone()
        off[i].view(-1)[11] += 3 * err + 2 * reference.GRAD_ATOL
        assert not reference.compare_grads_to_reference(off, q, k, v, dout, True)["ok"], i


def test_nan_is_reported_as_unwritten_elements():
    """Outputs are NaN-poisoned before a kernel runs: a NaN left says 'not written'."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 9, 2, 32, generator=g).to(torch.bfloat16) for _ in range(4))
    out, lse = reference.attention_reference(q, k, v)
    out[0, 3, 1, 4] = float("nan")
    res = reference.compare_to_reference(out, lse, q, k, v)
    assert not res["ok"] and "NaN in out (1)" in res["why"]
    grads = list(reference.attention_grad_reference(q, k, v, dout))
    grads[1][0, 2, 0, 0] = float("nan")
    res = reference.compare_grads_to_reference(grads, q, k, v, dout)
    assert not res["ok"] and res["why"] == "NaN in dk (1): elements not written or NaN math"


@pytest.mark.parametrize("threshold", [-1.0, 0.8, 8.0])
def test_blockwise_softmax_is_the_softmax_without_rounding(threshold):
    """blockwise_softmax_pv with P unrounded gives the softmax whatever the rescale threshold
    (the kernels' claim: a kept maximum changes only which P values get rounded): fp64 scores
    whose maxima grow block after block (so threshold 0.8 moves some rows and keeps others),
    masked keys, a row that sees no key (out 0, lse -inf), a last block shorter than the rest."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 3, 7, 45, generator=g, dtype=torch.float64) * 3
    scores += torch.linspace(0, 6, 45, dtype=torch.float64)  # later keys larger: maxima grow
    scores[..., ::7] = float("-inf")
    scores[0, 1, 4] = float("-inf")
    vt = torch.randn(2, 3, 45, 5, generator=g, dtype=torch.float64)
    out, lse = reference.blockwise_softmax_pv(scores, vt, 16, threshold, lambda p: p)
    seen = torch.isfinite(scores).any(-1)
    want = torch.softmax(scores, -1).nan_to_num(0.0) @ vt
    assert torch.allclose(out, want, rtol=0, atol=1e-12)
    assert torch.allclose(lse[seen], torch.logsumexp(scores, -1)[seen], rtol=0, atol=1e-12)
    assert not seen[0, 1, 4] and lse[0, 1, 4] == float("-inf") and (out[0, 1, 4] == 0).all()


def _blockwise_grads(q, k, v, dout, causal, scale, window=(-1, -1), block=64):
    """(dq, dk, dv) computed as the kernels compute them: 16-bit inputs, fp32 sums by key
    blocks, P and dS rounded to the inputs' dtype, 16-bit results; GQA by summing a kv head's
    query heads, windows by reference.window_mask."""
    dt, group = q.dtype, q.shape[2] // k.shape[2]
    qt, dot = (t.transpose(1, 2).float() for t in (q, dout))
    kt, vt = (t.transpose(1, 2).float().repeat_interleave(group, 1) for t in (k, v))
    s = qt @ kt.transpose(-1, -2) * scale
    if causal or window != (-1, -1):
        mask = reference.window_mask(q.shape[1], k.shape[1], (window[0], 0) if causal else window)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    out = (torch.exp(s - lse).to(dt).float() @ vt).to(dt).float()
    delta = (out * dot).sum(-1, keepdim=True)
    dq, dk, dv = torch.zeros_like(qt), torch.zeros_like(kt), torch.zeros_like(vt)
    for j in range(0, k.shape[1], block):
        cols = slice(j, j + block)
        p = torch.exp(s[..., cols] - lse)
        dv[:, :, cols] += p.to(dt).float().transpose(-1, -2) @ dot
        ds = (p * (dot @ vt[:, :, cols].transpose(-1, -2) - delta)).to(dt).float()
        dq += ds @ kt[:, :, cols] * scale
        dk[:, :, cols] += ds.transpose(-1, -2) @ qt * scale
    b, hkv, sk, d = k.shape[0], k.shape[2], k.shape[1], k.shape[3]
    dk, dv = (x.view(b, hkv, group, sk, d).sum(2) for x in (dk, dv))
    return tuple(x.transpose(1, 2).to(dt) for x in (dq, dk, dv))


@pytest.mark.parametrize("case", [  # (b, sq, sk, hq, hkv, d, dtype, causal, window)
    (1, 1000, 1000, 4, 4, 128, torch.bfloat16, True, (-1, -1)),
    (2, 300, 700, 8, 2, 64, torch.bfloat16, True, (-1, -1)),
    (1, 257, 257, 4, 1, 256, torch.float16, False, (-1, -1)),
    (2, 600, 600, 4, 2, 128, torch.bfloat16, False, (97, 23)),
    (1, 513, 400, 2, 2, 128, torch.float16, True, (64, -1)),
], ids=str)
def test_the_gradient_rule_passes_kernel_like_arithmetic(case):
    """The rule does not refuse gradients computed in the kernels' arithmetic (GQA, fp16,
    windows, a scale that is not the default)."""
    b, sq, sk, hq, hkv, d, dt, causal, window = case
    g = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(b, sq, hq, d, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(dt) for _ in range(2))
    scale = 0.8 * d**-0.5
    grads = _blockwise_grads(q, k, v, dout, causal, scale, window)
    res = reference.compare_grads_to_reference(grads, q, k, v, dout, causal, scale,
                                               window_size=window)
    assert res["ok"], res["why"]



def _blockwise_forward(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, tile_n=128):
    """(out, lse) computed as the 16-bit forward kernels compute them: fp32 scores of the 16-bit
    inputs, the online softmax over key blocks from the last down with the rescale threshold of
    rescale_threshold.cuh (8), P rounded to the inputs' dtype for the P V product, fp32 sums,
    the output rounded to the inputs' dtype."""
    dt, group = q.dtype, q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2).float()
    kt, vt = (t.transpose(1, 2).float().repeat_interleave(group, 1) for t in (k, v))
    s = qt @ kt.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal or window != (-1, -1):
        mask = reference.window_mask(q.shape[1], k.shape[1], (window[0], 0) if causal else window)
        s = s.masked_fill(~mask, float("-inf"))
    out, lse = reference.blockwise_softmax_pv(s, vt, tile_n, 8.0, lambda p: p.to(dt).float())
    return out.transpose(1, 2).contiguous().to(dt), lse


FORWARD_CASES = [  # (b, sq, sk, hq, hkv, d, dtype, causal, window, softcap, scale factor)
    (1, 1000, 1000, 4, 4, 128, torch.bfloat16, True, (-1, -1), 0.0, 0.8),
    (2, 300, 700, 8, 2, 64, torch.bfloat16, True, (-1, -1), 0.0, 6.0),
    (1, 257, 257, 4, 1, 256, torch.float16, False, (-1, -1), 0.0, 6.0),
    (2, 600, 600, 4, 2, 128, torch.bfloat16, False, (97, 23), 0.0, 0.8),
    (1, 513, 400, 2, 2, 128, torch.float16, True, (64, -1), 2.5, 6.0),
    (1, 700, 700, 4, 4, 64, torch.bfloat16, True, (-1, -1), 30.0, 6.0),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_the_forward_rule_passes_kernel_like_arithmetic(case):
    """The forward rule (global, per row, LSE) does not refuse outputs computed in the kernels'
    arithmetic, at the checks' scale and at large scores where rows rescale."""
    b, sq, sk, hq, hkv, d, dt, causal, window, softcap, factor = case
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, sq, hq, d, generator=g).to(dt)
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(dt) for _ in range(2))
    scale = factor * d**-0.5
    out, lse = _blockwise_forward(q, k, v, causal, scale, window, softcap)
    res = reference.compare_to_reference(out, lse, q, k, v, causal, scale, window_size=window,
                                         softcap=softcap)
    assert res["ok"], res["why"]


def test_the_forward_rule_catches_one_wrong_row_and_one_dropped_key():
    """Bugs the tensor-wide bound let pass (2026-12-07 hunt): one row's output 5% off (here the
    row with the smallest values, far below the tensor's largest error), and a causal kernel
    that drops the last key column (which only the last query row sees: its LSE moves by
    log(1 - p), well under the old 1e-3 + 1e-3 |lse|)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 333, 4, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    scale = 0.8 * 64**-0.5
    out, lse = _blockwise_forward(q, k, v, True, scale)
    assert reference.compare_to_reference(out, lse, q, k, v, True, scale)["ok"]
    row = out.float().abs().amax(-1).flatten().argmin()
    wrong = out.clone()
    wrong.view(-1, 64)[row] *= 1.05
    res = reference.compare_to_reference(wrong, lse, q, k, v, True, scale)
    assert not res["ok"] and "rows beyond the per-row tolerance" in res["why"]
    dropped = _blockwise_forward(q, k[:, :-1], v[:, :-1], True, scale)[1]
    last = lse.clone()
    last[..., -1] = dropped[..., -1]
    res = reference.compare_to_reference(out, last, q, k, v, True, scale)
    assert not res["ok"] and "lse" in res["why"]
