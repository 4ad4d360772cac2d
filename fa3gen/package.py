"""`fa3gen package`: a built library as a wheel that needs no compiler.

The wheel holds one import package, `fa3gen_<spec>` by default: the built library and its
manifest under lib/, and a copy of the runtime (RUNTIME_MODULES) with
its imports and its torch custom-op namespace renamed to that package. Nothing of the generator, the
templates, nvcc or CUTLASS goes in. Because every name is the package's own, wheels of two
specs install side by side, and beside the fa3gen tool, in one environment and one process.
The packaged runtime loads its bundled library by default (runtime.BUNDLED_LIBRARY).
"""
from __future__ import annotations

import base64
import hashlib
import json
import keyword
import re
import sys
import sysconfig
import zipfile
from pathlib import Path

from fa3gen import __version__, contract
from fa3gen.errors import Fa3genError, build_command
from fa3gen.files import replacing

# The runtime modules a packaged library needs, in dependency order.
RUNTIME_MODULES = ("contract", "errors", "files", "runtime", "tracing", "fp8", "ops", "varlen",
                   "packed", "kvcache",
                   "reference")  # reference: fp8's Hadamard signs and rotary, kvcache's rotary
REQUIRES = ("torch>=2.4", "pyyaml")


def _rename(source: str, package: str) -> str:
    """fa3gen's imports and custom-op namespace, renamed to `package`."""
    source = re.sub(r"\bfrom fa3gen import\b", f"from {package} import", source)
    source = re.sub(r"\b(from|import) fa3gen\.", rf"\1 {package}.", source)
    source = source.replace('"fa3gen::', f'"{package}::').replace("torch.ops.fa3gen.", f"torch.ops.{package}.")
    return source


# The tool's top-level import packages (pyproject.toml): a wheel of one of these names would
# install over the tool's own files.
TOOL_PACKAGES = ("fa3gen", "generator")


def _packaged_api() -> dict[str, str]:
    """fa3gen's lazily loaded API ({name: module}) that the packaged runtime carries too."""
    from fa3gen import _LAZY_ATTRS

    api = {name: module.rsplit(".", 1)[1] for name, module in _LAZY_ATTRS.items()}
    return {name: module for name, module in api.items() if module in RUNTIME_MODULES}


def _init_source(package: str, spec: str, version: str) -> str:
    api = _packaged_api()
    names = ", ".join(f"`{n}`" for n in api)
    import fa3gen
    from fa3gen import errors as error_module

    errors = tuple(sorted(n for n in fa3gen.__all__ if hasattr(error_module, n)))  # fa3gen's own
    exported = [*api, *errors, "__version__"]
    return f'''"""fa3gen kernels of spec {spec!r}, packaged with `fa3gen package` (fa3gen {__version__},
C ABI {contract.ABI_VERSION}). {names} run the bundled library's variants, as fa3gen's do."""
import importlib

from .errors import ({", ".join(errors)})

__version__ = {version!r}
SPEC = {spec!r}
__all__ = {exported!r}
_LAZY_ATTRS = {api!r}
_LAZY_MODULES = {tuple(sorted(RUNTIME_MODULES))!r}


def __getattr__(name):
    if name in _LAZY_ATTRS:  # imports torch on first use, like fa3gen
        value = globals()[name] = getattr(importlib.import_module("." + _LAZY_ATTRS[name], __name__), name)
        return value
    if name in _LAZY_MODULES:  # {package}.runtime and the others, as fa3gen.runtime
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module {{__name__!r}} has no attribute {{name!r}}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_ATTRS) | set(_LAZY_MODULES))
'''


def _commit(built_from: str | None = None) -> str:
    """The commit that built the library (its manifest's source_commit), else bench.git_commit()
    (a build that predates the field), as a local-version label: g<10 hex>[.dirty], or
    "unknown"."""
    from fa3gen.bench import git_commit

    commit = built_from if isinstance(built_from, str) and built_from else git_commit()
    if not commit:
        return "unknown"
    head, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    label = "g" + re.sub(r"[^0-9A-Za-z]+", ".", head)[:10].strip(".")
    return label + (".dirty" if dirty else "")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _taken_by(name: str) -> str | None:
    """What already answers `import name` here, unless it is an earlier wheel of this tool
    (which the new one replaces, as intended): a standard-library module, or an installed
    module or package (torch, yaml: the runtime's own dependencies among them)."""
    import importlib.util

    if name in sys.stdlib_module_names:
        return "a standard-library module"
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    # Nothing, a bare folder (a namespace package), or a finder's answer with no file behind it
    # (an editable install's finder may map names it does not hold): not a module to replace.
    init = Path(found.origin) if found is not None and found.origin else None
    if init is None or not init.is_file():
        return None
    if init.name == "__init__.py" and \
            "packaged with `fa3gen package`" in init.read_text(errors="replace")[:400]:
        return None
    return f"an installed module ({found.origin})"


def _distribution(name: str) -> str:
    """pip's normalized distribution name: case and runs of -_. folded (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution_taken_by(package_name: str, distributions=None) -> str | None:
    """What pip would uninstall to install a wheel of package_name, unless it is an earlier
    wheel of this package (which the new one replaces, as intended): pip matches installed
    distributions by the normalized name, so `PyYAML` would replace pyyaml, a requirement of
    the wheel itself, and fa3gen_t__1 a wheel of package fa3gen_t_1, whose import it breaks."""
    from importlib import metadata

    wanted = _distribution(package_name)
    for requirement in REQUIRES:
        if _distribution(re.match(r"[A-Za-z0-9._-]+", requirement).group()) == wanted:
            return f"a package the wheel requires ({requirement})"
    for dist in metadata.distributions() if distributions is None else distributions:
        name = dist.metadata.get("Name") or ""
        if _distribution(name) != wanted:
            continue
        ours = "Generator: fa3gen package" in (dist.read_text("WHEEL") or "")
        top_level = (dist.read_text("top_level.txt") or "").split()
        if ours and top_level == [package_name]:
            continue
        return (f"the installed distribution {name} {dist.version}"
                + (f" (a wheel of package {', '.join(top_level)})" if ours else ""))
    return None


# Flags of a build that change what its kernels compute or cost (build --define, --debug):
# measurement switches, some of them wrong on purpose (FA3GEN_FP8_SKIP_TRANSPOSE).
_SHIPPED_DEFINES = ("-DNDEBUG",)


# nvcc flags that say where tools and headers are, not what the kernels compute: conda's
# cuda-nvcc sets NVCC_PREPEND_FLAGS="-ccbin=$CXX" in every environment.
_PLACE_FLAGS = ("-ccbin", "--compiler-bindir", "-I", "-isystem", "--include-path",
                "--system-include")


def _changes_the_code(flags) -> bool:
    """Whether an nvcc flags string holds anything but _PLACE_FLAGS (and their values)."""
    import shlex
    if not isinstance(flags, str):  # not what a build records: say it
        return True
    try:
        tokens = shlex.split(flags)
    except ValueError:  # an unclosed quote: nvcc would not have taken it either
        return True
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if not t.startswith(_PLACE_FLAGS):
            return True
        i += 2 if t in _PLACE_FLAGS else 1  # "-ccbin PATH": the value is the next token
    return False


def _build_switches(info: dict) -> list[str]:
    """The --define flags of a manifest's build (all but NDEBUG), "no -DNDEBUG" for a debug
    build (--debug: device asserts kept), and nvcc's own NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS
    where the build ran with them (flags of any kind, none of them fa3gen's)."""
    toolchain = info.get("toolchain")
    flags = toolchain.get("flags") if isinstance(toolchain, dict) else None
    if not isinstance(flags, list) or not flags:  # not recorded: nothing to say
        return []
    switches = [f for f in flags if isinstance(f, str) and f.startswith("-D") and f not in _SHIPPED_DEFINES]
    env = toolchain.get("nvcc_env_flags")
    if isinstance(env, dict):
        switches += [f"{name}={value!r} (nvcc's environment)" for name, value in env.items()
                     if _changes_the_code(value)]
    return switches + ([] if "-DNDEBUG" in flags else ["no -DNDEBUG (a --debug build)"])


def _content_label(files: dict[str, bytes]) -> str:
    """A local-version label of what the wheel runs (the library and the runtime's sources, not
    the manifest, whose paths and compile times differ between identical builds): a rebuilt or
    re-filtered library is a new version, so pip replaces the installed one."""
    digest = hashlib.sha256()
    for name in sorted(n for n in files if not n.endswith(f"/{contract.MANIFEST_NAME}")):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return "h" + digest.hexdigest()[:8]


def package(spec_name: str, out_dir: Path = Path("dist"), name: str | None = None,
            allow_switches: bool = False, spec_file: str | None = None) -> Path:
    """Write the wheel of spec_name's built library into out_dir; returns its path.
    allow_switches: package a build made with --define or --debug (labelled `.switches`).
    spec_file: the --spec the caller gave (a file outside specs/ too), named by the hints."""
    library, manifest = contract.library_path(spec_name), contract.manifest_path(spec_name)
    build = build_command(spec_name, spec_file)
    out_dir = Path(out_dir)
    if not library.is_file() or not manifest.is_file():
        raise Fa3genError(f"no built library of spec {spec_name!r} at {library} (with its "
                          f"{contract.MANIFEST_NAME}); build it first: {build}")
    try:
        info = json.loads(manifest.read_text())
    except (ValueError, OSError) as e:  # JSON errors and non-UTF-8 bytes are ValueErrors
        raise Fa3genError(f"{manifest}: unreadable ({e}); rebuild: {build}") from e
    if not isinstance(info, dict) or not isinstance(info.get("variants", []), list):
        raise Fa3genError(f"{manifest}: not a manifest; rebuild: {build}")
    if info.get("abi_version") != contract.ABI_VERSION:
        raise Fa3genError(f"{manifest}: built for C ABI {info.get('abi_version')!r}, this fa3gen "
                          f"speaks {contract.ABI_VERSION}; rebuild: {build}")
    switches = _build_switches(info)
    if switches and not allow_switches:
        raise Fa3genError(f"the library of spec {spec_name!r} was built with {', '.join(switches)}: "
                          "a measurement or debug build, not one to ship (some switches give wrong "
                          f"results on purpose); rebuild without them ({build}), or pass --allow-switches "
                          "to package it anyway")
    package_name = name or contract.package_name_of(spec_name)
    # importable, and a distribution name pip takes (letters or digits at both ends)
    if not (package_name.isidentifier() and package_name.isascii()) or keyword.iskeyword(package_name) \
            or not re.fullmatch(r"[A-Za-z0-9](\w*[A-Za-z0-9])?", package_name):
        given = f"--name {package_name!r}" if name else \
            f"the package name {package_name!r} made from spec name {spec_name!r}"
        raise Fa3genError(f"{given} is not a Python package name pip installs (ASCII letters, "
                          "digits and _, a letter or digit at both ends)" + ("" if name else
                          "; pass --name"))
    if _distribution(package_name) in TOOL_PACKAGES:
        raise Fa3genError(f"--name {package_name} is the tool's own package: choose another name")
    taken = _taken_by(package_name) or _distribution_taken_by(package_name)
    if taken:
        raise Fa3genError(f"--name {package_name} is {taken}: installing the wheel would replace "
                          "it; choose another name")
    files: dict[str, bytes] = {}
    here = Path(__file__).parent
    for module in RUNTIME_MODULES:
        files[f"{package_name}/{module}.py"] = _rename((here / f"{module}.py").read_text(),
                                                       package_name).encode()
    files[f"{package_name}/lib/{library.name}"] = library.read_bytes()
    files[f"{package_name}/lib/{contract.MANIFEST_NAME}"] = manifest.read_bytes()
    # Local version (pip installs it; PyPI would not): the fa3gen commit and C ABI that built
    # it, and what it holds: the modules and library, and what this packager writes around
    # them (the package's __init__ and requirements), so that a wheel that differs is a new
    # version pip replaces (the commit is the library's build's, not the packager's).
    written = {f"{package_name}/__init__.py": _init_source(package_name, spec_name, "").encode(),
               "requires": "\n".join(REQUIRES).encode()}
    version = (f"{__version__}+abi{contract.ABI_VERSION}.{_commit(info.get('source_commit'))}."
               f"{_content_label({**files, **written})}" + (".switches" if switches else ""))
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    dist_info = f"{package_name}-{version}.dist-info"
    files[f"{package_name}/__init__.py"] = _init_source(package_name, spec_name, version).encode()
    files[f"{dist_info}/METADATA"] = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {package_name}", f"Version: {version}",
         f"Summary: fa3gen attention kernels of spec {spec_name} ({len(info.get('variants', []))} "
         f"variants, C ABI {contract.ABI_VERSION})",
         "Requires-Python: >=3.10", *(f"Requires-Dist: {r}" for r in REQUIRES), ""]).encode()
    files[f"{dist_info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: fa3gen package\n"
                                   f"Root-Is-Purelib: false\nTag: py3-none-{platform}\n").encode()
    files[f"{dist_info}/top_level.txt"] = f"{package_name}\n".encode()
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()

    if out_dir.exists() and not out_dir.is_dir():
        raise Fa3genError(f"--out {out_dir} is a file, not a folder for the wheel")
    wheel = out_dir / f"{package_name}-{version}-py3-none-{platform}.whl"
    with replacing(wheel) as tmp, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():  # a fixed time: the same build packages to the same bytes
            entry = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            z.writestr(entry, d, compress_type=zipfile.ZIP_DEFLATED)
    # Earlier wheels of this package in out_dir go: their versions end in a content hash, which
    # pip orders as text, so `pip install DIR/<package>-*.whl` found two candidates (no
    # resolution) and --find-links could pick an older build.
    for old in out_dir.glob(f"{package_name}-*-py3-none-*.whl"):
        if old.name != wheel.name and old.name.split("-")[0] == package_name:
            old.unlink()
            print(f"fa3gen: removed the earlier wheel {old}", file=sys.stderr)
    return wheel
