"""Rendering of the variant TUs, the dispatch table and build.ninja (generator/render.py)."""
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from fa3gen.contract import Variant, parse_name
from generator.ninja import render_build_ninja
from generator.errors import ToolchainError
from generator.units import partition
from generator.render import c_string, plan_sources, render_dispatch, render_variant, write_if_changed
from generator.toolchain import Toolchain, compile_flags

V1 = parse_name("fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1")
V2 = parse_name("fwd_fp16_d64_causal_m192n128_s3_ws0_pp0_ov0")


def fake_toolchain() -> Toolchain:
    inc = Path("/opt/cutlass/include")
    return Toolchain(Path("/opt/cuda/bin/nvcc"), "release 13.0, V13.0.88", inc, "4.2.0",
                     tuple(compile_flags(inc)))


def test_variant_tu():
    text = render_variant(V1)
    assert '#include "fa3gen_fwd.cuh"' in text
    assert ('extern "C" FA3GEN_API int fa3gen_launch_fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1('
            'const fa3gen_fwd_params* p, void* stream)') in text
    assert ("fa3gen::launch_fwd<cutlass::bfloat16_t, 128, 128, 176, 2, false, false, false, false, "
            "false, true, true, true, false, false, false>"
            "(*p, static_cast<cudaStream_t>(stream))") in text
    text2 = render_variant(V2)
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, true, false, false, false, false, "
            "false, false, false, false, false, false>") in text2
    local = dataclasses.replace(V2, causal=False, local=True, softcap=True)
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, false, true, true, false, false, "
            "false, false, false, false, false, false>") in render_variant(local)
    packed = dataclasses.replace(V2, varlen=True)
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, true, false, false, true, false, "
            "false, false, false, false, false, false>") in render_variant(packed)
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, true, false, false, true, true, "
            "false, false, false, false, false, false>") in render_variant(dataclasses.replace(packed, paged=True))
    peeled = dataclasses.replace(V2, peel_masked=True)
    assert peeled.name.endswith("_ov0_peel")
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, true, false, false, false, false, "
            "false, false, false, true, false, false>") in render_variant(peeled)


V3 = Variant("bwd", "bf16", 128, True, False, False, False, 64, 128, 2, True, False, False)


def test_backward_variant_tu():
    text = render_variant(V3)
    assert '#include "fa3gen_bwd.cuh"' in text and "fa3gen_fwd.cuh" not in text
    assert (f'extern "C" FA3GEN_API int fa3gen_launch_{V3.name}(const fa3gen_bwd_params* p, '
            'void* stream)') in text
    assert ("fa3gen::launch_bwd<cutlass::bfloat16_t, 128, 64, 128, 2, true, false, false, false>"
            "(*p, ") in text
    via_smem = dataclasses.replace(V2, p_in_smem=True)
    assert via_smem.name.endswith("_ov0_psmem")
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, true, false, false, false, false, "
            "false, false, false, false, true, false>") in render_variant(via_smem)
    via_tma = dataclasses.replace(V2, o_tma_store=True)
    assert via_tma.name.endswith("_ov0_otma")
    assert ("launch_fwd<cutlass::half_t, 64, 192, 128, 3, true, false, false, false, false, "
            "false, false, false, false, false, true>") in render_variant(via_tma)


def test_dispatch_table():
    text = render_dispatch("h100", [V1, V2, V3], {V2.name}, {"spec": "h100", "fingerprint": "ab"})
    assert '#include "fa3gen_abi.h"' in text and "fa3gen_fwd.cuh\"" not in text
    assert f"int fa3gen_launch_{V1.name}(const fa3gen_fwd_params* p, void* stream);" in text
    assert (f'{{"{V1.name}", "fwd", "bf16", 128, 0, 0, 0, 0, 128, 176, 2, 1, 1, 1, 0, 0, 0, 0, 0, '
            f'&fa3gen_launch_{V1.name}, nullptr}}') in text
    assert (f'{{"{V2.name}", "fwd", "fp16", 64, 1, 0, 0, 0, 192, 128, 3, 0, 0, 0, 0, 0, 0, 0, 1, '
            f'&fa3gen_launch_{V2.name}, nullptr}}') in text
    assert f"int fa3gen_launch_{V3.name}(const fa3gen_bwd_params* p, void* stream);" in text
    assert (f'{{"{V3.name}", "bwd", "bf16", 128, 1, 0, 0, 0, 64, 128, 2, 1, 0, 0, 0, 0, 0, 0, 0, '
            f'nullptr, &fa3gen_launch_{V3.name}}}') in text
    assert "kNumVariants = 3;" in text
    assert "? &kVariants[index] : nullptr" in text
    assert "thread_local std::string" in text
    for fn in ("fa3gen_abi_version", "fa3gen_num_variants", "fa3gen_variant",
               "fa3gen_build_info", "fa3gen_last_error", "fa3gen_set_error"):
        assert fn + "(" in text
    assert r'"{\"fingerprint\": \"ab\", \"spec\": \"h100\"}"' in text


def test_empty_dispatch_table_still_valid_cpp():
    text = render_dispatch("e", [], set(), {"spec": "e"})
    assert "kNumVariants = 0;" in text and "placeholder" in text


def test_c_string_escapes():
    assert c_string('a"b\\c') == r'"a\"b\\c"'
    assert c_string("é\n") == r'"\303\251\012"'


def test_write_if_changed_keeps_mtime(tmp_path):
    p = tmp_path / "sub" / "f.cu"
    assert write_if_changed(p, "x") is True
    os.utime(p, (1_000_000, 1_000_000))
    assert write_if_changed(p, "x") is False
    assert p.stat().st_mtime == 1_000_000
    assert write_if_changed(p, "y") is True and p.read_text() == "y"


def test_planned_sources_applied_incrementally(tmp_path):
    a = parse_name("fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0")
    b = parse_name("fwd_bf16_d128_causal_m128n128_s2_ws1_pp0_ov0")
    c = parse_name("fwd_bf16_d128_causal_m128n176_s2_ws1_pp0_ov0")
    info = {"spec": "t", "fingerprint": "f"}
    r1 = plan_sources(tmp_path, "t", [a, b], {a.name}, "f", info, units=partition([a, b], 1)).apply()
    assert len(r1.written) == 4  # 2 variants + dispatch + fingerprint
    r2 = plan_sources(tmp_path, "t", [a, b], {a.name}, "f", info, units=partition([a, b], 1)).apply()
    assert r2.written == [] and not r2.removed  # rendering twice changes nothing
    (tmp_path / "obj").mkdir()
    (tmp_path / "obj" / f"{b.name}.o").write_text("o")
    r3 = plan_sources(tmp_path, "t", [a, c], {a.name}, "f", info, units=partition([a, c], 1)).apply()
    names = sorted(p.name for p in r3.written)
    # exactly one variant TU is new; the dispatch table changes with the set
    assert names == sorted([f"{c.name}.cu", "dispatch.cu"])
    assert sorted(p.name for p in r3.removed) == [f"{b.name}.cu", f"{b.name}.o"]
    assert not (tmp_path / "src" / f"{b.name}.cu").exists()
    assert (tmp_path / "fingerprint.txt").read_text() == "f\n"


def test_build_ninja_content():
    tc = fake_toolchain()
    text = render_build_ninja("h100", [V1, V2], tc, launcher="ccache")
    assert f"build obj/{V1.name}.o | obj/{V1.name}.resources.json: nvcc_variant src/{V1.name}.cu" \
        " | fingerprint.txt\n" in text
    # Kernel headers: each TU's nvcc depfile, not a blanket implicit dependency.
    assert "fa3gen_fwd.cuh" not in text
    assert "-MD -MF $out.d -c $in -o $out" in text
    assert "  depfile = $out.d\n  deps = gcc\n" in text
    assert "-m generator.compile_one --name $name --out $out --resources $resources $kernels --" in text
    assert f"build lib/libfa3gen_h100.so: link obj/{V1.name}.o obj/{V2.name}.o obj/dispatch.o" \
        " | fingerprint.txt" in text
    assert "build obj/dispatch.o: nvcc_plain src/dispatch.cu | fingerprint.txt" in text
    assert "launcher = ccache" in text
    assert "ldflags = -shared -cudart static -gencode arch=compute_90a,code=sm_90a" in text
    assert f"python = {os.path.realpath(sys.executable)}" in text
    cflags = next(l for l in text.splitlines() if l.startswith("cflags ="))
    plain = next(l for l in text.splitlines() if l.startswith("cflags_plain ="))
    assert "-Xptxas -v" in cflags and "-Xptxas" not in plain
    assert "default lib/libfa3gen_h100.so" in text


def test_flags():
    inc = Path("/x/include")
    f = compile_flags(inc)
    s = " ".join(f)
    assert s.startswith("-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a "
                        "--expt-relaxed-constexpr --use_fast_math -DNDEBUG "
                        "-Xcompiler -fPIC -Xptxas -v")
    assert f[-1] == "-I/x/include" and f[-2].endswith("templates/kernels")
    d = compile_flags(inc, debug=True)
    assert "-DNDEBUG" not in d and "-lineinfo" in d
    assert "-lineinfo" in compile_flags(inc, lineinfo=True)
    traced = compile_flags(inc, defines=["FA3GEN_DECODE_TRACE", "X=1"])
    assert traced[-4:-2] == ["-DFA3GEN_DECODE_TRACE", "-DX=1"] and traced[-1] == "-I/x/include"


@pytest.mark.parametrize("bad", ["1X", "A B", "X=1 2", "-DX", ""])
def test_bad_define_is_refused(bad):
    with pytest.raises(ToolchainError, match="--define"):
        compile_flags(Path("/x/include"), defines=[bad])


def test_extended_mma_shapes_only_where_an_n_needs_them():
    from generator.render import needs_extended_mma_shapes, wgmma_n_sizes

    def v(name):
        return parse_name(name)
    # Forward: S has N = tile_n, O has N = head_dim.
    assert wgmma_n_sizes(v("fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1")) == {128}
    assert wgmma_n_sizes(v("fwd_bf16_d256_nocausal_m128n80_s2_ws1_pp0_ov1")) == {80, 256}
    # Backward: S^T/dP^T N = tile_m, dK/dV N = head_dim, dQ split over the warpgroups or dQ^T.
    assert wgmma_n_sizes(v("bwd_bf16_d128_causal_m64n128_s2_ws1_pp0_ov0")) == {64, 128}
    assert wgmma_n_sizes(v("bwd_bf16_d128_nocausal_m80n128_s2_ws1_pp0_ov0")) == {80, 128}
    assert wgmma_n_sizes(v("bwd_bf16_d96_causal_m64n64_s2_ws1_pp0_ov0")) == {64, 96}
    for name, ext in [("fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1", True),
                      ("fwd_bf16_d192_causal_m128n112_s2_ws1_pp0_ov1", True),
                      ("bwd_fp16_d128_nocausal_m80n128_s2_ws1_pp0_ov0", True),
                      ("fwd_fp16_d64_nocausal_m192n128_s2_ws1_pp1_ov1", False),
                      ("fwd_bf16_d96_causal_m128n128_s2_ws1_pp0_ov1", False)]:
        assert needs_extended_mma_shapes(v(name)) is ext
        text = render_variant(v(name))
        assert ("#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" in text) is ext
        if ext:  # before any include: the CuTe headers read it
            assert text.index("#define CUTE_SM90") < text.index("#include")


def test_build_ninja_starts_the_slow_tus_first():
    from generator.render import needs_extended_mma_shapes

    fast = parse_name("fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1")
    slow = parse_name("fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1")
    assert needs_extended_mma_shapes(slow) and not needs_extended_mma_shapes(fast)
    inc = Path("/x/include")
    tc = Toolchain(Path("/usr/bin/nvcc"), "v", inc, "4.2.0", tuple(compile_flags(inc)))
    text = render_build_ninja("s", [fast, slow], tc)
    assert text.index(f"build obj/{slow.name}.o") < text.index(f"build obj/{fast.name}.o")


def test_build_ninja_names_the_interpreter_one_way(tmp_path, monkeypatch):
    """python3 build.py and fa3gen build (python) must write the same build.ninja, or ninja
    sees every compile command changed and rebuilds everything."""
    inc = Path("/x/include")
    tc = Toolchain(Path("/usr/bin/nvcc"), "v", inc, "4.2.0", tuple(compile_flags(inc)))
    v = parse_name("fwd_bf16_d128_causal_m128n128_s2_ws1_pp1_ov1")
    link = tmp_path / "python-by-another-name"
    link.symlink_to(os.path.realpath(sys.executable))
    texts = []
    for exe in (sys.executable, str(link)):
        monkeypatch.setattr(sys, "executable", exe)
        texts.append(render_build_ninja("s", [v], tc))
    assert texts[0] == texts[1]


def test_specs_with_e4m3_variants_get_the_quantizer(tmp_path):
    """src/quantize.cu and its edge (fa3gen_quantize_fp8) only where the spec has e4m3 variants."""
    f8 = parse_name("fwd_e4m3_d128_nocausal_m128n128_s2_ws1_pp1_ov1")
    info = {"spec": "t", "fingerprint": "f"}
    plan = plan_sources(tmp_path, "t", [V1], {V1.name}, "f", info, units=partition([V1], 1))
    assert not any(p.name == "quantize.cu" for p in plan.files)
    plan = plan_sources(tmp_path, "t", [V1, f8], {V1.name, f8.name}, "f", info,
                        units=partition([V1, f8], 1))
    quantize = plan.files[tmp_path / "src" / "quantize.cu"]
    assert "fa3gen_quantize_fp8" in quantize and '#include "quantize_fp8.cuh"' in quantize
    assert "quantize" not in render_build_ninja("t", [V1], fake_toolchain())
    text = render_build_ninja("t", [V1, f8], fake_toolchain())
    assert "build obj/quantize.o: nvcc_plain src/quantize.cu | fingerprint.txt" in text
    assert "quantize_fp8.cuh" in text  # the kernel header rebuilds it (no depfile on this rule)
    assert "obj/dispatch.o obj/quantize.o | fingerprint.txt" in text
def test_decode_kernels_only_where_the_spec_asks(tmp_path):
    """`decode:` renders src/decode.cu (fa3gen_decode_fwd) with one instantiation per listed
    (dtype, head_dim) pair, and links it; other specs get none."""
    info = {"spec": "t", "fingerprint": "f"}
    none = plan_sources(tmp_path, "t", [V1], {V1.name}, "f", info, units=partition([V1], 1))
    assert not any(p.name == "decode.cu" for p in none.files)
    pairs = (("bf16", 128), ("fp16", 64))
    plan = plan_sources(tmp_path, "t", [V1], {V1.name}, "f", info, units=partition([V1], 1), decode=pairs)
    src = plan.files[tmp_path / "src" / "decode.cu"]
    assert "fa3gen_decode_fwd" in src and "fa3gen::check_decode(*p)" in src
    for kv_fp8 in ("false", "true"):  # each pair for a 16-bit and an e4m3 cache
        assert f"launch<__nv_bfloat16, 128, {kv_fp8}>" in src and f"launch<__half, 64, {kv_fp8}>" in src
    assert src.count("fa3gen::decode::launch<") == 4 and "decode: lists bf16 d128, fp16 d64)" in src
    assert "decode" not in render_build_ninja("t", [V1], fake_toolchain())
    text = render_build_ninja("t", [V1], fake_toolchain(), decode=pairs)
    assert "build obj/decode.o: nvcc_plain src/decode.cu | fingerprint.txt" in text
    assert "decode.cuh" in text and "obj/dispatch.o obj/decode.o | fingerprint.txt" in text


def test_the_h100_sources_are_the_same_in_every_process(under_hash_seeds):
    """Rendering twice in one process cannot see an order that hash() decides (a set of
    variants, say): the h100 spec's sources and build file rendered under two hash seeds."""
    a, b = under_hash_seeds("""
import hashlib
from generator.build import plan
from generator.render import plan_sources
from generator.ninja import render_build_ninja
from generator.units import partition
from tests.test_render import fake_toolchain
p = plan("h100")
units = partition(p.variants, 16)
files = plan_sources("/nowhere", p.spec.name, p.variants, p.default_names, "f", {"spec": "h100"},
                     units=units, decode=p.spec.decode).files
texts = [files[k] for k in sorted(files)] + [render_build_ninja(
    p.spec.name, p.variants, fake_toolchain(), units=units, linked=units, decode=p.spec.decode)]
print(len(texts), hashlib.sha256("".join(texts).encode()).hexdigest())
""")
    assert a == b


@pytest.mark.parametrize("unit", ["quantize", "decode"])
def test_a_plain_units_header_edges_name_every_header_it_includes(unit):
    """The CuTe-free units compile without a depfile: a header they include that their edges
    do not name would not rebuild them when edited (a stale kernel in the library)."""
    import re
    from generator.ninja import plain_unit_headers
    from generator.paths import KERNELS_DIR, TEMPLATES_DIR

    included, todo = set(), [TEMPLATES_DIR / f"{unit}.cu.j2"]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop().read_text(), re.M):
            if name not in included and (KERNELS_DIR / name).is_file():
                included.add(name)
                todo.append(KERNELS_DIR / name)
    assert included and included <= set(plain_unit_headers(unit)), \
        sorted(included - set(plain_unit_headers(unit)))
