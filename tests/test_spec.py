"""Spec loading and validation (generator/spec.py)."""
import textwrap

import pytest

from fa3gen.contract import KEY_AXES
from generator.errors import SpecError
from generator.paths import SPECS_DIR
from generator.spec import load_spec, parse_spec

FULL_AXES = """\
axes:
  direction: fwd
  dtype: bf16
  head_dim: 128
  causal: false
  tile: [128, 128]
  stages: 2
  warp_specialized: true
  pingpong: false
  intra_wg_overlap: false
"""


def write(tmp_path, text, name="s.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def error_of(tmp_path, text) -> str:
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    msg = str(ei.value)
    assert str(p) in msg, msg  # every error names the file
    return msg


def test_minimal_spec_single_group(tmp_path):
    spec = load_spec(write(tmp_path, FULL_AXES, "mini.yaml"))
    assert spec.name == "mini"  # defaults to the file stem
    assert len(spec.groups) == 1
    g = spec.groups[0]
    assert g.values("tile") == ((128, 128),)
    assert g.values("causal") == (False,)
    assert spec.dispatch_required is True


def test_groups_merge_top_level_and_lists(tmp_path):
    spec = load_spec(write(tmp_path, """\
        name: x
        axes: {direction: fwd, stages: 2, warp_specialized: true, pingpong: false,
               intra_wg_overlap: false, causal: false}
        groups:
          - name: a
            axes: {dtype: [bf16, fp16], head_dim: 128, tile: [[128, 128], [128, 176]],
                   causal: [false, true]}
          - axes: {dtype: bf16, head_dim: 64, tile: [192, 128], stages: [1, 2, 2]}
        """))
    a, b = spec.groups
    assert a.name == "a" and b.name == "groups[1]"
    assert a.values("causal") == (False, True)  # group overrides top level
    assert a.values("tile") == ((128, 128), (128, 176))
    assert b.values("causal") == (False,)       # inherited
    assert b.values("stages") == (1, 2)         # duplicates dropped


def test_shipped_specs_load():
    for name in ("tiny", "h100", "ablation"):
        spec = load_spec(SPECS_DIR / f"{name}.yaml")
        assert spec.name == name
    assert load_spec(SPECS_DIR / "ablation.yaml").dispatch_required is False


def test_unknown_top_level_key_suggests(tmp_path):
    msg = error_of(tmp_path, "nmae: x\n" + FULL_AXES)
    assert "nmae" in msg and "did you mean 'name'" in msg


def test_unknown_axis_key_suggests_with_path(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("groups", "") + """\
groups:
  - name: g
    axes:
      tyle: [128, 128]
""")
    assert "groups[0].axes.tyle" in msg and "did you mean 'tile'" in msg


def test_bad_bool_type(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("causal: false", 'causal: "yes"'))
    assert "axes.causal" in msg and '"yes"' in msg and "true or false" in msg


def test_bad_int_type(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("head_dim: 128", "head_dim: 12.5"))
    assert "axes.head_dim" in msg and "12.5" in msg


def test_bool_is_not_an_int(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("stages: 2", "stages: true"))
    assert "axes.stages" in msg and "true" in msg


def test_bad_choice(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("dtype: bf16", "dtype: fp32"))
    assert "axes.dtype" in msg and '"fp32"' in msg and "bf16" in msg


def test_bad_tile_in_group_list(tmp_path):
    text = FULL_AXES.replace("  tile: [128, 128]\n", "") + """\
groups:
  - name: a
    axes: {tile: [[128, 128]]}
  - name: b
    axes:
      tile: [[128], [128, 176]]
"""
    msg = error_of(tmp_path, text)
    assert "groups[1].axes.tile[0]" in msg and "[128]" in msg


def test_bad_single_tile(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("tile: [128, 128]", "tile: [128, 128, 64]"))
    assert "axes.tile" in msg and "[128, 128, 64]" in msg


def test_missing_axis(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("  stages: 2\n", ""))
    assert "axes.stages" in msg and "missing" in msg


def test_missing_axis_in_group(tmp_path):
    text = FULL_AXES.replace("  stages: 2\n", "") + """\
groups:
  - name: a
    axes: {stages: 2}
  - name: b
    axes: {head_dim: 64}
"""
    msg = error_of(tmp_path, text)
    assert "groups[1].axes.stages" in msg


def test_empty_list(tmp_path):
    msg = error_of(tmp_path, FULL_AXES.replace("dtype: bf16", "dtype: []"))
    assert "axes.dtype" in msg and "empty" in msg


def test_duplicate_yaml_key(tmp_path):
    msg = error_of(tmp_path, FULL_AXES + "  stages: 3\n")
    assert "duplicate key 'stages'" in msg


@pytest.mark.parametrize("spelling,yaml11", [("0100", 64), ("0x80", 128), ("12_8", 128),
                                              ("2:08", 128), ("0o200", None), ("0x_", ""),
                                              ("!!int ''", "")])
def test_integers_other_than_decimal_are_refused(tmp_path, spelling, yaml11):
    """YAML 1.1 reads 0100 as octal 64 (and hex, underscores, base 60): a spec meaning 100
    would build head dim 64. Decimal only; 0o200 (YAML 1.2's octal) stays a string, refused
    as one."""
    msg = error_of(tmp_path, FULL_AXES.replace("head_dim: 128", f"head_dim: {spelling}"))
    if yaml11 is None:
        assert "head_dim" in msg
    elif yaml11 == "":  # no digits: PyYAML's own reading raised (a traceback)
        assert "is not a decimal integer; write the number in decimal" in msg
    else:
        assert f"'{spelling}' is not a decimal integer (YAML 1.1 reads it as {yaml11})" in msg
    assert load_spec(write(tmp_path, FULL_AXES.replace("stages: 2", "stages: +2"))).groups


@pytest.mark.parametrize("name", ["v1.yaml", "v1.YML", "lib.so"])
def test_a_name_that_reads_as_a_file_is_refused(tmp_path, name):
    """`--spec v1.yaml` looks for that file, so such a build could not be named again."""
    msg = error_of(tmp_path, f"name: {name}\n" + FULL_AXES)
    assert "name" in msg and "does not end in .yaml, .yml or .so" in msg


def test_invalid_yaml(tmp_path):
    msg = error_of(tmp_path, "axes: [unclosed\n")
    assert "invalid YAML" in msg


def test_exclude_and_dispatch_parse(tmp_path):
    spec = load_spec(write(tmp_path, FULL_AXES + """\
exclude:
  - {head_dim: 128, tile: [128, 176]}
dispatch:
  - when: {head_dim: 128}
    use: {tile: [128, 128]}
dispatch_required: false
"""))
    assert spec.exclude[0].items == (("head_dim", (128,)), ("tile", ((128, 176),)))
    assert spec.exclude[0].where == "exclude[0]"
    e = spec.dispatch[0]
    assert e.where == "dispatch[0]" and e.when.items == (("head_dim", (128,)),)
    assert e.use.describe() == "{tile: [128, 128]}"
    assert spec.dispatch_required is False


def test_dispatch_knob_in_when_is_error(tmp_path):
    msg = error_of(tmp_path, FULL_AXES + """\
dispatch:
  - when: {tile: [128, 128]}
    use: {stages: 2}
""")
    assert "dispatch[0].when.tile" in msg and "use" in msg


def test_dispatch_key_in_use_is_error(tmp_path):
    msg = error_of(tmp_path, FULL_AXES + """\
dispatch:
  - when: {head_dim: 128}
    use: {causal: true}
""")
    assert "dispatch[0].use.causal" in msg


def test_dispatch_bad_value_path(tmp_path):
    msg = error_of(tmp_path, FULL_AXES + """\
dispatch:
  - when: {head_dim: 128}
    use: {pingpong: maybe}
""")
    assert "dispatch[0].use.pingpong" in msg and '"maybe"' in msg


def test_exclude_unknown_key(tmp_path):
    msg = error_of(tmp_path, FULL_AXES + "exclude:\n  - {head_dimm: 128}\n")
    assert "exclude[0].head_dimm" in msg and "head_dim" in msg


@pytest.mark.parametrize("text,got", [
    ("3\n", "got a scalar 3"),
    ("just text\n", 'got a scalar "just text"'),
    ("- {direction: fwd}\n", 'got a list [{"direction": "fwd"}]'),
])
def test_whole_spec_not_a_mapping(tmp_path, text, got):
    msg = error_of(tmp_path, text)
    assert msg.startswith(f"{tmp_path / 's.yaml'}: the spec must be a mapping with keys name, "
                          "axes, groups, exclude, dispatch, dispatch_required, decode (")
    assert msg.endswith(f"({got})") and ": :" not in msg


def test_repeated_value_is_used_once_with_a_warning(tmp_path):
    p = write(tmp_path, FULL_AXES.replace("dtype: bf16", "dtype: [bf16, fp16, bf16]")
              .replace("tile: [128, 128]", "tile: [[128, 128], [128, 176], [128, 176]]"))
    spec = load_spec(p)
    assert spec.groups[0].values("dtype") == ("bf16", "fp16")
    assert spec.groups[0].values("tile") == ((128, 128), (128, 176))
    assert spec.warnings == (
        f'{p}: axes.dtype[2]: "bf16" repeats axes.dtype[0]; the value is used once',
        f"{p}: axes.tile[2]: [128, 176] repeats axes.tile[1]; the value is used once")
    assert load_spec(write(tmp_path, FULL_AXES, "clean.yaml")).warnings == ()


def test_shipped_specs_have_no_warnings():
    for name in ("tiny", "h100", "ablation"):
        assert load_spec(SPECS_DIR / f"{name}.yaml").warnings == ()


def test_missing_file():
    with pytest.raises(SpecError, match="not found"):
        load_spec("/nonexistent/spec.yaml")


def test_parse_spec_from_text():
    spec = parse_spec(FULL_AXES, "inline.yaml", default_name="inline")
    assert spec.name == "inline" and spec.path == "inline.yaml"


def test_decode_key(tmp_path):
    """decode: true is every (dtype, head_dim) pair of the decode kernels, a list names some."""
    from fa3gen.contract import DECODE_PAIRS
    assert load_spec(SPECS_DIR / "h100.yaml").decode == DECODE_PAIRS
    assert load_spec(SPECS_DIR / "ablation.yaml").decode == ()
    axes = ("axes: {direction: fwd, dtype: bf16, head_dim: 64, causal: false, tile: [128, 128], "
            "stages: 2, warp_specialized: true, pingpong: false, intra_wg_overlap: false}\n")
    some = tmp_path / "some.yaml"
    some.write_text("name: some\ndecode: [[fp16, 64], [bf16, 128], [fp16, 64]]\n" + axes)
    loaded = load_spec(some)
    assert loaded.decode == (("bf16", 128), ("fp16", 64))  # one order, no repeats
    assert loaded.warnings == (f'{some}: decode[2]: ["fp16", 64] repeats decode[0]; the value '
                               'is used once',)
    some.write_text("name: some\ndecode: {dtype: bf16, head_dim: [64, 64]}\n" + axes)
    assert load_spec(some).warnings == (f"{some}: decode.head_dim[1]: 64 repeats "
                                        "decode.head_dim[0]; the value is used once",)
    for value, where in (("1", "decode"), ("[]", "decode"), ("[[bf16, 96]]", r"decode\[0\]"),
                         ("[bf16, 128]", r"decode\[0\]"), ("[[e4m3, 128]]", r"decode\[0\]")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"name: bad\ndecode: {value}\n" + axes)
        with pytest.raises(SpecError, match=where + r": expected true, false, axes \{dtype, head_dim\} "
                                                    r"or a list of \[dtype, head_dim\] pairs"):
            load_spec(bad)


def test_decode_axes(tmp_path):
    """decode: {dtype, head_dim} is the product of the two axes (an axis left out: all of its
    values); any other axis, or a value without a kernel, is an error naming the axis."""
    axes = ("axes: {direction: fwd, dtype: bf16, head_dim: 64, causal: false, tile: [128, 128], "
            "stages: 2, warp_specialized: true, pingpong: false, intra_wg_overlap: false}\n")
    from fa3gen.contract import DECODE_PAIRS
    spec = tmp_path / "s.yaml"
    for value, pairs in (("{dtype: [bf16, fp16], head_dim: [64, 128, 256]}", "all"),
                         ("{dtype: fp16, head_dim: [256, 64]}", (("fp16", 64), ("fp16", 256))),
                         ("{head_dim: 128}", (("bf16", 128), ("fp16", 128))),
                         ("{dtype: bf16}", (("bf16", 64), ("bf16", 128), ("bf16", 256)))):
        spec.write_text(f"name: s\ndecode: {value}\n" + axes)
        assert load_spec(spec).decode == (DECODE_PAIRS if pairs == "all" else pairs), value
    for value, match in (("{kv_layout: [dense, paged]}", r"decode\.kv_layout: unknown decode axis: the "
                                                          r"decode axes are dtype and head_dim"),
                         ("{head_dim: 96}", r"decode\.head_dim: expected one of 64, 128, 256, got 96"),
                         ("{dtype: e4m3}", r"decode\.dtype: expected one of bf16, fp16, got"),
                         ("{dtype: []}", r"decode\.dtype: expected a value or a non-empty list")):
        spec.write_text(f"name: s\ndecode: {value}\n" + axes)
        with pytest.raises(SpecError, match=match):
            load_spec(spec)


def test_specs_that_expand_or_nest_without_bound_are_errors_quickly():
    """A 400-byte file of YAML aliases took seconds and a GB to render its error; 500 levels
    of lists raised RecursionError."""
    import time

    levels = ["&a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 8)]
    start = time.monotonic()
    with pytest.raises(SpecError) as e:
        parse_spec("name: [" + ", ".join(levels) + "]\n")
    assert time.monotonic() - start < 2 and len(str(e.value)) < 1000
    with pytest.raises(SpecError, match="nested too deeply"):
        parse_spec("axes: {head_dim: " + "[" * 600 + "1" + "]" * 600 + "}\n")


BASE = textwrap.dedent("""\
    axes: {direction: fwd, dtype: bf16, head_dim: 128, causal: false, stages: 2,
           warp_specialized: true, pingpong: true, intra_wg_overlap: true,
           tile: [[128, 128], [128, 176]]}
""")


def test_a_null_seqlen_k_is_an_error_not_every_length():
    text = BASE + "dispatch:\n  - {when: {head_dim: 128}, seqlen_k: , use: {tile: [128, 128]}}\n"
    with pytest.raises(SpecError, match="seqlen_k: expected \\[lo, hi\\]"):
        parse_spec(text)


def test_a_varlen_keys_range_resolves_like_a_padded_one():
    """A varlen key's seqlen_k range (the runtime reads it as max_seqlen_k) resolves to its
    variant (the generator refused it before)."""
    from generator.variants import enumerate_variants, resolve_dispatch, resolve_seqlen_dispatch

    spec = parse_spec(BASE.replace("causal: false,", "causal: false, varlen: true,") + (
        "dispatch:\n  - {when: {varlen: true}, use: {tile: [128, 176]}}\n"
        "  - {when: {varlen: true}, seqlen_k: [0, 1536], use: {tile: [128, 128]}}\n"))
    kept = enumerate_variants(spec).kept
    [(key, [(lo, hi, v)])] = resolve_seqlen_dispatch(spec, kept, resolve_dispatch(spec, kept)).items()
    assert dict(zip(KEY_AXES, key))["varlen"] and (lo, hi) == (0, 1536)
    assert v.name == "fwd_bf16_d128_nocausal_varlen_m128n128_s2_ws1_pp1_ov1"
