"""Decode bandwidth against a device-to-device copy (issue 17: >= 80% of the copy's bandwidth
when at least 64 MB of K and V are read), sustained:
    python3 tests/gpu/bench_kvcache.py
seqlen_q 1 and 4, heads_q 32 over heads_kv 8, d128, bf16, contiguous and paged (64-row pages)
caches; bytes = K and V rows read + q + out. Not a pytest module."""
import torch

from fa3gen import kvcache, timing


def main():
    hq, hkv, d = 32, 8, 128
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(big)
    copy_ms = timing.sustained_ms([lambda: other.copy_(big)], 3, 100)[0]
    copy_gbs = 2 * big.numel() / copy_ms / 1e6
    print(f"device copy: {copy_gbs:.0f} GB/s")
    del big, other
    for sq in (1, 4):
        rows = sq * hq // hkv
        if rows > kvcache.MAX_ROWS:
            print(f"seqlen_q {sq}: {rows} rows per kv head, above the kernels' {kvcache.MAX_ROWS}")
            continue
        for b, n in ((1, 131072), (8, 32768), (64, 4096), (256, 1024)):
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            pages = kc.reshape(b * n // 64, 64, hkv, d)
            vpages = vc.reshape(b * n // 64, 64, hkv, d)
            table = torch.arange(b * n // 64, device="cuda", dtype=torch.int32).reshape(b, -1)
            fns = [lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n),
                   lambda: kvcache.flash_attn_with_kvcache(q, pages, vpages, cache_seqlens=n,
                                                           block_table=table)]
            ms = timing.sustained_ms(fns, 3, 100)
            moved = 2 * kc.numel() * 2 + 2 * q.numel() * 2
            gbs = [moved / m / 1e6 for m in ms]
            print(f"sq={sq} b={b} n={n} ({moved / 1e6:.0f} MB): contiguous {ms[0] * 1e3:.0f} us "
                  f"{gbs[0]:.0f} GB/s ({gbs[0] / copy_gbs:.0%}), paged {ms[1] * 1e3:.0f} us "
                  f"{gbs[1]:.0f} GB/s ({gbs[1] / copy_gbs:.0%})")


if __name__ == "__main__":
    main()
