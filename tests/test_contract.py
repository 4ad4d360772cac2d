"""The variant contract (fa3gen/contract.py) against the C headers and its two users.

The ABI header and the kernel launchers are hand-written C++; the contract is their Python
description. These tests read the headers as text, so a field, a version or a template
parameter changed on one side only fails here, on CPU, before any nvcc or GPU run.
"""
import dataclasses
import ast
import re
import subprocess
import sys

import pytest

from fa3gen import contract, runtime
from fa3gen.contract import (AXIS_TABLE, LAUNCHERS, NAME_SEP, VARIANT_FIELDS, VARIANT_INFO,
                             Variant, parse_name)
from fa3gen.errors import Fa3genError
from generator.paths import KERNELS_DIR, SPECS_DIR
from generator.spec import load_spec
from generator.variants import enumerate_variants

ABI_HEADER = (KERNELS_DIR / "fa3gen_abi.h").read_text()


def c_structs(text: str) -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(field, C type), ...]} of every `typedef struct X {...} X;` in text."""
    text = re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)
    out = {}
    for name, body in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\1\s*;", text, re.S):
        fields = []
        for decl in filter(None, (" ".join(d.split()) for d in body.split(";"))):
            first, *more = (d.strip() for d in decl.split(","))  # int64_t a, b, c
            base, stars, field = re.fullmatch(r"(.+?)\s*(\**)\s*(\w+)", first).groups()
            fields.append((field, base + stars))
            for d in more:
                stars, field = re.fullmatch(r"(\**)\s*(\w+)", d).groups()
                fields.append((field, base + stars))
        out[name] = fields
    return out


def test_header_parser_reads_declarations():
    structs = c_structs("typedef struct s {\n  const void* p;  // a comment; with a semicolon\n"
                        "  int64_t a, b;\n  int32_t* c;\n} s;")
    assert structs == {"s": [("p", "const void*"), ("a", "int64_t"), ("b", "int64_t"),
                             ("c", "int32_t*")]}


def test_abi_version_matches_header():
    m = re.search(r"^#define\s+FA3GEN_ABI_VERSION\s+(\d+)\s*$", ABI_HEADER, re.M)
    assert m and int(m.group(1)) == contract.ABI_VERSION


@pytest.mark.parametrize("struct,fields", [
    *((launcher.params, launcher.params_fields) for launcher in LAUNCHERS.values()),
    ("fa3gen_variant_info", VARIANT_INFO),
    ("fa3gen_quantize_params", contract.QUANTIZE_PARAMS),
    ("fa3gen_decode_params", contract.DECODE_PARAMS),
    ("fa3gen_append_params", contract.APPEND_PARAMS),
    ("fa3gen_rotary_params", contract.ROTARY_PARAMS),
])
def test_struct_fields_match_header(struct, fields):
    """Every field, in order, with its C type: adding one on a single side fails here."""
    assert c_structs(ABI_HEADER)[struct] == list(fields)


def test_varlen_limits_match_header():
    header = {m.lower(): int(v) for m, v in
              re.findall(r"^#define\s+FA3GEN_VARLEN_MAX_(\w+)\s+(\d+)", ABI_HEADER, re.M)}
    assert header == contract.VARLEN_LIMITS


def test_grid_modes_match_header():
    header = {m.lower(): int(v) for m, v in
              re.findall(r"^#define\s+FA3GEN_GRID_(\w+)\s+(\d+)", ABI_HEADER, re.M)}
    assert header == contract.GRID_MODES


@pytest.mark.parametrize("direction", LAUNCHERS)
def test_launcher_matches_kernel_header(direction):
    """The template parameters variant.cu.j2 passes are the kernel's, in its order, and the
    launcher typedef of the ABI takes the params struct the contract names."""
    launcher = LAUNCHERS[direction]
    kernel = (KERNELS_DIR / launcher.header).read_text()
    function = launcher.function.split("::")[-1]
    m = re.search(r"template\s*<([^>]*)>\s*int\s+" + function + r"\s*\(\s*const\s+(\w+)\s*&",
                  kernel)
    assert m, f"no `template <...> int {function}(const ...&` in {launcher.header}"
    declared = [p.split()[-1] for p in m.group(1).split(",")]
    assert declared == [param for param, _ in launcher.template_params]
    assert m.group(2) == launcher.params
    typedef = re.search(r"typedef\s+int\s*\(\s*\*\s*" + launcher.fn_type
                        + r"\s*\)\s*\(\s*const\s+(\w+)\s*\*", ABI_HEADER)
    assert typedef and typedef.group(1) == launcher.params


def test_every_axis_reaches_a_kernel():
    """A Variant field that no launcher takes would build identical kernels under two names
    (direction picks the launcher itself)."""
    taken = {f for launcher in LAUNCHERS.values() for _, f in launcher.template_params}
    assert taken == {f for f, _ in VARIANT_FIELDS} - {"direction"}
    assert tuple(LAUNCHERS) == contract.DIRECTIONS  # one launcher per direction, in order


def _c_row(v: Variant, name: str) -> runtime.VariantInfoC:
    """v as a row of a library's table, with `name` in its name field."""
    values = {f: getattr(v, f) for f, _ in VARIANT_FIELDS}
    return runtime.VariantInfoC(name=name.encode(), is_default=1, **{
        f: x.encode() if isinstance(x, str) else int(x) for f, x in values.items()})


def test_table_row_reads_back_as_its_variant():
    v = parse_name("bwd_fp16_d96_causal_m64n128_s2_ws1_pp0_ov0")
    info = runtime._variant_from_c(_c_row(v, v.name), "row 0")
    assert Variant(**{f: getattr(info, f) for f, _ in VARIANT_FIELDS}) == v
    assert info.name == v.name and info.key == v.key and info.is_default
    assert info.launch is None  # a NULL launcher


def test_table_row_named_unlike_its_fields_is_refused():
    v = parse_name("fwd_bf16_d128_nocausal_m128n128_s2_ws1_pp0_ov0")
    with pytest.raises(Fa3genError, match="row 3 is named 'fwd_bf16_d128_causal_.*rebuild"):
        runtime._variant_from_c(_c_row(v, v.name.replace("nocausal", "causal")), "row 3")


# ------------------------------------------------------------------------------- names


def test_name_format():
    v = Variant("fwd", "bf16", 128, False, False, False, False, 128, 176, 2, True, True, False)
    assert v.name == "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov0"
    assert contract.NAME_FORMAT == ("{direction}_{dtype}_d{head_dim}_{nocausal|causal}_"
                                    "[local]_[softcap]_[varlen]_"
                                    "m{tile_m}n{tile_n}_s{stages}_ws{0|1}_pp{0|1}_ov{0|1}_[peel]_[psmem]_"
                                    "[paged]_[otma]")
    assert v.key == ("fwd", "bf16", 128, False, False, False, False, False)
    assert contract.key_str(v.key) == "(fwd, bf16, d128, nocausal)"


def test_feature_flags_are_spelled_only_when_on():
    """local, softcap and varlen appear in a name only when set, so names from before the two axes
    existed still parse to the same variant."""
    v = Variant("bwd", "fp16", 64, False, True, True, False, 128, 128, 2, True, False, False)
    assert v.name == "bwd_fp16_d64_nocausal_local_softcap_m128n128_s2_ws1_pp0_ov0"
    assert parse_name(v.name) == v
    only_cap = Variant("fwd", "bf16", 128, True, False, True, False, 128, 128, 2, True, True, True)
    assert only_cap.name == "fwd_bf16_d128_causal_softcap_m128n128_s2_ws1_pp1_ov1"
    assert parse_name(only_cap.name) == only_cap
    assert contract.key_str(v.key) == "(bwd, fp16, d64, nocausal, local, softcap)"
    assert contract.make_key("fwd", "bf16", 128, 1) == ("fwd", "bf16", 128, True, False, False,
                                                         False, False)
    packed = dataclasses.replace(only_cap, varlen=True)
    assert packed.name == "fwd_bf16_d128_causal_softcap_varlen_m128n128_s2_ws1_pp1_ov1"
    paged = dataclasses.replace(packed, paged=True)  # a key axis spelled after the knobs
    assert paged.name == "fwd_bf16_d128_causal_softcap_varlen_m128n128_s2_ws1_pp1_ov1_paged"
    assert parse_name(paged.name) == paged and paged.key[-1] is True and packed.key[-1] is False
    assert parse_name(packed.name) == packed
    assert contract.key_str(packed.key) == "(fwd, bf16, d128, causal, softcap, varlen)"
    for bad in ("fwd_bf16_d128_causal_softcap_local_m128n128_s2_ws1_pp1_ov1",  # out of order
                "fwd_bf16_d128_causal__m128n128_s2_ws1_pp1_ov1",                # empty part
                "fwd_bf16_d128_causal_nolocal_m128n128_s2_ws1_pp1_ov1"):
        with pytest.raises(ValueError):
            parse_name(bad)


@pytest.mark.parametrize("spec", ["h100", "ablation"])
def test_every_variant_name_round_trips(spec):
    en = enumerate_variants(load_spec(SPECS_DIR / f"{spec}.yaml"))
    variants = en.kept + [p.variant for p in en.pruned]
    assert en.kept
    for v in variants:
        assert parse_name(v.name) == v
        spelled = [a for a in AXIS_TABLE if a.spell(a.value(v))]
        assert len(v.name.split(NAME_SEP)) == len(spelled)
        assert Variant.from_axes(v.axes()) == v


@pytest.mark.parametrize("name", [
    "fwd_bf16_d128_causal_m128n176_s2_ws1_pp1",            # a part missing
    "fwd_bf16_d128_causal_m128n176_s2_ws1_pp1_ov1_x",      # one too many
    "fwd_fp32_d128_causal_m128n176_s2_ws1_pp1_ov1",        # unknown dtype
    "fwd_bf16_d0128_causal_m128n176_s2_ws1_pp1_ov1",       # would not spell back the same
    "fwd_bf16_d128_causal_m128n176_s2_ws2_pp1_ov1",        # a flag is 0 or 1
    "fwd_bf16_d128_causal_m128n176_s2_ov1_pp1_ws1",        # parts out of order
])
def test_parse_name_rejects_non_canonical(name):
    with pytest.raises(ValueError, match="expected {direction}_"):
        parse_name(name)


def test_variant_info_row_follows_struct():
    fwd = parse_name("fwd_fp16_d64_causal_m192n128_s3_ws0_pp0_ov1")
    row = dict(zip((f for f, _ in VARIANT_INFO), contract.variant_info_values(fwd, True)))
    assert len(row) == len(VARIANT_INFO)
    assert row["name"] == f'"{fwd.name}"' and row["dtype"] == '"fp16"'
    assert (row["head_dim"], row["causal"], row["intra_wg_overlap"], row["is_default"]) == (
        "64", "1", "1", "1")
    assert row["launch_fwd"] == f"&fa3gen_launch_{fwd.name}" and row["launch_bwd"] == "nullptr"
    assert contract.variant_info_zero() == [
        "nullptr" if contract.is_pointer(t) else "0" for _, t in VARIANT_INFO]
    assert (row["local"], row["softcap"], row["varlen"]) == ("0", "0", "0")
    assert contract.template_args(fwd) == ["cutlass::half_t", "64", "192", "128", "3", "true",
                                           "false", "false", "false", "false", "false", "false", "true",
                                           "false", "false", "false"]
    assert row["peel_masked"] == "0" and row["p_in_smem"] == "0" and row["paged"] == "0"
    assert row["o_tma_store"] == "0"
    via_tma = dataclasses.replace(fwd, o_tma_store=True)  # a knob spelled after the paged key
    assert via_tma.name.endswith("_ov1_otma") and parse_name(via_tma.name) == via_tma
    assert contract.template_args(via_tma)[-1] == "true"
    assert contract.variant_info_values(via_tma, False)[list(dict(VARIANT_INFO)).index("o_tma_store")] == "1"
    paged = dataclasses.replace(fwd, varlen=True, paged=True)
    assert contract.template_args(paged)[8:10] == ["true", "true"]  # Varlen, Paged
    assert contract.variant_info_values(paged, False)[list(dict(VARIANT_INFO)).index("paged")] == "1"


# ------------------------------------------------------------------------------- layout


def test_output_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    assert contract.library_path("h100") == tmp_path / "h100" / "lib" / "libfa3gen_h100.so"
    assert contract.manifest_path("h100") == tmp_path / "h100" / "manifest.json"
    assert contract.spec_name_of_library(contract.library_path("a.b-c")) == "a.b-c"
    assert contract.spec_name_of_library("/x/libm.so.6") is None
    monkeypatch.delenv("FA3GEN_GENERATED")  # read per call
    assert contract.spec_out_dir("t") == contract.REPO_ROOT / "generated" / "t"


# ------------------------------------------------------------------------------- dependencies


def test_contract_and_runtime_import_no_generator():
    """The contract is stdlib only; the runtime (spec .yaml paths included) needs no generator."""
    code = ("import sys\n"
            "import fa3gen.contract\n"
            "assert not {'yaml', 'jinja2', 'torch', 'generator'} & set(sys.modules), 'contract'\n"
            "from fa3gen import runtime\n"
            "assert runtime.resolve_library('specs/tiny.yaml')[1] == 'tiny'\n"
            "assert not {'jinja2', 'torch', 'generator'} & set(sys.modules), 'runtime'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=contract.REPO_ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# The tool side (commands that build or rewrite specs) may use the generator; nothing else in
# fa3gen/ does.
GENERATOR_USERS = {"cli.py", "ablate.py", "tune.py"}


def test_package_modules_do_not_import_generator():
    users = set()
    for path in sorted((contract.REPO_ROOT / "fa3gen").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "generator" for n in names):
                users.add(path.name)
    assert users <= GENERATOR_USERS
