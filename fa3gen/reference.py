"""Plain PyTorch attention: the ground truth of the GPU tests and of quick_check.

Layout (batch, seqlen, heads, head_dim) like the kernels. Semantics the kernels must match:
- GQA/MQA: query head i reads kv head i // (heads_q // heads_kv).
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q
  (the last query sees every key; with seqlen_q > seqlen_k the first queries see none).
- a row with no visible key gives output 0 and LSE -inf (not NaN).
- window_size (left, right): query i sees key j iff
  i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded); causal sets right to 0.
- softcap > 0: scores become softcap * tanh(scores / softcap) (after the softmax scale,
  before the mask).
"""

from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k), True where query i may see key j (bottom-right aligned)."""
    return window_mask(seqlen_q, seqlen_k, (-1, 0), device)


def window_mask(seqlen_q: int, seqlen_k: int, window_size, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k), True where query i may see key j under window_size."""
    left, right = window_size
    diag = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    return visible


def _window(causal, window_size):
    left, right = window_size
    return (left, 0) if causal else (left, right)


def _heads_and_scores(q, k, v, causal, softmax_scale, dt, window_size=(-1, -1), softcap=0.0):
    """q, k, v as (b, heads_q, s, d) in dt (kv heads repeated for GQA), the masked, scaled
    (and softcapped) scores (b, heads_q, sq, sk) in dt, the scale, and tanh of the softcap
    (None without)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"heads_q={hq} is not a multiple of heads_kv={hkv}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qt = q.to(dt).transpose(1, 2)
    kt = k.to(dt).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    vt = v.to(dt).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    window = _window(causal, window_size)
    if window != (-1, -1):
        scores = scores.masked_fill(~window_mask(sq, sk, window, q.device), float("-inf"))
    return qt, kt, vt, scores, scale, tanh


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
    *,
    window_size=(-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse). out is fp32 when upcast (the reference), else in the input dtype (the
    "plain PyTorch in low precision" baseline of the tolerance rule). lse is fp32
    (batch, heads_q, seqlen_q) in both cases."""
    dt = torch.float32 if upcast else q.dtype
    _, _, vt, scores, _, _ = _heads_and_scores(q, k, v, causal, softmax_scale, dt, window_size,
                                               softcap)

    # LSE in fp32 either way (low-precision logsumexp would only add noise to the baseline).
    lse = torch.logsumexp(scores.float(), dim=-1)
    visible = torch.isfinite(lse).unsqueeze(-1)  # False for rows with no visible key
    if upcast:
        p = torch.exp(scores - torch.where(visible, lse.unsqueeze(-1), 0.0))
    else:
        p = torch.softmax(scores, dim=-1)  # in dt, as a naive low-precision implementation
    p = torch.where(visible, p, torch.zeros((), dtype=p.dtype, device=p.device))
    out = torch.matmul(p.to(dt), vt).transpose(1, 2).contiguous()  # (b, sq, hq, d)
    return out, lse.contiguous()


# ---------------------------------------------------------------------------------------------
# The tolerance rule shared by the GPU tests and fa3gen.checks (as in the FA3 test suite):
# the kernel may be at most twice as wrong as plain PyTorch in the same low precision, + atol.

OUT_ATOL = 1e-3
# Per row too, so that one wrong row cannot hide under the tensor's largest error: a row's max
# error within twice plain PyTorch's on that row, plus ROW_ULPS x eps of the output dtype times
# the row's largest reference value (1-2 ulps there: the final rounding either side may take),
# plus OUT_ATOL. Correct kernels measured at most 0.43 of that term beyond twice PyTorch's
# (same runs as below).
ROW_ULPS = 1.0
# LSE: correct kernels' errors measured (tests/gpu/reference_margins.py, H100, 2026-12-07,
# docs/results/reference_margins_h100_1207_46th.json) at most 1.9e-6 at the default scale, 5.3e-5
# at scale 0.5, and 2.1e-4 with softcap 30 at scale 0.5 (capped scores near 30: relative 1.1e-5,
# the hardware tanh's); these bounds keep at least 2x over each. The old 1e-3 + 1e-3|lse| let a
# causal kernel dropping the last key column pass.
LSE_ATOL = 1e-4
LSE_RTOL = 3e-5


def compare_to_reference(out, lse, q, k, v, causal=False, softmax_scale=None, *,
                         window_size=(-1, -1), softcap=0.0) -> dict:
    """Check a kernel's (out, lse) against the fp32 reference; returns errors, tolerances and
    ok/why. NaN anywhere fails (outputs are poisoned with NaN before the tests launch)."""
    extra = dict(window_size=window_size, softcap=softcap)
    ref_out, ref_lse = attention_reference(q, k, v, causal, softmax_scale, upcast=True, **extra)
    low_out, _ = attention_reference(q, k, v, causal, softmax_scale, upcast=False, **extra)
    out_f, lse_f = out.float(), lse.float()
    res = {"ok": True, "why": []}

    def fail(msg):
        res["ok"] = False
        res["why"].append(msg)

    n_nan_o, n_nan_l = int(torch.isnan(out_f).sum()), int(torch.isnan(lse_f).sum())
    if n_nan_o or n_nan_l:
        fail(f"NaN in out ({n_nan_o}) / lse ({n_nan_l}): elements not written or NaN math")
    out_diff, low_diff = (out_f - ref_out).abs(), (low_out.float() - ref_out).abs()
    res["out_err"] = _max_abs(out_diff)
    res["lowprec_err"] = _max_abs(low_diff)
    res["out_tol"] = 2 * res["lowprec_err"] + OUT_ATOL
    if not res["out_err"] <= res["out_tol"]:
        fail(f"max |out - ref| = {res['out_err']:.3g} > tolerance {res['out_tol']:.3g}")
    # per row (batch, query, head): max over head_dim
    row_err = out_diff.amax(-1)
    row_tol = (2 * low_diff.amax(-1) + OUT_ATOL
               + ROW_ULPS * _eps(out.dtype) * ref_out.abs().amax(-1))
    over = ~(row_err <= row_tol) & ~torch.isnan(row_err)  # NaN is reported above
    if bool(over.any()):
        where = [int(i) for i in over.nonzero()[0]]
        fail(f"{int(over.sum())} rows beyond the per-row tolerance (first at (batch, query, "
             f"head) {tuple(where)}: {float(row_err[tuple(where)]):.3g} > "
             f"{float(row_tol[tuple(where)]):.3g})")

    finite = torch.isfinite(ref_lse)
    if not torch.equal(torch.isneginf(lse_f), ~finite):
        fail("lse -inf positions differ from the reference "
             "(must be -inf exactly where a row sees no key)")
    diff = (lse_f - ref_lse).abs()[finite]
    res["lse_err"] = _max_abs(diff)
    bound = LSE_ATOL + LSE_RTOL * ref_lse.abs()[finite]
    if diff.numel() and not bool((diff <= bound).all()):
        fail(f"max |lse - ref| = {res['lse_err']:.3g} beyond atol {LSE_ATOL} + rtol {LSE_RTOL}")
    res["why"] = "; ".join(res["why"])
    return res


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _max_abs(t: torch.Tensor) -> float:
    # NaN-propagating max; 0 for empty tensors.
    return float(t.abs().max()) if t.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# Gradients. Written out (not autograd) so that rows with no visible key give 0 gradients
# instead of the NaN that autograd through softmax/logsumexp of an all -inf row produces.

GRAD_ATOL = 2e-3


def attention_grad_reference(q, k, v, dout, causal=False, softmax_scale=None, upcast=True, *,
                             window_size=(-1, -1), softcap=0.0):
    """(dq, dk, dv) of sum(out * dout). fp32 when upcast (the reference), else computed in
    the input dtype (the "plain PyTorch in low precision" baseline). GQA: dk, dv are summed
    over the query heads that share a kv head."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    dt = torch.float32 if upcast else q.dtype
    qt, kt, vt, scores, scale, tanh = _heads_and_scores(q, k, v, causal, softmax_scale, dt,
                                                        window_size, softcap)
    dot = dout.to(dt).transpose(1, 2)
    lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
    p = torch.exp(scores.float() - torch.where(torch.isfinite(lse), lse, 0.0)).to(dt)
    dv = torch.matmul(p.transpose(-1, -2), dot)
    dp = torch.matmul(dot, vt.transpose(-1, -2))
    out = torch.matmul(p, vt)
    delta = (out.float() * dot.float()).sum(-1, keepdim=True).to(dt)
    ds = p * (dp - delta)
    if tanh is not None:  # d(softcap * tanh(x / softcap)) / dx
        ds = ds * (1 - tanh * tanh)
    dq = torch.matmul(ds, kt) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qt) * scale

    def per_kv_head(x):  # (b, hq, sk, d) -> (b, sk, hkv, d), summing each group
        return x.float().view(b, hkv, group, sk, d).sum(2).to(dt).transpose(1, 2).contiguous()

    return dq.transpose(1, 2).contiguous(), per_kv_head(dk), per_kv_head(dv)


def compare_grads_to_reference(grads, q, k, v, dout, causal=False, softmax_scale=None, *,
                               window_size=(-1, -1), softcap=0.0) -> dict:
    """Check a kernel's (dq, dk, dv) with the forward's rule: max error <= 2 x the error of
    plain PyTorch in the same low precision + GRAD_ATOL; NaN anywhere fails. (A per-row form of
    the rule, each row against its own low-precision error plus 5% of its magnitude, failed
    correct kernels on the GPU at softmax scale 0.3, 2026-12-05 (twenty-second): rows whose
    gradient cancels to a small value carry rounding errors of the terms, not of the result.)"""
    extra = dict(window_size=window_size, softcap=softcap)
    ref = attention_grad_reference(q, k, v, dout, causal, softmax_scale, upcast=True, **extra)
    low = attention_grad_reference(q, k, v, dout, causal, softmax_scale, upcast=False, **extra)
    res = {"ok": True, "why": []}
    for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        got = got.float()
        nans = int(torch.isnan(got).sum())
        err = _max_abs(got - r)
        tol = 2 * _max_abs(lo.float() - r) + GRAD_ATOL
        res[f"{name}_err"], res[f"{name}_tol"] = err, tol
        if nans:
            res["ok"] = False
            res["why"].append(f"NaN in {name} ({nans}): elements not written or NaN math")
        elif not err <= tol:
            res["ok"] = False
            res["why"].append(f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g}")
    res["why"] = "; ".join(res["why"])
    return res


# ---------------------------------------------------------------------------------------------
# Variable-length batches: the rules above per sequence (packed (total, heads, d) tensors,
# sequence b is rows [cu[b], cu[b + 1])), errors merged.


def sequences(cu_seqlens_q, cu_seqlens_k) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _merge(results: list[tuple[int, dict]]) -> dict:
    res = {"ok": all(r["ok"] for _, r in results),
           "why": "; ".join(f"sequence {i}: {r['why']}" for i, r in results if not r["ok"])}
    for _, r in results:
        for key, value in r.items():
            if key.endswith(("_err", "_tol")):
                res[key] = max(res.get(key, 0.0), value)
    return res


def compare_varlen_to_reference(out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False,
                                softmax_scale=None, **extra) -> dict:
    """compare_to_reference per sequence; out (total_q, hq, d), lse (hq, total_q)."""
    results = []
    for i, (rq, rk) in enumerate(sequences(cu_seqlens_q, cu_seqlens_k)):
        if rq.stop > rq.start:
            results.append((i, compare_to_reference(
                out[rq][None], lse[:, rq][None], q[rq][None], k[rk][None], v[rk][None], causal,
                softmax_scale, **extra)))
    return _merge(results)


def compare_varlen_grads_to_reference(grads, q, k, v, dout, cu_seqlens_q, cu_seqlens_k,
                                      causal=False, softmax_scale=None, **extra) -> dict:
    """compare_grads_to_reference per sequence (a sequence without queries has zero dk, dv)."""
    dq, dk, dv = grads
    results = []
    for i, (rq, rk) in enumerate(sequences(cu_seqlens_q, cu_seqlens_k)):
        results.append((i, compare_grads_to_reference(
            (dq[rq][None], dk[rk][None], dv[rk][None]), q[rq][None], k[rk][None], v[rk][None],
            dout[rq][None], causal, softmax_scale, **extra)))
    return _merge(results)


# ---------------------------------------------------------------------------------------------
# FP8 (e4m3) attention, emulated in PyTorch: the ground truth for the numerics study
# (fa3gen/numerics.py) and, later, for the fp8 kernels. Q, K, V are quantized to e4m3 with
# per-tensor or per-block scales (optionally after incoherent processing: Q and K times the
# same random orthogonal M = diag(signs) H / sqrt(d)); the GEMMs run on the dequantized values
# in fp32 (what fp32-accumulating FP8 WGMMAs compute); P is cast to e4m3 (times p_scale) per
# key block under an online softmax that visits key blocks from the last down, as the kernels
# do; the row sum is taken in fp32 before that cast.

# The e4m3 forward's P is cast to e4m3 times this (fwd_mainloop.cuh, 2^kPLog2Fp8; a CPU test
# reads the header), so that small probabilities keep their precision.
FP8_P_SCALE = 256.0


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x times the orthonormal Sylvester-Hadamard matrix H_d / sqrt(d) along the last dim (a
    power of two), in O(d log d) (the fast Walsh-Hadamard transform)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two size, got {d}")
    y, h = x, 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape) * (1.0 / math.sqrt(d))  # one multiply on CPU and CUDA alike


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding of x (batch, seqlen, heads, d), in fp32, as flash-attn's
    apply_rotary_emb: cos, sin (>= seqlen, rotary_dim / 2) for positions 0, 1, ...; the first
    rotary_dim entries of each row rotate in pairs (the two halves, or (0, 1), (2, 3), ... when
    interleaved), the rest pass through."""
    positions = torch.arange(x.shape[1], device=cos.device)[None]
    return rotary_at(x, cos, sin, positions, interleaved)


def rotary_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              interleaved: bool = False) -> torch.Tensor:
    """apply_rotary with row i of sequence b at position positions[b, i] (positions (batch or
    1, seqlen), indices into cos and sin's rows)."""
    half = cos.shape[-1]
    xf = x.float()
    c, sn = cos[positions][:, :, None].float(), sin[positions][:, :, None].float()  # over heads
    if interleaved:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
    o1, o2 = x1 * c - x2 * sn, x1 * sn + x2 * c
    rotated = (torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved
               else torch.cat((o1, o2), dim=-1))
    return torch.cat((rotated, xf[..., 2 * half:]), dim=-1)


def random_signs(d: int, seed: int, device=None) -> torch.Tensor:
    """The diagonal of a random +-1 matrix (the random part of incoherent processing)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(device=device, dtype=torch.float32)


def quantize_e4m3(x: torch.Tensor, block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales) of x (batch, seqlen, heads, d), x ~ values * scale: one scale
    per tensor (block_rows None) or per (batch, block of block_rows rows, head); the largest
    magnitude of each scope maps to 448. Scales broadcast against x (fa3gen.fp8.quantize gives
    them in the kernels' (batch, heads, blocks) layout)."""
    from fa3gen.fp8 import quantize

    vals, scale = quantize(x, block_rows)
    if block_rows is None:
        return vals, scale.reshape(1, 1, 1, 1)
    rows = scale.permute(0, 2, 1).repeat_interleave(block_rows, dim=1)[:, :x.shape[1]]
    return vals, rows.unsqueeze(-1)


def fp8_attention_emulated(q, k, v, *, block_q: int | None = None, block_k: int | None = None,
                           hadamard: bool = False, seed: int = 0, p_scale: float = FP8_P_SCALE,
                           key_block: int = 128, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Non-causal FP8 attention of (batch, seqlen, heads, d) q, k, v as described above; block_q /
    block_k: rows per scale block of Q and of K/V (None: per tensor). Returns out_dtype."""
    d = q.shape[-1]
    if hadamard:
        signs = random_signs(d, seed, q.device)
        q, k = hadamard_transform(q.float() * signs), hadamard_transform(k.float() * signs)
    deq = [vals.float() * scale for vals, scale in (quantize_e4m3(q, block_q),
                                                   quantize_e4m3(k, block_k),
                                                   quantize_e4m3(v, block_k))]
    qt, kt, vt = (t.transpose(1, 2) for t in deq)  # (b, h, s, d)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) / math.sqrt(d)
    out, _ = blockwise_softmax_pv(  # threshold -1: the maximum moves with every block
        scores, vt, key_block, -1.0,
        lambda p: (p * p_scale).to(torch.float8_e4m3fn).float() / p_scale)
    return out.transpose(1, 2).to(out_dtype)


def _fp8_dequantized(q, k, v, q_descale, k_descale, v_descale, block_q=None, block_k=None):
    """q, k, v (b, s, h, d) fp8 times their descales (one value, (b, heads_kv), or (b, heads,
    blocks) of block_q / block_k rows), as fp64 (b, heads_q, s, d) (kv heads repeated)."""
    b, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
    group = hq // hkv

    def dequant(x, descale, per_q_head, block):
        x = x.double()
        if descale is not None:
            if descale.dim() == 3:  # (b, h, blocks): each row's block; a dim of 1 serves all,
                ds = descale.double().expand(b, x.shape[2], descale.shape[2])  # as the kernels
                rows = torch.arange(x.shape[1], device=x.device)        # read it (stride 0)
                ds = ds[:, :, rows // block if descale.shape[2] > 1 else rows * 0]
                x = x * ds.permute(0, 2, 1)[..., None]
            else:
                ds = descale.double().reshape(-1, 1) if descale.numel() == 1 else descale.double()
                ds = ds.expand(b, hkv)
                if per_q_head:
                    ds = ds.repeat_interleave(group, dim=1)
                x = x * ds[:, None, :, None]
        return x.transpose(1, 2)

    return (dequant(q, q_descale, True, block_q),
            *(dequant(t, ds, False, block_k).repeat_interleave(group, dim=1)
              for t, ds in ((k, k_descale), (v, v_descale))))


# The e4m3 forward's rescale rule (templates/kernels/rescale_threshold.cuh,
# kRescaleThresholdFp8P): a row keeps its maximum through growths up to 2^0.8, so that
# P * 256 <= 448 (tests/test_fp8_checks.py reads the header).
FP8_RESCALE_THRESHOLD = 0.8
LOG2E = 1.0 / math.log(2.0)


def blockwise_softmax_pv(scores, vt, key_block: int, rescale_threshold: float, round_p):
    """(out, lse) of softmax(scores) @ vt in the forward kernels' order, in scores' dtype: key
    blocks of key_block from the last down with the online softmax, a row keeping its running
    maximum while a block raises it by at most rescale_threshold (log2 units; its P then
    exceeds 1), round_p(P) (P as the P V GEMM takes it) in the product, the row sum of the
    unrounded P. scores (..., sq, sk) in natural-log units, masked keys -inf; vt (..., sk, d).
    A row that sees no key: out 0, lse -inf. out (..., sq, d), lse (..., sq)."""
    sk = scores.shape[-1]
    row_max = torch.full(scores.shape[:-1] + (1,), float("-inf"), dtype=scores.dtype,
                         device=scores.device)
    row_sum = torch.zeros_like(row_max)
    acc = scores.new_zeros(scores.shape[:-1] + (vt.shape[-1],))
    for start in reversed(range(0, sk, key_block)):
        sb = scores[..., start:start + key_block]
        grown = torch.maximum(row_max, sb.amax(-1, keepdim=True))
        grew = (grown - row_max) * LOG2E  # inf on a row's first visible key, NaN before any
        new_max = torch.where(grew <= rescale_threshold, row_max, grown)
        safe = torch.where(torch.isinf(new_max), 0.0, new_max)  # rows with no key yet
        rescale = torch.exp(row_max - safe)
        p = torch.exp(sb - safe)
        row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
        acc = acc * rescale + torch.matmul(round_p(p), vt[..., start:start + key_block, :])
        row_max = new_max
    empty = row_sum == 0
    out = torch.where(empty, 0.0, acc / torch.where(empty, 1.0, row_sum))
    lse = torch.where(empty, float("-inf"), row_max + torch.log(torch.where(empty, 1.0, row_sum)))
    return out, lse[..., 0]


def fp8_attention_reference(q, k, v, q_descale=None, k_descale=None, v_descale=None,
                            causal: bool = False, softmax_scale: float | None = None, *,
                            key_block: int | None = None, p_scale: float = FP8_P_SCALE,
                            block_q: int | None = None, block_k: int | None = None,
                            rescale_threshold: float = FP8_RESCALE_THRESHOLD):
    """(out, lse) in fp64 of attention on fp8 (batch, seqlen, heads, d) q, k, v times their
    descales ((batch, heads_kv) fp32, one value, or None = 1), GQA and bottom-right causal as
    the kernels. key_block None: the exact softmax of the dequantized inputs (the ground
    truth). key_block = the kernel's tile_n: its arithmetic (the e4m3 kernels' reference):
    key blocks from the last down with the online softmax, a row keeping its running maximum
    while a block raises it by at most rescale_threshold (log2 units; its P then exceeds 1),
    P * p_scale rounded to e4m3 for the PV product, the row sum of the unrounded P.
    out (b, sq, hq, d), lse (b, hq, sq)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    qt, kt, vt = _fp8_dequantized(q, k, v, q_descale, k_descale, v_descale, block_q, block_k)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(sq, sk, q.device), float("-inf"))
    if key_block is None:
        lse = torch.logsumexp(scores, dim=-1)
        finite = torch.isfinite(lse)[..., None]
        p = torch.where(finite, torch.exp(scores - torch.where(finite, lse[..., None], 0.0)), 0.0)
        return torch.matmul(p, vt).transpose(1, 2), lse
    out, lse = blockwise_softmax_pv(
        scores, vt, key_block, rescale_threshold,
        lambda p: (p * p_scale).float().to(torch.float8_e4m3fn).double() / p_scale)
    return out.transpose(1, 2), lse


def compare_fp8_to_reference(out, lse, q, k, v, descales: dict, causal: bool, tile_n: int,
                             block_q: int | None = None, softmax_scale: float | None = None) -> dict:
    """Check an e4m3 kernel's (out, lse) under the fp8 tolerance rule; errors, tolerances and
    ok/why like compare_to_reference. Against the kernels' arithmetic (key_block = tile_n):
    RMSE <= 1e-2 RMS(ref) and max error <= 0.15 max |ref| (P values at an e4m3 rounding
    midpoint may go to the other neighbour: one step is 12.5% of the value); against the exact
    softmax of the dequantized inputs: RMSE <= 4e-2 RMS(ref) (3 mantissa bits in P); LSE within
    2e-3 + 2^-10 max_j scale * sum_d |q_d k_jd| per row: FP8 WGMMAs accumulate with about 14
    bits, not fp32's 24, rounding at each 32-element k-step (measured on the H200: LSE errors
    of 0.005-0.02 on rows whose scores reach ~100, more at head dim 256), so a score carries an
    error of that order of its terms' magnitude. NaN anywhere fails. softmax_scale: the call's
    (None: 1 / sqrt(head_dim))."""
    blocks = dict(block_q=block_q, block_k=tile_n)  # block descales: the kernel's tiles
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    emu, _ = fp8_attention_reference(q, k, v, **descales, causal=causal, softmax_scale=scale,
                                     key_block=tile_n, **blocks)
    exact, ref_lse = fp8_attention_reference(q, k, v, **descales, causal=causal,
                                             softmax_scale=scale, **blocks)
    o, lse_d = out.double(), lse.double()
    res = {"ok": True, "why": []}

    def fail(msg):
        res["ok"] = False
        res["why"].append(msg)

    def rms(t):
        return t.pow(2).mean().sqrt().item() if t.numel() else 0.0

    if torch.isnan(o).any() or torch.isnan(lse_d).any():
        fail("NaN in out / lse: elements not written or NaN math")
    res["out_err"] = _max_abs(o - emu)
    res["out_tol"] = 0.15 * (_max_abs(emu) or 1.0)
    res["rmse_kernel_arith"] = rms(o - emu) / (rms(emu) or 1.0)
    res["rmse_exact"] = rms(o - exact) / (rms(exact) or 1.0)
    if not res["out_err"] <= res["out_tol"]:
        fail(f"max |out - ref| = {res['out_err']:.3g} > {res['out_tol']:.3g}")
    if not res["rmse_kernel_arith"] <= 1e-2:
        fail(f"relative RMSE vs the kernels' arithmetic {res['rmse_kernel_arith']:.3g} > 1e-2")
    if not res["rmse_exact"] <= 4e-2:
        fail(f"relative RMSE vs the exact softmax {res['rmse_exact']:.3g} > 4e-2")
    finite = torch.isfinite(ref_lse)
    if not torch.equal(torch.isneginf(lse_d), ~finite):
        fail("lse -inf positions differ from the reference")
    diff = (lse_d - ref_lse).abs()[finite]
    res["lse_err"] = _max_abs(diff)
    qt, kt, _ = _fp8_dequantized(q, k, v, descales.get("q_descale"), descales.get("k_descale"),
                                 descales.get("v_descale"), block_q, tile_n)
    magnitude = torch.matmul(qt.abs(), kt.abs().transpose(-1, -2)).amax(-1) * scale
    bound = 2e-3 + 2.0**-10 * magnitude[finite]
    res["lse_frac"] = float((diff / bound).max()) if diff.numel() else 0.0
    if diff.numel() and not bool((diff <= bound).all()):
        fail(f"max |lse - ref| = {res['lse_err']:.3g} beyond 2e-3 + 2^-10 sum|q k| scale")
    res["why"] = "; ".join(res["why"])
    return res


def kvcache_attention_reference(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                cache_batch_idx=None, causal=False, softmax_scale=None,
                                window_size=(-1, -1), softcap=0.0):
    """(out fp32, lse fp32 (b, hq, sq)) of flash_attn_with_kvcache's semantics: each sequence's
    keys gathered from the contiguous or paged cache, then attention_reference (causal
    bottom-right aligned to that sequence's length)."""
    b, sq, hq, d = q.shape
    rows_per = k_cache.shape[1]
    outs, lses = [], []
    for i in range(b):
        n = int(cache_seqlens[i]) if cache_seqlens is not None else (
            block_table.shape[1] * rows_per if block_table is not None else rows_per)
        if block_table is not None:
            pages = block_table[i, :-(-n // rows_per)].long()
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        else:
            row = int(cache_batch_idx[i]) if cache_batch_idx is not None else i
            k, v = k_cache[row, :n], v_cache[row, :n]
        o, lse = attention_reference(q[i:i + 1], k[None], v[None], causal, softmax_scale,
                                     upcast=True, window_size=window_size, softcap=softcap)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
