"""Load a YAML spec and validate it into a frozen `Spec`.

Validation is strict (unknown keys and wrong types are errors) because a typo in a spec
would otherwise silently build the wrong set of kernels. Every error names the file, the
key path and the bad value. Whether a variant can *work* is not decided here: that is the
job of the named constraints in generator/variants.py.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from fa3gen.contract import (AXES, AXIS_BY_NAME, DECODE_DTYPES, DECODE_HEAD_DIMS, DECODE_PAIRS,
                             INT32_MAX, KEY_AXES, KNOB_AXES, spec_bytes_sha256)
from fa3gen.errors import yaml_error_place

from .errors import SpecError
from .paths import SPECS_DIR

TOP_KEYS = ("name", "axes", "groups", "exclude", "dispatch", "dispatch_required", "decode")
GROUP_KEYS = ("name", "axes")
DISPATCH_KEYS = ("when", "use", "seqlen_k")
SEQLEN_MAX = INT32_MAX  # the open upper end of a seqlen_k range
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

AxisValues = tuple  # tuple of allowed values for one axis


def fmt_value(value: Any, limit: int = 10_000) -> str:
    """Render a value the way it would be written in YAML flow style (for messages), stopping
    after about `limit` characters: YAML aliases can make a small file's value enormous."""
    if isinstance(value, tuple):
        value = list(value)
    parts: list[str] = []
    size = 0

    def walk(v) -> bool:  # False once the budget is spent
        nonlocal size
        if size > limit:
            return False
        if isinstance(v, (list, tuple)):
            parts.append("[")
            for i, x in enumerate(v):
                if i:
                    parts.append(", ")
                if not walk(x):
                    return False
            parts.append("]")
        elif isinstance(v, dict):
            parts.append("{")
            for i, (k, x) in enumerate(v.items()):
                parts.append((", " if i else "") + f"{_scalar(k)}: ")
                if not walk(x):
                    return False
            parts.append("}")
        else:
            parts.append(_scalar(v))
        size += len(parts[-1]) + 2
        return True

    walk(value)
    text = "".join(parts)
    return text if size <= limit else text[:limit] + "..."


def _scalar(v: Any) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _short(text: str, limit: int = 200) -> str:
    """A value's rendering cut for an error message (YAML aliases can expand without bound)."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


@dataclass(frozen=True)
class Match:
    """A set of axis -> allowed values; a variant matches when every listed axis matches.

    Used for `exclude` entries and for the `when`/`use` halves of dispatch entries."""
    where: str                                   # key path, e.g. "exclude[0]"
    items: tuple[tuple[str, AxisValues], ...]

    def matches(self, axes: Mapping[str, Any]) -> bool:
        return all(axes[k] in vals for k, vals in self.items)

    def matches_flags_off(self, axes: Mapping[str, Any]) -> bool:
        """A dispatch `when` (over key axes) or `use` (over knobs): like matches, and an
        optional flag it does not name (local, softcap, varlen, peel_masked) must be off, so
        that entries written before the axis existed keep their meaning."""
        named = {k for k, _ in self.items}
        return self.matches(axes) and not any(
            axes[a] for a in axes if a not in named and AXIS_BY_NAME[a].optional)

    def describe(self) -> str:
        parts = [f"{k}: {fmt_value(v[0] if len(v) == 1 else list(v))}" for k, v in self.items]
        return "{" + ", ".join(parts) + "}"


@dataclass(frozen=True)
class DispatchEntry:
    where: str      # "dispatch[i]"
    when: Match     # over KEY_AXES
    use: Match      # over KNOB_AXES
    # Only for calls with lo <= seqlen_k <= hi (None: every call; the key's default).
    seqlen_k: tuple[int, int] | None = None

    def describe(self) -> str:
        rng = f" seqlen_k {list(self.seqlen_k)}" if self.seqlen_k else ""
        return f"{self.where} (when {self.when.describe()}{rng} use {self.use.describe()})"


@dataclass(frozen=True)
class Group:
    """One block of the cartesian product: every axis has its (merged) list of values."""
    name: str
    axes: tuple[tuple[str, AxisValues], ...]

    def values(self, axis: str) -> AxisValues:
        return dict(self.axes)[axis]


@dataclass(frozen=True)
class Spec:
    name: str
    path: str                      # as given, for error messages
    groups: tuple[Group, ...]
    exclude: tuple[Match, ...] = ()
    dispatch: tuple[DispatchEntry, ...] = ()
    dispatch_required: bool = True  # false: keys with several variants may have no default
    # The KV-cache decode kernels the library also gets (flash_attn_with_kvcache): (dtype,
    # head_dim) pairs; `decode: true` is every pair, false or absent none.
    decode: tuple[tuple[str, int], ...] = ()
    # What validation accepted but a reader should hear of (a value repeated in one list),
    # each "<file>: <key path>: <message>".
    warnings: tuple[str, ...] = field(default=(), compare=False)
    # sha256 of the file's bytes as load_spec read them ("" for a text parsed alone): what a
    # build records, not the file as it is when the build ends (it may be edited meanwhile)
    sha256: str = field(default="", compare=False)

    def error(self, message: str) -> SpecError:
        return SpecError(f"{self.path}: {message}")


# --------------------------------------------------------------------------- loading

class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one). A key beside
    a merge key (`<<: *anchor`) overrides the merged one, as YAML says: not a duplicate."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    merges = 0
    for key_node, _ in node.value:  # the mapping's own keys, before the merge adds its pairs
        if key_node.tag == "tag:yaml.org,2002:merge":
            merges += 1
            if merges > 1:  # PyYAML would let the last one win silently
                raise yaml.constructor.ConstructorError(
                    None, None, "duplicate key '<<' (merge several mappings with "
                    "`<<: [*a, *b]`)", key_node.start_mark)
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            dup = key in seen
            seen.add(key)
        except TypeError:  # unhashable key: let validation report it
            continue
        if dup:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
    loader.flatten_mapping(node)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """Decimal integers only: YAML 1.1 (PyYAML) also reads 0100 as octal 64, 0x40, 6_4 and
    base 60 (1:04), which a spec meaning 100 or 64 would silently get as another number."""
    if not _DECIMAL.fullmatch(node.value):
        try:
            read = f" (YAML 1.1 reads it as {yaml.SafeLoader.construct_yaml_int(loader, node)})"
        except (ValueError, IndexError):  # 0x_, an empty !!int: no digits
            read = ""
        raise yaml.constructor.ConstructorError(
            None, None, f"{node.value!r} is not a decimal integer{read}; write the number in "
            "decimal, without leading zeros", node.start_mark)
    return int(node.value)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _exactly_in(value, allowed) -> bool:
    """value in allowed with its type too: 128.0 or True is not the head dim 128 or 1 (the
    axes refuse them; so does `decode:`)."""
    if isinstance(value, tuple):
        return any(len(value) == len(a) and all(_exactly_in(x, (y,)) for x, y in zip(value, a))
                   for a in allowed)
    return any(type(value) is type(a) and value == a for a in allowed)


def spec_file_error(path: Path) -> SpecError:
    """load_spec's error for a path that holds no spec file, a folder or nothing (clean and
    package, which take a path's build, say it as build does)."""
    if path.is_dir():
        return SpecError(f"spec {str(path)!r} is a folder, not a spec file (an empty --spec is "
                         "one): give a spec name from specs/ or a .yaml path")
    known = ", ".join(sorted(p.stem for p in SPECS_DIR.glob("*.yaml")))
    return SpecError(f"spec file not found: {path} (specs in {SPECS_DIR}: {known or 'none'})")


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    try:
        data = path.read_bytes()
        text = data.decode()
    except (FileNotFoundError, IsADirectoryError):
        raise spec_file_error(path) from None
    except OSError as e:
        raise SpecError(f"cannot read spec {path}: {e.strerror}")
    except UnicodeDecodeError as e:
        raise SpecError(f"cannot read spec {path}: not UTF-8 text ({e.reason} at byte {e.start})")
    spec = parse_spec(text, str(path), default_name=path.stem)
    return replace(spec, sha256=spec_bytes_sha256(data))


def parse_spec(text: str, source: str = "<spec>", default_name: str = "spec") -> Spec:
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where, what = yaml_error_place(e)
        raise SpecError(f"{source}{where}: invalid YAML: {what}")
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to read")
    try:
        return _Validator(source).spec(data, default_name)
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to check")


# --------------------------------------------------------------------------- validation

class _Validator:
    def __init__(self, source: str):
        self.source = source
        self.warnings: list[str] = []

    def fail(self, path: str, message: str, value: Any = ...) -> SpecError:
        got = "" if value is ... else f", got {_short(fmt_value(value))}"
        return SpecError(f"{self.source}: {path + ': ' if path else ''}{message}{got}")

    def mapping(self, data: Any, path: str, allowed: tuple[str, ...], hint: str = "") -> dict:
        if not isinstance(data, dict):
            raise self.fail(path, "expected a mapping", data)
        for key in data:
            if not isinstance(key, str):
                raise self.fail(path, "keys must be strings", key)
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
                why = f" (did you mean '{close[0]}'?)" if close else ""
                extra = hint if key in AXES and hint else ""
                raise self.fail(f"{path}.{key}" if path else key, f"unknown key{why}{extra}; "
                                f"known keys: {', '.join(allowed)}")
        return data

    # ---- scalar values of one axis
    def scalar(self, axis: str, value: Any, path: str) -> Any:
        kind, choices = AXIS_BY_NAME[axis].kind, AXIS_BY_NAME[axis].choices
        if kind == "choice":
            if not isinstance(value, str) or value not in choices:
                raise self.fail(path, f"expected one of {', '.join(choices)}", value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise self.fail(path, "expected a positive integer", value)
        elif kind == "bool":
            if not isinstance(value, bool):
                raise self.fail(path, "expected true or false", value)
        elif kind == "tile":
            ok = (isinstance(value, list) and len(value) == 2 and
                  all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value))
            if not ok:
                raise self.fail(path, "expected a tile [M, N] of two positive integers", value)
            return (value[0], value[1])
        return value

    def values(self, axis: str, raw: Any, path: str) -> AxisValues:
        """A scalar or a list of scalars -> tuple of distinct values (order kept)."""
        if AXIS_BY_NAME[axis].kind == "tile":
            # One pair [M, N], or a list of pairs [[M, N], ...].
            is_list_of_pairs = isinstance(raw, list) and raw and isinstance(raw[0], list)
            items = raw if is_list_of_pairs else [raw]
            paths = [f"{path}[{i}]" for i in range(len(items))] if is_list_of_pairs else [path]
        elif isinstance(raw, list):
            items, paths = raw, [f"{path}[{i}]" for i in range(len(raw))]
        else:
            items, paths = [raw], [path]
        if not items:
            raise self.fail(path, "empty list", raw)
        first: dict = {}  # value -> key path of its first occurrence (dict order = list order)
        for item, p in zip(items, paths):
            self.note_repeat(first, self.scalar(axis, item, p), p, item)
        return tuple(first)

    def note_repeat(self, first: dict, value, path: str, item) -> None:
        """Record value's first path in `first`, or warn that it repeats (it is used once)."""
        if value in first:
            self.warnings.append(f"{self.source}: {path}: {fmt_value(item)} repeats "
                                 f"{first[value]}; the value is used once")
        else:
            first[value] = path

    def axes(self, data: Any, path: str, allowed: tuple[str, ...] = AXES, hint: str = "") -> dict:
        data = self.mapping({} if data is None else data, path, allowed, hint)
        return {k: self.values(k, v, f"{path}.{k}") for k, v in data.items()}

    def match(self, data: Any, path: str, allowed: tuple[str, ...], hint: str = "") -> Match:
        vals = self.axes(data, path, allowed, hint)
        return Match(path, tuple((k, vals[k]) for k in AXES if k in vals))

    # ---- the whole document
    def spec(self, data: Any, default_name: str) -> Spec:
        if data is None:
            raise SpecError(f"{self.source}: empty spec")
        if not isinstance(data, dict):
            kind = "list" if isinstance(data, list) else "scalar"
            text = fmt_value(data)
            text = text if len(text) <= 60 else text[:57] + "..."
            raise SpecError(f"{self.source}: the spec must be a mapping with keys "
                            f"{', '.join(TOP_KEYS)} (got a {kind} {text})")
        data = self.mapping(data, "", TOP_KEYS)
        name = data.get("name", default_name)
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):  # fullmatch: no trailing newline
            raise self.fail("name", "expected a name of letters, digits, '_', '-' or '.'", name)
        if name.lower().endswith((".yaml", ".yml", ".so")):  # --spec NAME would read a file
            raise self.fail("name", "expected a name that does not end in .yaml, .yml or .so "
                            "(--spec and FA3GEN_LIB would take it for a file)", name)
        top = self.axes(data.get("axes"), "axes")
        groups = self.groups(data, top)
        exclude = []
        for i, raw in enumerate(self.list_of(data.get("exclude"), "exclude")):
            m = self.match(raw, f"exclude[{i}]", AXES)
            if not m.items:
                raise self.fail(f"exclude[{i}]", "empty exclude entry would drop everything", raw)
            exclude.append(m)
        dispatch = [self.dispatch_entry(raw, f"dispatch[{i}]")
                    for i, raw in enumerate(self.list_of(data.get("dispatch"), "dispatch"))]
        required = data.get("dispatch_required", True)
        if not isinstance(required, bool):
            raise self.fail("dispatch_required", "expected true or false", required)
        decode = self.decode_pairs(data.get("decode", False))
        return Spec(name, self.source, groups, tuple(exclude), tuple(dispatch), required, decode,
                    tuple(self.warnings))

    def decode_pairs(self, raw: Any) -> tuple[tuple[str, int], ...]:
        """`decode:` true (every pair), false, axes `{dtype: .., head_dim: ..}` (each a value or
        a list, an axis left out is all its values; the pairs are their product), or a list of
        [dtype, head_dim] pairs."""
        if isinstance(raw, bool):
            return DECODE_PAIRS if raw else ()
        if isinstance(raw, dict):
            return self.decode_axes(raw)
        want = (f"true, false, axes {{dtype, head_dim}} or a list of [dtype, head_dim] pairs "
                f"(dtype in {', '.join(DECODE_DTYPES)}; head_dim in "
                f"{', '.join(map(str, DECODE_HEAD_DIMS))})")
        if not isinstance(raw, list) or not raw:
            raise self.fail("decode", f"expected {want}", raw)
        first: dict = {}  # pair -> index of its first occurrence
        for i, item in enumerate(raw):
            if not (isinstance(item, list) and len(item) == 2 and _exactly_in(tuple(item), DECODE_PAIRS)):
                raise self.fail(f"decode[{i}]", f"expected {want}", item)
            self.note_repeat(first, tuple(item), f"decode[{i}]", item)
        return tuple(p for p in DECODE_PAIRS if p in first)  # one order

    def decode_axes(self, raw: dict) -> tuple[tuple[str, int], ...]:
        """`decode: {dtype: .., head_dim: ..}`: the only two axes of the decode kernels."""
        for key in raw:
            if key not in ("dtype", "head_dim"):
                raise self.fail(f"decode.{key}", "unknown decode axis: the decode axes are dtype and "
                                "head_dim (cache layout, split-KV, GQA packing and an e4m3 cache are "
                                "chosen per call by the kernel of each pair)")
        chosen = []
        for axis, allowed in (("dtype", DECODE_DTYPES), ("head_dim", DECODE_HEAD_DIMS)):
            values = raw.get(axis, list(allowed))
            values = values if isinstance(values, list) else [values]
            if not values:
                raise self.fail(f"decode.{axis}", "expected a value or a non-empty list", values)
            first: dict = {}
            for i, value in enumerate(values):
                if not _exactly_in(value, allowed):
                    raise self.fail(f"decode.{axis}", f"expected one of {', '.join(map(str, allowed))}",
                                    value)
                self.note_repeat(first, value, f"decode.{axis}[{i}]", value)
            chosen.append(values)
        return tuple(p for p in DECODE_PAIRS if p[0] in chosen[0] and p[1] in chosen[1])

    def list_of(self, raw: Any, path: str) -> list:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise self.fail(path, "expected a list", raw)
        return raw

    def groups(self, data: dict, top: dict) -> tuple[Group, ...]:
        if "groups" not in data:
            raws = [("default", {}, "axes")]
        else:
            items = self.list_of(data["groups"], "groups")
            if not items:
                raise self.fail("groups", "empty list (omit `groups` to use the top-level axes)")
            raws = []
            for i, raw in enumerate(items):
                g = self.mapping(raw, f"groups[{i}]", GROUP_KEYS)
                gname = g.get("name", f"groups[{i}]")
                if not isinstance(gname, str) or not gname:
                    raise self.fail(f"groups[{i}].name", "expected a string", gname)
                raws.append((gname, self.axes(g.get("axes"), f"groups[{i}].axes"),
                             f"groups[{i}].axes"))
        out, seen = [], set()
        for gname, own, path in raws:
            if gname in seen:
                raise self.fail(path.rsplit(".", 1)[0] + ".name", "duplicate group name", gname)
            seen.add(gname)
            merged = {**top, **own}  # group values replace top-level defaults per axis
            for axis in AXES:
                if axis not in merged and AXIS_BY_NAME[axis].optional:
                    merged[axis] = (False,)  # a feature the spec does not ask for: not built
                if axis not in merged:
                    raise self.fail(f"{path}.{axis}", "missing: no value at top level "
                                    "(axes) or in the group")
            out.append(Group(gname, tuple((a, merged[a]) for a in AXES)))
        return tuple(out)

    def dispatch_entry(self, raw: Any, path: str) -> DispatchEntry:
        d = self.mapping(raw, path, DISPATCH_KEYS)
        when = self.match(d.get("when"), f"{path}.when", KEY_AXES,
                          hint=f" (knobs {', '.join(KNOB_AXES)} go under `use`)")
        if "use" not in d:
            raise self.fail(f"{path}.use", "missing: say which knobs pick the default variant")
        use = self.match(d["use"], f"{path}.use", KNOB_AXES,
                         hint=f" (key axes {', '.join(KEY_AXES)} go under `when`)")
        if not use.items:
            raise self.fail(f"{path}.use", "empty: name at least one knob", d["use"])
        rng = d.get("seqlen_k")
        if "seqlen_k" in d:  # present but empty (null) is not "every length": say so
            ok = (isinstance(rng, list) and len(rng) == 2 and
                  all(isinstance(x, int) and not isinstance(x, bool) for x in rng) and
                  0 <= rng[0] <= rng[1] <= SEQLEN_MAX)
            if not ok:
                raise self.fail(f"{path}.seqlen_k", "expected [lo, hi], ints with 0 <= lo <= hi "
                                f"<= {SEQLEN_MAX} (the calls with lo <= seqlen_k <= hi)", rng)
            rng = (rng[0], rng[1])
        return DispatchEntry(path, when, use, rng)
