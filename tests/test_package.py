"""`fa3gen package`: a built library as a wheel with its own copy of the runtime, installed and
imported without the checkout, the tool, nvcc or CUTLASS."""
import json
import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from fa3gen import cli, contract
from tests.test_runtime_errors import build_fake_lib


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A generated root holding spec 'fake' built (the fake C library and a manifest)."""
    root = tmp_path / "gen"
    monkeypatch.setenv("FA3GEN_GENERATED", str(root))
    lib = contract.library_path("fake")
    lib.parent.mkdir(parents=True)
    build_fake_lib(tmp_path).rename(lib)
    contract.manifest_path("fake").write_text(json.dumps(
        {"spec": "fake", "abi_version": contract.ABI_VERSION, "variants": [{"name": "x"}] * 3}))
    return tmp_path


def install(wheel, target, *code):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    # python -S: not even the checkout's editable fa3gen is importable; torch and yaml come from
    # this interpreter's site-packages.
    env = {k: v for k, v in os.environ.items() if k not in ("FA3GEN_GENERATED",)}
    env.update(PYTHONPATH=os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]),
               FA3GEN_LIB="/nonexistent/libfa3gen_other.so")  # the bundled library wins
    return subprocess.run([sys.executable, "-S", "-c", "\n".join(code)], cwd=target, env=env,
                          capture_output=True, text=True)


def test_package_installs_and_loads_its_library(built, capsys):
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 0, capsys.readouterr().err
    wheel = next((built / "dist").glob("fa3gen_fake-*.whl"))
    assert f"wrote {wheel}" in capsys.readouterr().out
    names = zipfile.ZipFile(wheel).namelist()
    assert "fa3gen_fake/lib/libfa3gen_fake.so" in names and "fa3gen_fake/lib/manifest.json" in names
    assert not any(n.startswith(("generator/", "fa3gen/")) or n.endswith((".cuh", ".j2")) for n in names)
    assert f"+abi{contract.ABI_VERSION}." in wheel.name
    proc = install(wheel, built / "site",
                   "import sys, fa3gen_fake as f",
                   "from fa3gen_fake import runtime, ops",
                   "lib = runtime.get_library()",
                   "print(lib.path); print(lib.find('fwd', 'bf16', 128, False).name)",
                   "print('fa3gen' in sys.modules)",
                   "import torch",
                   "q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)",
                   "try:\n    f.flash_attn_func(q, q, q)\nexcept f.Fa3genError as e:\n    print('error:', e)",
                   "print(torch.ops.fa3gen_fake.fwd)",
                   "cu = torch.tensor([0, 8], dtype=torch.int32)",
                   "try:\n    f.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8)\n"
                   "except f.Fa3genError as e:\n    print('error:', e)",
                   "print(torch.ops.fa3gen_fake.varlen_fwd)",
                   "print(f.__version__, f.SPEC, f.flash_attn_with_kvcache.__module__,",
                   "      f.quantize_fp8.__module__, f.trace.__module__, f.TraceError.__module__,",
                   "      f.AbiMismatchError.__name__, f.VariantNotBuiltError.__name__)")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    version = wheel.name.split("-")[1]
    assert lines[-1].split() == [version, "fake", "fa3gen_fake.kvcache", "fa3gen_fake.fp8",
                                 "fa3gen_fake.tracing", "fa3gen_fake.errors", "AbiMismatchError",
                                 "VariantNotBuiltError"]
    assert lines[0] == str(built / "site" / "fa3gen_fake" / "lib" / "libfa3gen_fake.so")
    assert lines[1] == "fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1"
    assert lines[2] == "False"  # the packaged runtime never imports the tool
    assert lines[3].startswith("error:") and "CUDA" in lines[3]
    assert lines[5].startswith("error:") and "CUDA" in lines[5]  # the varlen API is packaged too


def test_two_packages_side_by_side(built):
    for name in ("fa3gen_a", "fa3gen_b"):
        assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist"), "--name", name]) == 0
    for wheel in (built / "dist").glob("*.whl"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(built / "site"), str(wheel)], check=True, capture_output=True)
    proc = install(next((built / "dist").glob("fa3gen_a-*.whl")), built / "site",
                   "import fa3gen_a.ops, fa3gen_b.ops, torch",
                   "print(torch.ops.fa3gen_a.fwd, torch.ops.fa3gen_b.fwd)")
    assert proc.returncode == 0, proc.stderr


def test_package_without_a_build_says_how(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    assert cli.main(["package", "--spec", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "no built library of spec 'tiny'" in err and "fa3gen build --spec tiny" in err


@pytest.mark.parametrize("name, message", [("class", "not a Python package name"),
                                           ("_priv", "not a Python package name"),
                                           ("fa3gen_", "not a Python package name"),
                                           ("9lives", "not a Python package name"),
                                           ("a\u00e9b", "not a Python package name"),
                                           ("fa3gen", "the tool's own package"),
                                           ("Fa3gen", "the tool's own package"),
                                           ("generator", "the tool's own package"),
                                           ("yaml", "an installed module"),
                                           ("torch", "an installed module"),
                                           ("json", "a standard-library module"),
                                           ("PyYAML", "a package the wheel requires (pyyaml)"),
                                           ("Jinja2", "the installed distribution Jinja2")])
def test_package_names_that_would_not_import_or_would_replace_the_tool(built, capsys, name, message):
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist"), "--name", name]) == 2
    assert message in capsys.readouterr().err and not (built / "dist").exists()


@pytest.mark.parametrize("manifest", [b"{not json", b"[1, 2]", b"\xff\xfe",
                                      b'{"abi_version": 14, "variants": 5}'])
def test_package_with_a_damaged_manifest_says_rebuild(built, capsys, manifest):
    contract.manifest_path("fake").write_bytes(manifest)
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 2
    err = capsys.readouterr().err
    assert "rebuild: fa3gen build --spec fake" in err and "Traceback" not in err


def test_the_packaged_runtime_imports_only_packaged_modules():
    """Every fa3gen module a packaged one imports (at the top or inside a function) is packaged
    too: a missing one fails only on the code path that imports it (fp8's Hadamard signs,
    kvcache's rotary needed `reference`)."""
    import re

    from fa3gen import package

    here = contract.__file__.rsplit("/", 1)[0]
    imported = set()
    for module in package.RUNTIME_MODULES:
        source = open(f"{here}/{module}.py").read()
        imported |= set(re.findall(r"\bfrom fa3gen\.(\w+) import\b", source))
        imported |= set(re.findall(r"\bimport fa3gen\.(\w+)", source))
        imported |= {name for group in re.findall(r"\bfrom fa3gen import ([\w, ()\n]+)", source)
                     for name in re.findall(r"\w+", group)}
    modules = {p.rsplit("/", 1)[-1][:-3] for p in __import__("glob").glob(f"{here}/*.py")}
    assert imported & modules <= set(package.RUNTIME_MODULES), imported & modules - set(package.RUNTIME_MODULES)


def test_package_refuses_a_library_of_another_abi(built, capsys):
    contract.manifest_path("fake").write_text(json.dumps({"spec": "fake", "abi_version": -1}))
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 2
    assert "built for C ABI -1" in capsys.readouterr().err


def test_wheel_record_lists_every_file_with_its_hash_and_size(built, capsys):
    """RECORD as pip checks it (PEP 376/427): every other file with sha256 in unpadded
    urlsafe base64 and its size, RECORD itself without either."""
    import base64
    import hashlib

    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 0, capsys.readouterr().err
    wheels = sorted((built / "dist").iterdir())
    assert len(wheels) == 1 and wheels[0].suffix == ".whl", wheels
    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
        [record_name] = [n for n in names if n.endswith(".dist-info/RECORD")]
        rows = {r.split(",")[0]: r.split(",")[1:] for r in z.read(record_name).decode().splitlines()}
        assert set(rows) == set(names) and rows[record_name] == ["", ""]
        for n in names:
            if n == record_name:
                continue
            data = z.read(n)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert rows[n] == [f"sha256={digest}", str(len(data))], n


@pytest.mark.parametrize("commit, label", [("0123456789abcdef", "g0123456789"),
                                           ("v1.2.3-45-gabcdef", "gv1.2.3.45"),
                                           ("0123456789abcdef-dirty", "g0123456789.dirty"),
                                           (None, "unknown")])
def test_the_version_label_says_a_dirty_tree(monkeypatch, commit, label):
    from fa3gen import bench, package

    monkeypatch.setattr(bench, "git_commit", lambda: commit)
    assert package._commit() == label
    assert package._commit(None) == label  # a manifest from before source_commit
    # The library's own commit (its manifest's source_commit) wins over the tree's.
    assert package._commit("fedcba9876543210") == "gfedcba9876"


def test_a_wheel_that_differs_only_in_what_the_packager_writes_is_a_new_version(built, monkeypatch):
    """The label hashed the modules and the library, not the __init__ and requirements the
    packager writes: a packager change gave other bytes under the same version, which pip
    keeps as installed."""
    from fa3gen import package

    first = package.package("fake", built / "a")
    assert package.package("fake", built / "b").name == first.name  # the same build: same name
    monkeypatch.setattr(package, "REQUIRES", ("torch>=2.5", "pyyaml"))
    assert package.package("fake", built / "c").name != first.name


def test_wheel_metadata_tags_and_contents_agree_with_its_name(built, capsys):
    """The file name, METADATA, WHEEL and the dist-info folder say one name, version and
    platform tag; the dependencies are declared; every runtime module is in, none of them still
    calls the tool's custom ops."""
    from fa3gen import __version__, package

    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 0, capsys.readouterr().err
    [wheel] = (built / "dist").glob("*.whl")
    name, version, py, abi, platform = wheel.name[:-len(".whl")].split("-")
    assert (name, py, abi) == ("fa3gen_fake", "py3", "none")
    assert platform == sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert version.startswith(f"{__version__}+abi{contract.ABI_VERSION}.")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"{name}-{version}.dist-info/METADATA").decode().splitlines()
        tags = z.read(f"{name}-{version}.dist-info/WHEEL").decode().splitlines()
        sources = {n: z.read(n).decode() for n in names if n.endswith(".py")}
        assert z.read(f"{name}-{version}.dist-info/top_level.txt").decode() == "fa3gen_fake\n"
    fields = [line.split(": ", 1) for line in meta if line]
    assert dict(fields)["Metadata-Version"] == "2.1"
    assert (dict(fields)["Name"], dict(fields)["Version"]) == (name, version)
    # the packaged runtime imports torch and yaml
    assert sorted(v.split(">=")[0] for k, v in fields if k == "Requires-Dist") == ["pyyaml", "torch"]
    assert "(3 variants" in dict(fields)["Summary"]
    assert f"Tag: {py}-{abi}-{platform}" in tags and "Root-Is-Purelib: false" in tags
    assert {f"fa3gen_fake/{m}.py" for m in package.RUNTIME_MODULES} <= set(sources)
    assert not [n for n, text in sources.items() if "torch.ops.fa3gen." in text or '"fa3gen::' in text]


def test_a_spec_name_that_is_no_identifier_gets_a_package_name(built, capsys):
    """Spec my-spec packages as fa3gen_my_spec without --name."""
    import shutil

    contract.library_path("my-spec").parent.mkdir(parents=True)
    shutil.copy(contract.library_path("fake"), contract.library_path("my-spec"))
    shutil.copy(contract.manifest_path("fake"), contract.manifest_path("my-spec"))
    assert cli.main(["package", "--spec", "my-spec", "--out", str(built / "dist")]) == 0, capsys.readouterr().err
    assert [w.name.split("-")[0] for w in (built / "dist").glob("*.whl")] == ["fa3gen_my_spec"]


def test_the_hints_name_the_spec_file_given(built, capsys):
    """A spec file outside specs/ was hinted by its name (fa3gen build --spec mine), a command
    that finds no such spec."""
    spec = built / "mine" / "other.yaml"
    spec.parent.mkdir()
    spec.write_text("name: other\n")
    assert cli.main(["package", "--spec", str(spec), "--out", str(built / "dist")]) == 2
    assert f"build it first: fa3gen build --spec {spec}\n" in capsys.readouterr().err


def test_a_manifest_without_its_library_says_build_it(built, capsys):
    contract.library_path("fake").unlink()
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 2
    assert "build it first: fa3gen build --spec fake" in capsys.readouterr().err


def test_a_name_an_earlier_wheel_of_this_tool_holds_can_be_packaged_again(built, tmp_path, monkeypatch):
    """An installed fa3gen wheel of that name is what the new one replaces: not refused."""
    from fa3gen import package as P
    site = tmp_path / "site" / "fa3gen_again"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(P._init_source("fa3gen_again", "fake", "0"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert P._taken_by("fa3gen_again") is None
    (site / "__init__.py").write_text("x = 1\n")  # someone else's package of that name
    import importlib
    importlib.invalidate_caches()
    assert "an installed module" in P._taken_by("fa3gen_again")


def test_an_out_path_that_is_a_file_is_one_error(built, capsys):
    out = built / "a_file"
    out.write_text("x")
    assert cli.main(["package", "--spec", "fake", "--out", str(out)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_finder_answer_without_a_file_does_not_take_a_name(monkeypatch):
    """An editable install's finder may answer for a name with a path that holds nothing: the
    name is free (find_spec's answer alone once refused it)."""
    import importlib.machinery
    import importlib.util

    from fa3gen import package as P
    ghost = importlib.machinery.ModuleSpec("fa3gen_ghost", None, origin="/nonexistent/fa3gen_ghost/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: ghost)
    assert P._taken_by("fa3gen_ghost") is None


def test_the_version_names_the_contents_and_the_wheel_is_reproducible(built, capsys):
    """A rebuilt library is a new version (pip kept the old one when both wheels said the same
    commit), and packaging one build twice gives the same bytes (fixed zip times)."""
    out = built / "dist"
    assert cli.main(["package", "--spec", "fake", "--out", str(out)]) == 0, capsys.readouterr().err
    [first] = out.glob("*.whl")
    again = built / "again"
    assert cli.main(["package", "--spec", "fake", "--out", str(again)]) == 0
    [second] = again.glob("*.whl")
    assert second.name == first.name and second.read_bytes() == first.read_bytes()
    # The same library with another manifest (its paths and compile times) is the same version.
    manifest = contract.manifest_path("fake")
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "spec_path": "/elsewhere.yaml"}))
    assert cli.main(["package", "--spec", "fake", "--out", str(again)]) == 0
    assert [w.name for w in again.glob("*.whl")] == [first.name]
    # The package's source does not depend on the interpreter's hash seed.
    from fa3gen import package
    sources = {subprocess.run([sys.executable, "-c", "from fa3gen import package; "
                               "print(package._init_source('p', 's', '1'))"],
                              env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True,
                              text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert len(sources) == 1 and sources == {package._init_source("p", "s", "1") + "\n"}
    lib = contract.library_path("fake")
    lib.write_bytes(lib.read_bytes() + b"\0")  # another build of the spec
    (out / "fa3gen_fakeother-1-py3-none-any.whl").write_bytes(b"")  # another package's: stays
    assert cli.main(["package", "--spec", "fake", "--out", str(out)]) == 0
    # The earlier wheel is replaced (pip orders the hashes as text: two of them in one folder
    # made `pip install dist/fa3gen_fake-*.whl` unresolvable)
    assert "removed the earlier wheel" in capsys.readouterr().err
    [rebuilt] = out.glob("fa3gen_fake-*.whl")
    version, old_version = rebuilt.name.split("-")[1], first.name.split("-")[1]
    assert version != old_version and version.split(".h")[0] == old_version.split(".h")[0]
    assert (out / "fa3gen_fakeother-1-py3-none-any.whl").exists()


def test_a_build_with_switches_is_refused_unless_allowed(built, capsys):
    """A library built with --define (measurement switches, some wrong on purpose) or --debug
    is not packaged by default; --allow-switches packages it, labelled."""
    manifest = contract.manifest_path("fake")
    info = json.loads(manifest.read_text())
    appended = {"nvcc_env_flags": {"NVCC_APPEND_FLAGS": "-DFA3GEN_FP8_SKIP_TRANSPOSE"}}
    for flags, said, more in (
            (["-O3", "-DNDEBUG", "-DFA3GEN_FP8_SKIP_TRANSPOSE"], "-DFA3GEN_FP8_SKIP_TRANSPOSE", {}),
            (["-O3", "-lineinfo"], "no -DNDEBUG (a --debug build)", {}),
            (["-O3", "-DNDEBUG"], "NVCC_APPEND_FLAGS='-DFA3GEN_FP8_SKIP_TRANSPOSE' (nvcc's "
             "environment)", appended)):
        manifest.write_text(json.dumps({**info, "toolchain": {"flags": flags, **more}}))
        assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 2
        err = capsys.readouterr().err
        assert f"was built with {said}" in err and "--allow-switches" in err
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist"), "--allow-switches"]) == 0
    [wheel] = (built / "dist").glob("*.whl")
    assert wheel.name.split("-")[1].endswith(".switches")
    manifest.write_text(json.dumps({**info, "toolchain": {"flags": ["-O3", "-DNDEBUG"]}}))
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "shipped")]) == 0
    # conda's nvcc sets NVCC_PREPEND_FLAGS to its host compiler: where tools are, not a switch
    for where in ("-ccbin=/opt/conda/bin/x86_64-conda-linux-gnu-c++", "-ccbin /usr/bin/g++-12 "
                  "-I/opt/include"):
        manifest.write_text(json.dumps({**info, "toolchain": {
            "flags": ["-O3", "-DNDEBUG"], "nvcc_env_flags": {"NVCC_PREPEND_FLAGS": where}}}))
        assert cli.main(["package", "--spec", "fake", "--out", str(built / "conda")]) == 0


def test_package_waits_for_no_build_it_refuses_one_that_runs(built, capsys):
    from generator.lock import build_lock
    with build_lock(contract.manifest_path("fake").parent, "spec fake", log=lambda m: None):
        assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 2
        assert "is being built (pid" in capsys.readouterr().err
    assert not (built / "dist").exists()


def test_the_packaged_package_exposes_its_modules_and_api_as_fa3gen_does(built, capsys):
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist")]) == 0, capsys.readouterr().err
    proc = install(next((built / "dist").glob("*.whl")), built / "site",
                   "import fa3gen_fake as f",
                   "print(f.runtime.get_library().path.name, f.ops.__name__)",
                   "print(sorted(set(f.__all__) - set(dir(f))), 'runtime' in dir(f))",
                   "from fa3gen_fake import *",
                   "print(flash_attn_func.__module__, VariantNotBuiltError.__module__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["libfa3gen_fake.so fa3gen_fake.ops", "[] True",
                                        "fa3gen_fake.ops fa3gen_fake.errors"]


def test_a_name_pip_folds_into_another_distribution_is_refused():
    """pip matches distributions by the normalized name (case, runs of -_.): a wheel of
    fa3gen_t__1 would uninstall the wheel of package fa3gen_t_1 and break its import; an
    earlier wheel of the same package is what the new one replaces."""
    from fa3gen import package as P

    class Dist:
        def __init__(self, name, wheel, top):
            self.metadata, self.version, self._files = {"Name": name}, "0.1", {
                "WHEEL": wheel, "top_level.txt": top}

        def read_text(self, name):
            return self._files.get(name)

    ours = Dist("fa3gen_t_1", "Wheel-Version: 1.0\nGenerator: fa3gen package\n", "fa3gen_t_1\n")
    assert P._distribution_taken_by("fa3gen_t__1", [ours]) == (
        "the installed distribution fa3gen_t_1 0.1 (a wheel of package fa3gen_t_1)")
    assert P._distribution_taken_by("fa3gen_t_1", [ours]) is None
    other = Dist("My.Kernels", "Generator: bdist_wheel\n", "my_kernels\n")
    assert P._distribution_taken_by("my_kernels", [other]) == "the installed distribution My.Kernels 0.1"
    assert P._distribution_taken_by("my_kernels2", [other]) is None


def test_a_spec_file_is_packaged_only_from_its_own_build(built, capsys):
    """Two spec files with one `name:` build into one folder: `package --spec FILE` wrote the
    other file's build as FILE's wheel."""
    recorded, other = built / "specs" / "fake.yaml", built / "mine" / "fake.yaml"
    for spec in (recorded, other):
        spec.parent.mkdir()
        spec.write_text("name: fake\n")
    manifest = contract.manifest_path("fake")
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "spec_path": str(recorded)}))
    assert cli.main(["package", "--spec", str(other), "--out", str(built / "dist")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(recorded) in err and str(other) in err
    assert f"fa3gen build --spec {other}" in err and not (built / "dist").exists()
    for spec in (str(recorded), "fake"):  # its own file, or the build's name
        assert cli.main(["package", "--spec", spec, "--out", str(built / "dist")]) == 0, capsys.readouterr().err


def test_a_moved_checkout_packages_its_build(built, capsys):
    """The manifest records the spec file's path and bytes: the same bytes at another path (a
    checkout moved, a tree copied to another machine) are that build, as the runtime takes
    them; bytes that differ there are another file's build."""
    import hashlib
    recorded, moved = built / "old" / "fake.yaml", built / "new" / "fake.yaml"
    for spec in (recorded, moved):
        spec.parent.mkdir()
        spec.write_text("name: fake\n")
    manifest = contract.manifest_path("fake")
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "spec_path": str(recorded),
                                    "spec_sha256": hashlib.sha256(recorded.read_bytes()).hexdigest()}))
    assert cli.main(["package", "--spec", str(moved), "--out", str(built / "dist")]) == 0, \
        capsys.readouterr().err
    moved.write_text("name: fake\n# tuned\n")
    assert cli.main(["package", "--spec", str(moved), "--out", str(built / "dist2")]) == 2
    assert f"was made from {recorded}, another spec file" in capsys.readouterr().err


def test_a_spec_file_edited_since_its_build_is_not_packaged(built, capsys):
    """The manifest records the spec file's bytes: a file edited (or rewritten by fa3gen tune)
    after the build had been packaged as that build without a word."""
    import hashlib
    spec = built / "specs" / "fake.yaml"
    spec.parent.mkdir()
    spec.write_text("name: fake\n")
    manifest = contract.manifest_path("fake")
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "spec_path": str(spec),
                                    "spec_sha256": hashlib.sha256(spec.read_bytes()).hexdigest()}))
    out = built / "dist"
    assert cli.main(["package", "--spec", str(spec), "--out", str(out)]) == 0, capsys.readouterr().err
    spec.write_text("name: fake\n# tuned\n")
    assert cli.main(["package", "--spec", str(spec), "--out", str(built / "dist2")]) == 2
    err = capsys.readouterr().err
    assert "changed since the build" in err and f"fa3gen build --spec {spec}" in err
    assert not (built / "dist2").exists()
    assert cli.main(["package", "--spec", "fake", "--out", str(built / "dist2")]) == 0  # by name
