"""Where the generator's inputs live: templates/ (Jinja templates and the kernel headers) and
specs/. In a checkout they sit at the repository root; an installed wheel carries them as
package data of `generator` (pyproject.toml maps them to generator/_templates and
generator/_specs). Build outputs are laid out by fa3gen.contract, which the runtime shares."""
import importlib.resources
import os
from pathlib import Path

from fa3gen.contract import IN_CHECKOUT, REPO_ROOT, SPEC_SUFFIXES


def _data_dir(checkout_name: str, package_name: str) -> Path:
    if IN_CHECKOUT:
        return REPO_ROOT / checkout_name
    return Path(str(importlib.resources.files("generator") / package_name))


TEMPLATES_DIR = _data_dir("templates", "_templates")
KERNELS_DIR = TEMPLATES_DIR / "kernels"
SPECS_DIR = _data_dir("specs", "_specs")


def resolve_spec_path(spec: str) -> Path:
    """Accept a path to a YAML file or a bare spec name from specs/ (e.g. `h100`)."""
    p = Path(spec)
    if p.is_file() or p.suffix in SPEC_SUFFIXES or os.sep in spec:  # not a folder named h100
        return p
    for suffix in SPEC_SUFFIXES:
        cand = SPECS_DIR / (spec + suffix)
        if cand.exists():
            return cand
    return p
