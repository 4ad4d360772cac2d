"""fp8 (e4m3) on CPU: the variant scope (pruning), the reference and its tolerance rule, and the
argument checks that need no GPU. The kernels themselves: tests/gpu/test_fp8.py."""
import pytest
import torch

from fa3gen import fp8, ops
from fa3gen.contract import Variant
from fa3gen.errors import InvalidInputError
from fa3gen.reference import attention_reference, compare_fp8_to_reference, fp8_attention_reference
from generator.variants import fp8_scope


def _v(**kw):
    base = dict(direction="fwd", dtype="e4m3", head_dim=128, causal=False, local=False,
                softcap=False, varlen=False, tile_m=128, tile_n=128, stages=2,
                warp_specialized=True, pingpong=True, intra_wg_overlap=True)
    return Variant(**{**base, **kw})


def test_fp8_scope_names_what_is_not_realized():
    assert fp8_scope(_v()) is None
    assert "forward only" in fp8_scope(_v(direction="bwd"))
    assert "not realized yet" in fp8_scope(_v(softcap=True))
    assert "warp_specialized" in fp8_scope(_v(warp_specialized=False, pingpong=False))
    assert "multiple of 64" in fp8_scope(_v(tile_n=96))
    assert fp8_scope(_v(dtype="bf16", tile_n=96)) is None


def _inputs(b=2, sq=129, sk=200, hq=4, hkv=2, d=64):
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(b, s, h, d, generator=g) * 2).to(torch.float8_e4m3fn)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    ds = {n: torch.rand(b, hkv, generator=g) + 0.5 for n in fp8.DESCALE_NAMES}
    return q, k, v, ds


def test_fp8_reference_exact_matches_attention_on_dequantized_inputs():
    q, k, v, ds = _inputs()
    out, lse = fp8_attention_reference(q, k, v, **ds, causal=True)
    group = q.shape[2] // k.shape[2]
    deq = [t.double() * d.double().repeat_interleave(g, 1)[:, None, :, None]
           for t, d, g in ((q, ds["q_descale"], group), (k, ds["k_descale"], 1),
                           (v, ds["v_descale"], 1))]
    ref, ref_lse = attention_reference(*deq, causal=True, upcast=True)
    assert torch.allclose(out, ref.double(), atol=1e-5) and torch.allclose(lse, ref_lse.double(), atol=1e-5)


def test_fp8_tolerance_rule_accepts_the_kernel_arithmetic_and_rejects_errors():
    q, k, v, ds = _inputs()
    emu, lse = fp8_attention_reference(q, k, v, **ds, causal=True, key_block=128)
    good = compare_fp8_to_reference(emu.to(torch.bfloat16), lse.float(), q, k, v, ds, True, 128)
    assert good["ok"], good["why"]
    bad = compare_fp8_to_reference((emu * 1.05).to(torch.bfloat16), lse.float(), q, k, v, ds,
                                   True, 128)
    assert not bad["ok"] and "RMSE" in bad["why"]
    nan = emu.to(torch.bfloat16).clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "NaN" in compare_fp8_to_reference(nan, lse.float(), q, k, v, ds, True, 128)["why"]
    off = compare_fp8_to_reference(emu.to(torch.bfloat16), lse.float() + 0.05, q, k, v, ds, True, 128)
    assert not off["ok"] and "lse" in off["why"]


def test_descales_belong_to_fp8_inputs():
    t = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match="float8_e4m3fn q, k, v only"):
        fp8.check_descale_use(t, t, t, {"q_descale": torch.ones(1)}, None)
    with pytest.raises(InvalidInputError, match="out_dtype"):
        fp8.check_descale_use(t, t, t, {}, torch.float16)
    fp8.check_descale_use(t.to(torch.float8_e4m3fn), t, t, {"q_descale": torch.ones(1)}, None)


def test_descale_views():
    dims = ops.Dims(2, 8, 8, 4, 2, 64, "e4m3")
    cpu = torch.device("cpu")
    assert fp8._descale_view("q_descale", None, dims, cpu) is None
    one = fp8._descale_view("q_descale", torch.tensor([2.0]), dims, cpu)
    assert one.shape == (2, 2) and one.stride() == (0, 0)
    full = torch.rand(2, 2)
    assert fp8._descale_view("k_descale", full, dims, cpu) is full
    with pytest.raises(InvalidInputError, match=r"shape \(batch, heads_kv\) = \(2, 2\)"):
        fp8._descale_view("k_descale", torch.rand(2, 4), dims, cpu)
    with pytest.raises(InvalidInputError, match="float32"):
        fp8._descale_view("v_descale", torch.rand(2, 2).half(), dims, cpu)
    with pytest.raises(InvalidInputError, match="must be a float32 tensor"):
        fp8._descale_view("v_descale", 2.0, dims, cpu)
