"""Render the per-variant translation units and the dispatch table from Jinja templates.

Files are written only when their text changes, so untouched files keep their mtime and
ninja recompiles exactly the variants whose source changed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import jinja2

from fa3gen.contract import (LAUNCHERS, Variant, launch_symbol, template_args,
                             variant_info_values, variant_info_zero)

from .paths import TEMPLATES_DIR


def c_string(text: str) -> str:
    """A C string literal for any text (JSON build info goes through here)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= ord(ch) < 127:
            out.append(ch)
        else:  # octal escapes cannot swallow following hex digits, unlike \x
            out.extend(f"\\{b:03o}" for b in ch.encode())
    return '"' + "".join(out) + '"'


def environment(templates_dir: Path = TEMPLATES_DIR) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,  # a typo in a template is an error, not ""
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
        autoescape=False)
    env.filters["cstring"] = c_string
    env.filters["cinit"] = lambda values: "{" + ", ".join(values) + "}"
    return env


def render_variant(v: Variant, env: jinja2.Environment | None = None) -> str:
    env = env or environment()
    return env.get_template("variant.cu.j2").render(
        name=v.name, launcher=LAUNCHERS[v.direction], symbol=launch_symbol(v),
        template_args=template_args(v))


def render_dispatch(spec_name: str, variants: list[Variant], default_names: Iterable[str],
                    build_info: dict, env: jinja2.Environment | None = None) -> str:
    env = env or environment()
    defaults = set(default_names)
    info = json.dumps(build_info, sort_keys=True)
    return env.get_template("dispatch.cu.j2").render(
        spec_name=spec_name,
        launchers=[(launch_symbol(v), LAUNCHERS[v.direction].params) for v in variants],
        rows=[variant_info_values(v, v.name in defaults) for v in variants],
        empty_row=variant_info_zero(), build_info=info)


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` unless the file already holds it; True when the file was written."""
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: ninja never sees a half-written file
    return True


@dataclass
class RenderResult:
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)


def render_sources(out_dir: Path, spec_name: str, variants: list[Variant],
                   default_names: Iterable[str], fingerprint: str, build_info: dict,
                   env: jinja2.Environment | None = None) -> RenderResult:
    """src/<name>.cu per variant, src/dispatch.cu, fingerprint.txt; drop stale sources."""
    env = env or environment()
    out_dir = Path(out_dir)
    res = RenderResult()
    files = {out_dir / "src" / f"{v.name}.cu": render_variant(v, env) for v in variants}
    files[out_dir / "src" / "dispatch.cu"] = render_dispatch(
        spec_name, variants, default_names, build_info, env)
    files[out_dir / "fingerprint.txt"] = fingerprint + "\n"
    for path, text in files.items():
        (res.written if write_if_changed(path, text) else res.unchanged).append(path)
    # Variants no longer in the spec: remove their source and build products.
    names = {v.name for v in variants} | {"dispatch"}
    for pattern in ("src/*.cu", "obj/*.o", "obj/*.resources.json", "obj/*.log"):
        for p in sorted(out_dir.glob(pattern)):
            if p.name.split(".", 1)[0] not in names:
                p.unlink()
                res.removed.append(p)
    return res
