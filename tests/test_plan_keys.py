"""The plan caches' keys (CPU, fake library): a call that differs from a cached one only in
something its plan depends on gets its own plan, never the cached one's params. Each case
reused a wrong plan once (a review of the caches, 2026-12-05)."""
import pytest
import torch

from fa3gen import contract, kvcache, ops, varlen

BF = torch.bfloat16


def test_paged_prefill_tells_batch_from_seqlen(fake_launches, monkeypatch):
    """(2, 40) and (4, 20) queries are 80 rows either way: the paged forward's plan is keyed
    by q's own shape, so the second call launches batch 4 of 20 rows."""
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))
    kc = torch.zeros(10, 64, 2, 128, dtype=BF)
    for b, sq in ((2, 40), (4, 20)):
        q = torch.zeros(b, sq, 4, 128, dtype=BF)
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.full((b,), 70, dtype=torch.int32),
                                        block_table=torch.zeros(b, 3, dtype=torch.int32), causal=True)
        (name, p) = fake_launches[-1]
        assert (p.batch, p.seqlen_q, p.total_q, p.total_k) == (b, sq, b * sq, b * 3 * 64)


@pytest.mark.parametrize("kind", ["dense", "varlen"])
def test_a_gradients_alignment_is_part_of_the_backward_plan(fake_launches, kind):
    """dout of one layout, first 2 bytes off the 16-byte alignment (copied), then aligned (read
    where it lies): the second launch reads it with its own strides, not the copy's."""
    buf = torch.zeros(64, 2, 264, dtype=BF) if kind == "varlen" else torch.zeros(1, 64, 2, 264, dtype=BF)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    for off in (1, 0):
        q = torch.zeros(buf.shape[:-1] + (128,), dtype=BF, requires_grad=True)
        out = (varlen.flash_attn_varlen_func(q, q, q, cu, cu, 34, 34, causal=True) if kind == "varlen"
               else ops.flash_attn_func(q, q, q))
        dout = buf[..., off:off + 128]
        out.backward(dout)
        (_, p) = fake_launches[-1]
        if off == 0:
            assert p.dout == dout.data_ptr() and p.do_row_stride == 2 * 264 and p.do_head_stride == 264
        else:
            assert p.dout != dout.data_ptr() and p.do_row_stride == 2 * 128


def test_kvcache_scale_given_as_a_tensor_is_keyed_by_value(fake_launches, monkeypatch):
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))
    calls = []
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: calls.append(p))
    q = torch.zeros(2, 1, 8, 128, dtype=BF)
    kc = torch.zeros(2, 256, 2, 128, dtype=BF)
    for s in (0.5, 0.125):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100, softmax_scale=torch.tensor(s))
    assert [p.softmax_scale for p in calls] == [0.5, 0.125]


@pytest.mark.parametrize("dtype", [BF, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_a_tensor_scale_changed_in_place_is_read_again(fake_launches, dtype):
    q = torch.zeros(1, 128, 2, 128).to(dtype)
    s = torch.tensor(0.5)
    for value in (0.5, 0.125):
        s.fill_(value)
        ops.flash_attn_func(q, q, q, s, causal=dtype != BF)  # the fake library's keys
    assert [p.softmax_scale for _, p in fake_launches] == [0.5, 0.125]


def test_kvcache_plan_is_per_library(fake_launches, tmp_path, monkeypatch):
    """A decode call planned under a library with decode kernels, then the same call under one
    without (FA3GEN_LIB changed): the second is checked again and refused, not launched."""
    from fa3gen import runtime
    from fa3gen.errors import VariantNotBuiltError
    from tests.test_runtime_errors import build_fake_lib

    with_decode = runtime.get_library()
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(
        contract.DECODE_PAIRS if runtime.get_library() is with_decode else ()))
    calls = []
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: calls.append(p))
    q, kc = torch.zeros(2, 1, 8, 128, dtype=BF), torch.zeros(2, 256, 2, 128, dtype=BF)
    kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100)
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("FA3GEN_LIB", str(build_fake_lib(other)))
    with pytest.raises(VariantNotBuiltError, match="decode over a KV cache"):
        kvcache.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=100)
    assert len(calls) == 1


@pytest.mark.parametrize("kind", ["dense", "varlen", "e4m3"])
def test_a_plan_launches_on_its_own_library(fake_launches, tmp_path, monkeypatch, kind):
    """A call planned under one library, repeated (the plan reused), then repeated after
    FA3GEN_LIB names another: that launch goes to the new library, planned again."""
    from fa3gen import runtime
    from tests.test_runtime_errors import build_fake_lib

    libs = []
    monkeypatch.setattr(ops, "_launch", lambda lib, info, device, make: libs.append(lib))
    q = torch.zeros(1, 64, 2, 128, dtype=BF)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    call = {"dense": lambda: ops.flash_attn_func(q, q, q),
            "varlen": lambda: varlen.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 34, 34,
                                                            causal=True),
            "e4m3": lambda: ops.flash_attn_func(*[q.to(torch.float8_e4m3fn)] * 3, causal=True),
            }[kind]
    first = runtime.get_library()
    call()
    call()
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("FA3GEN_LIB", str(build_fake_lib(other)))
    call()
    assert libs[0] is libs[1] is first and libs[2] is runtime.get_library() is not first
