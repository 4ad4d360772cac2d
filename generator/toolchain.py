"""The compiler toolchain: nvcc, CUTLASS headers, flags, and the build fingerprint.

CUTLASS is located without importing it (importing cutlass_library is slow and pulls in
its Python generator); we only need the header directory shipped in the wheel.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Sequence
from pathlib import Path

from . import __version__
from .errors import ToolchainError
from .paths import KERNELS_DIR, TEMPLATES_DIR

GENCODE = ["-gencode", "arch=compute_90a,code=sm_90a"]  # 'a': WGMMA + setmaxnreg need it
LINK_FLAGS = ["-shared", "-cudart", "static", *GENCODE]


def find_nvcc() -> Path:
    """env NVCC, then PATH, then /usr/local/cuda/bin/nvcc."""
    env = os.environ.get("NVCC")
    if env:
        p = Path(env)
        if not p.is_file():
            raise ToolchainError(f"NVCC={env} " + ("is a folder, not the nvcc program" if p.is_dir()
                                                   else "does not exist"))
        return p
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    if default.is_file():
        return default
    raise ToolchainError("nvcc not found (set NVCC, put nvcc on PATH, or install CUDA "
                         "in /usr/local/cuda)")


def find_cutlass_include() -> Path:
    """env CUTLASS_DIR (a CUTLASS checkout or its include/ dir), else the nvidia-cutlass wheel."""
    env = os.environ.get("CUTLASS_DIR")
    if env:
        for cand in (Path(env) / "include", Path(env)):
            if (cand / "cute" / "tensor.hpp").is_file():
                return cand
        raise ToolchainError(f"CUTLASS_DIR={env}: no cute/tensor.hpp under it or its include/")
    spec = importlib.util.find_spec("cutlass_library")  # finds the file, runs nothing
    if spec is None or not spec.origin:
        raise ToolchainError("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 "
                             "or set CUTLASS_DIR")
    inc = Path(spec.origin).parent / "source" / "include"
    if not (inc / "cute" / "tensor.hpp").is_file():
        raise ToolchainError(f"cutlass_library found but {inc}/cute/tensor.hpp is missing")
    return inc


def nvcc_version(nvcc: Path) -> str:
    """The full `nvcc --version` text (build id included: it goes into the fingerprint)."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"cannot run {nvcc} --version: {e}")
    lines = [ln.strip() for ln in out.splitlines() if "release" in ln or ln.startswith("Build")]
    return " | ".join(lines) or out.strip()


def cutlass_version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define\s+CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ToolchainError(f"cannot parse {include}/cutlass/version.h")
    return ".".join(m.group(1) for m in parts)


DEFINE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(=[^\s]*)?")


def check_defines(defines: Sequence[str]) -> list[str]:
    """`--define` values (NAME or NAME=VALUE, as nvcc's -D takes them), checked."""
    for d in defines:
        if not DEFINE_RE.fullmatch(d):
            raise ToolchainError(f"--define {d!r}: expected NAME or NAME=VALUE (NAME a C identifier, "
                                 "VALUE without spaces)")
    return list(defines)


def compile_flags(cutlass_include: Path, debug: bool = False, lineinfo: bool = False,
                  defines: Sequence[str] = ()) -> list[str]:
    flags = ["-std=c++17", "-O3", *GENCODE, "--expt-relaxed-constexpr", "--use_fast_math"]
    if not debug:
        flags.append("-DNDEBUG")  # device asserts cost a lot of speed
    # CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED: defined by the TUs that need it (generator/render.py)
    flags += ["-Xcompiler", "-fPIC", "-Xptxas", "-v"]     # -v: registers/spills per kernel
    # Export only FA3GEN_API (fa3gen_abi.h): C++ template instances and their statics stay
    # private to each library, so that two libraries load side by side in one process.
    flags += ["-Xcompiler", "-fvisibility=hidden"]
    if debug or lineinfo:
        flags.append("-lineinfo")
    flags += [f"-D{d}" for d in check_defines(defines)]  # debugging builds (e.g. FA3GEN_DECODE_TRACE)
    flags += [f"-I{KERNELS_DIR}", f"-I{cutlass_include}"]
    return flags


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    nvcc_version: str
    cutlass_include: Path
    cutlass_version: str
    flags: tuple[str, ...]
    link_flags: tuple[str, ...] = tuple(LINK_FLAGS)
    templates_dir: Path = field(default=TEMPLATES_DIR)

    def fingerprint(self) -> str:
        return fingerprint(self.nvcc_version, self.flags, self.link_flags,
                           self.cutlass_version, self.templates_dir)

    def describe(self) -> dict:
        env = nvcc_env_flags()
        return {"nvcc": str(self.nvcc), "nvcc_version": self.nvcc_version,
                "cutlass_include": str(self.cutlass_include),
                "cutlass_version": self.cutlass_version, "flags": list(self.flags),
                "link_flags": list(self.link_flags), "generator_version": __version__,
                **({"nvcc_env_flags": env} if env else {})}


# nvcc reads these itself: flags that reach every compile without being in ours
NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")


def nvcc_env_flags() -> dict[str, str]:
    """The NVCC_ENV_FLAGS set now (non-empty), by name."""
    return {v: os.environ[v] for v in NVCC_ENV_FLAGS if os.environ.get(v, "").strip()}


def detect(debug: bool = False, lineinfo: bool = False, defines: Sequence[str] = ()) -> Toolchain:
    nvcc = find_nvcc()
    inc = find_cutlass_include()
    return Toolchain(nvcc, nvcc_version(nvcc), inc, cutlass_version(inc),
                     tuple(compile_flags(inc, debug, lineinfo, defines)))


def template_hashes(templates_dir: Path = TEMPLATES_DIR) -> list[tuple[str, str]]:
    """(relative path, sha256) of the Jinja templates. Not the kernel headers under
    templates/kernels/: ninja tracks those per translation unit from nvcc's depfiles, so a
    header edit rebuilds only the variants that include it."""
    out = []
    for p in sorted(templates_dir.rglob("*")):
        rel = p.relative_to(templates_dir)
        if p.is_file() and "__pycache__" not in p.parts and rel.parts[0] != "kernels":
            out.append((rel.as_posix(), hashlib.sha256(p.read_bytes()).hexdigest()))
    return out


def fingerprint(nvcc_version: str, flags, link_flags, cutlass_version: str,
                templates_dir: Path = TEMPLATES_DIR) -> str:
    """Everything that changes the compiled output without changing a rendered .cu file.

    Absolute -I paths are part of `flags` on purpose: a different CUTLASS checkout is a
    different build."""
    h = hashlib.sha256()
    nvcc_env = [os.environ.get(v, "") for v in NVCC_ENV_FLAGS]
    for part in (nvcc_version, " ".join(flags), " ".join(link_flags), cutlass_version,
                 __version__, *nvcc_env):
        h.update(part.encode() + b"\0")
    for rel, digest in template_hashes(templates_dir):
        h.update(f"{rel}={digest}\n".encode())
    return h.hexdigest()
