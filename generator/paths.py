"""Where things live. The package is used from the checkout, so everything is relative
to the repository root (the parent of this package)."""
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "templates"
KERNELS_DIR = TEMPLATES_DIR / "kernels"
SPECS_DIR = REPO_ROOT / "specs"


def generated_root() -> Path:
    """Root of build outputs; FA3GEN_GENERATED overrides (read per call so tests can set it)."""
    env = os.environ.get("FA3GEN_GENERATED")
    return Path(env).resolve() if env else REPO_ROOT / "generated"


def spec_out_dir(spec_name: str) -> Path:
    return generated_root() / spec_name


def resolve_spec_path(spec: str) -> Path:
    """Accept a path to a YAML file or a bare spec name from specs/ (e.g. `h100`)."""
    p = Path(spec)
    if p.exists() or p.suffix in (".yaml", ".yml") or os.sep in spec:
        return p
    for suffix in (".yaml", ".yml"):
        cand = SPECS_DIR / (spec + suffix)
        if cand.exists():
            return cand
    return p
