"""CPU tests of the runtime half: input validation messages, library lookup errors, variant
selection, the reference's masking, and the pure parts of bench. No GPU, no built library."""

import ctypes
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fa3gen
from fa3gen import bench, contract, runtime
from fa3gen.errors import (
    Fa3genError,
    InvalidInputError,
    LibraryNotBuiltError,
    VariantNotBuiltError,
)
from fa3gen.ops import check_device, check_inputs, check_layout
from fa3gen.reference import attention_reference, causal_mask
from fa3gen.runtime import VariantInfo, select_variant
from fa3gen.contract import GRID_MODES, parse_name
from generator.paths import KERNELS_DIR


def qkv(b=2, sq=16, sk=16, hq=4, hkv=4, d=64, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(b, sq, hq, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device))


# ---- input validation ------------------------------------------------------------------------


def test_cpu_tensors_rejected_with_hint():
    q, k, v = qkv()
    with pytest.raises(Fa3genError, match="CUDA Hopper"):
        check_device(q, k, v)
    with pytest.raises(Fa3genError, match="q is on device 'cpu'"):
        fa3gen.flash_attn_func(q, k, v)


def test_bad_fp8_tensors_are_reported_before_a_missing_library(clean_runtime):
    """No library at all: an e4m3 call on CPU tensors says where the tensors are, as the 16-bit
    call does (the fp8 plan key's library lookup must not raise first)."""
    x = torch.zeros(1, 8, 2, 128).to(torch.float8_e4m3fn)
    with pytest.raises(Fa3genError, match="q is on device 'cpu'"):
        fa3gen.flash_attn_func(x, x, x)


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got NoneType"):
        check_inputs(q, None, v)


def test_dtype_mismatch_and_unsupported():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="one dtype.*k: torch.float16"):
        check_inputs(q, k.half(), v)
    with pytest.raises(InvalidInputError, match="unsupported dtype torch.float32"):
        check_inputs(q.float(), k.float(), v.float())


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"q must have 4 dims .* got shape \(2, 16, 256\)"):
        check_inputs(q.flatten(2), k, v)


def test_shape_mismatches():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="k and v must have the same shape"):
        check_inputs(q, k, v[:, :8])
    q2, _, _ = qkv(b=3)
    with pytest.raises(InvalidInputError, match="batch differs"):
        check_inputs(q2, k, v)
    q3, _, _ = qkv(d=128)
    with pytest.raises(InvalidInputError, match="head_dim differs"):
        check_inputs(q3, k, v)


def test_gqa_head_mismatch():
    q, k, v = qkv(hq=6, hkv=4)
    with pytest.raises(InvalidInputError, match=r"heads_q \(6\) must be a multiple of heads_kv"):
        check_inputs(q, k, v)
    dims = check_inputs(*qkv(hq=8, hkv=2, sq=5, sk=9))  # GQA is fine
    assert (dims.batch, dims.seqlen_q, dims.seqlen_k, dims.heads_q, dims.heads_kv,
            dims.head_dim, dims.dtype) == (2, 5, 9, 8, 2, 64, "bf16")
    assert check_inputs(*qkv(hq=8, hkv=1)).heads_kv == 1  # MQA


def test_bad_strides():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"q.stride\(-1\) is 2.*contiguous"):
        check_layout(q=q[..., ::2])  # head_dim stride 2
    # (b, s, h, d) made from a transposed (b, h, s, d) tensor is legal: strides stay 8-multiples
    check_layout(k=torch.randn(2, 4, 16, 64, dtype=torch.bfloat16).transpose(1, 2))
    # heads stride 60 elements: not a multiple of 8
    wide = torch.randn(2, 16, 4, 60, dtype=torch.bfloat16)[..., :56]
    with pytest.raises(InvalidInputError, match=r"v.stride\(2\) \(heads\) is 60.*v.contiguous\(\)"):
        check_layout(v=wide)
    flat = torch.randn(q.numel() + 1, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match="16-byte aligned"):
        check_layout(q=flat[1:].view(q.shape))


def test_size_one_dims_exempt_from_stride_rules():
    x = torch.randn(1, 1, 1, 64, dtype=torch.bfloat16)
    check_layout(q=x.as_strided(x.shape, (3, 5, 7, 1)))
    check_layout(q=torch.empty(2, 16, 4, 64, dtype=torch.bfloat16, device="meta"))


def test_size_one_dims_get_legal_strides():
    from fa3gen.ops import _strides

    x = torch.randn(1, 1, 1, 64, dtype=torch.bfloat16).as_strided((1, 1, 1, 64), (3, 5, 7, 1))
    assert all(s % 8 == 0 for s in _strides(x))
    y = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)
    assert _strides(y) == (16 * 4 * 64, 4 * 64, 64)


# ---- library location and variant lookup -----------------------------------------------------


@pytest.fixture
def clean_runtime(monkeypatch, tmp_path):
    monkeypatch.delenv("FA3GEN_LIB", raising=False)
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    monkeypatch.setattr(runtime, "_selected", None)
    monkeypatch.setattr(runtime, "_libraries", {})
    monkeypatch.setattr(runtime, "_requests", {})
    monkeypatch.setattr(runtime, "_relative_requests", {})
    monkeypatch.setattr(runtime, "_checked_spec_files", set())
    return tmp_path


def test_a_relative_path_is_looked_up_again_after_a_chdir(clean_runtime, monkeypatch):
    """get_library's per-request cache: a relative library path, spec file or FA3GEN_LIB
    names another file after os.chdir, and the answer follows it; absolute requests and bare
    spec names stay on the fast path (no getcwd)."""
    one, two = clean_runtime / "one", clean_runtime / "two"
    for d in (one, two):
        d.mkdir()
        build_fake_lib(d)
    name = build_fake_lib(one).name  # the same file name in both
    # (compare the objects, each loaded once per resolved file)
    monkeypatch.chdir(one)
    first = runtime.get_library(name)
    assert runtime._libraries[(one / name).resolve()] is first
    monkeypatch.chdir(two)
    assert first.path == one.absolute() / name  # made absolute when loaded: not two's file now
    second = runtime.get_library(name)
    assert second is not first and runtime._libraries[(two / name).resolve()] is second
    monkeypatch.setenv("FA3GEN_LIB", name)
    assert runtime.get_library() is second
    monkeypatch.chdir(one)
    assert runtime.get_library() is first
    monkeypatch.setenv("FA3GEN_LIB", str(two / name))
    lib = runtime.get_library()
    calls, real = [], os.getcwd
    with monkeypatch.context() as m:
        m.setattr(runtime.os, "getcwd", lambda: calls.append(1) or real())
        again = runtime.get_library()
    assert again is lib and calls == []  # no getcwd on the fast path
    assert runtime._names_relative_path(("h100", None, None, b"generated"))
    assert not runtime._names_relative_path(("h100", None, b"", b""))  # empty: unset
    assert not runtime._names_relative_path(("h100", None, b"lib.so", None))  # not read
    assert runtime._names_relative_path((None, None, b"lib.so", None))
    assert not runtime._names_relative_path(("h100", None, None, str(clean_runtime).encode()))
    assert runtime._names_relative_path(("specs/x.yaml", None, None, None))


def test_grid_mode_from_environment(monkeypatch):
    """FA3GEN_GRID maps to the header's FA3GEN_GRID_* constants (test_contract pins those); a
    typo is an error naming the accepted values, never a silent default."""
    from fa3gen.ops import _grid_mode

    monkeypatch.delenv("FA3GEN_GRID", raising=False)
    assert _grid_mode() == 0
    for name, value in GRID_MODES.items():
        monkeypatch.setenv("FA3GEN_GRID", name)
        assert _grid_mode() == value
    monkeypatch.setenv("FA3GEN_GRID", "persist")
    with pytest.raises(InvalidInputError, match="FA3GEN_GRID='persist': expected auto, persistent or tiles"):
        _grid_mode()


def test_library_not_built_message(clean_runtime):
    with pytest.raises(LibraryNotBuiltError) as e:
        runtime.get_library()
    msg = str(e.value)
    assert str(clean_runtime / "h100" / "lib" / "libfa3gen_h100.so") in msg
    assert "fa3gen build --spec specs/h100.yaml" in msg


def test_library_not_built_names_the_spec_file_given(clean_runtime, tmp_path):
    # A spec outside specs/: the hint builds that file, not specs/<its name>.yaml.
    spec = tmp_path / "mine" / "trial.yaml"
    spec.parent.mkdir()
    spec.write_text("name: trial\naxes: {head_dim: 64}\n")
    with pytest.raises(LibraryNotBuiltError) as e:
        runtime.use_spec(str(spec))
    msg = str(e.value)
    assert str(clean_runtime / "trial" / "lib" / "libfa3gen_trial.so") in msg
    assert f"fa3gen build --spec {spec}\n" in msg
    assert "specs/trial.yaml" not in msg


def test_library_paths(clean_runtime, monkeypatch):
    root = clean_runtime
    assert runtime.resolve_library("ablation") == (
        root / "ablation/lib/libfa3gen_ablation.so", "ablation")
    assert runtime.resolve_library("specs/tiny.yaml")[0] == root / "tiny/lib/libfa3gen_tiny.so"
    monkeypatch.setenv("FA3GEN_LIB", "/x/libfa3gen_mine.so")
    assert runtime.resolve_library() == (runtime.Path("/x/libfa3gen_mine.so"), "mine")
    assert runtime.resolve_library("tiny")[1] == "tiny"  # an explicit spec beats the env
    with pytest.raises(LibraryNotBuiltError, match="specs/ablation.yaml"):
        runtime.use_spec("ablation")
    assert runtime._selected is None  # a failed use_spec changes nothing


def test_not_a_fa3gen_library(clean_runtime):
    # Any shared library without the fa3gen symbols: a clear error, not an AttributeError.
    import ctypes.util

    name = ctypes.util.find_library("m")  # e.g. "libm.so.6"; resolve it in the usual dirs only
    dirs = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")
    libm = [f"{d}/{name}" for d in dirs if name and runtime.Path(d, name).is_file()]
    if not libm:
        pytest.skip("no libm found to load")
    with pytest.raises(fa3gen.AbiMismatchError, match="no fa3gen_abi_version symbol"):
        runtime.Library(libm[0])


def _v(name, default=True):
    """A table row as a library would hold it: the fields are those of the name."""
    return VariantInfo(**dataclasses.asdict(parse_name(name)), is_default=default)


TABLE = [
    _v("fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"),
    _v("fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1"),
    _v("fwd_bf16_d64_nocausal_m192n128_s2_ws1_pp1_ov1"),
    _v("fwd_bf16_d64_nocausal_m128n128_s2_ws0_pp0_ov0", default=False),
    _v("fwd_fp16_d256_causal_m128n80_s2_ws1_pp0_ov1", default=False),
]


def test_select_default_and_named():
    assert select_variant(TABLE, "fwd", "bf16", 64, False).name == TABLE[2].name
    assert select_variant(TABLE, "fwd", "bf16", 128, True).name == TABLE[1].name
    named = select_variant(TABLE, "fwd", "bf16", 64, False, TABLE[3].name)
    assert named is TABLE[3]


def test_variant_not_built_lists_variants_and_build_hint():
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "bf16", 96, True, spec_name="h100")
    msg = str(e.value)
    assert "direction=fwd dtype=bf16 head_dim=96 causal=True" in msg
    for v in TABLE:
        assert v.name in msg
    assert "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1 (default)" in msg
    assert ("add head_dim: 96 (direction fwd, dtype bf16, causal: true) to a group of specs/h100.yaml "
            "and run: fa3gen build --spec specs/h100.yaml") in msg
    assert e.value.available and e.value.requested


def test_the_build_hint_of_a_spec_whose_groups_give_every_axis(tmp_path):
    """A spec without top-level axes (as fa3gen spec --from-trace writes): adding head_dim to
    one of its groups would not build the key, so the hint says to add a whole group or to
    trace again."""
    trimmed = tmp_path / "trimmed.yaml"
    trimmed.write_text("name: trimmed\ngroups:\n  - name: g\n    axes: {direction: fwd}\n")
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "bf16", 96, True, spec_name="trimmed",
                       rebuild=(str(trimmed), f"fa3gen build --spec {trimmed}"))
    msg = str(e.value)
    assert (f"add a group to {trimmed} with head_dim: 96 (direction fwd, dtype bf16, causal: "
            "true) and every other axis") in msg
    assert "`fa3gen spec --from-trace` again; then run: fa3gen build --spec" in msg
    assert "to a group of" not in msg


def test_unsupported_head_dim_is_not_a_build_hint():
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "bf16", 80, False, spec_name="h100")
    msg = str(e.value)
    assert ("Not supported: head_dim 80 is not supported by the fa3gen kernels "
            "(supported head dims: 64, 96, 128, 192, 256)") in msg
    assert "add head_dim" not in msg and "To build it" not in msg
    assert TABLE[0].name in msg  # the table is still listed


@pytest.mark.parametrize("head_dim", [192, 256])
def test_backward_of_every_forward_head_dim_is_buildable(head_dim):
    """The backward realizes every forward head dim (192 and 256 split head_dim over two
    warpgroups), so a missing one is a build hint, not "Not supported"."""
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "bwd", "bf16", head_dim, True, spec_name="h100")
    msg = str(e.value)
    assert "Not supported" not in msg
    assert f"To build it: add head_dim: {head_dim} (direction bwd, dtype bf16, causal: true)" in msg


# build_info as generator/build.py writes it (JSON): the build's filters and the dispatch keys
# of the whole spec's kept variants, before filtering.
FILTERED_INFO = json.loads(json.dumps({
    "spec": "h100",
    "filters": {"only": ["fwd_bf16_*"], "exclude": ["*_causal_*"]},
    "spec_keys": [["fwd", "bf16", 64, False], ["fwd", "fp16", 64, False],
                  ["fwd", "fp16", 128, True]],
}))


def test_variant_left_out_by_a_filtered_build_says_rebuild():
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100",
                       build_info=FILTERED_INFO)
    msg = str(e.value)
    assert ("To build it: specs/h100.yaml has this key, but the library was built with the "
            "filter --only 'fwd_bf16_*' --exclude '*_causal_*', which left it out; rebuild "
            "without the filter: fa3gen build --spec specs/h100.yaml") in msg
    assert "add head_dim" not in msg


def test_a_miss_records_the_filter_that_left_it_out_through_wrapping_errors():
    """GPU tests of a filtered build skip on such misses (tests/gpu/conftest.py), also where
    torch.compile re-raises the miss as its own error."""
    from fa3gen.errors import left_out_by_filter

    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100", build_info=FILTERED_INFO)
    flags = "--only 'fwd_bf16_*' --exclude '*_causal_*'"
    assert e.value.left_out_by == flags and left_out_by_filter(e.value) == flags

    class Wrapper(Exception):  # as torch._dynamo's BackendCompilerFailed keeps the error
        def __init__(self, inner):
            super().__init__(str(inner))
            self.inner_exception = inner

    def reraised(how):
        try:
            try:
                raise e.value
            except VariantNotBuiltError as inner:
                if how == "from":
                    raise RuntimeError("wrapped") from inner
                if how == "from None":  # __cause__ None, the context kept
                    raise RuntimeError("wrapped") from None
                raise Wrapper(inner) from None
        except Exception as outer:
            return outer

    for how in ("from", "from None", "inner"):
        assert left_out_by_filter(reraised(how)) == flags, how
    # an error raised while handling the miss (a failed assert in an except) is not the miss
    try:
        try:
            raise e.value
        except VariantNotBuiltError:
            raise AssertionError("the test's own failure")
    except AssertionError as failure:
        assert left_out_by_filter(failure) == ""
    # a full build's miss, an unfiltered key and other errors are not skipped
    with pytest.raises(VariantNotBuiltError) as full:
        select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100")
    assert full.value.left_out_by == "" and left_out_by_filter(full.value) == ""
    assert left_out_by_filter(RuntimeError("x")) == "" and left_out_by_filter(None) == ""


@pytest.mark.parametrize("info", [
    None, {}, {"spec": "h100", "fingerprint": "x"},                       # older libraries
    {**FILTERED_INFO, "filters": {"only": [], "exclude": []}},          # not filtered
    {**FILTERED_INFO, "spec_keys": [["fwd", "bf16", 64, False]]},       # not in the spec
    {**FILTERED_INFO, "spec_keys": [["fwd", "fp16"]]},                   # malformed
])
def test_key_missing_from_the_spec_keeps_the_add_hint(info):
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100", build_info=info)
    assert ("add head_dim: 64 (direction fwd, dtype fp16, causal: false) to a group of specs/h100.yaml "
            "and run: fa3gen build --spec specs/h100.yaml") in str(e.value)


def test_non_default_hint_mentions_a_filter_that_may_have_dropped_the_default():
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "fp16", 256, True, spec_name="h100", build_info={
            **FILTERED_INFO, "spec_keys": [["fwd", "fp16", 256, True]]})
    assert ("if specs/h100.yaml gives it a default, the build's filter --only 'fwd_bf16_*' "
            "--exclude '*_causal_*' left it out: rebuild without the filter") in str(e.value)


def test_variant_not_built_never_falls_back_to_non_default():
    with pytest.raises(VariantNotBuiltError, match="non-default variants for this key.*d256") as e:
        select_variant(TABLE, "fwd", "fp16", 256, True, spec_name="h100")
    # the headline says what is missing: the key's default, not its variants
    assert str(e.value).startswith("no default fa3gen variant for direction=fwd dtype=fp16")
    with pytest.raises(VariantNotBuiltError) as e:
        select_variant(TABLE, "fwd", "fp16", 64, False, spec_name="h100")
    assert str(e.value).startswith("no fa3gen variant built for direction=fwd dtype=fp16")


def test_unknown_and_mismatched_variant_names():
    with pytest.raises(VariantNotBuiltError, match="variant name 'fwd_bogus'"):
        select_variant(TABLE, "fwd", "bf16", 64, False, "fwd_bogus", spec_name="ablation")
    with pytest.raises(Fa3genError, match="serves direction=fwd dtype=bf16 head_dim=128"):
        select_variant(TABLE, "fwd", "bf16", 64, False, TABLE[0].name)


def test_long_variant_lists_are_cut():
    many = [_v(f"fwd_bf16_d128_nocausal_m128n{i}_s2_ws1_pp1_ov1", default=False)
            for i in range(1, 101)]
    with pytest.raises(VariantNotBuiltError, match="and 60 more"):
        select_variant(many, "fwd", "bf16", 64, False)


def _c_layout(struct: str, fields: list[str], tmp_path) -> dict:
    """offsetof each field and sizeof the struct, as the C compiler lays out fa3gen_abi.h."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to lay out fa3gen_abi.h")
    lines = [f'printf("{f} %zu\\n", offsetof({struct}, {f}));' for f in fields]
    src = tmp_path / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"fa3gen_abi.h\"\n"
                   "int main(void) {\n" + "\n".join(lines)
                   + f'\nprintf("sizeof %zu\\n", sizeof({struct}));\nreturn 0;\n}}\n')
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", str(KERNELS_DIR), str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("struct,mirror", [
    ("fa3gen_fwd_params", runtime.FwdParams),
    ("fa3gen_bwd_params", runtime.BwdParams),
    ("fa3gen_variant_info", runtime.VariantInfoC),
])
def test_ctypes_mirror_layout(struct, mirror, tmp_path):
    """Every ctypes field sits where the C compiler puts it, and the sizes agree."""
    fields = [name for name, _ in mirror._fields_]
    c = _c_layout(struct, fields, tmp_path)
    assert {f: getattr(mirror, f).offset for f in fields} == {f: c[f] for f in fields}
    assert ctypes.sizeof(mirror) == c["sizeof"]


def test_custom_op_fake_shapes():
    import fa3gen.ops  # noqa: F401  (registers fa3gen::fwd)

    # non-contiguous q (b, s, h, d) from a (b, h, s, d) tensor: outputs are contiguous anyway
    q = torch.empty(2, 8, 7, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    assert not q.is_contiguous()
    k = torch.empty(2, 9, 2, 128, dtype=torch.bfloat16, device="meta")
    out, lse = torch.ops.fa3gen.fwd(q, k, k, True, 0.1, "any")
    assert out.shape == (2, 7, 8, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (2, 8, 7) and lse.dtype == torch.float32 and lse.is_contiguous()
    schema = str(torch.ops.fa3gen.fwd.default._schema)
    assert ("bool causal, float softmax_scale, str variant, bool deterministic=False, "
            "SymInt window_left=-1, SymInt window_right=-1, float softcap=0.) -> "
            "(Tensor, Tensor)") in schema


def test_backward_op_fake_shapes():
    """fa3gen::bwd's fake impl: gradients shaped like q, k, v (GQA: dk, dv have heads_kv)."""
    import fa3gen.ops  # noqa: F401

    q = torch.empty(2, 7, 8, 64, dtype=torch.float16, device="meta")
    k = torch.empty(2, 9, 2, 64, dtype=torch.float16, device="meta")
    lse = torch.empty(2, 8, 7, device="meta")
    dq, dk, dv = torch.ops.fa3gen.bwd(q, q, k, k, q, lse, False, 0.1, "any", True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert dq.dtype == dk.dtype == torch.float16


def test_backward_needs_a_bwd_variant(monkeypatch):
    """The autograd formula resolves the default backward variant: a library without one
    fails with VariantNotBuiltError at backward time, naming the key."""
    from fa3gen import ops

    table = [_v("fwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov1")]
    fake_lib = type("L", (), {"find": lambda self, *a, seqlen_k=None, **k: select_variant(table, *a, **k)})()
    monkeypatch.setattr(runtime, "get_library", lambda *a, **k: fake_lib)
    q = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(VariantNotBuiltError, match="direction=bwd dtype=bf16 head_dim=64"):
        ops.resolve_bwd_variant(q, 64, False)


def test_import_is_light():
    code = ("import sys, fa3gen; fa3gen.__version__; "
            "assert 'torch' not in sys.modules and 'fa3gen.runtime' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'fa3gen')))")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert fa3gen.__version__ == "0.1.0"


# ---- reference -------------------------------------------------------------------------------


def test_causal_mask_bottom_right():
    # seqlen_q=2, seqlen_k=4: query 0 sees keys 0..2, query 1 sees 0..3
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    # seqlen_q=4, seqlen_k=2: queries 0, 1 see nothing; query 2 sees key 0; query 3 sees both
    assert causal_mask(4, 2).tolist() == [[False, False], [False, False],
                                          [True, False], [True, True]]


def test_reference_hand_example():
    # One head, d=1, scale 1: q=[0, 0, 0], k=[0, 0], v=[1, 3] -> uniform weights over visible keys.
    q = torch.zeros(1, 3, 1, 1)
    k = torch.zeros(1, 2, 1, 1)
    v = torch.tensor([1.0, 3.0]).view(1, 2, 1, 1)
    out, lse = attention_reference(q, k, v, causal=True, softmax_scale=1.0)
    assert out.flatten().tolist() == [0.0, 1.0, 2.0]  # row 0 sees no key, row 1 key 0, row 2 both
    assert lse[0, 0, 0] == float("-inf")
    assert lse[0, 0, 1].item() == 0.0 and lse[0, 0, 2].item() == pytest.approx(math.log(2))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("upcast", [True, False])
def test_reference_fully_masked_rows(upcast):
    q, k, v = qkv(b=1, sq=7, sk=3, hq=4, hkv=2, d=16)
    out, lse = attention_reference(q, k, v, causal=True, upcast=upcast)
    assert out.dtype == (torch.float32 if upcast else torch.bfloat16)
    assert (out[:, :4] == 0).all() and torch.isneginf(lse[:, :, :4]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 4:]).all()


def test_reference_gqa_matches_repeated_heads():
    q, k, v = qkv(b=1, sq=5, sk=6, hq=4, hkv=2, d=8, dtype=torch.float32)
    out, lse = attention_reference(q, k, v)
    out2, lse2 = attention_reference(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))
    torch.testing.assert_close(out, out2)
    # query head 1 uses kv head 0, query head 2 uses kv head 1
    o_h1, _ = attention_reference(q[:, :, 1:2], k[:, :, 0:1], v[:, :, 0:1])
    torch.testing.assert_close(out[:, :, 1:2], o_h1)


def test_reference_matches_sdpa():
    q, k, v = qkv(b=2, sq=9, sk=9, hq=2, hkv=2, d=16, dtype=torch.float32)
    out, _ = attention_reference(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_compare_to_reference_catches_nan_and_errors():
    from fa3gen.reference import compare_to_reference

    q, k, v = qkv(b=1, sq=6, sk=3, hq=2, hkv=1, d=16)
    ref_o, ref_l = attention_reference(q, k, v, causal=True)
    good = compare_to_reference(ref_o.to(q.dtype), ref_l, q, k, v, causal=True)
    assert good["ok"], good["why"]
    bad_o = ref_o.to(q.dtype).clone()
    bad_o[0, 5, 0, 0] = float("nan")
    assert "NaN" in compare_to_reference(bad_o, ref_l, q, k, v, causal=True)["why"]
    bad_l = ref_l.clone()
    bad_l[0, 0, 0] = 0.0  # should be -inf (row sees no key)
    assert "-inf" in compare_to_reference(ref_o, bad_l, q, k, v, causal=True)["why"]
    assert not compare_to_reference(ref_o + 0.1, ref_l, q, k, v, causal=True)["ok"]


# ---- bench (pure parts) ----------------------------------------------------------------------


def test_grid_and_flops():
    g = bench.grid([512, 16384], [64, 256])
    assert g[0] == {"head_dim": 64, "seqlen": 512, "batch": 32, "heads": 32}
    assert g[-1] == {"head_dim": 256, "seqlen": 16384, "batch": 1, "heads": 8}
    assert all(s["batch"] * s["seqlen"] == 16384 and s["heads"] * s["head_dim"] == 2048 for s in g)
    f = bench.attention_flops(32, 32, 512, 512, 64, causal=False)
    assert f == 4 * 32 * 32 * 512**2 * 64
    assert bench.attention_flops(32, 32, 512, 512, 64, causal=True) == f / 2
    assert bench.attention_flops(32, 32, 512, 512, 64, causal=False, direction="bwd") == 2.5 * f
    assert bench.tflops(1e12, 1000.0) == 1.0 and bench.tflops(1e12, None) is None


@pytest.mark.parametrize("sq, sk", [(0, 5), (5, 0), (1, 1), (1, 4096), (7, 7), (128, 512),
                                    (512, 128), (300, 301), (301, 300)])
def test_causal_flops_count_the_visible_pairs_when_lengths_differ(sq, sk):
    """Halving sq*sk counted 3.97x the work at sq 512, sk 128 (rows that see no key) and 0.57x
    at sq 128, sk 512; square shapes keep the peers' sq*sk/2."""
    exact = sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))
    assert bench.causal_pairs(sq, sk) == exact
    want = 4 * (exact - min(sq, sk) / 2) * 64
    assert bench.attention_flops(1, 1, sq, sk, 64, causal=True) == want
    if sq == sk:
        assert want == 4 * sq * sk / 2 * 64
    if sq <= sk:  # FlashAttention-3's benchmark: sq * (sk - sq / 2)
        assert want == 4 * sq * (sk - sq / 2) * 64


def fabricated_report():
    rows = []
    for causal in (False, True):
        for shape in bench.grid([512, 1024], [64, 128]):
            ms = {"fa3gen": 0.5, "cudnn": 0.6, "flash": None if shape["head_dim"] == 128 else 0.8}
            rows.append(bench.make_row("fwd", "bf16", shape, causal, "fwd_bf16_x", ms))
    header = {"gpu": "NVIDIA H200", "commit": "abc123", "date": "2026-11-30 00:00 UTC",
              "torch": "2.11", "cuda": "13.0", "cudnn": 91000, "gemm_tflops": 700.0,
              "library": "generated/h100/lib/libfa3gen_h100.so", "command": "fa3gen bench"}
    return {"header": header, "rows": rows}


def test_rows_json_roundtrip(tmp_path):
    rep = fabricated_report()
    r = rep["rows"][0]
    assert set(r) >= {"direction", "dtype", "head_dim", "causal", "batch", "seqlen", "heads",
                      "variant", "ms", "tflops"}
    assert r["tflops"]["fa3gen"] == pytest.approx(r["flops"] / 0.5e-3 / 1e12)
    assert rep["rows"][-1]["tflops"]["flash"] is None
    bench.write_json(rep, tmp_path / "r/bench.json")
    assert json.loads((tmp_path / "r/bench.json").read_text()) == rep


def test_markdown_tables_and_markers(tmp_path):
    rep = fabricated_report()
    block = bench.render_markdown(rep)
    assert block.startswith(bench.BEGIN) and block.rstrip().endswith(bench.END)
    assert "### fwd, bf16, causal=False" in block and "### fwd, bf16, causal=True" in block
    assert "| head_dim | seqlen | fa3gen | cuDNN | FA2 | FA4 | fa3gen / best peer |" in block
    assert "NVIDIA H200" in block and "abc123" in block and "`fa3gen bench`" in block
    # the ceiling says how it was timed: a report from before gemm_timing was a burst
    assert "GEMM 8192^3: 700 TFLOP/s (a burst of launches)" in block
    rep["header"]["gemm_timing"] = "rows"
    assert "GEMM 8192^3: 700 TFLOP/s (timed as the rows)" in bench.render_markdown(rep)
    assert "| 128 | 512 |" in block and "| — |" in block  # missing FA2 -> dash
    assert "1.20" in block  # ratio 0.6/0.5

    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\nHand notes above.\n\n{bench.BEGIN}\nold\n{bench.END}\n\n"
                  "Hand notes below.\n")
    bench.update_markdown(md, block)
    text = md.read_text()
    assert "Hand notes above." in text and "Hand notes below." in text
    assert "old" not in text and text.count(bench.BEGIN) == 1
    bench.update_markdown(md, block)  # idempotent
    assert md.read_text() == text
    fresh = tmp_path / "new.md"
    bench.update_markdown(fresh, block)
    assert bench.BEGIN in fresh.read_text()


def test_plot_writes_png(tmp_path):
    bench.plot(fabricated_report(), tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_options():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench.register(sub)
    a = parser.parse_args(["bench"])
    assert a.func is bench.run and a.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert a.head_dims == [64, 128, 256] and a.causal == "both" and a.dtype == ["bf16"]
    assert (a.warmup, a.iters, a.no_baselines) == (5, 30, False)
    assert a.out.name == "bench.json" and a.markdown.name == "BENCHMARKS.md"
    a = parser.parse_args(["bench", "--seqlens", "1024,2048", "--head-dims", "128",
                           "--causal", "true", "--no-baselines"])
    assert a.seqlens == [1024, 2048] and a.head_dims == [128] and a.no_baselines
    assert parser.parse_args(["bench", "--dtype", "bf16,fp16"]).dtype == ["bf16", "fp16"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--dtype", "fp8"])


@pytest.mark.parametrize("argv,expected", [
    (["--seqlens", "abc"], "argument --seqlens: expected a comma-separated list of positive "
                           "integers (e.g. 1024,4096), got 'abc'"),
    (["--seqlens", "1024,0"], "argument --seqlens: expected a comma-separated list of positive "
                              "integers (e.g. 1024,4096), got '1024,0'"),
    (["--head-dims", "64,x"], "argument --head-dims: expected a comma-separated list of positive "
                              "integers (e.g. 64,128), got '64,x'"),
    (["--dtype", "fp8"], "argument --dtype: expected a comma-separated list of dtypes from bf16, "
                         "fp16, e4m3 (e.g. bf16,fp16), got 'fp8'"),
])
def test_bench_cli_says_what_a_list_option_expects(argv, expected, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", *argv])
    err = capsys.readouterr().err
    assert expected in err and "_int_list" not in err


def test_bench_and_ablate_options_have_help():
    import argparse

    from fa3gen import ablate

    for module in (bench, ablate):
        parser = argparse.ArgumentParser()
        sub = module.register(parser.add_subparsers())
        missing = [a.option_strings for a in sub._actions if not a.help]
        assert not missing, f"{module.__name__}: options without help: {missing}"


# ---- a fake library built with the host C compiler: the ctypes path end to end ---------------

FAKE_LIB_C = r"""
#include <string.h>
#include "fa3gen_abi.h"
static __thread char err[256];
fa3gen_fwd_params fake_last_params;
void* fake_last_stream;
static int launch(const fa3gen_fwd_params* p, void* stream) {
  fake_last_params = *p;
  fake_last_stream = stream;
  if (p->batch == 13) { fa3gen_set_error("unlucky batch"); return 7; }
  return 0;
}
fa3gen_bwd_params fake_last_bwd_params;
static int launch_bwd(const fa3gen_bwd_params* p, void* stream) {
  fake_last_bwd_params = *p;
  return 0;
}
static const fa3gen_variant_info table[] = {
  {"fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1", "fwd", "bf16", 128, 0, 0, 0, 0, 128, 176, 2, 1, 1,
   1, 0, 0, 0, 0, 1, launch, 0},
  {"fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0", "fwd", "bf16", 128, 0, 0, 0, 0, 128, 128, 2, 0, 0,
   0, 0, 0, 0, 0, 0, launch, 0},
  {"bwd_bf16_d128_nocausal_m64n128_s2_ws1_pp0_ov0", "bwd", "bf16", 128, 0, 0, 0, 0, 64, 128, 2, 1, 0,
   0, 0, 0, 0, 0, 1, 0, launch_bwd},
  {"fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1", "fwd", "bf16", 128, 0, 1, 1, 0,
   128, 128, 2, 1, 1, 1, 0, 0, 0, 0, 1, launch, 0},
  {"fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1", "fwd", "bf16", 128, 1, 0, 0, 1,
   128, 128, 2, 1, 1, 1, 0, 0, 0, 0, 1, launch, 0},
  {"bwd_bf16_d128_causal_varlen_m64n128_s2_ws1_pp0_ov0", "bwd", "bf16", 128, 1, 0, 0, 1,
   64, 128, 2, 1, 0, 0, 0, 0, 0, 0, 1, 0, launch_bwd},
  {"fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1_paged", "fwd", "bf16", 128, 1, 0, 0, 1,
   128, 128, 2, 1, 1, 1, 0, 0, 1, 0, 1, launch, 0},
  {"fwd_e4m3_d128_causal_m128n128_s2_ws1_pp1_ov1", "fwd", "e4m3", 128, 1, 0, 0, 0,
   128, 128, 2, 1, 1, 1, 0, 0, 0, 0, 1, launch, 0},
};
#define COUNT ((int32_t)(sizeof table / sizeof table[0]))
int32_t fa3gen_abi_version(void) { return ABI; }
int32_t fa3gen_num_variants(void) { return COUNT; }
const fa3gen_variant_info* fa3gen_variant(int32_t i) { return (i >= 0 && i < COUNT) ? &table[i] : 0; }
const char* fa3gen_build_info(void) { return "{\"spec\": \"fake\", \"fingerprint\": \"x\"}"; }
const char* fa3gen_last_error(void) { return err; }
void fa3gen_set_error(const char* m) { strncpy(err, m, sizeof err - 1); }
"""


def build_fake_lib(tmp_path, abi=runtime.ABI_VERSION, source=FAKE_LIB_C, name="fake"):
    """The fake library compiled (`source`: FAKE_LIB_C or a variation of it) as
    libfa3gen_<name><abi>.so in tmp_path."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    so = tmp_path / f"libfa3gen_{name}{abi}.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-DABI={abi}", "-I",
                    str(KERNELS_DIR), str(src), "-o", str(so)],
                   check=True)
    return so


def test_fake_library_table_and_launch(tmp_path):
    from fa3gen import ops
    from fa3gen.ops import Dims, _bwd_layout, _bwd_workspace, _make_bwd_params, _make_params

    lib = runtime.Library(build_fake_lib(tmp_path))
    assert lib.spec_name == "fake" and lib.build_info["fingerprint"] == "x"
    assert lib.names("fwd") == ["fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1",
                                "fwd_bf16_d128_nocausal_m128n128_s2_ws0_pp0_ov0",
                                "fwd_bf16_d128_nocausal_local_softcap_m128n128_s2_ws1_pp1_ov1",
                                "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1",
                                "fwd_bf16_d128_causal_varlen_m128n128_s2_ws1_pp1_ov1_paged",
                                "fwd_e4m3_d128_causal_m128n128_s2_ws1_pp1_ov1"]
    assert lib.find("fwd", "bf16", 128, True, varlen=True, paged=True) is lib.variants[6]
    assert lib.find("fwd", "bf16", 128, True, varlen=True) is lib.variants[4]
    with pytest.raises(VariantNotBuiltError):  # no dense causal variant in the table
        lib.find("fwd", "bf16", 128, True)
    feature = lib.variants[3]
    assert (feature.causal, feature.local, feature.softcap, feature.is_default) == (
        False, True, True, True)
    assert lib.find("fwd", "bf16", 128, False, local=True, softcap=True) is feature
    with pytest.raises(VariantNotBuiltError):  # the key includes both features
        lib.find("fwd", "bf16", 128, False, local=True)
    v0 = lib.variants[0]
    assert (v0.tile_m, v0.tile_n, v0.stages, v0.warp_specialized, v0.is_default) == (
        128, 176, 2, True, True)
    assert lib.variants[2].launch is not None and lib.variants[2].direction == "bwd"
    assert lib.find("fwd", "bf16", 128, False) is v0
    assert lib.find("fwd", "bf16", 128, False, lib.variants[1].name) is lib.variants[1]
    with pytest.raises(VariantNotBuiltError, match="specs/fake.yaml"):
        lib.find("fwd", "fp16", 128, False)
    # The library's build_info reaches the hint: a key its filter left out says rebuild.
    lib.build_info = {"filters": {"only": ["fwd_bf16_*"], "exclude": []},
                      "spec_keys": [["fwd", "fp16", 128, False]]}
    with pytest.raises(VariantNotBuiltError, match="rebuild without the filter"):
        lib.find("fwd", "fp16", 128, False)

    # Params marshalling: strides of a packed-qkv view and a GQA k/v, read back from C.
    qkv_t = torch.randn(2, 5, 3, 4, 128, dtype=torch.bfloat16)
    q = qkv_t[:, :, 0]
    k, v = (torch.randn(2, 9, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch.empty(2, 5, 4, 128, dtype=torch.bfloat16), torch.empty(2, 4, 5)
    dims = Dims(2, 5, 9, 4, 2, 128, "bf16")
    params = _make_params(q, k, v, out, lse, dims, 0.125, 132, GRID_MODES["tiles"],
                          ops.Masking(False, 100, 3, 30.0))
    lib.launch(v0, params, 0xABC0)
    got = runtime.FwdParams.in_dll(lib._dll, "fake_last_params")
    assert ctypes.c_void_p.in_dll(lib._dll, "fake_last_stream").value == 0xABC0
    assert (got.q, got.k, got.o, got.lse) == (q.data_ptr(), k.data_ptr(), out.data_ptr(),
                                              lse.data_ptr())
    assert (got.q_batch_stride, got.q_row_stride, got.q_head_stride) == (5 * 3 * 4 * 128,
                                                                        3 * 4 * 128, 128)
    assert (got.k_batch_stride, got.k_row_stride, got.k_head_stride) == (9 * 256, 256, 128)
    assert (got.batch, got.seqlen_q, got.seqlen_k, got.heads_q, got.heads_kv, got.head_dim) == (
        2, 5, 9, 4, 2, 128)
    assert got.softmax_scale == 0.125 and got.num_sms == 132 and got.grid_mode == 2
    assert (got.window_left, got.window_right, got.softcap) == (100, 3, 30.0)

    params.batch = 13  # the fake launcher fails: the C error text reaches Python
    with pytest.raises(Fa3genError, match=r"fwd_bf16_d128.*failed \(code 7\): unlucky batch"):
        lib.launch(v0, params, 0)
    with pytest.raises(Fa3genError, match="takes BwdParams, got FwdParams"):
        lib.launch(lib.variants[2], params, 0)

    # Backward marshalling: workspace sized by the variant's tile_m, gradients' strides.
    layout = _bwd_layout(dims, 64, deterministic=True)
    workspace = _bwd_workspace(layout, q.device)
    accum, semaphore = layout.view(workspace, "dq_accum"), layout.view(workspace, "dq_semaphore")
    assert accum.shape == (2, 4, 64, 128) and semaphore.shape == (2, 4, 1)
    assert accum.dtype == torch.float32 and semaphore.dtype == torch.int32
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bp = _make_bwd_params(q, k, v, out, out, lse, dq, dk, dv, layout.pointers(workspace), dims,
                          0.125, True, ops.Masking(causal=True, softcap=2.5))
    lib.launch(lib.variants[2], bp, 0)
    got = runtime.BwdParams.in_dll(lib._dll, "fake_last_bwd_params")
    assert (got.dout, got.dq_accum, got.dq_semaphore) == (
        out.data_ptr(), accum.data_ptr(), semaphore.data_ptr())
    assert (got.q_batch_stride, got.q_row_stride, got.dq_row_stride) == (
        5 * 3 * 4 * 128, 3 * 4 * 128, 4 * 128)
    assert (got.dk_head_stride, got.deterministic, got.softmax_scale) == (128, 1, 0.125)
    assert (got.window_left, got.window_right, got.softcap) == (-1, -1, 2.5)


def test_a_symlink_repointed_at_another_library_loads_that_one(tmp_path):
    """dlopen answers a path string it has loaded with that object: after the link moved to
    another file, the old library came back silently (here: no ABI error from the new one)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = runtime.Library(build_fake_lib(tmp_path / "a"))
    other = build_fake_lib(tmp_path / "b", abi=99)
    link = tmp_path / "libfa3gen_link.so"
    link.symlink_to(first.path)
    assert runtime.Library(link).variants  # loads through the link
    link.unlink()
    link.symlink_to(other)
    with pytest.raises(fa3gen.AbiMismatchError, match="C ABI version 99"):
        runtime.Library(link)


def test_a_library_rebuilt_after_a_failed_load_loads_in_the_same_process(tmp_path):
    """The failed library stayed loaded under its path, and dlopen answered the path with it:
    the ABI error came back after the rebuild, until a new process."""
    import os
    import shutil
    lib = tmp_path / "libfa3gen_rebuilt.so"
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    shutil.copy(build_fake_lib(tmp_path / "old", abi=99), lib)
    with pytest.raises(fa3gen.AbiMismatchError, match="C ABI version 99"):
        runtime.Library(lib)
    shutil.copy(build_fake_lib(tmp_path / "new"), tmp_path / "next.so")
    os.replace(tmp_path / "next.so", lib)  # as the build links aside and renames
    assert runtime.Library(lib).variants


def test_fake_library_abi_mismatch(tmp_path):
    with pytest.raises(fa3gen.AbiMismatchError, match="C ABI version 99, this fa3gen package "
                                                      f"expects {runtime.ABI_VERSION}"):
        runtime.Library(build_fake_lib(tmp_path, abi=99))


def test_get_library_via_env_and_cache(tmp_path, clean_runtime, monkeypatch):
    so = build_fake_lib(tmp_path)
    monkeypatch.setenv("FA3GEN_LIB", str(so))
    lib = runtime.get_library()
    assert lib is runtime.get_library() and lib.path == so


def test_get_library_caches_per_request(clean_runtime, monkeypatch):
    """Repeated calls are served from the cache (no path resolution per call), but a changed
    FA3GEN_LIB or use_spec choice is a new request."""
    made = []

    class FakeLibrary:
        def __init__(self, path, spec_name, spec_file=None):
            made.append(path)
            self.path = path

    monkeypatch.setattr(runtime, "Library", FakeLibrary)
    a, b = clean_runtime / "libfa3gen_a.so", clean_runtime / "libfa3gen_b.so"
    a.write_bytes(b"")
    b.write_bytes(b"")
    monkeypatch.setenv("FA3GEN_LIB", str(a))
    first = runtime.get_library()
    assert runtime.get_library() is first and made == [a]
    monkeypatch.setenv("FA3GEN_LIB", str(b))
    assert runtime.get_library().path == b and made == [a, b]
    assert runtime.get_library(str(a)) is first  # same file, other request: no second load
    assert made == [a, b]


def test_library_paths_that_are_not_plain_libraries(tmp_path, clean_runtime, monkeypatch):
    """A bare file name loads the file in the working directory (dlopen would search the
    library paths, maybe finding another library of that name); a folder and a library of the
    right ABI number without its functions are one clear error each."""
    import shutil

    so = build_fake_lib(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert runtime.Library(so.name).spec_name == "fake"
    monkeypatch.setenv("FA3GEN_LIB", so.name)
    assert runtime.get_library().path.name == so.name
    with pytest.raises(fa3gen.Fa3genError, match="is a folder"):
        runtime.Library(tmp_path)
    cc = shutil.which("cc") or shutil.which("gcc")
    src = tmp_path / "half.c"
    src.write_text(f"int fa3gen_abi_version(void) {{ return {runtime.ABI_VERSION}; }}\n")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(tmp_path / "libhalf.so")], check=True)
    with pytest.raises(fa3gen.Fa3genError, match="not a complete fa3gen library"):
        runtime.Library(tmp_path / "libhalf.so")


def test_an_empty_grid_variable_is_unset(monkeypatch):
    from fa3gen import ops
    from fa3gen.contract import GRID_MODES

    monkeypatch.setenv("FA3GEN_GRID", "")
    assert ops._grid_mode() == GRID_MODES["auto"]
    monkeypatch.setenv("FA3GEN_GRID", "Persistent")
    with pytest.raises(fa3gen.InvalidInputError, match="expected auto, persistent or tiles"):
        ops._grid_mode()


def test_a_bad_layout_is_reported_before_a_missing_library(clean_runtime, monkeypatch):
    """Without a library, the dense and varlen calls still name a tensor TMA cannot read (its
    strides or alignment), not the missing build."""
    from fa3gen import ops, varlen
    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    k = torch.zeros(2, 8, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match=r"q.stride\(-1\)"):
        ops.flash_attn_func(torch.zeros(2, 8, 4, 256, dtype=torch.bfloat16)[..., ::2], k, k)
    x = torch.zeros(16 * 4 * 128 + 4, dtype=torch.bfloat16)[4:].view(16, 4, 128)  # 8 bytes in
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match=r"q.data_ptr\(\) is not 16-byte aligned"):
        varlen.flash_attn_varlen_func(x, x[:, :2], x[:, :2], cu, cu, 16, 16)
    with pytest.raises(LibraryNotBuiltError):  # a good call still says what is missing
        ops.flash_attn_func(k, k, k)


def test_a_miss_names_the_spec_file_the_library_was_built_from(tmp_path, monkeypatch):
    """The build hint names the spec its manifest records (a traced spec written elsewhere than
    specs/ was hinted as specs/<name>.yaml, which does not exist), and for a library bundled in
    a wheel it adds packaging and installing again."""
    import json as _json
    lib = runtime.Library(build_fake_lib(tmp_path))
    assert lib.rebuild_hint == (f"specs/{lib.spec_name}.yaml", f"fa3gen build --spec specs/{lib.spec_name}.yaml")
    spec = tmp_path / "out" / "mymodel.yaml"
    (lib.path.parent / "manifest.json").write_text(_json.dumps({"spec_path": str(spec)}))
    lib = runtime.Library(lib.path)
    with pytest.raises(VariantNotBuiltError, match=rf"to a group of {spec} and run: fa3gen build --spec {spec}"):
        lib.find("fwd", "fp16", 96, False)
    monkeypatch.setattr(runtime, "BUNDLED_LIBRARY", lib.path)
    monkeypatch.setattr(runtime, "PACKAGE", contract.package_name_of(lib.spec_name))
    lib = runtime.Library(lib.path)
    assert lib.rebuild_hint[1] == (f"fa3gen build --spec {spec}, then fa3gen package --spec {spec} "
                                   "and install the new wheel")
    # a wheel packaged with --name: the hint packages it under that name again (without it,
    # fa3gen_<spec> is another package and the installed one keeps its old library)
    monkeypatch.setattr(runtime, "PACKAGE", "fa3gen_x")
    lib = runtime.Library(lib.path)
    assert lib.rebuild_hint[1].endswith(f"fa3gen package --spec {spec} --name fa3gen_x and "
                                        "install the new wheel")


def test_bench_e4m3_backward_alone_is_an_error(capsys):
    from fa3gen import cli
    assert cli.main(["bench", "--dtype", "e4m3", "--direction", "bwd"]) == 2
    assert "e4m3 has no backward: bench it with --direction fwd" in capsys.readouterr().err


def test_bench_tables_leave_out_e4m3_backward():
    assert bench.bench_runs("both", ["bf16", "e4m3"], [False]) == [
        ("fwd", "bf16", False), ("fwd", "e4m3", False), ("bwd", "bf16", False)]
    assert bench.bench_runs("bwd", ["e4m3"], [False, True]) == []


def test_the_gemm_ceiling_is_timed_as_the_rows(monkeypatch):
    """Through measure_backends with the bench's own arguments (sustained, steady or burst),
    not a burst of its own."""
    seen = []
    monkeypatch.setattr(bench, "measure_backends",
                        lambda fns, args: seen.append((sorted(fns), args)) or ({"gemm": 2.0}, {}, {}))
    monkeypatch.setattr(bench, "gemm_tflops", lambda measure: measure(lambda: None))
    args = object()
    assert bench.gemm_ceiling(args) == 2.0 and seen == [(["gemm"], args)]


def test_merge_replaces_the_points_measured_again_and_names_each_run(tmp_path):
    old = fabricated_report()
    new = fabricated_report()
    new["header"] = dict(new["header"], date="2026-12-06 14:00 UTC", commit="def456", command="fa3gen bench --merge")
    new["rows"] = [dict(r, ms=dict(r["ms"], fa3gen=0.25)) for r in new["rows"] if r["head_dim"] == 64]
    merged = bench.merge_reports(old, new)
    assert len(merged["rows"]) == len(old["rows"])  # same points, none twice
    by_point = {bench.point_of(r): r for r in merged["rows"]}
    assert len(by_point) == len(merged["rows"])
    for point, r in by_point.items():
        assert r["run"] == (1 if point[2] == 64 else 0)
        assert r["ms"]["fa3gen"] == (0.25 if point[2] == 64 else 0.5)
    assert merged["header"] == new["header"] and merged["runs"] == [old["header"], new["header"]]
    block = bench.render_markdown(merged)
    assert "4 rows (run 0 in the tables' last column) from an earlier run: 2026-11-30 00:00 UTC" in block
    assert "commit `abc123`" in block and "| variant | run |" in block
    assert any(ln.startswith("| 64 | 512 |") and ln.endswith(" 1 |") for ln in block.splitlines())
    # a third run that replaces every run-0 row drops that run and renumbers
    third = fabricated_report()
    third["header"] = dict(third["header"], commit="0a0b0c")
    third["rows"] = [r for r in third["rows"] if r["head_dim"] == 128]
    again = bench.merge_reports(merged, third)
    assert [h["commit"] for h in again["runs"]] == ["def456", "0a0b0c"]
    assert {r["run"] for r in again["rows"] if r["head_dim"] == 64} == {0}
    # one run: no run column
    assert "| run |" not in bench.render_markdown(old)


def test_merge_keeps_a_timed_row_where_the_new_run_has_no_fa3gen_time():
    """A run against a library without a point's variant (a filtered build) has no fa3gen time
    there: --merge keeps the earlier measured row instead of blanking it, and still takes the
    peers' new rows where neither run timed fa3gen."""
    old = fabricated_report()
    old["rows"][1] = dict(old["rows"][1], tflops=dict(old["rows"][1]["tflops"], fa3gen=None))
    new = fabricated_report()
    new["header"] = dict(new["header"], commit="def456")
    new["rows"] = [dict(r, variant=None, tflops=dict(r["tflops"], fa3gen=None, cudnn=1.0))
                   for r in new["rows"][:2]]
    assert bench.unmeasured_points(old, new) == [bench.point_of(old["rows"][0])]
    merged = bench.merge_reports(old, new)
    by_point = {bench.point_of(r): r for r in merged["rows"]}
    assert len(by_point) == len(old["rows"]) == len(merged["rows"])
    assert by_point[bench.point_of(old["rows"][0])] == dict(old["rows"][0], run=0)  # kept
    assert by_point[bench.point_of(old["rows"][1])]["run"] == 1  # untimed both times: the new row
    assert by_point[bench.point_of(old["rows"][1])]["tflops"]["cudnn"] == 1.0
    # the library had the variant and the call failed: this run's result, not the old number
    new["rows"][0] = dict(new["rows"][0], variant="fwd_bf16_d64_nocausal_m192n128_s2_ws1_pp1_ov1")
    assert bench.unmeasured_points(old, new) == []
    failed = {bench.point_of(r): r for r in bench.merge_reports(old, new)["rows"]}
    assert failed[bench.point_of(old["rows"][0])]["tflops"]["fa3gen"] is None
    assert failed[bench.point_of(old["rows"][0])]["run"] == 1


def test_a_merged_reports_candidate_table_is_the_latest_runs():
    """The markdown's candidates took a geomean over every merged row (older runs: another
    library, another GPU) and could mark another pick than the run's picked_defaults."""
    old = fabricated_report()
    old["rows"] = [dict(r, candidates={"A": 900.0, "B": 100.0}) for r in old["rows"]]
    new = fabricated_report()
    new["header"] = dict(new["header"], commit="def456")
    new["rows"] = [dict(r, candidates={"A": 300.0, "B": 400.0})
                   for r in new["rows"] if r["head_dim"] == 64]
    merged = bench.merge_reports(old, new)
    want = bench.pick_defaults(new["rows"])
    assert {p["variant"] for p in want.values()} == {"B"}
    table = bench.render_markdown(merged).split("### Candidates")[1]
    picked = [ln.split("|")[2].strip() for ln in table.splitlines() if ln.endswith("| * |")]
    assert picked and set(picked) == {"B"}
    assert "_d128_" not in table  # a key only the older run timed: not this run's pick


def test_merge_refuses_a_report_of_another_gpu():
    old = fabricated_report()  # NVIDIA H200
    bench.check_same_gpu(old, "NVIDIA H200", "bench.json")
    with pytest.raises(Fa3genError, match=r"--merge: bench.json holds rows measured on NVIDIA "
                                          r"H200, this run is on NVIDIA H100 80GB HBM3"):
        bench.check_same_gpu(old, "NVIDIA H100 80GB HBM3", "bench.json")


def test_bench_merge_checks_the_gpu_before_the_grid(tmp_path, monkeypatch, capsys):
    """bench.run calls check_same_gpu with the run's GPU before any timing."""
    import types

    import torch

    out = tmp_path / "bench.json"
    bench.write_json(fabricated_report(), out)  # NVIDIA H200
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lib = types.SimpleNamespace(find=lambda *a, **k: types.SimpleNamespace(name="v"), path="lib")
    monkeypatch.setattr(runtime, "get_library", lambda *a: lib)
    monkeypatch.setattr(bench, "provenance", lambda lib: {"gpu": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(bench, "gemm_ceiling", lambda args: pytest.fail("timed before the check"))
    from fa3gen import cli
    assert cli.main(["bench", "--merge", "--out", str(out), "--seqlens", "512",
                     "--head-dims", "64"]) == 2
    assert "holds rows measured on NVIDIA H200, this run is on NVIDIA H100" in \
        capsys.readouterr().err


def test_merge_refuses_what_is_not_a_report(tmp_path):
    assert bench.earlier_report(tmp_path / "none.json") is None
    bad = tmp_path / "bad.json"
    for text in ("not json", "[]", '{"header": {}, "rows": [{"dtype": "bf16"}]}'):
        bad.write_text(text)
        with pytest.raises(Fa3genError, match="--merge: .* is not a bench report"):
            bench.earlier_report(bad)
    good = tmp_path / "good.json"
    bench.write_json(fabricated_report(), good)
    assert bench.earlier_report(good) == fabricated_report()
