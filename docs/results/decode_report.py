"""The decode table and plot of docs/BENCHMARKS.md from docs/results/decode.json (written by
tests/gpu/bench_kvcache.py, its runs merged: a case's newest run wins): prints the markdown table, writes decode.png.
    python3 docs/results/decode_report.py"""
import json
from pathlib import Path

HERE = Path(__file__).parent


def _key(r):
    return r["seqlen_q"], r["heads_kv"], r["batch"], r["cache_len"]


def main():
    data = json.loads((HERE / "decode.json").read_text())
    runs = data["runs"]
    # The full grid is run 2's; runs after it re-measured some cases, with every peer in the
    # process (run 3, FA4 included) or fa3gen alone (run 4); run 1 holds FA4 for the others.
    # GPU times come from a case's newest run, eager times from its newest run with cuDNN in
    # the same process.
    newest, eager = {}, {}
    for number, run in enumerate(runs, 1):
        if number >= 2:
            for r in run["rows"]:
                newest[_key(r)] = (number, r, run["copy_gbs"])
                if "cudnn" in r["us"]:
                    eager[_key(r)] = (number, r)
    fa4 = {_key(r): r["us"] for r in runs[0]["rows"]}
    roof = runs[1]["copy_gbs"]
    print("| seqlen_q | kv heads | batch | cache | MB | fa3gen GPU us (contig / paged) | % of copy | "
          "fa3gen eager us | cuDNN eager us | FA4 eager us (contig / paged) | run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for key in [_key(r) for r in runs[1]["rows"]]:
        number, r, copy_gbs = newest[key]
        eager_number, eager_row = eager[key]
        r = dict(r, us=eager_row["us"], gbs=eager_row["gbs"])
        rows.append(r)
        g, e = r["graph_us"], r["us"]
        p = e if "fa4" in e else fa4.get(key, {})
        pct = (f"{r['graph_gbs']['fa3gen'] / copy_gbs:.0%} / "
               f"{r['graph_gbs']['fa3gen_paged'] / copy_gbs:.0%}")
        peer = f"{p['fa4']:.0f} / {p['fa4_paged']:.0f}" if "fa4" in p else "n/a"
        print(f"| {r['seqlen_q']} | {r['heads_kv']} | {r['batch']} | {r['cache_len'] // 1024}k | "
              f"{r['mb_moved']} | {g['fa3gen']:.0f} / {g['fa3gen_paged']:.0f} | {pct} | "
              f"{e['fa3gen']:.0f} | {e.get('cudnn', float('nan')):.0f} | {peer} | "
              f"{number}{'' if eager_number == number else f' (eager: {eager_number})'}"
              f"{'' if 'fa4' in e else ' (FA4: 1)'} |")
    merged = {"rows": rows}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    fa4_rows = [dict(r, us=r["us"] if "fa4" in r["us"] else fa4.get(_key(r), {})) for r in rows]
    series = [("fa3gen, contiguous (graph replay)", merged, "graph_us", "fa3gen", "o"),
              ("fa3gen, paged 64 (graph replay)", merged, "graph_us", "fa3gen_paged", "s"),
              ("cuDNN SDPA, contiguous (eager)", merged, "us", "cudnn", "^"),
              ("FA4, paged 64 (eager)", {"rows": fa4_rows}, "us", "fa4_paged", "v")]
    for label, run, field, name, marker in series:
        pts = [(r["mb_moved"], r["mb_moved"] / r[field][name] * 1e3) for r in run["rows"]
               if name in r.get(field, {})]
        ax.scatter(*zip(*pts), label=label, marker=marker, s=22, alpha=0.8)
    ax.axhline(roof, color="k", linestyle="--", linewidth=1)
    ax.text(2, roof * 1.02, f"device-to-device copy: {roof} GB/s", fontsize=8)
    ax.axhline(0.8 * roof, color="gray", linestyle=":", linewidth=1)
    ax.text(2, 0.8 * roof * 1.02, "80% of copy (issue 17's target)", fontsize=8, color="gray")
    ax.axvline(64, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("MB of K, V, q and out moved per call")
    ax.set_ylabel("GB/s")
    ax.set_title("Decode over a KV cache, H200, bf16, d128, 32 query heads")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(HERE / "decode.png", dpi=110)


if __name__ == "__main__":
    main()
