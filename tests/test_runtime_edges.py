"""fa3gen.runtime's edges that a mutation audit found unpinned (41 of 54 mutants passed the
CPU suite): dispatch by seqlen range keeping the feature axes, named variants matched whole
and against the whole key, which library get_library answers after use_spec or an env change,
the optional quantizer and decode entry points, and odd build info."""
import ctypes

import pytest

from fa3gen import contract, runtime
from fa3gen.contract import make_key, parse_name
from fa3gen.errors import AbiMismatchError, Fa3genError, VariantNotBuiltError
from tests.test_contract import _c_row
from tests.test_runtime_errors import (FAKE_LIB_C, FILTERED_INFO, TABLE, build_fake_lib,  # noqa: F401
                                       clean_runtime)  # clean_runtime: a fixture


KEY = make_key("fwd", "bf16", 128, False)
OTHER = "fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0"


@pytest.fixture


def lib(tmp_path):
    return runtime.Library(build_fake_lib(tmp_path))


def ranged(lib, rows):
    lib.seqlen_dispatch = runtime._seqlen_dispatch({"seqlen_dispatch": rows}, lib._by_name)


def test_a_row_of_unknown_direction_is_an_error():
    c = _c_row(parse_name("fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0"), "x")
    c.direction = b"sideways"
    with pytest.raises(Fa3genError, match="unknown direction 'sideways'"):
        runtime._variant_from_c(c, "row 0")


def test_only_default_rows_are_defaults(lib):
    assert [v.is_default for v in lib.variants] == [True, False, True, True, True, True, True, True]


def test_a_variant_name_matches_whole():
    with pytest.raises(VariantNotBuiltError):
        runtime.select_variant(TABLE, "fwd", "bf16", 64, False, "fwd_bf16_d64")


def test_a_named_variant_must_serve_the_whole_key(lib):
    with pytest.raises(Fa3genError, match="serves"):
        lib.find("fwd", "bf16", 128, True, "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1")


def test_the_build_hint_without_filters():
    with pytest.raises(VariantNotBuiltError, match="add head_dim: 64"):
        runtime.select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100",
                               build_info={"spec_keys": [["fwd", "fp16", 64, False]]})


def test_the_build_hint_survives_a_bad_spec_key():
    with pytest.raises(VariantNotBuiltError, match="add head_dim: 64"):
        runtime.select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100",
                               build_info={**FILTERED_INFO, "spec_keys": [["fwd", "fp16", "x", False]]})


def test_two_libraries_keep_their_own_error_messages(tmp_path):
    runtime.Library(build_fake_lib(tmp_path, name="a"))  # loaded first: its symbols must not serve b
    b = runtime.Library(build_fake_lib(tmp_path, name="b"))
    p = runtime.FwdParams(batch=13)
    with pytest.raises(Fa3genError, match="unlucky batch"):
        b.launch(b.variants[0], p, 0)


def test_an_older_abi_is_refused(tmp_path):
    with pytest.raises(AbiMismatchError):
        runtime.Library(build_fake_lib(tmp_path, abi=runtime.ABI_VERSION - 1))


QD = r"""
fa3gen_quantize_params fake_q; fa3gen_decode_params fake_d; void* fake_s;
int fa3gen_quantize_fp8(const fa3gen_quantize_params* p, void* s) { fake_q = *p; fake_s = s; return 0; }
int fa3gen_decode_fwd(const fa3gen_decode_params* p, void* s) { fake_d = *p; fake_s = s; return 3; }
"""


def test_quantizer_and_decode_entry_points_get_their_params_and_stream(tmp_path):
    src = FAKE_LIB_C.replace('\\"fingerprint\\": \\"x\\"', '\\"decode\\": true') + QD
    lib = runtime.Library(build_fake_lib(tmp_path, source=src, name="qd"))
    assert lib.has_quantizer and lib.decode_kernels == frozenset(contract.DECODE_PAIRS)
    f = runtime.QuantizeParams._fields_[0][0]
    qp = runtime.QuantizeParams(**{f: 1234})
    lib.quantize_fp8(qp, 0xAB0)
    assert getattr(runtime.QuantizeParams.in_dll(lib._dll, "fake_q"), f) == 1234
    assert ctypes.c_void_p.in_dll(lib._dll, "fake_s").value == 0xAB0
    with pytest.raises(Fa3genError, match=r"decode kernel failed \(code 3\)"):
        lib.decode(runtime.DecodeParams(), 0)


def test_decode_claimed_without_its_symbol_is_not_served(tmp_path):
    src = FAKE_LIB_C.replace('\\"fingerprint\\": \\"x\\"', '\\"decode\\": true')
    lib = runtime.Library(build_fake_lib(tmp_path, source=src, name="nod"))
    assert lib.decode_kernels == frozenset()


def test_a_null_variant_row_is_an_error(tmp_path):
    src = FAKE_LIB_C.replace("return COUNT; }", "return COUNT + 1; }")
    with pytest.raises(Fa3genError, match="returned NULL"):
        runtime.Library(build_fake_lib(tmp_path, source=src, name="null"))


def test_names_defaults_and_dispatched_cover_every_direction(lib):
    assert lib.names() == [v.name for v in lib.variants]
    assert len(lib.defaults()) == 7 and len(lib.dispatched()) == 7


def test_dispatched_lists_a_range_variant_once(lib):
    ranged(lib, [[*KEY, 0, 100, OTHER], [*KEY, 200, 300, OTHER]])
    assert [v.name for v in lib.dispatched("fwd")].count(OTHER) == 1


def test_a_bad_name_is_refused_within_a_seqlen_range(lib):
    ranged(lib, [[*KEY, 0, 100, OTHER]])
    with pytest.raises(VariantNotBuiltError):
        lib.find("fwd", "bf16", 128, False, "fwd_bogus", seqlen_k=64)


def test_a_seqlen_range_keeps_the_feature_axes(lib):
    ranged(lib, [[*KEY, 0, 100, OTHER]])
    assert lib.find("fwd", "bf16", 128, False, local=True, softcap=True, seqlen_k=64) is lib.variants[3]
    with pytest.raises(VariantNotBuiltError):
        lib.find("fwd", "bf16", 128, False, varlen=True, seqlen_k=64)


def test_a_missing_variant_names_the_library(lib):
    with pytest.raises(VariantNotBuiltError, match=f"in {lib.path}"):
        lib.find("fwd", "fp16", 128, False)


def test_a_variant_of_another_library_is_not_launched(lib, tmp_path):
    other = runtime.Library(build_fake_lib(tmp_path, name="other"))
    with pytest.raises(Fa3genError, match="has no launcher"):
        lib.launch(other.variants[0], runtime.FwdParams(), 0)


def test_malformed_seqlen_rows_are_skipped():
    assert runtime._seqlen_dispatch({"seqlen_dispatch": [[1, 2], [*KEY, "x", 5, OTHER]]}, {}) == {}


def test_odd_build_info_is_kept_not_fatal():
    assert runtime._parse_build_info(b"not json") == {"raw": "not json"}
    assert runtime._parse_build_info(b"[1]") == {"value": [1]}


def test_an_empty_fa3gen_lib_means_unset(clean_runtime, monkeypatch):
    monkeypatch.setenv("FA3GEN_LIB", "")
    assert runtime.resolve_library() == (clean_runtime / "h100/lib/libfa3gen_h100.so", "h100")


def test_a_yml_spec_path_names_its_library(clean_runtime):
    assert runtime.resolve_library("specs/tiny.yml")[0] == clean_runtime / "tiny/lib/libfa3gen_tiny.so"


def test_a_spec_file_names_its_library_by_its_name_key(clean_runtime, tmp_path):
    y = tmp_path / "x.yaml"
    y.write_text("name: other\n")
    assert runtime.resolve_library(y) == (clean_runtime / "other/lib/libfa3gen_other.so", "other")


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8: \x80", b"name: [unclosed\n"])
def test_an_unreadable_spec_file_names_its_library_by_its_stem(clean_runtime, tmp_path, content):
    y = tmp_path / "weird.yaml"
    y.write_bytes(content)  # not UTF-8 (raised UnicodeDecodeError) or not YAML
    assert runtime.resolve_library(y) == (clean_runtime / "weird/lib/libfa3gen_weird.so", "weird")


class FakeLibrary:
    """Stands in for Library: get_library's choice of path is what these tests look at."""

    def __init__(self, path, spec_name, spec_file=None):
        self.path = path


def test_a_spec_file_is_served_only_by_a_build_of_its_bytes(clean_runtime, tmp_path, monkeypatch,
                                                           capsys):
    """get_library(FILE) loaded generated/<name>/'s library whatever file had built it: another
    spec file with the same name (other variants), or this one before an edit (fa3gen tune)."""
    import json

    monkeypatch.setattr(runtime, "Library", FakeLibrary)
    built, other = tmp_path / "a" / "s.yaml", tmp_path / "b" / "s.yaml"
    for f, text in ((built, "name: same\n# a\n"), (other, "name: same\n# b\n")):
        f.parent.mkdir()
        f.write_text(text)
    manifest = contract.manifest_path("same")
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"spec_path": str(built.resolve()),
                                    "spec_sha256": contract.spec_sha256(built)}))
    assert runtime.get_library(str(built)).path == contract.library_path("same")
    assert capsys.readouterr().err == ""
    with pytest.raises(Fa3genError, match=rf"the build of spec 'same' was made from {built}, "
                                          rf"another spec file .*fa3gen build --spec {other}"):
        runtime.get_library(str(other))
    with pytest.raises(Fa3genError, match="another spec file"):  # refused on every request
        runtime.get_library(str(other))
    other.write_text(built.read_text())  # the same bytes elsewhere: the same spec
    runtime.get_library(str(other))
    built.write_text("name: same\n# tuned\n")
    runtime._requests.clear()  # as a new process (one answers a request once)
    runtime._relative_requests.clear()
    runtime._checked_spec_files.clear()
    runtime.get_library(str(built))
    assert f"{built} changed since the build of spec 'same'" in capsys.readouterr().err
    runtime.use_spec(str(built))  # use_spec, then a call's lookup: warned once a process
    runtime.get_library()
    assert capsys.readouterr().err == ""
    runtime.use_spec(None)
    # a checkout moved, then edited: the recorded file is gone, so this is the file edited
    moved = tmp_path / "moved" / "s.yaml"
    moved.parent.mkdir()
    moved.write_text("name: same\n# moved and tuned\n")
    built.unlink()
    runtime.get_library(str(moved))
    assert f"{moved} changed since the build" in capsys.readouterr().err
    assert runtime.get_library("same").path == contract.library_path("same")  # by name: as built


def test_use_spec_and_its_reset_change_what_get_library_answers(clean_runtime, monkeypatch):
    monkeypatch.setattr(runtime, "Library", FakeLibrary)
    a, b = clean_runtime / "libfa3gen_a.so", clean_runtime / "libfa3gen_b.so"
    a.write_bytes(b"")
    b.write_bytes(b"")
    monkeypatch.setenv("FA3GEN_LIB", str(a))
    assert runtime.get_library().path == a
    runtime.use_spec(str(b))
    assert runtime.get_library().path == b
    runtime.use_spec(None)
    assert runtime.get_library().path == a


def test_a_changed_generated_root_is_followed(clean_runtime, monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "Library", FakeLibrary)
    for d in ("g1", "g2"):
        p = tmp_path / d / "h100/lib"
        p.mkdir(parents=True)
        (p / "libfa3gen_h100.so").write_bytes(b"")
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "g1"))
    assert runtime.get_library().path.parts[-4] == "g1"
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path / "g2"))
    assert runtime.get_library().path.parts[-4] == "g2"


def test_one_file_by_two_paths_loads_once(clean_runtime, monkeypatch):
    monkeypatch.setattr(runtime, "Library", FakeLibrary)
    a = clean_runtime / "libfa3gen_a.so"
    a.write_bytes(b"")
    (clean_runtime / "link.so").symlink_to(a)
    assert runtime.get_library(str(a)) is runtime.get_library(str(clean_runtime / "link.so"))


def test_a_library_notes_its_range_defaults_for_traces(tmp_path, monkeypatch):
    """Loading a library registers the seqlen_k ranges of its range defaults (not of a key's
    default, which serves every other length) for fa3gen.tracing to record."""
    from fa3gen import tracing

    monkeypatch.setattr(tracing, "_dispatch_ranges", {})
    default = "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"
    rows = f'[[\\"fwd\\", \\"bf16\\", 128, false, 0, 1500, \\"{OTHER}\\"], ' \
           f'[\\"fwd\\", \\"bf16\\", 128, false, 9000, 9999, \\"{default}\\"]]'
    info = '"{\\"spec\\": \\"fake\\", \\"fingerprint\\": \\"x\\"}"'
    assert info in FAKE_LIB_C
    source = FAKE_LIB_C.replace(info, '"{\\"spec\\": \\"fake\\", \\"fingerprint\\": \\"x\\", '
                                      f'\\"seqlen_dispatch\\": {rows}}}"')
    lib = runtime.Library(build_fake_lib(tmp_path, source=source, name="ranges"))
    assert [(lo, hi, v.name) for lo, hi, v in lib.seqlen_dispatch[KEY]] == \
        [(0, 1500, OTHER), (9000, 9999, default)]
    assert tracing._dispatch_ranges[OTHER] == ((0, 1500),)
    assert tracing._dispatch_ranges[default] == ()  # a key's default: no range, even with a row
    assert {n for n, r in tracing._dispatch_ranges.items() if r} == {OTHER}
