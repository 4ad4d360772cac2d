"""The build pipeline: spec -> variants -> filter -> render -> ninja -> manifest.json."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from fa3gen.contract import (ABI_VERSION, GENERATED_ENV, MANIFEST_NAME, Variant, key_str,
                             library_name, other_spec_file, read_manifest, spec_out_dir)

from fa3gen.files import write_atomically

from . import __version__
from .compile_one import MARKER_SUFFIX, spills_allowed
from .errors import BuildError, FilterError, GeneratorError
from .ninja import (check_launcher, objects_without_deps, planned_edges, render_build_ninja,
                    run_ninja, write_build_ninja)
from .paths import resolve_spec_path
from .lock import build_lock
from .render import RenderPlan, environment, plain_units, plan_sources
from .spec import Spec, load_spec
from .toolchain import Toolchain, detect
from .units import Unit, partition, unit_size
from .variants import (Enumeration, enumerate_variants, resolve_dispatch, unmatched_values,
                       resolve_seqlen_dispatch, smem_bytes)

GIB_PER_JOB = 4  # an nvcc of a CuTe attention kernel can take several GB
MAX_JOBS = 1024  # ninja refuses -j above 2**31 - 1, and a build has far fewer compiles


def default_jobs() -> int:
    """min(cores, free GiB // 4), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    try:
        meminfo = Path("/proc/meminfo").read_text()
        kib = int(re.search(r"^MemAvailable:\s+(\d+)", meminfo, re.M).group(1))
        by_mem = kib // (1024 * 1024) // GIB_PER_JOB
    except (OSError, AttributeError, ValueError):
        by_mem = cpus
    return max(1, min(cpus, by_mem))


def select(en: Enumeration, only: Iterable[str] = (), exclude: Iterable[str] = ()) -> list[Variant]:
    """Apply --only / --exclude globs to variant names. A glob that matches nothing is an
    error (a typo would otherwise build the wrong set), as is an empty result."""
    only, exclude = list(only), list(exclude)
    names = [v.name for v in en.kept]

    def check(glob: str, flag: str) -> None:
        if fnmatch.filter(names, glob):
            return
        pruned = [p for p in en.pruned if fnmatch.fnmatch(p.variant.name, glob)]
        if pruned:
            why = "; ".join(f"{p.variant.name} pruned by {p.constraint}: {p.reason}"
                            for p in pruned[:5])
            more = f" (+{len(pruned) - 5} more)" if len(pruned) > 5 else ""
            raise FilterError(f"{flag} {glob!r} matches only pruned variants: {why}{more}")
        raise FilterError(f"{flag} {glob!r} matches no variant; available: "
                          f"{', '.join(names) or 'none'}")

    for g in only:
        check(g, "--only")
    for g in exclude:
        check(g, "--exclude")
    out = [v for v in en.kept
           if (not only or any(fnmatch.fnmatch(v.name, g) for g in only))
           and not any(fnmatch.fnmatch(v.name, g) for g in exclude)]
    if not out:
        raise FilterError("nothing left to build after filtering")
    return out


@dataclass
class Plan:
    """What a build would produce, before running ninja."""
    spec: Spec
    enumeration: Enumeration
    variants: list[Variant]
    defaults: dict[tuple, Variant]        # over the whole spec, before filtering
    out_dir: Path
    # key -> [(lo, hi, variant)]: the dispatch entries with a seqlen_k range
    seqlen_defaults: dict = field(default_factory=dict)

    def seqlen_dispatch(self) -> list:
        """[[*key, lo, hi, name]] of the built range defaults (the library's build info)."""
        built = {v.name for v in self.variants}
        return [[*key, lo, hi, v.name] for key, ranges in sorted(self.seqlen_defaults.items())
                for lo, hi, v in ranges if v.name in built]

    @property
    def warnings(self) -> list[str]:
        return [*self.spec.warnings, *self.enumeration.warnings]

    @property
    def default_names(self) -> set[str]:
        built = {v.name for v in self.variants}
        return {v.name for v in self.defaults.values() if v.name in built}


def _pruned_lines(pruned: list) -> list[str]:
    """Each pruned variant with its constraint; past ten, each constraint once with its count
    and an example (a large spec prunes thousands)."""
    if len(pruned) <= 10:
        return [f"  {x.variant.name}: {x.constraint}: {x.reason}" for x in pruned]
    by_constraint: dict = {}
    for x in pruned:
        by_constraint.setdefault(x.constraint, []).append(x)
    return [f"  {name} ({len(xs)}): {xs[0].reason}, e.g. {xs[0].variant.name}"
            for name, xs in by_constraint.items()]


def plan(spec_path, only: Iterable[str] = (), exclude: Iterable[str] = ()) -> Plan:
    spec = load_spec(resolve_spec_path(str(spec_path)))
    en = enumerate_variants(spec)
    if not en.kept:
        raise spec.error(f"the spec leaves no variant; each one is pruned ({len(en.pruned)}):\n"
                         + "\n".join(_pruned_lines(en.pruned)))
    # Dispatch resolves over the whole spec so a filter cannot make an entry "match nothing".
    en.warnings += unmatched_values(spec, en)
    defaults = resolve_dispatch(spec, en.kept)
    seqlen_defaults = resolve_seqlen_dispatch(spec, en.kept, defaults)
    variants = select(en, only, exclude)
    return Plan(spec, en, variants, defaults, spec_out_dir(spec.name), seqlen_defaults)


@dataclass
class BuildResult:
    plan: Plan
    library: Path
    manifest: Optional[Path] = None
    planned: list[str] = field(default_factory=list)   # dry run: edges ninja would run


def filter_notes(p) -> list[str]:
    """What an --only/--exclude filter took from the dispatch of plan p's keys: a default, or a
    seqlen_k range's choice (the key keeps variants, so a call runs something else or fails)."""
    notes = []
    for key, v in p.defaults.items():
        if v not in p.variants and any(x.key == key for x in p.variants):
            notes.append(f"{key_str(key)} has no default in this build ({v.name} was filtered "
                         "out)")
    for key, ranges in p.seqlen_defaults.items():
        for lo, hi, v in ranges:
            if v not in p.variants and any(x.key == key for x in p.variants):
                notes.append(f"{key_str(key)} takes its default for seqlen_k {lo}-{hi} in this "
                             f"build ({v.name}, the spec's choice there, was filtered out)")
    return notes


def build(spec_path, only: Iterable[str] = (), exclude: Iterable[str] = (),
          jobs: Optional[int] = None, dry_run: bool = False,
          compiler_launcher: Optional[str] = None, allow_spills: bool = False,
          debug: bool = False, lineinfo: bool = False, defines: Sequence[str] = (),
          toolchain: Optional[Toolchain] = None, units: Optional[int] = None,
          log: Callable[[str], None] = print) -> BuildResult:
    """Render and compile a spec (or its --only/--exclude selection) into its library.

    Variants compile in units of up to `units` a TU (generator/units.py; default: env
    FA3GEN_UNIT_SIZE, else units.DEFAULT_SIZE). A filtered build compiles and links only the
    selected variants but keeps the spec's units' objects, so the full library comes back
    with one link. A dry run writes nothing. Builds of one output directory take turns
    (generator/lock.py)."""
    if jobs is not None and not 1 <= jobs <= MAX_JOBS:
        raise GeneratorError(f"-j/--jobs must be at least 1 and at most {MAX_JOBS} (got {jobs})")
    size = unit_size(units)
    only, exclude = list(only), list(exclude)
    p = plan(spec_path, only, exclude)
    linked = partition(p.variants, size)
    filtered = len(p.variants) < len(p.enumeration.kept)
    compiled = linked
    if filtered:  # the selection's units and the spec's, each once
        compiled = list({u.name: u for u in [*linked, *partition(p.enumeration.kept, size)]}.values())
    for warning in p.warnings:
        log(f"fa3gen: warning: {warning}")
    tc = toolchain or detect(debug=debug, lineinfo=lineinfo, defines=defines)
    fp = tc.fingerprint()
    # An explicit --launcher "" means none, over the environment's.
    launcher = (os.environ.get("FA3GEN_COMPILER_LAUNCHER") if compiler_launcher is None
                else compiler_launcher) or None
    if launcher:
        check_launcher(launcher)
    fitting = default_jobs()
    if jobs and jobs > fitting and not dry_run:
        log(f"fa3gen: note: -j {jobs} is more than this machine's cores and free memory fit "
            f"({fitting}, at {GIB_PER_JOB} GiB a compile); compiles may run out of memory")
    jobs = jobs or fitting
    out = p.out_dir
    existing = next(d for d in (out, *out.parents) if d.exists())  # the dry run too: say it now
    if not existing.is_dir():
        raise GeneratorError(f"cannot build into {out}: {existing} is a file, not a folder (check "
                         f"${GENERATED_ENV})")
    env = environment(tc.templates_dir)

    for note in filter_notes(p):
        log(f"fa3gen: note: {note}")
    info = {"spec": p.spec.name, "fingerprint": fp, "generator_version": __version__,
            "num_variants": len(p.variants), "filters": {"only": only, "exclude": exclude},
            "spec_keys": sorted({v.key for v in p.enumeration.kept})}
    if p.seqlen_defaults:
        info["seqlen_dispatch"] = p.seqlen_dispatch()
    info["decode"] = [list(pair) for pair in p.spec.decode]  # the runtime's check of a call
    if defines:  # a measurement or prepared switch: the GPU tests read which one a library has
        info["defines"] = list(defines)
    sources = plan_sources(out, p.spec.name, p.variants, p.default_names, fp, info,
                           units=compiled, env=env, decode=p.spec.decode)
    ninja_text = render_build_ninja(p.spec.name, p.variants, tc, launcher, env=env,
                                    units=compiled, linked=linked, decode=p.spec.decode)
    lib = out / library_name(p.spec.name)
    log(f"fa3gen: spec {p.spec.name}: {len(p.variants)} variant(s)"
        + (f" of {len(p.enumeration.kept)} (filtered)" if filtered else "")
        + f" in {len(linked)} compile unit(s) of up to {size}"
        + f", {len(p.default_names)} dispatch default(s), {len(p.enumeration.pruned)} pruned; "
        f"{jobs} parallel job(s){' (dry run)' if dry_run else ''} -> {out}")

    if dry_run:
        return BuildResult(p, lib, planned=_dry_run(p, linked, sources, ninja_text, jobs, log,
                                                    _strict(allow_spills)))

    with build_lock(out, f"spec {p.spec.name}", log):
        other = other_spec_file(read_manifest(out / MANIFEST_NAME), p.spec.path)
        if other:  # one output folder a spec name: this build replaces that file's library
            log(f"fa3gen: warning: {out} held the build of {other}, another spec file named "
                f"{p.spec.name!r}; this build of {p.spec.path} replaces it (give one of them "
                "another `name:` to keep both)")
        rendered = sources.apply()
        if rendered.removed:
            log(f"fa3gen: removed {len(rendered.removed)} file(s) of compile units no longer planned "
                "(their variants left the spec, or were regrouped)")
        write_build_ninja(out, ninja_text)
        for obj in objects_without_deps(out):
            log(f"fa3gen: {obj} has no recorded header dependencies; compiling it again")
            (out / obj).unlink(missing_ok=True)
        for marker in (out / "obj").glob(f"*{MARKER_SUFFIX}"):  # a killed build's, under the lock
            marker.unlink(missing_ok=True)
        if _strict(allow_spills):
            for obj in objects_built_with_spills(out):
                log(f"fa3gen: {obj} was built with spills allowed; compiling it again")
                (out / obj).unlink(missing_ok=True)
        proc = run_ninja(out, jobs, allow_spills=allow_spills)
        if proc.returncode != 0:
            raise BuildError(f"build of spec {p.spec.name} failed (ninja exit {proc.returncode}); "
                             f"see the messages above and {out}/obj/*.log")
        manifest = write_manifest(p, tc, fp, lib, only, exclude, linked)
    log(f"fa3gen: built {lib}")
    return BuildResult(p, lib, manifest)


def _strict(allow_spills: bool) -> bool:
    """Whether spills fail this build (--allow-spills and FA3GEN_ALLOW_SPILLS allow them)."""
    return not (allow_spills or spills_allowed())


def objects_built_with_spills(out: Path) -> list[str]:
    """Objects (relative to out) whose compile passed only because spills were allowed (their
    obj/<name>.resources.json lists problems): ninja does not see the allowance, which travels
    in the environment, so a strict build would link them unchanged."""
    objects = []
    for resources in sorted((out / "obj").glob("*.resources.json")):
        name = resources.name.removesuffix(".resources.json")
        if (_resources(out, name) or {}).get("problems") and (out / "obj" / f"{name}.o").exists():
            objects.append(f"obj/{name}.o")
    return objects


def _dry_run(p: Plan, linked: list[Unit], sources: RenderPlan, ninja_text: str, jobs: int,
             log: Callable[[str], None], strict: bool = True) -> list[str]:
    """What a build would do, from the files on disk, without writing any."""
    out = p.out_dir
    dispatch_edge, link_edge = "NVCC obj/dispatch.o", f"LINK {library_name(p.spec.name)}"
    changed = sources.changed  # reads every file once
    plain = plain_units(p.variants, p.spec.decode)  # compiled like dispatch
    for path in changed:
        log(f"  would write: {path.relative_to(out)}")
    for path in sources.stale:
        log(f"  would remove: {path.relative_to(out)}")
    if out / "fingerprint.txt" in changed:
        why = ("no build yet" if not (out / "fingerprint.txt").exists()
               else "the toolchain, flags or templates changed")
        edges = ([f"NVCC {u.name}" for u in linked] + [dispatch_edge]
                 + [f"NVCC obj/{name}.o" for name in plain] + [link_edge])
        log(f"fa3gen: {why}: every unit compiles")
    else:
        edges = []
        if (out / "build.ninja").exists():  # ninja -n on the build file the build would write:
            # header edits, and command changes (flags, launcher, compiler path) from its log
            with tempfile.TemporaryDirectory(prefix="fa3gen_dry_run_") as tmp:
                would_be = Path(tmp) / "build.ninja"
                would_be.write_text(ninja_text)
                proc = run_ninja(out, jobs, dry_run=True, capture=True, build_file=would_be)
            if proc.returncode != 0 and "missing and no known rule" in proc.stdout:
                # sources the build would write first (new variants): the present build file
                # still answers for the others; the loops below add the new ones
                proc = run_ninja(out, jobs, dry_run=True, capture=True)
            if proc.returncode == 0:
                edges = planned_edges(proc.stdout)
            else:
                # a source the build would write again is gone (deleted by hand): ninja cannot
                # plan before it exists; the loops below list what the sources decide
                missing = re.search(r"'([^']+)', needed by .*missing and no known rule", proc.stdout)
                if not (missing and out / missing.group(1) in changed):
                    raise BuildError(f"ninja -n failed:\n{proc.stdout.strip()}")
                log(f"fa3gen: note: {missing.group(1)} is missing (the build writes it first); "
                    "header changes are not checked in this dry run")
        changed_names = {path.name for path in changed}
        for u in linked:
            edge = f"NVCC {u.name}"
            fresh = (out / "obj" / f"{u.name}.o").exists() and f"{u.name}.cu" not in changed_names
            if not fresh and edge not in edges:
                edges.append(edge)
        if "dispatch.cu" in changed_names and dispatch_edge not in edges:
            edges.append(dispatch_edge)
        for name in plain:
            edge = f"NVCC obj/{name}.o"
            fresh = (out / "obj" / f"{name}.o").exists() and f"{name}.cu" not in changed_names
            if not fresh and edge not in edges:
                edges.append(edge)
        if edges and link_edge not in edges:
            edges.append(link_edge)
        for obj in objects_without_deps(out):
            log(f"fa3gen: note: {obj} has no recorded header dependencies; a build compiles it again")
        selected = {u.name for u in linked}
        for obj in objects_built_with_spills(out) if strict else ():
            name = Path(obj).stem
            edge = f"NVCC {name}" if name in selected else f"NVCC {obj}"
            log(f"fa3gen: note: {obj} was built with spills allowed; a strict build compiles it again")
            if edge not in edges:
                edges.append(edge)
        if edges and link_edge not in edges:
            edges.append(link_edge)
    members = {f"NVCC {u.name}": u.variants for u in linked if len(u.variants) > 1}
    for e in edges:
        held = members.get(e)
        log(f"  would run: {e}" + (f" ({len(held)} variants: {', '.join(v.name for v in held)})"
                                   if held else ""))
    log(f"fa3gen: {len(edges)} edge(s) out of date" if edges else "fa3gen: up to date")
    return edges


def _resources(out: Path, name: str, variant: Optional[str] = None) -> Optional[dict]:
    """Unit `name`'s obj/<name>.resources.json (compile_one), or its part for `variant`."""
    try:
        data = json.loads((out / "obj" / f"{name}.resources.json").read_text())
    except (OSError, ValueError):
        return None
    if variant is not None:
        own = (data.get("variants") or {}).get(variant)
        if own is None:
            return None
        # compile_seconds: the unit's (a TU's time is not split between its kernels)
        return {"unit": name, "compile_seconds": data.get("compile_seconds"), "ok": data.get("ok"), **own}
    data.pop("entries", None)
    data.pop("name", None)
    data.pop("variants", None)
    return data


def write_manifest(p: Plan, tc: Toolchain, fp: str, lib: Path,
                   only: list[str], exclude: list[str], linked: list[Unit]) -> Path:
    from fa3gen.bench import git_commit  # torch-free, but not needed until a build succeeds

    defaults = p.default_names
    unit_of = {v.name: u.name for u in linked for v in u.variants}
    variants = []
    for v in p.variants:
        row = {"name": v.name, **asdict(v),
               "key": list(v.key), "is_default": v.name in defaults,
               "smem_bytes_estimate": smem_bytes(v),
               "resources": _resources(p.out_dir, unit_of[v.name], v.name)}
        variants.append(row)
    data = {
        "spec": p.spec.name,
        "spec_path": str(Path(p.spec.path).resolve()),
        # what the file held (fa3gen package refuses a file edited since, e.g. by fa3gen tune)
        "spec_sha256": p.spec.sha256,
        "fingerprint": fp,
        "generator_version": __version__,
        "abi_version": ABI_VERSION,  # tests/test_contract.py pins it to fa3gen_abi.h
        "library": str(lib.relative_to(p.out_dir)),
        "toolchain": tc.describe(),
        # The tree this build compiled, for reports that time the library elsewhere
        # (bench.library_commit): FA3GEN_COMMIT, else git's HEAD ("-dirty" with changes).
        "source_commit": git_commit(),
        "filters": {"only": only, "exclude": exclude},
        "variants": variants,
        "pruned": [{"name": x.variant.name, "constraint": x.constraint, "reason": x.reason}
                   for x in p.enumeration.pruned],
    }
    path = p.out_dir / MANIFEST_NAME
    write_atomically(path, json.dumps(data, indent=2) + "\n")
    return path
