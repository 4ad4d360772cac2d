"""Chunked prefill against a KV cache (issue 17: within 5% of fa3gen's dense forward rate at the
same sizes), sustained, one process:
    python3 tests/gpu/bench_chunked_prefill.py [--out chunked_prefill.json]
A chunk of seqlen_q new query rows (bf16, d128, 32 query heads over 8 kv heads, batch 1,
causal: bottom-right aligned) attends to a cache of seqlen_k keys. "dense": flash_attn_func on
plain (1, seqlen_k, 8, 128) K and V (the dense rate). Then flash_attn_with_kvcache on a
contiguous cache with room for 4096 more keys, cache_seqlens given as an int (flash_attn_func
on a view of the cache) and as a tensor (the varlen forward over the cache rows); on a paged
cache (--page rows, 64 by default, pages shuffled) and on the contiguous cache with
cache_batch_idx, both through the paged varlen forward (the latter one page a cache row). Each
runs again with the paged variants hidden ("before": the path taken before them: a gathered
copy after a sync for the paged cache; the length and row read on the host, two syncs, and a
view for cache_batch_idx; the int and tensor calls take the same path twice, a control of
what the bench's order alone moves: a call timed after a slow or syncing, low-power one runs
with the power cap's headroom, hence a 200 ms settle of each call before its timed batch and a
shuffled order; "dense_again", the dense call placed after a fast one, is another control;
each call's mean board power and SM clock, from nvidia-smi, are printed and kept). TFLOP/s
count the visible (query, key) pairs (bench.causal_pairs: seqlen_q * (seqlen_k - seqlen_q) +
seqlen_q (seqlen_q + 1) / 2 while seqlen_q <= seqlen_k).
Not a pytest module."""
import argparse
import json
import sys

import torch

import fa3gen
from fa3gen import bench, kvcache, runtime, timing, varlen

HQ, HKV, D, ROOM = 32, 8, 128, 4096


CALLS = ("cache_int", "cache_tensor", "paged", "batch_idx")
LABELS = {"cache_int": "cache, int", "cache_tensor": "cache, tensor", "paged": "paged",
          "batch_idx": "cache_batch_idx"}


def before(call):
    """call() with the library's paged variants hidden: flash_attn_with_kvcache takes the path
    it took before them (a view, the varlen forward over the cache rows, or a gathered copy)."""
    real = varlen.paged_variant
    varlen.paged_variant = lambda *a, **kw: None
    try:
        return call()
    finally:
        varlen.paged_variant = real


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--seqlens-q", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--seqlens-k", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-ms", type=float, default=60)
    ap.add_argument("--page", type=int, default=64)
    # Some calls sync (the "before" paths), so the board idles between their launches; a call
    # timed after one starts with the power cap's headroom for longer than sustained_ms's
    # default settle (30 ms here) covers: dense read 667 after one and 619 after a fast call.
    bench.add_settle_arguments(ap, settle_ms=200.0, order="shuffle")
    args = ap.parse_args()
    dt, rows, PAGE = torch.bfloat16, [], args.page
    print("| seqlen_q | seqlen_k | dense | " + " | ".join(f"{LABELS[c]} (before)" for c in CALLS)
          + " | " + " | ".join(f"{LABELS[c]} / dense" for c in CALLS) + " |")
    print("|---" * (3 + 2 * len(CALLS)) + "|")
    # Each call's mean board power and SM clock (inert without nvidia-smi).
    with timing.PowerSampler(torch.cuda.current_device()) as sampler:
        for sk in args.seqlens_k:
            for sq in args.seqlens_q:
                g = torch.Generator(device="cuda").manual_seed(sq + sk)
                q = torch.randn(1, sq, HQ, D, device="cuda", dtype=dt, generator=g)
                kc = torch.randn(1, sk + ROOM, HKV, D, device="cuda", dtype=dt, generator=g)
                vc = torch.randn(1, sk + ROOM, HKV, D, device="cuda", dtype=dt, generator=g)
                k, v = kc[:, :sk].contiguous(), vc[:, :sk].contiguous()
                n_pages = -(-(sk + ROOM) // PAGE)
                order = torch.randperm(n_pages, device="cuda", generator=g)
                kp = torch.zeros(n_pages, PAGE, HKV, D, device="cuda", dtype=dt)
                vp = torch.zeros_like(kp)
                kp[order] = kc[0].reshape(n_pages, PAGE, HKV, D)
                vp[order] = vc[0].reshape(n_pages, PAGE, HKV, D)
                table = order.to(torch.int32).reshape(1, -1)
                lengths = torch.full((1,), sk, dtype=torch.int32, device="cuda")
                idx = torch.zeros(1, dtype=torch.int32, device="cuda")
                calls = {
                    "cache_int": lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk, causal=True),
                    "cache_tensor": lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths,
                                                                            causal=True),
                    "paged": lambda: kvcache.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lengths,
                                                                     block_table=table, causal=True),
                    "batch_idx": lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths,
                                                                         cache_batch_idx=idx, causal=True),
                }
                fns = {"dense": lambda: fa3gen.flash_attn_func(q, k, v, causal=True)}
                for name, call in calls.items():
                    fns[name] = call
                    fns[name + "_before"] = lambda call=call: before(call)
                    if name == "cache_int":  # a control: dense again, placed after a fast call
                        fns["dense_again"] = fns["dense"]
                ref = fns["dense"]()
                for name, fn in fns.items():  # every path computes the same thing
                    err = (fn().float() - ref.float()).abs().max().item()
                    if err > 2e-2:
                        print(f"{name}: differs from dense by {err}", file=sys.stderr)
                        return 1
                sampler.reset()
                ms = timing.sustained_ms(list(fns.values()), args.rounds, args.min_ms, tag=sampler.tag,
                                        settle_ms=args.settle_ms, order=args.order)
                power = sampler.means(range(len(fns)))
                pairs = bench.causal_pairs(sq, sk)
                tf = {name: 4.0 * HQ * D * pairs / (m * 1e-3) / 1e12 for name, m in zip(fns, ms)}
                row = {"seqlen_q": sq, "seqlen_k": sk, "ms": dict(zip(fns, ms)), "tflops": tf,
                       "power_w_sm_mhz": {name: power[i] for i, name in enumerate(fns)}}
                rows.append(row)
                print(f"| {sq} | {sk} | {tf['dense']:.0f} | "
                      + " | ".join(f"{tf[c]:.0f} ({tf[c + '_before']:.0f})" for c in CALLS) + " | "
                      + " | ".join(f"{tf[c] / tf['dense']:.2f} ({tf[c + '_before'] / tf['dense']:.2f})"
                                   for c in CALLS) + " |", flush=True)
                print(f"  dense again: {tf['dense_again']:.0f}", flush=True)
                print("  mean SM MHz: " + ", ".join(f"{name} {mhz:.0f}" for name, (_, mhz) in
                                                   row["power_w_sm_mhz"].items() if mhz), flush=True)
                del kc, vc, k, v, kp, vp
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": bench.provenance(runtime.get_library()), "dtype": "bf16", "heads_q": HQ, "heads_kv": HKV,
                       "head_dim": D, "page_size": PAGE, "causal": True, "rows": rows,
                       "timing": {"rounds": args.rounds, "min_ms": args.min_ms, "settle_ms": args.settle_ms,
                                  "order": args.order}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
