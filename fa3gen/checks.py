"""Correctness checks of built kernels against the fp32 reference (fa3gen/reference.py).

- quick_check: each default forward and backward variant of a library once (build.py --check).
- check_cell: one ablation cell on its problems (`fa3gen ablate` times only cells that pass).
Both run check_forward / check_backward: seeded inputs, NaN-poisoned outputs, the tolerance rule
of reference.compare_to_reference / compare_grads_to_reference.

torch is imported inside the functions, so importing this module stays torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

from fa3gen.errors import Fa3genError


# The checks' softmax scale, as a factor of the default 1 / sqrt(head_dim): not the default,
# so that a kernel or plan that ignores the scale argument fails.
CHECK_SCALE_FACTOR = 0.8


class Problem(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    # softmax scale = scale_factor / sqrt(head_dim): the scores of randn inputs have this std
    scale_factor: float = CHECK_SCALE_FACTOR

    def scale(self, head_dim: int) -> float:
        return self.scale_factor * head_dim**-0.5

    def describe(self, sep: str = " ", join: str = ", ", packed: bool = False) -> str:
        """'seqlen_q 200, seqlen_k 333' (sep '=' and join ' ': 'seqlen_q=200 seqlen_k=333'),
        and the scale factor where it is not the checks' usual one. packed: the problem of a
        varlen variant, which runs VARLEN_LENGTHS whatever the seqlens say."""
        parts = ([("lengths", "VARLEN_LENGTHS")] if packed else
                 [("seqlen_q", self.seqlen_q), ("seqlen_k", self.seqlen_k)])
        if self.scale_factor != CHECK_SCALE_FACTOR:
            parts.append(("scale_factor", f"{self.scale_factor:g}"))
        return join.join(f"{name}{sep}{value}" for name, value in parts)


# quick_check's problem: odd sizes (not tile multiples), GQA, seqlen_q != seqlen_k (exercises
# the causal alignment). 8 query heads on 4 kv heads: groups of 2, so that a kernel mapping
# query head i to kv head i // heads_kv (not i // group) fails, as 4 on 2 would not show.
QUICK_PROBLEM = Problem(batch=2, seqlen_q=200, seqlen_k=333, heads_q=8, heads_kv=4)
# Its transpose, for dense causal and local variants: with seqlen_q > seqlen_k the first query
# rows see no key (out 0, lse -inf, no gradient), which QUICK_PROBLEM never produces.
QUICK_EMPTY_ROWS = QUICK_PROBLEM._replace(seqlen_q=QUICK_PROBLEM.seqlen_k,
                                          seqlen_k=QUICK_PROBLEM.seqlen_q)

# Large scores, so that the forward's rescale path runs: at scale factor 0.8 no row's maximum
# ever grows by the rescale threshold (2^8 in P, rescale_threshold.cuh) from one key block to the
# next, so a kernel that rescaled O or the row sum wrongly passed. At 6, a CPU simulation of
# QUICK_PROBLEM's rows (visiting key blocks last to first) rescales 5% of them at tile_n 176,
# 14% at 128, 44% at 64.
LARGE_SCORE_FACTOR = 6.0
QUICK_LARGE_SCORES = QUICK_PROBLEM._replace(scale_factor=LARGE_SCORE_FACTOR)

# check_cell's problems, by causal: odd sizes; causal cells also get seqlen_q < seqlen_k.
_SQUARE, _FEWER_Q = Problem(2, 333, 333, 4, 4), Problem(2, 200, 333, 4, 4)
_LARGE = _SQUARE._replace(scale_factor=LARGE_SCORE_FACTOR)
CELL_PROBLEMS = {False: (_SQUARE, _LARGE), True: (_SQUARE, _FEWER_Q, _LARGE)}
# For ablate's report header: what every cell was checked on.
CELL_CHECK_DESCRIPTION = (
    f"batch {_SQUARE.batch}, heads {_SQUARE.heads_q}, seqlen {_SQUARE.seqlen_q} (causal also "
    f"seqlen_q {_FEWER_Q.seqlen_q} / seqlen_k {_FEWER_Q.seqlen_k}), seeded randn inputs at "
    f"softmax scale {CHECK_SCALE_FACTOR:g} and {LARGE_SCORE_FACTOR:g} / sqrt(head_dim)")


# The runtime arguments that exercise a local or softcap variant: a window narrower than the
# problems, open on both sides (left != right, so a swapped bound fails), and a cap small
# enough that tanh saturates for the larger scores of randn inputs.
PROBE_WINDOW = (97, 23)
PROBE_SOFTCAP = 2.5


def probe_masking(variant) -> dict:
    """window_size and softcap keyword arguments for `variant` (defaults where it has neither)."""
    return dict(window_size=PROBE_WINDOW if variant.local else (-1, -1),
                softcap=PROBE_SOFTCAP if variant.softcap else 0.0)


class _Untouched:
    """Copies of a check's inputs from before its launch. The references are computed from the
    inputs after the launch, so a kernel that wrote into one could otherwise pass."""

    def __init__(self, **inputs):
        self.inputs, self.copies = {}, {}
        self.add(**inputs)

    def add(self, **inputs) -> None:
        """More inputs, for a later launch (those already held keep their first copies)."""
        self.inputs.update(inputs)
        self.copies.update((name, t.clone()) for name, t in inputs.items())

    def verdict(self, res: dict) -> dict:
        """res, failed where the launch changed an input's bits (NaN-safe)."""
        import torch

        def bits(t):  # flat first: a 0-d tensor cannot be viewed as bytes
            return t.reshape(-1).contiguous().view(torch.uint8)

        changed = [name for name, t in self.inputs.items()
                   if not torch.equal(bits(t), bits(self.copies[name]))]
        if changed:
            res["ok"] = False
            res["why"] = "; ".join(filter(None, (res["why"], "the launch wrote into its input(s) "
                                                 + ", ".join(changed))))
        return res


# ---------------------------------------------------------------------------------------------
# One variant on one problem. `variant` is anything with the VariantInfo attribute names
# (name, dtype, head_dim, causal): a runtime VariantInfo or a generator Variant.


def _inputs(problem: Problem, variant, gen, count: int, dtype: str | None = None) -> list:
    """q, k, v (and dout when count is 4) of `problem` in the variant's dtype (or `dtype`),
    drawn from gen."""
    import torch

    from fa3gen.ops import TORCH_DTYPES

    b, sq, sk, hq, hkv = problem[:5]
    dims = [(b, sq, hq), (b, sk, hkv), (b, sk, hkv), (b, sq, hq)][:count]
    return [torch.randn(*bsh, variant.head_dim, device="cuda", generator=gen,
                        dtype=TORCH_DTYPES[dtype or variant.dtype]) for bsh in dims]


# The packed problem of varlen variants (whatever the Problem's seqlens): (q, k) lengths per
# sequence, not tile multiples, with an empty query sequence and an empty key sequence.
VARLEN_LENGTHS = ((200, 333), (0, 40), (77, 0), (1, 150), (333, 200))


def _varlen_inputs(problem: Problem, variant, gen, count: int) -> tuple[list, tuple]:
    """Packed q, k, v (and dout) and (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    import itertools

    import torch

    from fa3gen.ops import TORCH_DTYPES

    lq, lk = zip(*VARLEN_LENGTHS)
    rows = [(sum(lq), problem.heads_q), (sum(lk), problem.heads_kv), (sum(lk), problem.heads_kv),
            (sum(lq), problem.heads_q)][:count]
    tensors = [torch.randn(n, h, variant.head_dim, device="cuda", generator=gen,
                           dtype=TORCH_DTYPES[variant.dtype]) for n, h in rows]
    cu = [torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
          for lens in (lq, lk)]
    return tensors, (*cu, max(lq), max(lk))


def _check_varlen(lib, variant, problem: Problem, gen, backward: bool) -> dict:
    """check_forward / check_backward of a varlen variant, on the packed problem."""
    import torch

    from fa3gen import ops, reference, varlen

    tensors, sizes = _varlen_inputs(problem, variant, gen, 4 if backward else 3)
    q, k, v = tensors[:3]
    causal, scale = bool(variant.causal), problem.scale(variant.head_dim)
    mask = ops.masking(causal, **probe_masking(variant))
    extra = dict(window_size=(mask.window_left, mask.window_right), softcap=mask.softcap)
    fwd = variant if not backward else lib.find("fwd", variant.dtype, variant.head_dim, causal,
                                                local=variant.local, softcap=variant.softcap,
                                                varlen=True)
    untouched = _Untouched(q=q, k=k, v=v, cu_seqlens_q=sizes[0], cu_seqlens_k=sizes[1])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    plan = varlen._fwd_plan(q, k, v, *sizes, out, lse, mask, scale, fwd.name, lib)
    varlen._fwd_run(plan, q, k, v, *sizes[:2], out, lse)
    if not backward:
        torch.cuda.synchronize()
        return untouched.verdict(reference.compare_varlen_to_reference(
            out, lse, q, k, v, *sizes[:2], causal, scale, **extra))
    dout = tensors[3]
    untouched.add(dout=dout, out=out, lse=lse)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    bplan = varlen._bwd_plan(dout, q, k, v, out, lse, *sizes, *grads, mask, scale, variant.name,
                             False, lib)
    varlen._bwd_run(bplan, dout, q, k, v, out, lse, *sizes[:2], *grads)
    torch.cuda.synchronize()
    return untouched.verdict(reference.compare_varlen_grads_to_reference(
        grads, q, k, v, dout, *sizes[:2], causal, scale, **extra))


# Pages of the paged check: a multiple of the 64-row chunk that is no power of two.
PAGED_CHECK_PAGE = 192


def _check_paged(lib, variant, problem: Problem, gen) -> dict:
    """check_forward of a paged variant into NaN-poisoned out and lse: the problem's keys
    scattered over shuffled pages of PAGED_CHECK_PAGE rows (NaN in the rows past seqlen_k and in
    a spare page), against dense attention over them."""
    import torch

    from fa3gen import ops, reference, varlen

    q, k, v = _inputs(problem, variant, gen, 3)
    b, sq, sk, hq, hkv = problem[:5]
    page = PAGED_CHECK_PAGE
    cols = -(-sk // page)
    order = torch.randperm(b * cols + 1, device="cuda", generator=gen)
    table = order[:b * cols].view(b, cols).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = torch.full((b * cols + 1, page, hkv, t.shape[-1]), float("nan"), dtype=t.dtype,
                           device="cuda")
        padded = torch.full((b, cols * page, hkv, t.shape[-1]), float("nan"), dtype=t.dtype,
                            device="cuda")
        padded[:, :sk] = t
        cache[table.long()] = padded.view(b, cols, page, hkv, -1)
        caches.append(cache)
    causal, extra = bool(variant.causal), probe_masking(variant)
    scale = problem.scale(variant.head_dim)
    seqused = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    untouched = _Untouched(q=q, k_cache=caches[0], v_cache=caches[1], page_table=table,
                           seqused_k=seqused)
    poisoned = (torch.full((b * sq, hq, q.shape[-1]), float("nan"), dtype=q.dtype, device="cuda"),
                torch.full((hq, b * sq), float("nan"), device="cuda"))
    out, lse = varlen.paged_forward(q, *caches, table, seqused, ops.masking(causal, **extra),
                                    scale, variant, lib, poisoned)
    torch.cuda.synchronize()
    return untouched.verdict(reference.compare_to_reference(out, lse, q, k, v, causal, scale,
                                                            **extra))


def check_forward(lib, variant, problem: Problem, gen) -> dict:
    """Forward `variant` into NaN-poisoned out and lse; reference.compare_to_reference's result."""
    import torch

    from fa3gen import ops, reference

    if getattr(variant, "paged", False):
        return _check_paged(lib, variant, problem, gen)
    if getattr(variant, "varlen", False):
        return _check_varlen(lib, variant, problem, gen, backward=False)
    if variant.dtype == "e4m3":
        return _check_fp8(lib, variant, problem, gen)
    q, k, v = _inputs(problem, variant, gen, 3)
    causal, extra = bool(variant.causal), probe_masking(variant)
    scale = problem.scale(variant.head_dim)
    untouched = _Untouched(q=q, k=k, v=v)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((problem.batch, problem.heads_q, problem.seqlen_q), float("nan"),
                     device="cuda", dtype=torch.float32)
    ops._fwd_into(q, k, v, out, lse, causal, scale, variant.name, lib=lib, **extra)
    torch.cuda.synchronize()
    return untouched.verdict(reference.compare_to_reference(out, lse, q, k, v, causal, scale,
                                                            **extra))


def _check_fp8(lib, variant, problem: Problem, gen) -> dict:
    """check_forward of an e4m3 variant: fp8 inputs, descales per (batch, heads_kv)."""
    import torch

    from fa3gen import fp8, ops, reference

    # randn has no 8-bit kernels: bf16 draws, rounded
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _inputs(problem, variant, gen, 3, "bf16"))
    descales = {n: torch.rand(problem.batch, problem.heads_kv, device="cuda", generator=gen) + 0.5
                for n in fp8.DESCALE_NAMES}
    untouched = _Untouched(q=q, k=k, v=v, **descales)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((problem.batch, problem.heads_q, problem.seqlen_q), float("nan"),
                     device="cuda", dtype=torch.float32)
    scale = problem.scale(variant.head_dim)
    fp8.fp8_forward(q, k, v, ops.masking(bool(variant.causal)), scale, variant.name, descales,
                    torch.bfloat16, out, lse)
    torch.cuda.synchronize()
    return untouched.verdict(reference.compare_fp8_to_reference(
        out, lse, q, k, v, descales, bool(variant.causal), variant.tile_n, softmax_scale=scale))


def check_backward(lib, variant, problem: Problem, gen) -> dict:
    """Backward `variant` (after the key's default forward) into NaN-poisoned dq, dk, dv;
    reference.compare_grads_to_reference's result."""
    import torch

    from fa3gen import ops, reference

    if getattr(variant, "varlen", False):
        return _check_varlen(lib, variant, problem, gen, backward=True)
    q, k, v, dout = _inputs(problem, variant, gen, 4)
    causal, extra = bool(variant.causal), probe_masking(variant)
    scale = problem.scale(variant.head_dim)
    fwd = lib.find("fwd", variant.dtype, variant.head_dim, causal, local=variant.local,
                   softcap=variant.softcap)
    out, lse = ops._empty_outputs(q)
    ops._fwd_into(q, k, v, out, lse, causal, scale, fwd.name, lib=lib, **extra)
    untouched = _Untouched(q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    ops._bwd_into(dout, q, k, v, out, lse, *grads, causal, scale, variant.name, lib=lib, **extra)
    torch.cuda.synchronize()
    return untouched.verdict(reference.compare_grads_to_reference(grads, q, k, v, dout, causal,
                                                                  scale, **extra))


# ---------------------------------------------------------------------------------------------
# build.py --check.


def quick_check(spec=None, verbose: bool = True) -> list[dict]:
    """Each forward and backward variant the library dispatches to (key defaults and seqlen_k
    range defaults) on its quick_problems, against the fp32 references under the tolerance
    rule. Raises Fa3genError listing the failures."""
    import torch

    from fa3gen import runtime

    if not torch.cuda.is_available():
        raise Fa3genError("quick_check needs a CUDA GPU (Hopper sm_90)")
    lib = runtime.get_library(spec)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, failed = [], []
    checks = [(info, check_forward) for info in lib.dispatched("fwd")]
    checks += [(info, check_backward) for info in lib.dispatched("bwd")]
    for info, check in checks:
        for problem in quick_problems(info):
            res = _checked(check, lib, info, problem, gen)
            results.append(res)
            where = f"{info.name} ({problem.describe(packed=_packed(info))})"
            if verbose:
                status = "ok  " if res["ok"] else "FAIL"
                print(f"{status} {where}: {error_summary(res)} {'' if res['ok'] else res['why']}",
                      flush=True)
            if not res["ok"]:
                failed.append(f"{where}: {res['why']}")
    if not results:
        raise Fa3genError(f"{lib.path} has no default forward variant to check")
    if failed:
        raise Fa3genError("quick_check failed:\n  " + "\n  ".join(failed))
    return results


def check_variant(lib, info, seed: int = 0) -> dict:
    """check_forward or check_backward (by the variant's direction) on each of its
    quick_problems, seeded with `seed`: the first failing result, else the last one. A launch
    or library error is a failed check with the reason (fa3gen tune's check of candidates)."""
    import torch

    check = check_backward if info.direction == "bwd" else check_forward
    gen = torch.Generator(device="cuda").manual_seed(seed)
    res = {"ok": True, "why": ""}
    for problem in quick_problems(info):
        res = _checked(check, lib, info, problem, gen)
        if not res["ok"]:
            res["why"] = f"{problem.describe(packed=_packed(info))}: {res['why']}"
            break
    return res


def _packed(info) -> bool:
    """Whether the variant's checks run the packed VARLEN_LENGTHS (varlen, not paged)."""
    return bool(getattr(info, "varlen", False)) and not getattr(info, "paged", False)


def quick_problems(info) -> tuple[Problem, ...]:
    """quick_check's problems for a variant: QUICK_PROBLEM; QUICK_EMPTY_ROWS where a causal or
    local mask hides every key from some query rows (not for varlen variants, which run
    VARLEN_LENGTHS, with such sequences, but for the paged ones, varlen in the key, which run
    the dense problems: _check_paged); and QUICK_LARGE_SCORES."""
    masked = info.causal or getattr(info, "local", False)
    empty_rows = (QUICK_EMPTY_ROWS,) if masked and not _packed(info) else ()
    return (QUICK_PROBLEM, *empty_rows, QUICK_LARGE_SCORES)


def _checked(check, lib, info, problem: Problem, gen) -> dict:
    """check's result for variant `info` on `problem`; a launch or library error is a failed
    check with the reason, not an exception."""
    try:
        res = check(lib, info, problem, gen)
    except (RuntimeError, Fa3genError) as e:
        res = {"ok": False, "why": f"{type(e).__name__}: {e}"}
    res["variant"] = info.name
    return res


def error_summary(res: dict) -> str:
    """The measured errors of a forward or backward check result, for one line of output."""
    if "out_err" in res:
        return (f"max|out-ref| {res['out_err']:.2e} (tol {res['out_tol']:.2e}), "
                f"max|lse-ref| {res['lse_err']:.2e}")
    return ", ".join(f"max|{g}-ref| {res[g + '_err']:.2e} (tol {res[g + '_tol']:.2e})"
                     for g in ("dq", "dk", "dv") if g + "_err" in res)


# ---------------------------------------------------------------------------------------------
# fa3gen ablate.


def check_cell(lib, cell, seed: int = 0) -> dict:
    """check_forward of an ablation cell on each of CELL_PROBLEMS, each seeded with `seed`.

    Returns run_cells' check result: {"status": "ok" | "wrong" | "error", "max_err", "detail"};
    a launch error propagates (run_cells records it as "error")."""
    import torch

    if lib.get(cell.name) is None:
        return {"status": "error", "max_err": None,
                "detail": f"not built in {lib.path} (build the spec, or drop --no-build)"}
    worst = 0.0
    for problem in CELL_PROBLEMS[bool(cell.causal)]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        res = check_forward(lib, cell, problem, gen)
        err = res["out_err"]
        err = None if err != err else err  # NaN: not JSON; the detail says NaN
        if not res["ok"]:
            return {"status": "wrong", "max_err": err,
                    "detail": f"{problem.describe('=', ' ')}: {res['why']}"}
        worst = max(worst, err)
    return {"status": "ok", "max_err": worst, "detail": None}
