"""The FP8 emulation and the numerics study on CPU: the Hadamard transform, incoherent
processing, e4m3 quantization scales, and `fa3gen numerics` writing its report."""
import json

import pytest
import torch

from fa3gen import cli, numerics
from fa3gen.reference import (attention_reference, fp8_attention_emulated, hadamard_transform,
                              quantize_e4m3, random_signs)


def test_hadamard_is_the_orthonormal_sylvester_matrix():
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 64:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert torch.allclose(hadamard_transform(x), x @ h / 8, atol=1e-12)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-12)  # H H = I
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_transform(torch.zeros(2, 96))


def test_incoherent_processing_keeps_the_scores():
    q, k = torch.randn(33, 128, dtype=torch.float64), torch.randn(40, 128, dtype=torch.float64)
    s = random_signs(128, seed=3).double()
    assert set(s.tolist()) == {-1.0, 1.0}
    qm, km = hadamard_transform(q * s), hadamard_transform(k * s)
    assert torch.allclose(qm @ km.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-10)


def test_e4m3_scales_per_tensor_and_per_block():
    x = torch.randn(2, 300, 3, 64)
    x[1, 250, 2, 7] = 100.0  # one outlier, in block 1 of batch 1, head 2
    vals, scale = quantize_e4m3(x)
    assert vals.dtype == torch.float8_e4m3fn and scale.shape == (1, 1, 1, 1)
    assert float(vals.float().abs().max()) == 448.0
    vals_b, scale_b = quantize_e4m3(x, block_rows=128)
    assert scale_b.shape == (2, 300, 3, 1)
    assert float(scale_b[1, 250, 2, 0]) == pytest.approx(100.0 / 448)
    assert float(scale_b[1, 10, 2, 0]) < 10.0 / 448  # other blocks keep their own range
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 away from the subnormals
    big = x.abs() > 0.5
    err = ((vals_b.float() * scale_b - x).abs() / x.abs())[big]
    assert float(err.max()) <= 2 ** -4 + 1e-6


def test_fp8_emulation_is_close_without_outliers_and_exact_in_the_limit():
    q, k, v = (torch.randn(1, 300, 2, 64, dtype=torch.float64) for _ in range(3))
    ref, _ = attention_reference(q, k, v, upcast=False)
    out = fp8_attention_emulated(q.float(), k.float(), v.float(), block_q=128, block_k=128,
                                 hadamard=True, out_dtype=torch.float64)
    err = float(((out - ref) ** 2).mean().sqrt())
    assert 1e-4 < err < 3e-2  # fp8 error: present, and bounded
    # A single key: softmax is 1 whatever the scores, so only V's quantization remains.
    one = fp8_attention_emulated(q.float(), k[:, :1].float(), v[:, :1].float(),
                                 out_dtype=torch.float64)
    vals, scale = quantize_e4m3(v[:, :1].float())
    assert torch.allclose(one, (vals.float() * scale).double().expand_as(one), atol=1e-6)


def test_numerics_command_writes_every_row(tmp_path, capsys):
    out, doc = tmp_path / "n.json", tmp_path / "NUMERICS.md"
    assert cli.main(["numerics", "--shape", "1,256,2,64", "--device", "cpu", "--out", str(out),
                     "--doc", str(doc)]) == 0
    report = json.loads(out.read_text())
    r = report["results"][0]
    assert r["shape"] == [1, 256, 2, 64]
    assert set(r["rmse"]) == {"standard_fp16", "flash_fp16", "flash_bf16", "fp8_per_tensor",
                              "fp8_block", "fp8_hadamard", "fp8_block_hadamard"}
    assert all(0 < e < 1 for e in r["rmse"].values())
    assert r["rmse"]["flash_fp16"] < r["rmse"]["fp8_block_hadamard"] < r["rmse"]["fp8_per_tensor"]
    text = doc.read_text()
    assert "| fp8, block quantization + incoherent processing, emulated | 9.1e-03 |" in text
    assert "fa3gen kernel, bf16 | - | not measured: needs a GPU" in text
    # A second run replaces its table (between the markers), hand-written text stays.
    doc.write_text("Prose above.\n\n" + text)
    assert cli.main(["numerics", "--shape", "1,256,2,64", "--device", "cpu", "--out", str(out),
                     "--doc", str(doc)]) == 0
    again = doc.read_text()
    assert again.startswith("Prose above.") and again.count("| row | paper |") == 1
    with pytest.raises(SystemExit):
        cli.main(["numerics", "--shape", "1,256,2,96"])  # not a power of two


def test_cudnn_fp8_row_falls_back_to_e4m3_output_and_scales_it_back(monkeypatch):
    """cudnn_fp8_row asks cuDNN for bf16 output first; where that graph does not build it takes
    e4m3 output scaled by 448 / max|V| and divides the scale back out. cuDNN itself is faked
    here (it runs on the GPU only): the fake's e4m3 output is V's first row times o_scale."""
    from fa3gen import bench

    q, k, v = numerics.paper_inputs((1, 16, 2, 64), 0)
    calls = []

    def fake_graph(q8, k8, v8, causal, descales, p_scale, out_bf16, o_scale):
        calls.append((out_bf16, p_scale, o_scale))
        if out_bf16:
            raise RuntimeError("no bf16 output for fp8 SDPA here")
        deq = v8.float() * descales["v_descale"]
        out = (deq[:, :1].expand_as(deq) * o_scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return (lambda: None), out
    monkeypatch.setattr(bench, "cudnn_fp8_graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    out, note = numerics.cudnn_fp8_row(q, k, v)
    assert [c[0] for c in calls] == [True, False] and calls[1][1] == 256.0
    assert note.startswith("e4m3 output")
    v8, vd = fp8_quantized_v(v)
    deq = v8.float() * vd
    assert calls[1][2] == pytest.approx(448.0 / float(deq.abs().max()), rel=1e-6)
    expect = deq[:, :1].expand_as(deq)
    assert torch.allclose(out, expect, rtol=2 ** -3, atol=0)   # e4m3 keeps 3 mantissa bits


def fp8_quantized_v(v):
    from fa3gen.fp8 import quantize_fp8

    _, _, v8, descales = quantize_fp8(v, v, v, block=False)
    return v8, descales["v_descale"]


def test_a_note_with_a_bar_stays_in_its_cell():
    """The cuDNN row's note says 'max|V|': unescaped, its bars split the row into extra cells."""
    import re

    report = {"device": "cpu", "seed": 0, "block_rows": 128, "p_scale": 256.0, "results": [
        {"shape": [1, 8, 1, 64], "rmse": {"fp8_per_tensor": 0.1},
         "notes": {"fp8_per_tensor": "scaled by 448 / max|V|"}, "not_measured": {}}]}
    rows = [ln for ln in numerics.render_markdown(report).splitlines() if ln.startswith("|")]
    cells = {len(re.split(r"(?<!\\)\|", ln)) for ln in rows}
    assert len(cells) == 1 and any("max\\|V\\|" in ln for ln in rows)


def test_report_markers_that_do_not_pair_are_an_error_not_a_guess(tmp_path):
    """A begin marker without its end once made the second run delete the text after it; two
    pairs kept one stale copy."""
    from fa3gen.bench import update_markdown
    from fa3gen.errors import Fa3genError

    begin, end = "<!-- x:begin -->", "<!-- x:end -->"
    doc = tmp_path / "doc.md"
    for text in (f"{begin}\nold\n\n## Hand notes\nkeep me\n",
                 f"{begin}\na\n{end}\n{begin}\nb\n{end}\n", f"{end}\n{begin}\n"):
        doc.write_text(text)
        with pytest.raises(Fa3genError, match="expected one"):
            update_markdown(doc, f"{begin}\nnew\n{end}\n", begin, end)
        assert doc.read_text() == text
    doc.write_text(f"# t\n\n{begin}\nold\n{end}\nafter\n")
    update_markdown(doc, f"{begin}\nnew\n{end}\n", begin, end)
    assert doc.read_text() == f"# t\n\n{begin}\nnew\n{end}\nafter\n"


def test_numerics_arguments_out_of_range_are_one_error(tmp_path, capsys, monkeypatch):
    """A seed torch cannot take, or a shape whose fp64 reference does not fit, was a traceback."""
    out = ["--out", str(tmp_path / "n.json"), "--doc", str(tmp_path / "n.md"), "--device", "cpu"]
    with pytest.raises(SystemExit):
        cli.main(["numerics", "--seed", str(2**64), *out])
    assert "a seed is in [0, 2^64)" in capsys.readouterr().err

    def no_memory(*a):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 7 bytes")
    monkeypatch.setattr(numerics, "study", no_memory)
    assert cli.main(["numerics", "--shape", "1,64,1,64", *out]) == 2
    assert "--shape too large" in capsys.readouterr().err
