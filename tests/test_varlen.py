"""flash_attn_varlen_func on CPU: its checks (each bad input one clear error, no device sync
unless FA3GEN_DEBUG_CHECKS=1), its signature, and what reaches the C ABI (a fake library
stands in; the kernels are checked in tests/gpu/test_varlen_kernels.py)."""
import inspect
import subprocess

import pytest
import torch

from fa3gen import InvalidInputError, VariantNotBuiltError, contract, ops, varlen
from fa3gen.varlen import flash_attn_varlen_func


def qkv(total_q=10, total_k=12, hq=4, hkv=2, d=128, dtype=torch.bfloat16, grad=False):
    return (torch.zeros(total_q, hq, d, dtype=dtype, requires_grad=grad),
            torch.zeros(total_k, hkv, d, dtype=dtype, requires_grad=grad),
            torch.zeros(total_k, hkv, d, dtype=dtype, requires_grad=grad))


CU_Q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
CU_K = torch.tensor([0, 5, 7, 12], dtype=torch.int32)


def test_signature_keeps_flash_attn_positions_and_the_rest_keyword_only():
    params = inspect.signature(flash_attn_varlen_func).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                          "max_seqlen_k"]
    q, k, v = qkv()
    # flash-attn 2 puts dropout_p 8th, FlashAttention-3 seqused_q: neither may mean the scale.
    with pytest.raises(TypeError, match="positional"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, 0.0)
    with pytest.raises(InvalidInputError, match="seqused_q is not supported"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, seqused_q=CU_Q[1:])


def test_seqused_k_checks():
    """seqused_k (FA3's): int32 (batch,) beside cu_seqlens_k."""
    q, k, v = qkv()
    for bad in (CU_K, CU_K[1:].long(), CU_K[1:][None], CU_K[1:, None], CU_K[1:].to("meta"), [5, 2, 5]):
        with pytest.raises(InvalidInputError, match=r"seqused_k must be int32 of shape \(batch,\)"):
            flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, seqused_k=bad)
    with pytest.raises(InvalidInputError, match="seqused_k must be contiguous"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5,
                               seqused_k=torch.zeros(6, dtype=torch.int32)[::2])


@pytest.mark.parametrize("change, message", [
    (dict(cu_seqlens_q=CU_Q.long()), "cu_seqlens_q must be int32, got torch.int64"),
    (dict(cu_seqlens_k=CU_K.float()), "cu_seqlens_k must be int32"),
    (dict(cu_seqlens_q=CU_Q[None]), r"cu_seqlens_q must be 1-D with batch \+ 1 >= 2 entries"),
    (dict(cu_seqlens_q=CU_Q[:1]), r"cu_seqlens_q must be 1-D with batch \+ 1 >= 2 entries"),
    (dict(cu_seqlens_k=torch.tensor([0, 0, 5, 0, 7, 0, 12, 0], dtype=torch.int32)[::2]),
     r"cu_seqlens_k must be contiguous \(stride 2\)"),
    (dict(cu_seqlens_k=CU_K[:3]), "cu_seqlens_q and cu_seqlens_k must have batch \\+ 1 entries "
                                  "each, got 4 and 3"),
    (dict(cu_seqlens_q=[0, 3, 10]), "cu_seqlens_q must be a torch.Tensor, got list"),
    (dict(cu_seqlens_k=CU_K.to("meta")), "cu_seqlens_k is on meta, q on cpu"),
    (dict(max_seqlen_q=0), r"max_seqlen_q must be an int in \[1, 2\*\*31\) \(the longest sequence\), got 0"),
    (dict(max_seqlen_q=2**32 + 7), "max_seqlen_q must be an int in"),  # would wrap to 7 in int32
    (dict(cu_seqlens_q=torch.zeros(16386, dtype=torch.int32),
          cu_seqlens_k=torch.zeros(16386, dtype=torch.int32)),
     "varlen: at most 16384 sequences and 32767 query heads per call, got 16385 and 4"),
    (dict(max_seqlen_k=True), "max_seqlen_k must be an int in"),
    (dict(max_seqlen_k=5.0), "max_seqlen_k must be an int in"),
    (dict(q=torch.zeros(1, 10, 4, 128, dtype=torch.bfloat16)),
     r"q must have 3 dims \(total_tokens, heads, head_dim\)"),
    (dict(v=torch.zeros(11, 2, 128, dtype=torch.bfloat16)), "k and v must have the same shape"),
    (dict(q=torch.zeros(10, 3, 128, dtype=torch.bfloat16)), "heads_q \\(3\\) must be a multiple"),
    (dict(q=torch.zeros(10, 4, 128, dtype=torch.float16)), "q, k, v must have one dtype"),
    (dict(window_size=(-2, 0)), "window_size left must be an int >= -1"),
    (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
    # what a mutation audit (2026-12-02) found unpinned:
    (dict(v=torch.zeros(12, 2, 128, dtype=torch.float16)), "q, k, v must have one dtype"),
    (dict(q=torch.zeros(10, 4, 128), k=torch.zeros(12, 2, 128), v=torch.zeros(12, 2, 128)),
     "unsupported dtype torch.float32"),
    (dict(zip("qkv", qkv(dtype=torch.float8_e4m3fn))), "no fp8 varlen kernels"),
    (dict(k=torch.zeros(1, 12, 2, 128, dtype=torch.bfloat16), v=torch.zeros(1, 12, 2, 128, dtype=torch.bfloat16)),
     r"k must have 3 dims"),
    (dict(k=torch.zeros(12, 2, 64, dtype=torch.bfloat16), v=torch.zeros(12, 2, 64, dtype=torch.bfloat16)),
     "head_dim differs: q has 128, k/v have 64"),
    (dict(k=torch.zeros(12, 0, 128, dtype=torch.bfloat16), v=torch.zeros(12, 0, 128, dtype=torch.bfloat16)),
     r"heads_q \(4\) must be a multiple of heads_kv \(0\)"),
    (dict(cu_seqlens_q=CU_Q[:, None].contiguous(), cu_seqlens_k=CU_K[:, None].contiguous()),
     r"cu_seqlens_q must be 1-D"),
    (dict(max_seqlen_k=2**31), "max_seqlen_k must be an int in"),
])
def test_bad_input_one_clear_error(fake_launches, change, message):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=7,
                max_seqlen_k=5)
    args.update(change)
    with pytest.raises(InvalidInputError, match=message):
        flash_attn_varlen_func(**args)
    assert fake_launches == []


@pytest.mark.parametrize("cu_q, cu_k, max_q, message", [
    ([1, 3, 3, 10], CU_K.tolist(), 7, r"cu_seqlens_q\[0\] must be 0, got 1"),
    ([0, 3, 2, 10], CU_K.tolist(), 8, "cu_seqlens_q must not decrease: entry 2 is 2 after 3"),
    (CU_Q.tolist(), [0, 5, 7, 13], 7, r"cu_seqlens_k\[-1\] is 13 but k has 12 rows"),
    (CU_Q.tolist(), CU_K.tolist(), 6, "max_seqlen_q is 6 but sequence 2 has 7 rows"),
])
def test_debug_checks_read_cu_seqlens(fake_launches, monkeypatch, cu_q, cu_k, max_q, message):
    q, k, v = qkv()
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, 5, causal=True)  # off: not checked
    monkeypatch.setenv(ops.DEBUG_CHECKS_ENV, "1")
    with pytest.raises(InvalidInputError, match=message):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, 5, causal=True)


def test_debug_checks_take_padding_after_the_last_sequence(fake_launches, monkeypatch):
    """cu_seqlens_q[-1] below q's rows: the rest is padding, never written (as FA3)."""
    q, k, v = qkv()
    monkeypatch.setenv(ops.DEBUG_CHECKS_ENV, "1")
    flash_attn_varlen_func(q, k, v, torch.tensor([0, 3, 3, 9], dtype=torch.int32), CU_K, 7, 5,
                           causal=True)
    assert len(fake_launches) == 1


def test_a_sequence_past_the_tile_lists_bound_is_refused_whatever_max_seqlen_says(fake_launches):
    """An understated max_seqlen_q passed the bound's check, and the kernel that lists the
    tiles packed block 65536 into the head field (a tile twice, one never, lse written past its
    end): where the rows alone could hold such a sequence, its length is read."""
    n = 65536 * 128 + 1  # 65537 query tiles of 128 rows
    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16).expand(n, 1, 128)  # no 2 GB input
    k = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    cu_q, cu_k = (torch.tensor([0, m], dtype=torch.int32) for m in (n, 64))
    with pytest.raises(InvalidInputError, match=r"a sequence of 8388609 rows makes more than "
                                                r"65535 tiles of 128 rows .*max_seqlen_q "
                                                r"understates it"):
        flash_attn_varlen_func(q, k, k, cu_q, cu_k, 1024, 64, causal=True)
    assert fake_launches == []
    # the backward's key tiles alike; no read where the rows cannot hold such a sequence
    long = torch.tensor([0, 5, 70005], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match=r"a sequence of 70000 rows makes more"):
        varlen._check_longest("max_seqlen_k", long, 70005, 1, "v")
    varlen._check_longest("max_seqlen_k", long, 65535, 1, "v")


def test_both_directions_check_the_longest_sequence(fake_launches, monkeypatch):
    """The forward on the query rows and tiles, the backward on the key rows and tiles."""
    seen = []
    monkeypatch.setattr(varlen, "_check_longest", lambda *a: seen.append(a))
    q, k, v = qkv(grad=True)
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True).float().sum().backward()
    assert len(fake_launches) == 2
    assert [(a[0], a[2], a[3]) for a in seen] == [("max_seqlen_q", q.shape[0], 128),
                                                  ("max_seqlen_k", k.shape[0], 128)]
    assert seen[0][1] is CU_Q and seen[1][1] is CU_K


def test_params_reach_the_abi(fake_launches):
    q, k, v = qkv()
    out, lse = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, return_lse=True)
    assert out.shape == (10, 4, 128) and lse.shape == (4, 10) and lse.dtype == torch.float32
    [(name, p)] = fake_launches
    assert name == "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1"
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (3, 7, 5, 10, 12)
    assert (p.cu_seqlens_q, p.cu_seqlens_k) == (CU_Q.data_ptr(), CU_K.data_ptr())
    assert (p.q_row_stride, p.q_head_stride, p.k_row_stride, p.o_row_stride) == (512, 128, 256, 512)
    assert p.tile_list != 0 and p.softmax_scale == pytest.approx(128 ** -0.5)
    with pytest.raises(VariantNotBuiltError, match="varlen: true"):  # only causal is in the table
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5)


def test_backward_params_and_padded_workspace(fake_launches, monkeypatch):
    from fa3gen import ops

    q, k, v = qkv(grad=True)
    made = []
    real = ops._bwd_workspace
    monkeypatch.setattr(ops, "_bwd_workspace",
                        lambda layout, device: made.append((layout, real(layout, device))) or made[-1][1])
    out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, deterministic=True)
    out.float().sum().backward()
    assert [n for n, _ in fake_launches] == ["fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1",
                                    "bwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp0_ov0"]
    p = fake_launches[1][1]
    assert (p.batch, p.total_q, p.total_k, p.deterministic) == (3, 10, 12, 1)
    (layout, workspace), = made
    view = lambda name: layout.view(workspace, name)
    # (total_q + batch * tile_m) rounded up to tile_m = 64: 202 -> 256 rows per head
    assert view("dq_accum").shape == (4, 256, 128) and view("lse_log2").shape == (4, 256)
    assert view("dq_semaphore").shape == (4, 4)
    assert view("tile_list").numel() == 2 * contract.varlen_tiles(12, 3, 128) * 2
    assert p.dq_accum == view("dq_accum").data_ptr() and p.tile_list == view("tile_list").data_ptr()
    assert q.grad is not None and k.grad is not None


def test_opcheck_and_fake_shapes(fake_launches):
    q, k, v = qkv()
    torch.library.opcheck(torch.ops.fa3gen.varlen_fwd.default,
                          (q, k, v, CU_Q, CU_K, 7, 5, True, 0.1,
                           "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1", False, -1, -1,
                           0.0), test_utils=("test_schema", "test_faketensor"))


def test_tile_bound_matches_the_abi_macro(tmp_path):
    """contract.varlen_tiles mirrors FA3GEN_VARLEN_TILES of fa3gen_abi.h (it sizes the
    workspace the kernel fills)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    cases = [(10, 3, 128), (1000, 7, 64), (16384, 32, 128), (5, 5, 80), (0, 1, 128),
             (2**31 - 1, 16384, 64)]
    body = "".join(f'printf("%lld\\n", (long long)FA3GEN_VARLEN_TILES({t}, {b}, {tile}));'
                   for t, b, tile in cases)
    src = tmp_path / "bound.c"
    src.write_text(f'#include <stdio.h>\n#include "fa3gen_abi.h"\nint main(void) {{ {body} }}\n')
    subprocess.run([cc, "-I", str(contract.REPO_ROOT / "templates" / "kernels"), str(src), "-o",
                    str(tmp_path / "bound")], check=True)
    got = subprocess.run([str(tmp_path / "bound")], capture_output=True, text=True).stdout.split()
    assert [int(x) for x in got] == [contract.varlen_tiles(*c) for c in cases]
    # The exact maximum over every split of the total, whatever the longest sequence (a
    # max_seqlen below the real longest cannot make the list too short).
    import itertools
    for total, batch, tile in [(10, 3, 4), (9, 4, 2), (12, 2, 5)]:
        most = max(sum(-(-n // tile) for n in lengths)
                   for lengths in itertools.product(range(total + 1), repeat=batch)
                   if sum(lengths) == total)
        assert contract.varlen_tiles(total, batch, tile) == most


@pytest.mark.parametrize("through", ["eager", "op"])
def test_calls_plan_once_per_signature(fake_launches, monkeypatch, through):
    """Eager calls and the custom ops' bodies (the path of compiled calls) check and plan
    once per call signature, forward and backward; the expanded dout is copied every call."""
    checks = []
    for plan in ("_fwd_plan", "_bwd_plan"):
        real = getattr(varlen, plan)
        monkeypatch.setattr(varlen, plan, lambda *a, real=real: checks.append(1) or real(*a))
    douts, run = [], varlen._bwd_run
    monkeypatch.setattr(varlen, "_bwd_run", lambda plan, dout, *a: douts.append(dout) or run(plan, dout, *a))
    q, k, v = qkv(grad=True)
    if through == "op":
        monkeypatch.setattr(ops, "_captured", lambda *t: True)
    for _ in range(3):  # a bf16 sum's grad: expanded, stride 0
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True).sum().backward()
    assert len(fake_launches) == 6 and len(checks) == 2  # three forwards and backwards, one plan each
    bwd = fake_launches[5][1]
    assert (bwd.do_row_stride, bwd.do_head_stride) == (512, 128)
    assert [d.stride() for d in douts] == [(512, 128, 1)] * 3  # copied on every call
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 8, 5, causal=True)  # another max_seqlen
    assert len(checks) == 3


def test_no_key_in_any_sequence_gives_zero_rows_and_lse_minus_inf(fake_launches):
    q, _, _ = qkv()
    k = v = torch.zeros(0, 2, 128, dtype=torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, k, v, CU_Q, torch.zeros(4, dtype=torch.int32), 7, 1,
                                      causal=True, return_lse=True)
    assert fake_launches == [] and not out.float().any() and bool((lse == float("-inf")).all())


def test_no_query_row_launches_nothing(fake_launches):
    """Every sequence empty on the query side: empty outputs, no launch; its backward gives
    zero key and value gradients."""
    _, k, v = qkv(grad=True)
    q = torch.zeros(0, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    out, lse = flash_attn_varlen_func(q, k, v, torch.zeros(4, dtype=torch.int32), CU_K, 1, 5,
                                      causal=True, return_lse=True)
    assert out.shape == (0, 4, 128) and lse.shape == (4, 0) and fake_launches == []
    out.float().sum().backward()
    assert fake_launches == [] and not k.grad.any() and not v.grad.any() and q.grad.shape == q.shape


def test_a_plan_per_v_signature_and_the_tile_list_size(fake_launches, monkeypatch):
    """The plan cache keys on v too; the tile list holds two ints per (tile, head) of the
    ABI's bound (FA3GEN_VARLEN_TILES)."""
    sizes = []
    real = varlen._fwd_tile_list
    monkeypatch.setattr(varlen, "_fwd_tile_list", lambda *a: (
        sizes.append(real(*a).numel()) or real(*a)))
    q, k, v = qkv()
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    wide = torch.zeros(12, 4, 128, dtype=torch.bfloat16)[:, :2]
    flash_attn_varlen_func(q, k, wide, CU_Q, CU_K, 7, 5, causal=True)
    assert [p.v_row_stride for _, p in fake_launches] == [256, 512]
    assert sizes == [2 * contract.varlen_tiles(10, 3, 128) * 4] * 2


@pytest.mark.parametrize("total, hq, message", [
    (10, 32768, "32767 query heads per call, got 3 and 32768"),
    (2**31, 4, "total_q and total_k must be below 2\\^31 rows"),
])
def test_varlen_size_limits(fake_launches, total, hq, message):
    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16).expand(total, hq, 128)
    k = v = torch.zeros(12, 2 if hq == 4 else 1, 128, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match=message):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)


@pytest.mark.parametrize("through", ["eager", "op"])
def test_seqused_k_reaches_the_backward(fake_launches, through):
    """seqused_k reaches the backward's params (the eager path and the custom op's autograd),
    and dk, dv start zeroed: the kernels write no row past seqused_k."""
    q, k, v = qkv(grad=True)
    used = torch.tensor([4, 2, 0], dtype=torch.int32)
    k.data.fill_(1.0)
    if through == "eager":
        out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, seqused_k=used)
    else:
        out, _ = torch.ops.fa3gen.varlen_fwd(
            q, k, v, CU_Q, CU_K, 7, 5, True, 128 ** -0.5,
            "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1", False, -1, -1, 0.0, used)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    (fwd, pf), (bwd, pb) = fake_launches
    assert fwd.startswith("fwd_") and bwd.startswith("bwd_")
    assert pf.seqused_k == pb.seqused_k == used.data_ptr()
    assert (dk == 0).all() and (dv == 0).all()  # the fake launch wrote nothing: the zero fill
    out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert fake_launches[-1][1].seqused_k is None


def test_total_keys_past_int32_are_refused(fake_launches):
    q, _, _ = qkv()
    k = torch.zeros(1, 2, 128, dtype=torch.bfloat16).expand(2**31, 2, 128)
    with pytest.raises(InvalidInputError, match="total_q and total_k must be below 2\\^31 rows"):
        flash_attn_varlen_func(q, k, k, CU_Q, CU_K, 7, 5)


def test_backward_copies_a_misaligned_dout(fake_launches):
    """As tests/test_ops_params.py's: a contiguous dout at an odd address is copied (the varlen
    path always took it for a copy and then handed the odd address on: an error)."""
    from tests.test_ops_params import _misaligned_like
    q, k, v = qkv(grad=True)
    for _ in range(2):  # the second call hits the plan cache
        out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
        dout = _misaligned_like(out)
        torch.autograd.grad(out, (q, k, v), dout)
        name, p = fake_launches[-1]
        assert name.startswith("bwd_") and p.dout % 16 == 0 and p.dout != dout.data_ptr()
    aligned = torch.randn_like(out)
    out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    torch.autograd.grad(out, (q, k, v), aligned)
    assert fake_launches[-1][1].dout == aligned.data_ptr()  # not copied


def test_misaligned_input_named_on_a_plan_cache_hit(fake_launches):
    """The forward's plan is cached by strides; a tensor at an odd address on a later call is
    named as such (it was reported as q.stride(2) (heads), the 3-D view read as 4-D)."""
    q, k, v = qkv()
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    flat = torch.zeros(k.numel() + 8, dtype=k.dtype)
    odd_k = flat[4:4 + k.numel()].view(k.shape)
    with pytest.raises(InvalidInputError, match=r"k.data_ptr\(\) is not 16-byte aligned"):
        flash_attn_varlen_func(q, odd_k, v, CU_Q, CU_K, 7, 5, causal=True)


@pytest.mark.parametrize("with_seqused_k", [False, True])
def test_cu_seqlens_k_not_a_tensor_is_named(fake_launches, with_seqused_k):
    """A list for cu_seqlens_k is reported as cu_seqlens_k's fault, seqused_k given or not (a
    valid seqused_k was blamed for it)."""
    q, k, v = qkv()
    extra = {"seqused_k": torch.tensor([5, 2, 5], dtype=torch.int32)} if with_seqused_k else {}
    with pytest.raises(InvalidInputError, match="cu_seqlens_k") as err:
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K.tolist(), 7, 5, causal=True, **extra)
    assert "seqused_k" not in str(err.value)


def test_debug_checks_read_seqused_k(fake_launches, monkeypatch):
    """seqused_k beyond its sequence's keys (or negative) is reported under FA3GEN_DEBUG_CHECKS=1
    only (the kernels clamp it otherwise)."""
    q, k, v = qkv()  # sequences of 5, 2 and 5 keys
    for bad, message in (([5, 3, 5], r"seqused_k\[1\] is 3 but sequence 1 has 2 keys"),
                         ([-1, 2, 5], r"seqused_k\[0\] is -1")):
        used = torch.tensor(bad, dtype=torch.int32)
        monkeypatch.delenv(ops.DEBUG_CHECKS_ENV, raising=False)
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, seqused_k=used)
        monkeypatch.setenv(ops.DEBUG_CHECKS_ENV, "1")
        with pytest.raises(InvalidInputError, match=message):
            flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, seqused_k=used)
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True,
                           seqused_k=torch.tensor([5, 0, 2], dtype=torch.int32))


@pytest.mark.parametrize("through", ["eager", "op"])
def test_numpy_integer_max_seqlens_are_ints(fake_launches, monkeypatch, through):
    """flash-attn takes max_seqlen as a numpy integer (cu_seqlens' max from numpy code);
    fa3gen too, launching what the same Python ints launch, and a plan made for one serves the
    other (they are the same key)."""
    np = pytest.importorskip("numpy")
    if through == "op":
        monkeypatch.setattr(ops, "_captured", lambda *t: True)
    q, k, v = qkv()
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, np.int64(7), np.int32(5), causal=True)
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    (_, p_np), (_, p_int) = fake_launches
    assert (p_np.seqlen_q, p_np.seqlen_k) == (p_int.seqlen_q, p_int.seqlen_k) == (7, 5)
    with pytest.raises(InvalidInputError, match="max_seqlen_k must be an int in"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, np.float32(5), causal=True)
    with pytest.raises(InvalidInputError, match="max_seqlen_q must be an int in"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, np.bool_(True), 5, causal=True)
    big = np.int32(2**31 - 1)  # summed as numpy int32 this wraps to -2: the limit holds on ints
    with pytest.raises(InvalidInputError, match=r"max_seqlen_q \+ max_seqlen_k must be at most"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, big, big, causal=True)


@pytest.mark.parametrize("through", ["eager", "op"])
def test_backward_params_mirror_the_forward(fake_launches, through):
    """The backward launch gets the forward's sizes, scale and mask: max_seqlen_q and _k,
    softmax_scale, window and softcap in their own places (through the eager autograd.Function
    and through the custom op's registered backward)."""
    q, k, v = qkv(grad=True)
    if through == "eager":
        out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, softmax_scale=0.3)
    else:
        out, _ = torch.ops.fa3gen.varlen_fwd(
            q, k, v, CU_Q, CU_K, 7, 5, True, 0.3, "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1",
            False, -1, 0, 0.0, None)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    (_, pf), (bwd, pb) = fake_launches
    assert bwd == "bwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp0_ov0"
    fields = ("seqlen_q", "seqlen_k", "softmax_scale", "window_left", "window_right", "softcap",
              "batch", "total_q", "total_k", "heads_q", "heads_kv")
    assert [getattr(pb, f) for f in fields] == [getattr(pf, f) for f in fields]
    assert (pb.seqlen_q, pb.seqlen_k, pb.batch) == (7, 5, 3)
    assert pb.softmax_scale == pytest.approx(0.3)


def test_variant_is_honoured_and_checked(fake_launches):
    """variant= runs that variant (the one table entry here), and a name the library lacks is a
    VariantNotBuiltError naming it."""
    q, k, v = qkv()
    name = "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1"
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, variant=name)
    assert fake_launches[-1][0] == name
    with pytest.raises(VariantNotBuiltError, match="m64n128"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True,
                               variant="fwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp1_ov1")


def test_layout_checks_name_the_tensor(fake_launches):
    """head_dim not contiguous in k, or v's row stride not 16-byte aligned: an InvalidInputError
    that names the tensor and the caller's own dim (v's rows are its dim 0: the check once named
    dims of an internal 4-D view)."""
    q, k, v = qkv()
    k_t = torch.zeros(12, 128, 2, dtype=torch.bfloat16).transpose(1, 2)  # head_dim stride 2
    with pytest.raises(InvalidInputError, match=r"k.stride\(-1\)"):
        flash_attn_varlen_func(q, k_t, v, CU_Q, CU_K, 7, 5, causal=True)
    v_odd = torch.zeros(12, 2 * 128 + 4, dtype=torch.bfloat16)[:, :256].view(12, 2, 128)
    with pytest.raises(InvalidInputError, match=r"v.stride\(0\) \(rows\) is 260 elements"):
        flash_attn_varlen_func(q, k, v_odd, CU_Q, CU_K, 7, 5, causal=True)
    v_heads = torch.zeros(12, 2, 128 + 4, dtype=torch.bfloat16)[..., :128]  # heads 132 apart
    with pytest.raises(InvalidInputError, match=r"v.stride\(1\) \(heads\) is 132 elements"):
        flash_attn_varlen_func(q, k, v_heads, CU_Q, CU_K, 7, 5, causal=True)


def test_limits_are_inclusive(fake_launches):
    """One sequence, 16384 sequences, 32767 query heads and max_seqlen_q + max_seqlen_k of
    2^30 - 1 are legal; one more of each is refused (the sum: it passed the host and failed at
    launch, 'seqlen_q + seqlen_k too large for one launch')."""
    q, k, v = qkv()
    one_q, one_k = (torch.tensor([0, n], dtype=torch.int32) for n in (10, 12))
    flash_attn_varlen_func(q, k, v, one_q, one_k, 10, 12, causal=True)
    longest_q = 65535 * 128  # the tile list's bound at 128-row tiles
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, longest_q, 2**30 - 1 - longest_q, causal=True)
    with pytest.raises(InvalidInputError, match=r"max_seqlen_q \+ max_seqlen_k must be at most 2\*\*30 - 1"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, longest_q, 2**30 - longest_q, causal=True)
    with pytest.raises(InvalidInputError, match=r"max_seqlen_q must be an int in \[1, 2\*\*31\)"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 2**31, 5, causal=True)
    n = contract.VARLEN_LIMITS["batch"]
    for batch, ok in ((n, True), (n + 1, False)):
        cu = torch.arange(batch + 1, dtype=torch.int32)
        qb, kb, vb = qkv(total_q=batch, total_k=batch, hq=2, hkv=1, d=64)
        if ok:
            varlen.check_varlen_inputs(qb, kb, vb, cu, cu, 1, 1)
        else:
            with pytest.raises(InvalidInputError, match="at most 16384 sequences"):
                varlen.check_varlen_inputs(qb, kb, vb, cu, cu, 1, 1)
    heads = contract.VARLEN_LIMITS["heads"]
    for hq, ok in ((heads, True), (heads + 1, False)):
        qh = torch.zeros(1, hq, 64, dtype=torch.bfloat16)
        kh = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
        cu = torch.tensor([0, 1], dtype=torch.int32)
        if ok:
            varlen.check_varlen_inputs(qh, kh, kh, cu, cu, 1, 1)
        else:
            with pytest.raises(InvalidInputError, match="32767 query heads"):
                varlen.check_varlen_inputs(qh, kh, kh, cu, cu, 1, 1)


def test_backward_op_checks_its_tensors(fake_launches):
    """torch.ops.fa3gen.varlen_bwd called directly with a dout of another dtype: one
    InvalidInputError naming dout, no launch."""
    q, k, v = qkv()
    out, lse = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True, return_lse=True)
    calls = len(fake_launches)
    with pytest.raises(InvalidInputError, match="dout must be torch.bfloat16"):
        torch.ops.fa3gen.varlen_bwd(out.half(), q, k, v, out, lse, CU_Q, CU_K, 7, 5, True,
                                    128 ** -0.5, "bwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp0_ov0",
                                    False, -1, 0, 0.0)
    assert len(fake_launches) == calls


def test_the_captured_path_names_the_varlen_variant(fake_launches, monkeypatch):
    """Under graph capture the call goes through torch.ops.fa3gen.varlen_fwd with the varlen
    variant's name."""
    monkeypatch.setattr(ops, "_captured", lambda *t: True)
    q, k, v = qkv()
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    assert fake_launches[-1][0] == "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1"


def test_one_input_requiring_grad_is_enough(fake_launches):
    q, k, v = qkv()
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
    assert out.requires_grad
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert dq.shape == q.shape and fake_launches[-1][0].startswith("bwd_")


@pytest.mark.parametrize("through", ["eager", "op"])
def test_a_trace_records_both_directions(fake_launches, tmp_path, through):
    """fa3gen.tracing records the varlen forward and its backward as the dispatch's defaults,
    with the batch (sequences) and the max_seqlen sizes, through the eager path and the op."""
    from fa3gen import tracing
    q, k, v = qkv(grad=True)
    with tracing.trace(tmp_path / "t.yaml") as t:
        if through == "eager":
            out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True)
        else:
            out, _ = torch.ops.fa3gen.varlen_fwd(
                q, k, v, CU_Q, CU_K, 7, 5, True, 128 ** -0.5,
                "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1", False, -1, 0, 0.0, None)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    bwd = t.entries[("bwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp0_ov0", True)]
    assert bwd.count == 1 and bwd.ranges["batch"] == [3, 3]
    assert bwd.ranges["seqlen_q"] == [7, 7] and bwd.ranges["seqlen_k"] == [5, 5]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # a prototype
def test_a_nested_tensor_is_one_error(fake_launches):
    """A strided nested tensor's stride() raised inside torch while the plan key was built."""
    q = torch.nested.nested_tensor([torch.zeros(3, 4, 128, dtype=torch.bfloat16),
                                    torch.zeros(7, 4, 128, dtype=torch.bfloat16)])
    with pytest.raises(InvalidInputError, match="q is a nested tensor"):
        flash_attn_varlen_func(q, q, q, CU_Q, CU_K, 7, 5, causal=True)
    with pytest.raises(InvalidInputError, match="q is a nested tensor"):
        ops.flash_attn_func(q, q, q)


def test_max_seqlen_read_from_cu_seqlens_inside_a_compiled_graph(fake_launches):
    """max_seqlen as `(cu[1:] - cu[:-1]).max().item()` (Hugging Face's packed path) under
    torch.compile(fullgraph=True) with capture_scalar_outputs: its checks become assertions
    that run with the graph (a guard on its value could not be traced), forward and backward
    launch with the value of each run, and a value outside [1, 2**31) fails when it runs."""
    torch._dynamo.reset()
    longest = lambda cu: (cu[1:] - cu[:-1]).max().item()  # noqa: E731
    call = torch.compile(lambda q, cu: varlen.flash_attn_varlen_func(
        q, q, q, cu, cu, longest(cu), longest(cu), causal=True), fullgraph=True,
        backend="aot_eager")
    q = torch.zeros(40, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for cu, most in (([0, 30, 40], 30), ([0, 12, 40], 28)):
            call(q, torch.tensor(cu, dtype=torch.int32)).float().sum().backward()
            fwd, bwd = (p for _, p in fake_launches[-2:])
            assert (fwd.seqlen_q, fwd.seqlen_k, bwd.seqlen_q, bwd.seqlen_k) == (most,) * 4
        with pytest.raises(RuntimeError, match="u0 >= 1"):
            call(q, torch.zeros(3, dtype=torch.int32))


def test_debug_checks_under_compile_and_vmap(fake_launches, monkeypatch):
    """FA3GEN_DEBUG_CHECKS=1 reads cu_seqlens in the op's body when the call is captured: a
    compiled graph checks each run's values, vmap each entry's (tracing cannot read them)."""
    monkeypatch.setenv("FA3GEN_DEBUG_CHECKS", "1")
    i32 = dict(dtype=torch.int32)
    cu, falling = torch.tensor([0, 30, 40], **i32), torch.tensor([0, 30, 20], **i32)
    attend = lambda q, cu: varlen.flash_attn_varlen_func(  # noqa: E731
        q, q, q, cu, cu, 30, 30, causal=True)
    torch._dynamo.reset()
    call = torch.compile(attend, fullgraph=True, backend="aot_eager")
    q = torch.zeros(40, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    call(q, cu).float().sum().backward()
    with pytest.raises(InvalidInputError, match="cu_seqlens_q must not decrease"):
        call(q, falling)
    with pytest.raises(InvalidInputError, match="max_seqlen_q is 30 but sequence 1 has 35"):
        call(q, torch.tensor([0, 5, 40], **i32))
    batched = torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16)
    assert torch.func.vmap(attend)(batched, torch.stack([cu, cu])).shape == batched.shape
    with pytest.raises(InvalidInputError, match="cu_seqlens_q must not decrease"):
        torch.func.vmap(attend)(batched, torch.stack([cu, falling]))


def test_a_bad_dynamic_max_seqlen_under_compile_is_still_invalid_input(fake_launches):
    """A max_seqlen that torch.compile made dynamic has a value while tracing: a bad one raises
    InvalidInputError as in eager (only one read from a tensor in the graph waits for the run)."""
    cu = torch.tensor([0, 30, 40], dtype=torch.int32)
    q = torch.zeros(40, 2, 128, dtype=torch.bfloat16)
    torch._dynamo.reset()
    call = torch.compile(lambda q, cu, m: varlen.flash_attn_varlen_func(
        q, q, q, cu, cu, m, m, causal=True), backend="aot_eager", dynamic=True)
    call(q, cu, 30)
    for bad, match in ((0, r"in \[1, 2\*\*31\)"), (2**31, r"in \[1, 2\*\*31\)"),
                       (2**30, "at most 2\\*\\*30 - 1")):
        with pytest.raises(InvalidInputError, match=match):
            call(q, cu, bad)


def _nested(t):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype API's warning
        return torch.nested.nested_tensor([t])


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"])
def test_nested_index_tensors_get_one_clear_error(fake_launches, which):
    """A nested cu_seqlens or seqused_k had raised torch's "NestedTensorImpl doesn't support
    sizes" while the call's key was made."""
    q, k, v = qkv()
    args = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)
    if which == "seqused_k":
        args["seqused_k"] = _nested(CU_K[1:] - CU_K[:-1])
    else:
        args[which] = _nested(args[which])
    with pytest.raises(InvalidInputError, match=f"{which} is a nested tensor; pass a 1-D int32"):
        flash_attn_varlen_func(q, k, v, max_seqlen_q=7, max_seqlen_k=5, **args)
    assert fake_launches == []


@pytest.mark.parametrize("scale, seqused_k, message", [
    (1e40, None, "outside"), (1e-45, None, "outside"), (float("nan"), None, "finite number"),
    (0.1, torch.tensor([5, 2, 5]), "seqused_k must be int32"),
    (0.1, torch.tensor([5], dtype=torch.int32), "seqused_k must be int32 of shape"),
])
def test_the_ops_called_directly_check_what_the_functions_do(fake_launches, scale, seqused_k,
                                                             message):
    """fa3gen::varlen_fwd / varlen_bwd / fwd / bwd are public entry points: a scale that fp32
    makes inf or 0 and a seqused_k the kernel would misread (int64, too short) had reached the
    launch when the op was called without the public function."""
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=message):
        torch.ops.fa3gen.varlen_fwd(q, k, v, CU_Q, CU_K, 7, 5, True, scale, "", False, -1, -1,
                                    0.0, seqused_k)
    out, lse = torch.zeros_like(q), torch.zeros(4, 10)
    with pytest.raises(InvalidInputError, match=message):
        torch.ops.fa3gen.varlen_bwd(out, q, k, v, out, lse, CU_Q, CU_K, 7, 5, True, scale, "",
                                    False, -1, -1, 0.0, seqused_k)
    if seqused_k is None:
        qd = q[None]
        with pytest.raises(InvalidInputError, match=message):
            torch.ops.fa3gen.fwd(qd, qd, qd, False, scale, "", False, -1, -1, 0.0)
        with pytest.raises(InvalidInputError, match=message):
            torch.ops.fa3gen.bwd(qd, qd, qd, qd, qd, torch.zeros(1, 4, 10), False, scale, "",
                                 False, -1, -1, 0.0)
    assert fake_launches == []


def test_more_tiles_a_sequence_than_the_list_holds_is_refused_before_the_launch(fake_launches):
    """65535 tiles a sequence (the tile list's bound) had been checked only by the launcher,
    as a generic Fa3genError; the backward's key tiles only when .backward() ran."""
    too_long = 65535 * 128 + 1
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="max_seqlen_q=8388481 makes more than 65535 tiles"):
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, too_long, 5, causal=True)
    assert fake_launches == []
    flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 65535 * 128, 5, causal=True)  # the bound itself
    q, k, v = qkv(grad=True)
    out = flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, too_long, causal=True)
    with pytest.raises(InvalidInputError, match="max_seqlen_k=8388481 makes more than 65535 tiles"):
        out.sum().backward()


def test_a_numpy_max_seqlen_under_fullgraph_compile_is_named(fake_launches):
    """dynamo traces a numpy scalar as an array: the check's message had failed on its repr
    (dynamo's "repr() on tensor"), so the user saw no word of max_seqlen."""
    np = pytest.importorskip("numpy")
    torch._dynamo.reset()
    q, k, v = qkv()
    call = torch.compile(lambda q, k, v, m: flash_attn_varlen_func(q, k, v, CU_Q, CU_K, m, m,
                                                                   causal=True),
                         fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"max_seqlen_q must be an int .* got a numpy value, "
                                        r"which torch.compile traces as an array \(pass int"):
        call(q, k, v, np.int64(7))
    assert flash_attn_varlen_func(q, k, v, CU_Q, CU_K, np.int64(7), np.int64(5),
                                  causal=True).shape == q.shape  # eagerly taken


def test_torch_deterministic_algorithms_make_the_varlen_backward_deterministic(fake_launches):
    q, k, v = qkv(grad=True)
    torch.use_deterministic_algorithms(True)
    try:
        flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 7, 5, causal=True).float().sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert fake_launches[1][1].deterministic == 1


def test_the_deterministic_backward_takes_offsets_that_never_decrease(fake_launches, monkeypatch):
    """cu_seqlens are read on the host only under FA3GEN_DEBUG_CHECKS: decreasing offsets give
    wrong numbers, but in the deterministic backward two sequences would share a query tile's
    dQ semaphore and wait for each other forever (a hang). That backward launches with the
    offsets' running maximum (the offsets themselves when valid); the other launches take the
    caller's tensors as they are."""
    import ctypes

    seen = []
    real = ops._launch

    def launch(lib, info, device, make):
        p = make()
        read = lambda ptr: list(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int32))[:4])
        seen.append((info.name, p.cu_seqlens_q, read(p.cu_seqlens_q), read(p.cu_seqlens_k)))
        return real(lib, info, device, lambda: p)

    monkeypatch.setattr(ops, "_launch", launch)
    cu_q = torch.tensor([0, 7, 3, 10], dtype=torch.int32)  # decreasing: bad input
    cu_k = torch.tensor([0, 9, 5, 12], dtype=torch.int32)
    for deterministic in (False, True):
        q, k, v = qkv(grad=True)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True,
                                     deterministic=deterministic)
        out.float().sum().backward()
        (fwd, fwd_ptr, fwd_q, _), (bwd, bwd_ptr, bwd_q, bwd_k) = seen[-2:]
        assert fwd.startswith("fwd_") and bwd.startswith("bwd_")
        assert fwd_ptr == cu_q.data_ptr() and fwd_q == [0, 7, 3, 10]
        if deterministic:
            assert bwd_q == [0, 7, 7, 10] and bwd_k == [0, 9, 9, 12]
        else:
            assert bwd_ptr == cu_q.data_ptr() and bwd_q == [0, 7, 3, 10]
