"""Where the generator's inputs live. The package is used from the checkout, so everything is
relative to the repository root. Build outputs are laid out by fa3gen.contract, which the
runtime shares."""
import os
from pathlib import Path

from fa3gen.contract import REPO_ROOT

TEMPLATES_DIR = REPO_ROOT / "templates"
KERNELS_DIR = TEMPLATES_DIR / "kernels"
SPECS_DIR = REPO_ROOT / "specs"


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
