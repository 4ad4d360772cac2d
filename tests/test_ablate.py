"""`fa3gen ablate` without a GPU: the spec's matrix, rows, knob effects, paper table, rendering,
the per-cell driver (a wrong cell is never timed) and the CLI options."""
import csv
import io
import json
from pathlib import Path

import pytest

from fa3gen import ablate as A
from fa3gen import cli
from generator.build import plan
from fa3gen.contract import parse_name

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(A.ABLATION_SHAPE)


def cell(name):
    return parse_name(name)  # a Variant has the fields of a runtime VariantInfo


def row(name, tflops=None, status="ok", shape=SHAPE, **res):
    """A row of cell `name` timed at `tflops` (None: not timed)."""
    c = cell(name)
    ms = None
    if tflops is not None:
        flops = A.attention_flops(shape["batch"], shape["heads"], shape["seqlen"],
                                  shape["seqlen"], shape["head_dim"], c.causal)
        ms = flops / (tflops * 1e12) * 1e3
    return A.make_row(c, shape, status, ms, 1e-3 if status == "ok" else 0.5, None, res)


def name(dtype="fp16", causal=False, tile=(128, 128), stages=2, ws=1, pp=1, ov=1):
    return (f"fwd_{dtype}_d128_{'causal' if causal else 'nocausal'}_m{tile[0]}n{tile[1]}_"
            f"s{stages}_ws{ws}_pp{pp}_ov{ov}")


# ---- the spec ---------------------------------------------------------------------------------


def test_spec_matrix_and_pruned_reasons():
    p = plan(REPO_ROOT / "specs/ablation.yaml")
    kept = {v.name for v in p.variants}
    pruned = {x.variant.name: (x.constraint, x.reason) for x in p.enumeration.pruned}
    assert len(kept) == 70 and len(pruned) == 42
    assert not p.defaults or not p.spec.dispatch_required
    for dtype in ("fp16", "bf16"):
        for tile in ((128, 128), (128, 176)):
            for stages in (1, 2, 3):
                for ws in (0, 1):
                    for pp in (0, 1):
                        for ov in (0, 1):
                            n = name(dtype, False, tile, stages, ws, pp, ov)
                            if tile == (128, 176) and stages == 3:
                                assert pruned[n][0] == "smem_budget"
                            elif pp and not ws:
                                c, why = pruned[n]
                                assert c == "pingpong_needs_two_consumers"
                                assert "warp specialization" in why
                            else:
                                assert n in kept
    fp8 = {n for n in kept if "_e4m3_" in n}
    assert fp8 == {f"fwd_e4m3_d128_nocausal_m128n128_s2_ws1_pp{pp}_ov{ov}" for pp in (0, 1)
                   for ov in (0, 1)}
    assert {c for n, (c, _) in pruned.items() if "_e4m3_" in n} == {"fp8_scope"}
    causal = {n for n in kept if "_causal_" in n}
    assert causal == {name("fp16", True, ws=ws, pp=pp, ov=ov) for ws in (0, 1) for pp in (0, 1)
                      for ov in (0, 1) if ws or not pp}
    # The paper's three rows and the unreported one are cells of the matrix.
    for ws, pp, ov in ((1, 1, 1), (1, 1, 0), (0, 0, 1), (0, 0, 0)):
        assert name(ws=ws, pp=pp, ov=ov) in kept


def test_list_explain_shows_the_pruned(capsys):
    assert cli.main(["list", "--spec", str(REPO_ROOT / "specs/ablation.yaml"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert f"- {name(ws=0, pp=1, ov=0)}  pruned by pingpong_needs_two_consumers: pingpong " \
           "needs warp specialization" in out
    assert f"- {name(tile=(128, 176), stages=3)}  pruned by smem_budget" in out


# ---- rows -------------------------------------------------------------------------------------


def test_paper_row_labels():
    assert A.paper_row(True, True, True) == "full"
    assert A.paper_row(True, True, False) == "no_overlap"
    assert A.paper_row(False, False, True) == "no_ws"
    assert A.paper_row(False, False, False) == "both_off"
    assert A.paper_row(True, False, True) is None and A.paper_row(True, False, False) is None
    assert row(name(ws=0, pp=0, ov=1), 500)["paper_row"] == "no_ws"
    assert row(name(ws=1, pp=0, ov=1), 500)["paper_row"] is None


def test_make_row_fields():
    r = row(name(tile=(128, 176), stages=3, ws=1, pp=0, ov=1), 600, registers=168,
            spill_bytes=0, smem_bytes=200000, compile_s=50.0)
    assert r["tflops"] == pytest.approx(600)
    assert r["ms"] == pytest.approx(4 * 4 * 16 * 8448**2 * 128 / 600e12 * 1e3)
    assert (r["tile_m"], r["tile_n"], r["stages"], r["ws"], r["pp"], r["ov"]) == \
        (128, 176, 3, True, False, True)
    assert (r["batch"], r["seqlen"], r["heads"], r["head_dim"]) == (4, 8448, 16, 128)
    assert r["registers"] == 168 and r["compile_s"] == 50.0
    assert set(A.CSV_COLUMNS) <= set(r)
    wrong = row(name(), None, status="wrong")
    assert wrong["ms"] is None and wrong["tflops"] is None and wrong["registers"] is None


def test_ratio_to_best_is_per_dtype_causal_shape():
    small = {"batch": 2, "seqlen": 1024, "heads": 16, "head_dim": 128}
    rows = [row(name("fp16", stages=1), 400), row(name("fp16", stages=2), 500),
            row(name("bf16", stages=2), 250), row(name("fp16", True), 300),
            row(name("fp16", stages=1), 100, shape=small), row(name("fp16"), 200, shape=small),
            row(name("fp16", stages=3), None, status="wrong")]
    A.add_ratio_to_best(rows)
    assert [r["ratio_to_best"] for r in rows] == [pytest.approx(0.8), 1.0, 1.0, 1.0,
                                                  pytest.approx(0.5), 1.0, None]


def test_resources_from_manifest(tmp_path):
    from fa3gen.contract import library_manifest
    assert A.resources_of(library_manifest(tmp_path / "none" / "lib" / "lib.so") or {}) == {}
    m = {"variants": [
        {"name": "a", "smem_bytes_estimate": 1000,
         "resources": {"registers": 168, "spill_stores": 8, "spill_loads": 8,
                       "smem_static": 24, "compile_seconds": 51.5}},
        {"name": "b", "smem_bytes_estimate": 2000, "resources": None}]}
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    res = A.resources_of(library_manifest(tmp_path / "lib" / "lib.so") or {})
    assert res["a"] == {"registers": 168, "spill_bytes": 8, "smem_bytes": 1024, "compile_s": 51.5}
    assert res["b"] == {"registers": None, "spill_bytes": None, "smem_bytes": 2000,
                        "compile_s": None}


# ---- knob effects and the paper table ---------------------------------------------------------


def test_knob_effects_median_over_matched_pairs():
    rows = [
        # ws pairs (pp0): ov0 400->440 (1.1), ov1 450->540 (1.2); stages 1 has no ws partner.
        row(name(ws=0, pp=0, ov=0), 400), row(name(ws=1, pp=0, ov=0), 440),
        row(name(ws=0, pp=0, ov=1), 450), row(name(ws=1, pp=0, ov=1), 540),
        row(name(ws=1, pp=0, ov=1, stages=1), 270),
        # pingpong: 540 -> 594 (1.1); its ws0 partner cannot exist (pruned).
        row(name(ws=1, pp=1, ov=1), 594),
        # a wrong cell pairs with nothing.
        row(name(ws=1, pp=1, ov=0), None, status="wrong"),
        # another group is never paired with this one.
        row(name("bf16", ws=0, pp=0, ov=0), 100),
    ]
    eff = A.knob_effects(rows)
    get = {(e["dtype"], e["label"], e["given"]): e for e in eff}
    ws = get[("fp16", "warp specialization", None)]
    assert ws["pairs"] == 2 and ws["median"] == pytest.approx(1.15)
    assert ws["min"] == pytest.approx(1.1) and ws["max"] == pytest.approx(1.2)
    assert get[("fp16", "warp specialization", "ov=0")]["median"] == pytest.approx(1.1)
    assert get[("fp16", "warp specialization", "ov=1")]["median"] == pytest.approx(1.2)
    ov = get[("fp16", "GEMM-softmax overlap", None)]
    assert ov["pairs"] == 2 and ov["median"] == pytest.approx((450 / 400 + 540 / 440) / 2)
    pp = get[("fp16", "pingpong", None)]
    assert pp["pairs"] == 1 and pp["median"] == pytest.approx(1.1)
    # pp=1 implies ws=1: "pingpong given ws=1" would repeat the unconditional row.
    assert ("fp16", "pingpong", "ws=1") not in get
    st = get[("fp16", "stages 1→2", None)]
    assert st["pairs"] == 1 and st["median"] == pytest.approx(2.0)
    assert get[("fp16", "stages 2→3", None)]["pairs"] == 0
    assert get[("fp16", "stages 2→3", None)]["median"] is None
    assert get[("bf16", "warp specialization", None)]["pairs"] == 0


def test_paper_table_best_cell_per_row():
    rows = [row(name(stages=2), 600), row(name(stages=3, ws=1, pp=1, ov=1), 620),
            row(name(ws=1, pp=1, ov=0, tile=(128, 176)), 558),
            row(name(ws=0, pp=0, ov=1), 527), row(name(ws=0, pp=0, ov=0), None, status="wrong"),
            row(name("bf16"), 900), row(name(causal=True), 900)]
    t = {p["paper_row"]: p for p in A.paper_table(rows)}
    assert list(t) == ["full", "no_overlap", "no_ws", "both_off"]
    assert t["full"]["tflops"] == pytest.approx(620) and "s3" in t["full"]["variant"]
    assert t["no_overlap"]["ratio_to_full"] == pytest.approx(558 / 620)
    assert t["no_ws"]["paper_h100_tflops"] == 570
    assert t["no_ws"]["paper_ratio_to_full"] == pytest.approx(570 / 661)
    assert t["both_off"]["tflops"] is None and t["both_off"]["paper_h100_tflops"] is None


# ---- rendering --------------------------------------------------------------------------------


def fabricated_report():
    rows = [row(name(ws=1, pp=1, ov=1), 620, registers=168, spill_bytes=0, smem_bytes=230400,
                compile_s=50.0),
            row(name(ws=1, pp=1, ov=0), 560), row(name(ws=0, pp=0, ov=1), 540),
            row(name(ws=0, pp=0, ov=0), 500), row(name(ws=1, pp=0, ov=1), 600),
            row(name(stages=1), None, status="wrong"),
            row(name("bf16"), 610), row(name("fp16", True), 580)]
    rows[5]["detail"] = "max |out - ref| = 0.5 > tolerance 0.002"
    p = plan(REPO_ROOT / "specs/ablation.yaml")
    pruned = [A.pruned_entry(x) for x in p.enumeration.pruned]
    header = {"gpu": "NVIDIA H200", "commit": "abc123", "date": "2026-12-01 00:00 UTC",
              "torch": "2.11", "cuda": "13.0", "library": "generated/ablation/lib/x.so",
              "command": "fa3gen ablate --spec specs/ablation.yaml", "warmup": 5, "iters": 30,
              "check": "batch 2"}
    return A.make_report(header, rows, pruned)


def test_csv_and_json(tmp_path):
    rep = fabricated_report()
    A.write_csv(rep["rows"], tmp_path / "r/ablation.csv")
    got = list(csv.DictReader(io.StringIO((tmp_path / "r/ablation.csv").read_text())))
    assert tuple(got[0]) == A.CSV_COLUMNS and len(got) == len(rep["rows"])
    assert got[0]["ws"] == "1" and got[0]["causal"] == "0" and got[0]["paper_row"] == "full"
    assert float(got[0]["tflops"]) == pytest.approx(620) and got[0]["registers"] == "168"
    assert float(got[0]["ratio_to_best"]) == 1.0
    assert got[5]["status"] == "wrong" and got[5]["ms"] == "" and "tolerance" in got[5]["detail"]
    A.write_json(rep, tmp_path / "r/ablation.json")
    back = json.loads((tmp_path / "r/ablation.json").read_text())
    assert back == rep and {"rows", "pruned", "knob_effects", "paper_table"} <= set(back)
    assert {p["constraint"] for p in back["pruned"]} == {"smem_budget",
                                                         "pingpong_needs_two_consumers", "fp8_scope"}


def test_markdown_block_and_markers(tmp_path):
    rep = fabricated_report()
    block = A.render_markdown(rep)
    assert block.startswith(A.BEGIN) and block.rstrip().endswith(A.END)
    assert "NVIDIA H200" in block and "abc123" in block
    assert "`fa3gen ablate --spec specs/ablation.yaml`" in block
    # Paper table: ours next to the paper's H100 numbers.
    assert "| full (WS + overlap) | 620 | 1.000 | 661 | 1.000 |" in block
    assert "| no warp specialization | 540 | 0.871 | 570 | 0.862 |" in block
    assert "| both off (not in the paper) | 500 |" in block and "| — | — |" in block
    assert "### What each mechanism gains" in block and "| warp specialization | all |" in block
    # Full table: sorted by dtype, causal, TFLOP/s (bf16 first, wrong last in its group).
    body = block[block.index("### All cells"):]
    assert body.index("| bf16 |") < body.index("| fp16 | False |") < body.index("| fp16 | True |")
    assert body.index("| 620 |") < body.index("| 600 |") < body.index("**wrong**")
    assert "| 168 | 0 | 225.0 | 50 |" in body
    assert "by `smem_budget`" in block and "by `pingpong_needs_two_consumers`" in block

    doc = tmp_path / "ABLATION.md"
    doc.write_text(f"# Ablation\n\nHand intro.\n\n{A.BEGIN}\nSTALE BLOCK\n{A.END}\n\n"
                   "## Analysis\n\nMine.\n")
    A.update_markdown(doc, block, A.BEGIN, A.END)
    text = doc.read_text()
    assert "Hand intro." in text and "Mine." in text and "STALE BLOCK" not in text
    assert text.count(A.BEGIN) == 1
    A.update_markdown(doc, block, A.BEGIN, A.END)
    assert doc.read_text() == text


def test_repo_doc_has_markers():
    text = (REPO_ROOT / "docs/ABLATION.md").read_text()
    assert text.count(A.BEGIN) == 1 and text.count(A.END) == 1


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    A.plot(fabricated_report(), tmp_path / "ablation.png")
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the per-cell driver ----------------------------------------------------------------------


def test_wrong_or_broken_cells_are_not_timed():
    cells = [cell(name(ws=1)), cell(name(ws=0, pp=0)), cell(name(stages=1)),
             cell(name(stages=3))]
    wrong, broken, slow = cells[1].name, cells[2].name, cells[3].name
    timed = []

    def check(c):
        if c.name == wrong:
            return {"status": "wrong", "max_err": 0.5, "detail": "max |out - ref| = 0.5"}
        if c.name == broken:
            raise RuntimeError("CUDA error: an illegal memory access")
        return {"status": "ok", "max_err": 1e-3, "detail": None}

    def time(c, shape):
        timed.append((c.name, shape["seqlen"]))
        if c.name == slow:
            raise RuntimeError("launch failed")
        return 4.0

    other_d = {"batch": 1, "seqlen": 512, "heads": 8, "head_dim": 64}  # no cell has d=64
    logs = []
    rows = A.run_cells(cells, [SHAPE, other_d], check, time, {cells[0].name: {"registers": 1}},
                       log=logs.append)
    assert timed == [(cells[0].name, 8448), (slow, 8448)]
    by = {r["variant"]: r for r in rows}
    assert len(rows) == 4 and len(logs) == 4
    assert by[cells[0].name]["status"] == "ok" and by[cells[0].name]["ms"] == 4.0
    assert by[cells[0].name]["registers"] == 1
    assert by[wrong]["status"] == "wrong" and by[wrong]["max_err"] == 0.5
    assert by[wrong]["ms"] is None and by[wrong]["tflops"] is None
    assert by[broken]["status"] == "error" and "illegal memory access" in by[broken]["detail"]
    assert by[slow]["status"] == "error" and "launch failed" in by[slow]["detail"]
    assert all("ms_batches" not in r for r in rows)  # a single number per cell: no batches


def test_batched_timings_give_the_median_and_are_kept():
    c = cell(name(ws=1))
    ok = lambda c_: {"status": "ok", "max_err": 1e-3, "detail": None}  # noqa: E731
    rows = A.run_cells([c], [SHAPE], ok, lambda c_, s: [5.0, 3.0, 4.0], log=lambda m: None)
    assert rows[0]["ms"] == 4.0 and rows[0]["ms_batches"] == [5.0, 3.0, 4.0]


def test_sustained_batches_carry_their_clock_and_power(monkeypatch):
    """With a sampler, each timed batch is tagged: the row keeps the SM clock and board power of
    every batch beside its time (a slow batch at a low clock is the board, not the kernel)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(A, "random_inputs", lambda shape, dtype, n: [None] * n)
    # two calibration batches, the untimed lead-in (min_ms / 2 = 50 launches of 1 ms), then
    # three timed ones
    times = iter([1.0, 1.0, 50.0, 5.0, 7.0, 5.0])
    launched = []
    monkeypatch.setattr(A, "batch_ms", lambda fn, launches: launched.append(launches) or next(times))

    class Sampler:
        def __init__(self):
            self.tags, self.resets = [], 0

        def reset(self):
            self.resets += 1

        def tag(self, i):
            self.tags.append(i)

        def means(self, tags):
            return {t: (600.0 + t, [1980.0, 990.0, 1980.0][t]) for t in tags}

        def reasons(self, tags):
            return {t: [[], ["sw_thermal"], ["sw_power_cap"]][t] for t in tags}

    sampler = Sampler()
    got = A.make_timer(5, 30, 100.0, sampler)(cell(name(ws=1)), SHAPE)
    assert got == {"ms": [5.0, 7.0, 5.0], "sm_mhz": [1980.0, 990.0, 1980.0],
                   "power_w": [600.0, 601.0, 602.0],
                   "clock_reasons": [[], ["sw_thermal"], ["sw_power_cap"]]}
    assert sampler.tags == [0, None, 1, None, 2, None] and sampler.resets == 1
    assert launched == [3, 5, 50, 100, 100, 100]
    ok = lambda c_: {"status": "ok", "max_err": 1e-3, "detail": None}  # noqa: E731
    row, = A.run_cells([cell(name(ws=1))], [SHAPE], ok, lambda c_, s: got, log=lambda m: None)
    assert row["ms"] == 5.0 and row["ms_batches"] == [5.0, 7.0, 5.0]
    assert row["sm_mhz_batches"] == [1980.0, 990.0, 1980.0] and row["power_w_batches"][1] == 601.0
    assert row["clock_reasons_batches"][1] == ["sw_thermal"]
    # the report's board line: ranges, and which reason held back how many batches
    assert A.clock_summary([row]) == ("Board: SM clock 990-1980 MHz, power 600-602 W over the timed "
                                      "batches; clock-event reasons over 3 batches: sw_thermal in 1, "
                                      "sw_power_cap in 1.")
    assert "Board: SM clock 990-1980 MHz" in A.render_markdown(
        {"header": {}, "rows": [row], "pruned": [], "knob_effects": [], "paper_table": []})
    old = dict(row, clock_reasons_batches=None)  # a run from before the reasons were sampled
    assert A.clock_summary([old]).endswith("clock-event reasons not recorded.")
    assert A.clock_summary([dict(row, sm_mhz_batches=None)]) is None


# ---- CLI --------------------------------------------------------------------------------------


def test_cli_options():
    ap = cli.build_parser()
    a = ap.parse_args(["ablate"])
    assert a.func is A.run and a.shape is None and not a.no_build
    from generator.paths import resolve_spec_path
    assert resolve_spec_path(a.spec) == REPO_ROOT / "specs/ablation.yaml"
    assert a.out_dir == REPO_ROOT / "docs/results" and a.doc == REPO_ROOT / "docs/ABLATION.md"
    a = ap.parse_args(["ablate", "--shape", "4,8448,16,128", "--shape", "2,1024,8,64",
                       "--only", "*fp16*", "--exclude", "*s1_*", "-j", "3", "--no-build",
                       "--warmup", "1", "--iters", "2"])
    assert a.shape == [SHAPE, {"batch": 2, "seqlen": 1024, "heads": 8, "head_dim": 64}]
    assert a.only == ["*fp16*"] and a.exclude == ["*s1_*"] and a.jobs == 3 and a.no_build
    assert (a.warmup, a.iters) == (1, 2)


@pytest.mark.parametrize("bad", ["4,8448,16", "4,8448,16,x", "0,8448,16,128", "4,8448,16,128,1"])
def test_cli_rejects_bad_shapes(bad, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["ablate", "--shape", bad])
    assert "--shape" in capsys.readouterr().err


def test_ablate_without_gpu_fails_before_building(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr("generator.build.build", lambda *a, **k: called.append(a))
    assert cli.main(["ablate", "--only", "*fp16*"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not called


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """The GPU parts of run() faked: a library of the ablation spec whose manifest has one
    cell's resources, every cell checked right but name(stages=1); returns make_timer's calls."""
    torch = pytest.importorskip("torch")
    from fa3gen import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: the power sampler stays inert
    lib_dir = tmp_path / "gen/ablation/lib"
    lib_dir.mkdir(parents=True)
    manifest = {"variants": [{"name": name(), "smem_bytes_estimate": 230400,
                              "resources": {"registers": 168, "spill_stores": 0,
                                            "compile_seconds": 50.0}}]}
    (tmp_path / "gen/ablation/manifest.json").write_text(json.dumps(manifest))

    class FakeLib:
        path = lib_dir / "libfa3gen_ablation.so"

    monkeypatch.setattr(runtime, "use_spec", lambda spec: FakeLib())
    monkeypatch.setattr(A, "provenance", lambda lib: {"gpu": "fake", "command": "fa3gen ablate"})
    bad = name(stages=1)
    monkeypatch.setattr(A, "check_cell", lambda lib, c: (
        {"status": "wrong", "max_err": 0.5, "detail": "bad"} if c.name == bad
        else {"status": "ok", "max_err": 1e-3, "detail": None}))
    timers = []
    monkeypatch.setattr(A, "make_timer", lambda warmup, iters, min_ms, sampler: timers.append(
        (min_ms, type(sampler).__name__)) or (lambda c, s: 4.0))
    return timers


def test_run_glue_writes_every_output(fake_gpu, tmp_path, capsys):
    """run() end to end with the GPU parts faked: build args, outputs, exit status."""
    timers = fake_gpu
    built = []
    args = cli.build_parser().parse_args([
        "ablate", "--only", "*fp16*nocausal*m128n128_s[12]*", "--exclude", "*ws0_pp0_ov0",
        "-j", "2", "--define", "FA3GEN_FWD_NO_CLUSTER2",
        "--out-dir", str(tmp_path / "out"), "--doc", str(tmp_path / "A.md")])
    assert A.run(args, build_fn=lambda *a, **k: built.append((a, k))) == 1  # one wrong cell
    assert built == [((args.spec,), {"only": args.only, "exclude": args.exclude, "jobs": 2,
                                     "defines": ["FA3GEN_FWD_NO_CLUSTER2"]})]
    rep = json.loads((tmp_path / "out/ablation.json").read_text())
    assert len(rep["rows"]) == 10 and {r["status"] for r in rep["rows"]} == {"ok", "wrong"}
    assert next(r for r in rep["rows"] if r["variant"] == name())["registers"] == 168
    assert all("fp16_d128_nocausal_m128n128_s" in p["variant"] for p in rep["pruned"])
    assert (tmp_path / "out/ablation.csv").exists() and (tmp_path / "out/ablation.png").exists()
    text = (tmp_path / "A.md").read_text()
    assert A.BEGIN in text and "each at least 100 ms of back-to-back launches (sustained" in text
    assert timers == [(100.0, "PowerSampler")] and rep["header"]["min_ms"] == 100.0  # sustained unless --burst
    assert "wrong" in capsys.readouterr().out


@pytest.mark.parametrize("burst", [False, True])
def test_the_header_records_only_the_timing_the_run_used(fake_gpu, tmp_path, burst):
    """A sustained run's header gave --warmup 5 and --iters 30, which it never used."""
    args = cli.build_parser().parse_args(
        ["ablate", "--only", "*fp16*nocausal*m128n128_s2*", "--out-dir", str(tmp_path / "out"),
         "--doc", str(tmp_path / "A.md")] + (["--burst", "--warmup", "2", "--iters", "7"] if burst else []))
    A.run(args, build_fn=lambda *a, **k: None)
    header = json.loads((tmp_path / "out/ablation.json").read_text())["header"]
    used = {"warmup": 2, "iters": 7, "min_ms": None} if burst else \
        {"warmup": None, "iters": None, "min_ms": 100.0}
    assert {k: header[k] for k in used} == used


def test_shapes_that_fit_no_cell_are_refused_before_the_build(fake_gpu, tmp_path, monkeypatch, capsys):
    """A --shape of a head dim no cell has: it built and checked every cell, then wrote reports
    of 0 timed cells and exited 0."""
    monkeypatch.setattr("generator.build.build", lambda *a, **k: pytest.fail("built"))
    monkeypatch.setattr(A, "check_cell", lambda *a: pytest.fail("checked"))
    assert cli.main(["ablate", "--no-power", "--shape", "4,8448,16,64", "--shape", "2,1024,8,96",
                     "--out-dir", str(tmp_path / "out"), "--doc", str(tmp_path / "A.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no cell has the head dim of any --shape" in err
    assert "4,8448,16,64, 2,1024,8,96" in err and "head dims: 128" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "A.md").exists()


def test_jobs_need_the_build(fake_gpu, monkeypatch, capsys):
    """-j with --no-build was taken and ignored (nothing compiles), as --define is refused."""
    monkeypatch.setattr(A, "check_cell", lambda *a: pytest.fail("checked"))
    assert cli.main(["ablate", "--no-build", "-j", "64", "--only", "*fp16*_causal*"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-j/--jobs" in err and "--no-build" in err


def test_a_define_needs_the_build(monkeypatch):
    """--define changes the compiled cells, so with --no-build (the library as it was built) it
    is one clear error, not a report that claims a define its library never had."""
    torch = pytest.importorskip("torch")
    from fa3gen.errors import Fa3genError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = cli.build_parser().parse_args(["ablate", "--no-build", "--define", "FA3GEN_FWD_NO_CLUSTER2"])
    with pytest.raises(Fa3genError, match="--define .*--no-build"):
        A.run(args, build_fn=lambda *a, **k: pytest.fail("built"))


@pytest.mark.parametrize("argv, message", [
    (["--burst", "--min-ms", "50"], "--min-ms is for the sustained timing, which --burst replaces"),
    (["--warmup", "2"], "--warmup is for --burst's timing, which this run does not use"),
    (["--iters", "9"], "--iters is for --burst's timing"),
    (["--doc", "folder"], "--doc 'folder' is a folder: give a file path"),
    (["--doc", "marked.md"], "marked.md: expected one <!-- ablation:begin --> before one"),
    (["--out-dir", "afile/out"], "--out-dir afile/out: afile is a file, not a folder"),
])
def test_options_the_run_would_ignore_or_cannot_write_are_refused_first(
        fake_gpu, tmp_path, monkeypatch, capsys, argv, message):
    """As bench's: a timing option the timing does not use was taken silently, and an output
    that cannot be written failed after the whole matrix."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "marked.md").write_text(A.END + "\n" + A.BEGIN + "\n")
    monkeypatch.setattr("generator.build.build", lambda *a, **k: pytest.fail("built"))
    monkeypatch.setattr(A, "check_cell", lambda *a: pytest.fail("checked"))
    base = ["ablate", "--no-power", "--only", "*fp16*nocausal*m128n128_s2*", "--out-dir", "out",
            "--doc", "A.md"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fa3gen: error: ") and message in err and err.count("\n") == 1
