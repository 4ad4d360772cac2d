"""Trace-to-spec: record which dispatch keys and variants a program's calls resolve to, then
write the smallest spec that builds exactly those.

    with fa3gen.trace("used.yaml"):        # or FA3GEN_TRACE=used.yaml for a whole program
        train_steps()
    fa3gen spec --from-trace used.yaml -o specs/mymodel.yaml

Forward calls are recorded when their variant is resolved (under torch.compile: by the custom
op, each time the graph runs it), backward ones when
autograd runs the backward (under torch.compile: while compiling, once per graph), decode calls
(flash_attn_with_kvcache) as the (dtype, head_dim) pairs of the decode kernels they ran (or, for
a chunked prefill that appends, of the append kernels built with them). Each
entry keeps the call count and the range of every size seen. No torch import here.
"""
from __future__ import annotations

import atexit
import copy
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fa3gen.contract import (AXES, AXIS_BY_NAME, INT32_MAX, KEY_AXES, KNOB_AXES, key_str,
                             parse_name, takes_seqlen_ranges)
from fa3gen.errors import TraceError, yaml_error_place
from fa3gen.files import write_atomically, written_through

TRACE_ENV = "FA3GEN_TRACE"
BEGAN_ENV = "FA3GEN_TRACE_BEGAN"  # when the traced run began: child processes inherit it
PROCESS_ENV = "FA3GEN_TRACE_PROCESS"  # _process_id's token where /proc is missing
SIZES = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv")
FORMAT = "fa3gen-trace-1"
LINES_KEY = "lines"  # the file's line count, written second (older traces have none)


@dataclass
class Entry:
    variant: str
    default: bool                 # resolved by the spec's dispatch (not named with variant=)
    count: int = 0
    ranges: dict = field(default_factory=dict)   # size -> [min, max]
    dispatch_ranges: set = field(default_factory=set)  # dispatch_seqlen_k of merged traces

    def add(self, sizes: dict) -> None:
        self.absorb(1, {k: (v, v) for k, v in sizes.items()})

    def copy(self) -> "Entry":
        return Entry(self.variant, self.default, self.count,
                     {k: list(r) for k, r in self.ranges.items()}, set(self.dispatch_ranges))

    def absorb(self, count: int, ranges: dict) -> None:
        """count more calls, whose sizes span `ranges` (size -> (min, max))."""
        self.count += count
        for k, (lo_new, hi_new) in ranges.items():
            lo, hi = self.ranges.get(k, (lo_new, hi_new))
            self.ranges[k] = [min(lo, lo_new), max(hi, hi_new)]


class Trace:
    def __init__(self, path: str | os.PathLike, began: float | None = None):
        """began: when the run this trace belongs to began (a whole-program trace's, which
        child processes inherit); default now."""
        self.path = Path(path).absolute()  # where it was asked for, whatever the cwd at exit
        self.began = time.time() if began is None else began
        if self.path.is_dir():
            raise TraceError(f"trace path {path} is a folder: name a file")
        parent = next(p for p in self.path.parents if p.exists())  # the rest is created at write
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise TraceError(f"trace path {path}: cannot write under {parent}")
        self.entries: dict[tuple[str, bool], Entry] = {}
        self.decode: set[tuple[str, int]] = set()  # (dtype, head_dim) of flash_attn_with_kvcache calls
        self._lock = threading.Lock()

    def add(self, variant: str, default: bool, sizes: dict) -> None:
        with self._lock:
            self.entries.setdefault((variant, default), Entry(variant, default)).add(sizes)

    def to_dict(self) -> dict:
        with self._lock:  # threads still calling attention add entries meanwhile
            entries, decode = [e.copy() for e in self.entries.values()], set(self.decode)
        calls = []
        parsed = sorted((parse_name(e.variant), not e.default, e) for e in entries)
        for v, _, e in parsed:
            calls.append({**_spec_values(v, KEY_AXES), "variant": e.variant,
                          "default": e.default, "count": e.count,
                          **{k: e.ranges[k] for k in SIZES if k in e.ranges}})
            rows = (e.dispatch_ranges | set(_dispatch_ranges.get(e.variant) or ())) if e.default \
                else ()
            if rows:
                calls[-1]["dispatch_seqlen_k"] = [list(r) for r in sorted(rows)]
        data = {"format": FORMAT, "calls": calls}
        if decode:
            data["decode"] = [list(pair) for pair in sorted(decode)]
        return data

    def merge(self, data: dict) -> None:
        """Add the calls of a trace's data (to_dict's form) to this one's."""
        for c in data.get("calls") or []:
            e = self.entries.setdefault((c["variant"], c["default"]), Entry(c["variant"], c["default"]))
            e.absorb(c.get("count", 0), {k: c[k] for k in SIZES if k in c})
            e.dispatch_ranges.update(tuple(r) for r in c.get("dispatch_seqlen_k") or ())
        self.decode |= {tuple(pair) for pair in data.get("decode") or []}

    def _merged_dict(self, data: dict) -> dict | None:
        """to_dict() of this trace with another's data merged in, tried on a copy (an edited or
        cut trace may fail part-way, in the merge or when written out) and then kept; None,
        with a warning, if it does not merge: this trace's calls then replace it."""
        with self._lock:  # no call recorded meanwhile is lost when the merged entries are kept
            trial = copy.copy(self)  # its own lock and containers; the rest shared
            trial._lock = threading.Lock()
            trial.entries = {k: e.copy() for k, e in self.entries.items()}
            trial.decode = set(self.decode)
            try:
                trial.merge(data)
                merged = trial.to_dict()
            except Exception as e:  # noqa: BLE001 - whatever an edited file holds
                print(f"fa3gen: warning: {self.path}: a trace of this run that does not merge, "
                      f"replaced ({e!r})"[:300], file=sys.stderr)
                return None
            self.entries, self.decode = trial.entries, trial.decode  # as the file will hold
            return merged

    def write(self, whole_program: bool = False) -> None:
        """Write the trace. A whole-program trace (FA3GEN_TRACE, at exit) keeps the calls of
        whole-program traces written there since its run began by other processes (a job's
        ranks, children) and by the program's other runtime copies (fa3gen and a packaged
        fa3gen_<spec> each write theirs at exit), but not those of an earlier run, which it
        replaces; writers take turns (a lock on the folder), so that two exiting at once lose
        neither's calls. A `trace()` block's write replaces the file: it keeps only its own
        calls (a trace of this runtime copy active beside it saw them too)."""
        if not whole_program:
            self._write(self.to_dict())
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)  # the folder the lock is taken on
        with _folder_lock(self.path.parent):
            earlier = _this_runs(self.path, self.began)
            data = (earlier and self._merged_dict(earlier)) or self.to_dict()
            # what _this_runs reads; `process` as runtimes before 2026-12-07 (forty-third) wrote
            # and read it, so that they merge with this one
            data.update(written=time.time(), writer=_COPY, process=_process_id())
            self._write(data)

    def _write(self, data: dict) -> None:
        import yaml  # kept out of import time: ops imports this module

        rest = {k: v for k, v in data.items() if k not in ("format", LINES_KEY)}

        def text(lines: int) -> str:
            return ("# fa3gen trace: the dispatch keys and variants that calls resolved to;\n"
                    f"# turn it into a spec with: fa3gen spec --from-trace {self.path.name} "
                    "-o specs/NAME.yaml\n"
                    + yaml.safe_dump({"format": data["format"], LINES_KEY: lines, **rest},
                                     sort_keys=False, default_flow_style=None))

        # The file's own line count near its top: a copy cut short at a line boundary still
        # parses (whole call entries or decode pairs missing), and _read then says so.
        write_atomically(self.path, text(len(text(0).splitlines())))


def _copy_token() -> str:
    return f"{os.getpid()}:{id(Trace):x}:{time.time_ns()}"


_COPY = _copy_token()  # this copy of the module in this process (a forked child makes its own)


def _process_id() -> str:
    """This process, the same for every copy of this module in it and never again for another
    process: its pid and start time (Linux), else its pid and a random token kept in the
    environment (which a child inherits with its parent's pid: it makes its own)."""
    pid = os.getpid()
    try:
        return f"{pid}:{Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        pass
    token = os.environ.get(PROCESS_ENV, "")
    if not token.startswith(f"{pid}:"):
        import secrets
        token = os.environ[PROCESS_ENV] = f"{pid}:{secrets.token_hex(8)}"
    return token


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive flock on the folder for the block; none where the platform or file system
    has no such lock (the writes are then only atomic, not serialized)."""
    try:
        import fcntl
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _this_runs(path: Path, began: float) -> dict | None:
    """The trace data at path if another runtime copy's whole-program trace of this run wrote
    it: written at or after `began` (epoch seconds), or by this process (a runtime from before
    `written`). None otherwise: no file, not a trace, an earlier run's, this copy's own, or a
    path written through (/dev/stdout, a pipe: reading it would wait for input)."""
    import yaml

    try:
        if written_through(path) or not path.is_file():
            return None
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("writer") == _COPY:
        return None
    written = data.get("written")
    if (isinstance(written, (int, float)) and written >= began) or \
            data.get("process") == _process_id():
        return data
    return None


_active: list[Trace] = []  # ops checks this on every call: empty list = one truth test


# variant name -> its seqlen_k ranges in the loaded libraries' dispatch (range defaults that are
# no key's default), None where two libraries disagree. A trace writes them beside the calls
# the dispatch served with such a variant, so a trimmed spec keeps the library's bounds rather
# than guessing them from the traced lengths.
_dispatch_ranges: dict[str, tuple | None] = {}


def note_dispatch_ranges(ranges: dict) -> None:
    """Called by fa3gen.runtime for each library it loads: {variant name: [(lo, hi), ...]},
    with [] for a key's default (so that a variant one library ranges and another serves as a
    default records no range)."""
    for name, rows in ranges.items():
        rows = tuple(sorted(rows))
        _dispatch_ranges[name] = rows if _dispatch_ranges.get(name, rows) == rows else None


def record(variant: str, default: bool, **sizes: int) -> None:
    """Called by fa3gen.ops for every dispatched call while a trace is active. Sizes that are
    not ints are left out: a backward recorded while torch.compile traces it with dynamic
    shapes has SymInts, which min/max would guard on and YAML cannot write."""
    sizes = {k: v for k, v in sizes.items() if type(v) is int}
    for t in _active:
        t.add(variant, default, sizes)


def record_decode(dtype: str, head_dim: int) -> None:
    """Called by fa3gen.kvcache for every decode call while a trace is active."""
    for t in _active:
        with t._lock:
            t.decode.add((dtype, head_dim))


@contextmanager
def trace(path: str | os.PathLike) -> Iterator[Trace]:
    """Record the calls made inside the block and write them to path when it ends."""
    t = Trace(path)
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)
        t.write()


def _inherited_start(path: Path) -> float | None:
    """The run's start a parent traced into `path` left in BEGAN_ENV ("<epoch seconds> <path>"),
    if it is for this path and a time not in the future; else None (this process begins the
    run)."""
    start, _, for_path = os.environ.get(BEGAN_ENV, "").partition(" ")
    try:
        began = float(start)
    except ValueError:
        return None
    ok = math.isfinite(began) and began <= time.time() + 1.0 and for_path == str(path)
    return began if ok else None


def _trace_whole_program() -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        path = Path(os.path.expandvars(path)).absolute()  # 'trace_$RANK.yaml': each rank's own
        try:
            t = Trace(path, _inherited_start(path))
        except TraceError as e:  # at import: say so once and run untraced
            print(f"fa3gen: warning: {TRACE_ENV} ignored: {e}", file=sys.stderr)
            return
        # Absolute from now on: another runtime copy (a packaged fa3gen_<spec>) loads this
        # module at its own first call, maybe after a chdir, and must write the same file.
        # The run's start goes to children too: one started after another exited keeps the
        # earlier one's calls.
        os.environ[TRACE_ENV] = str(t.path)
        os.environ[BEGAN_ENV] = f"{t.began!r} {t.path}"
        _active.append(t)
        _program_traces.append(t)
        atexit.register(_write_if_recorded, t)


_program_traces: list[Trace] = []  # this copy's whole-program trace (FA3GEN_TRACE), if any


def _forget_the_parents_calls() -> None:
    """In a forked child: its own token, and none of the calls its parent recorded before the
    fork (the parent writes those); the child then writes only its own calls, if any."""
    global _COPY
    _COPY = _copy_token()
    for t in _program_traces:  # new containers and lock: a thread of the parent's may have
        t._lock = threading.Lock()  # held the old one at the fork, which no thread here frees
        t.entries, t.decode = {}, set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_parents_calls)


def _write_if_recorded(t: Trace) -> None:
    """At exit: a process that made no call (e.g. `fa3gen spec` reading this very trace) leaves
    the file as it is. A failure is one line, not a traceback at exit."""
    if t.entries or t.decode:
        try:
            t.write(whole_program=True)
        except Exception as e:  # noqa: BLE001 - at exit, nothing else would say it
            print(f"fa3gen: warning: {TRACE_ENV}: could not write {t.path}: {e!r}"[:300],
                  file=sys.stderr)


_trace_whole_program()


# --------------------------------------------------------------------------- trace -> spec

def _read(path: Path) -> tuple[list[dict], list]:
    import yaml

    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text)
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a trace (not UTF-8 text)") from e
    except yaml.YAMLError as e:  # one line, where: as a spec's (generator/spec.py)
        where, what = yaml_error_place(e)
        raise TraceError(f"{path}{where}: not a trace (invalid YAML: {what})") from e
    except RecursionError as e:
        raise TraceError(f"{path}: not a trace (nested too deeply to read)") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("calls"), list):
        raise TraceError(f"{path}: not an fa3gen trace (expected format: {FORMAT} and a calls list)")
    lines, found = data.get(LINES_KEY), len(text.splitlines())
    # fewer lines than written: cut short (a line or a blank line added after is harmless)
    if lines is not None and (type(lines) is not int or found < lines):
        raise TraceError(f"{path}: {found} lines where the trace wrote "
                         f"{LINES_KEY}: {lines!r} (cut short? copy the whole file again; a trace "
                         f"edited by hand: delete its {LINES_KEY}: line)")
    decode = data.get("decode", [])
    if not isinstance(decode, list) or not all(isinstance(p, list) and len(p) == 2 for p in decode):
        raise TraceError(f"{path}: decode must be a list of [dtype, head_dim] pairs, got {decode!r}")
    return data["calls"], decode


def _read_all(paths: list[Path]) -> tuple[list[tuple[Path, int, dict]], list]:
    """The calls of the traces at paths, each with its file and place there, and their decode
    pairs (each once): several traces make one spec (a job's ranks or nodes traced to files of
    their own)."""
    calls, decode = [], []
    for path in paths:
        file_calls, file_decode = _read(path)
        calls += [(path, i, c) for i, c in enumerate(file_calls)]
        decode += [p for p in file_decode if p not in decode]
    if not calls:
        one = len(paths) == 1
        what = " but decode calls (a spec needs a flash_attn_func variant too)" if decode else ""
        raise TraceError(f"{', '.join(map(str, paths))}: the trace{'' if one else 's'} recorded "
                         f"no call{what or (' (was anything run inside it?)' if one else '')}")
    return calls, decode


def _spec_values(v, axes) -> dict:
    """v's values of `axes` as a spec writes them (a tile as a YAML list [M, N])."""
    values = v.axes()
    return {a: list(values[a]) if AXIS_BY_NAME[a].kind == "tile" else values[a] for a in axes}


def _by_length(defaults: list, seqlen_k: dict) -> list | None:
    """[(variant, [lo, hi] or None)] for one key whose dispatched calls went to several
    variants by length: the one of the longest lengths is the key's default, each other one
    a range up to the next one's shortest traced length. None when the traced lengths overlap
    (e.g. a CUDA graph that baked in the key's default) or are missing."""
    if not all(v in seqlen_k for v in defaults):
        return None
    ordered = sorted(defaults, key=lambda v: seqlen_k[v][0])
    if any(seqlen_k[a][1] >= seqlen_k[b][0] for a, b in zip(ordered, ordered[1:])):
        return None
    out, lo = [(ordered[-1], None)], 0
    for a, b in zip(ordered, ordered[1:]):
        out.append((a, [lo, seqlen_k[b][0] - 1]))
        lo = seqlen_k[b][0]
    return out


def _library_ranges(defaults: list, library_ranges: dict, seqlen_k: dict) -> list | None:
    """[(variant, [lo, hi] or None)] that keep the traced library's own seqlen_k bounds: the
    variant it served without a range (its key default) stays the default, each other one gets
    its library ranges. Where every traced variant had ranges, the one reaching furthest is the
    default (its range let go: the traced calls longer than the others' ranges reached it).
    None where the trace did not record the ranges (an older trace), they overlap, or they do
    not send each variant's shortest and longest traced lengths back to it (ranges from one
    library do; a merge of traces from two need not)."""
    unranged = [v for v in defaults if v not in library_ranges]
    if len(unranged) > 1:
        return None
    default = unranged[0] if unranged else max(defaults, key=lambda v: max(library_ranges[v]))
    rows = sorted((r, v) for v in defaults if v != default for r in library_ranges[v])
    if any(a[1] >= b[0] for (a, _), (b, _) in zip(rows, rows[1:])):
        return None

    def served(n):
        return next((v for r, v in rows if r[0] <= n <= r[1]), default)
    if any(served(n) != v for v in defaults for n in seqlen_k.get(v, ())):
        return None
    return [(default, None)] + [(v, list(r)) for r, v in rows]


NO_DEFAULT_NOTE = "no dispatch default for"  # spec_from_trace's header lines; fa3gen spec prints them


def spec_from_trace(paths, name: str) -> str:
    """The YAML text of the smallest spec that builds the variants traced in paths (one trace
    file or several): one group per variant, every axis fixed; a key served by several
    variants gets a dispatch entry for the one its calls resolved to by default, and where the
    dispatch chose by seqlen_k (the library's range defaults), entries that reproduce that
    choice for every traced length."""
    import yaml

    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    calls, decode = _read_all(paths)
    variants = {}
    seqlen_k: dict = {}  # variant -> [min, max] seqlen_k of its dispatched calls
    library_ranges: dict = {}  # variant -> {(lo, hi)}: its rows in the traced library's dispatch
    for path, i, c in calls:
        if not isinstance(c, dict) or "variant" not in c:
            raise TraceError(f"{path}: bad call entry {i}: expected a mapping with a variant "
                             f"(and default, seqlen_k), got {c!r}")
        try:
            v = parse_name(c["variant"])
        except (TypeError, ValueError) as e:
            raise TraceError(f"{path}: bad call entry {c!r}: {e}") from e
        if not isinstance(c.get("default"), bool):  # every trace writes it: a missing one is
            raise TraceError(f"{path}: bad call entry {c!r}: default must be true or false "
                             "(a trace cut short?)")  # a cut, e.g. in the middle of a name
        written = _spec_values(v, KEY_AXES)  # the key axes written beside the name must agree
        if any(a in c and c[a] != written[a] for a in KEY_AXES):
            raise TraceError(f"{path}: bad call entry {c!r}: its key axes do not match variant "
                             f"{v.name} (a trace cut short or edited?)")
        variants[v] = variants.get(v, False) or c.get("default", False)
        lengths = c.get("seqlen_k")
        if lengths is not None and not (isinstance(lengths, list) and len(lengths) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths)
                and lengths[0] <= lengths[1]):
            raise TraceError(f"{path}: bad call entry {c!r}: seqlen_k must be [shortest, longest]")
        if c.get("default") and lengths is not None:  # entries of one variant (merged traces): all
            lo, hi = seqlen_k.get(v, lengths)
            seqlen_k[v] = [min(lo, lengths[0]), max(hi, lengths[1])]
        rows = c.get("dispatch_seqlen_k")
        if rows is not None:
            if not (isinstance(rows, list) and rows and all(
                    isinstance(r, list) and len(r) == 2 and all(
                        isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= INT32_MAX
                        for n in r) and r[0] <= r[1] for r in rows)):
                raise TraceError(f"{path}: bad call entry {c!r}: dispatch_seqlen_k must be a "
                                 "list of [lo, hi] ranges")
            if c.get("default"):
                library_ranges.setdefault(v, set()).update(tuple(r) for r in rows)
    # Autograd runs fa3gen's backward only after fa3gen's forward of the same key.
    forward_keys = {v.key[1:] for v in variants if v.direction == "fwd"}
    orphans = sorted({key_str(v.key) for v in variants
                      if v.direction == "bwd" and v.key[1:] not in forward_keys})
    if orphans:
        where = ", ".join(map(str, paths))
        raise TraceError(f"{where}: the trace{'s hold' if len(paths) > 1 else ' holds'} the backward of {', '.join(orphans)} without "
                         "its forward, which a library needs to run it (autograd calls fa3gen's "
                         "backward after fa3gen's forward): trace the forward calls too")
    groups, dispatch = [], []
    by_key: dict[tuple, list] = {}
    for v, is_default in sorted(variants.items()):
        groups.append({"name": v.name, "axes": _spec_values(v, AXES)})
        by_key.setdefault(v.key, []).append((v, is_default))
    required, undispatched = True, []
    for key, served in by_key.items():
        if len(served) == 1:
            continue
        defaults = [v for v, d in served if d]
        if len(defaults) > 1 and not takes_seqlen_ranges(key):
            # (a trace of an older library may hold a backward chosen by length): the longest
            # lengths' variant
            defaults = [max(defaults, key=lambda v: seqlen_k.get(v, [0, 0])[1])]
        entries = ((_library_ranges(defaults, library_ranges, seqlen_k)
                    or _by_length(defaults, seqlen_k))
                   if len(defaults) > 1 else [(defaults[0], None)] if defaults else None)
        if not entries:  # only named variants (variant=) were traced, or lengths overlap
            required = False
            undispatched.append(key_str(key))
            continue
        for v, rng in entries:
            entry = {"when": _spec_values(v, KEY_AXES), "use": _spec_values(v, KNOB_AXES)}
            dispatch.append({**entry, "seqlen_k": rng} if rng else entry)
    spec = {"name": name, "groups": groups}
    if decode:  # the decode kernels flash_attn_with_kvcache used
        spec["decode"] = decode
    if dispatch:
        spec["dispatch"] = dispatch
    if not required:
        spec["dispatch_required"] = False
    header = (f"# Generated by `fa3gen spec --from-trace {' '.join(p.name for p in paths)}`: the {len(variants)} "
              f"variant(s) the traced calls used.\n")
    for key in undispatched:
        header += (f"# {NO_DEFAULT_NOTE} {key}: its traced calls named their variant, or the "
                   "lengths its variants served overlap; calls must name one (variant=...).\n")
    return header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=None)
