"""`fa3gen tune`: time every built candidate of each dispatch key on the GPU and write the
winners into the spec's dispatch section.

For each key of the spec with several candidates (a key with one needs no choice), every
candidate runs the same shapes (batch = --tokens // seqlen, heads = --hidden // head_dim, one
per --seqlens entry) under sustained timing (fa3gen.timing.sustained_ms: the candidates of a
shape alternate, order rotated per round, each settled before its timed batch, median). The
winner has the highest geometric-mean speed over the shapes. Each candidate is first checked
against the fp32 reference (fa3gen.checks.check_variant: build.py --check's problems); one that
fails is reported and not timed, so it cannot win. The spec's `dispatch:` block is
then replaced by one exact entry per multi-candidate key (the winner; keys not timed keep
their current default), each commented with its measurement; the new spec is validated (it
must resolve to those defaults) before it is written. The measurement is kept as JSON (--out).

Feature keys run with the call arguments that select them: window (1024, 0) for `local` (or
--window's), softcap 30 for `softcap`, packed sequences of equal length for `varlen`. Without
--ranges one winner per key covers every length (the per-shape times in the JSON show where
another candidate would win); the dispatch cannot condition on the window's size, so tune at
the window the model uses.

Pure parts (candidates, choice, rendering, writing) run on CPU; torch is imported only to time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
from pathlib import Path
from typing import Callable

from fa3gen.bench import RESULTS_DIR, check_output_file, count, int_list, positive_ms, provenance
from fa3gen.contract import KEY_AXES, KNOB_AXES, AXIS_BY_NAME, key_str, takes_seqlen_ranges
from fa3gen.errors import Fa3genError
from fa3gen.files import write_atomically
from generator.errors import GeneratorError

DEFAULT_SEQLENS = (1024, 4096, 16384)
TOKENS, HIDDEN = 16384, 2048
LOCAL_WINDOW, SOFTCAP = (1024, 0), 30.0


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e}): {text!r}")
    return text


def _window(text: str) -> tuple[int, int]:
    """LEFT,RIGHT for --window: a window_size that selects the local keys (ops.masking's rules,
    -1 for no limit on that side)."""
    from fa3gen.errors import InvalidInputError
    try:
        from fa3gen.ops import masking  # imports torch: only when --window is given
    except ImportError as e:
        if e.name != "torch":
            raise
        masking = None  # unchecked: run() says that `fa3gen tune` needs torch, as without --window

    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError(f"got {len(parts)} value(s) in {text!r}")
        left, right = (int(x) for x in parts)
        if masking is None:
            return left, right
        local = masking(False, (left, right)).local
    except (ValueError, InvalidInputError) as e:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT, two integers >= -1: {e}")
    if not local:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sliding window (-1,0 is causal, "
                                         "-1,-1 no window; a side of 2^31 keys or more is "
                                         "unbounded)")
    return left, right


# The top-level `dispatch:` line and the lines that belong to it: indented, list items (YAML
# allows them at column 0 under a key) or blank. Any other line (a key, a quoted key, a
# comment at column 0) ends it and stays.
_DISPATCH_BLOCK = re.compile(r"^dispatch:[^\n]*(?:\n|\Z)(?:(?:[ \t-][^\n]*)?(?:\n|\Z))*", re.M)


# ---------------------------------------------------------------------------------------------
# Pure parts.


def candidates(spec_path) -> tuple[dict, dict]:
    """({key: [Variant, ...]} for keys with several kept variants, {key: current default})."""
    from generator.spec import load_spec
    from generator.variants import enumerate_variants

    spec = load_spec(spec_path)
    return _candidates_of(spec, enumerate_variants(spec).kept)


def _candidates_of(spec, kept) -> tuple[dict, dict]:
    from generator.variants import resolve_dispatch

    by_key: dict = {}
    for v in sorted(kept, key=lambda v: v.name):
        by_key.setdefault(v.key, []).append(v)
    return ({k: vs for k, vs in by_key.items() if len(vs) > 1}, resolve_dispatch(spec, kept))


def choose(times: dict[str, list[float]]) -> tuple[str, dict[str, float]]:
    """(winner, {name: geometric-mean speed relative to the winner}) from per-shape times
    (ms) of each candidate; a candidate that failed on any shape (None) cannot win."""
    speed = {n: math.exp(-sum(math.log(t) for t in ts) / len(ts))
             for n, ts in times.items() if ts and all(t and t > 0 for t in ts)}
    if not speed:
        raise Fa3genError("no candidate ran on every shape: " + ", ".join(times))
    best = max(speed, key=speed.get)
    return best, {n: s / speed[best] for n, s in sorted(speed.items(), key=lambda x: -x[1])}


def round_spread(per_round: dict, best: str) -> dict[str, list]:
    """{candidate: [[lowest, highest] speed relative to the winner per shape]}, each round's
    candidate batch against the winner's in the same round (best ms / candidate ms), so the
    spread of one run shows beside its medians; None for a shape either side did not run."""
    spread = {}
    for name, shapes in per_round.items():
        spread[name] = []
        for mine, theirs in zip(shapes, per_round.get(best, [])):
            ratios = [b / m for m, b in zip(mine or [], theirs or []) if m and b]
            spread[name].append([min(ratios), max(ratios)] if ratios else None)
    return spread


def _yaml_value(axis: str, value) -> str:
    if AXIS_BY_NAME[axis].kind == "tile":
        return f"[{value[0]}, {value[1]}]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_dispatch(defaults: dict, notes: dict, ranges: dict | None = None) -> str:
    """The `dispatch:` block: one exact entry per key (`when` names the key's axes, the
    features only when set; `use` every knob of the default, optional flags only when set: an
    entry that does not name one means it off), each preceded by its note, then
    the key's seqlen_k range entries ({key: [(lo, hi, variant)]})."""
    def entry(v, rng=None):
        axes = v.axes()
        when = [(a, axes[a]) for a in KEY_AXES if not AXIS_BY_NAME[a].optional or axes[a]]
        use = [(a, axes[a]) for a in KNOB_AXES if not AXIS_BY_NAME[a].optional or axes[a]]
        out = ["  - when: {" + ", ".join(f"{a}: {_yaml_value(a, x)}" for a, x in when) + "}"]
        if rng is not None:
            out.append(f"    seqlen_k: [{rng[0]}, {rng[1]}]")
        out.append("    use: {" + ", ".join(f"{a}: {_yaml_value(a, x)}" for a, x in use) + "}")
        return out

    lines = ["dispatch:"]
    for key, v in sorted(defaults.items(), key=lambda kv: kv[1].name):
        if key in notes:
            lines.append(f"  # {notes[key]}")
        lines += entry(v)
        for lo, hi, rv in (ranges or {}).get(key, ()):
            lines += entry(rv, (lo, hi))
    return "\n".join(lines) + "\n"


def seqlen_ranges(seqlens: list[int], times: dict[str, list], fallback: str) -> list:
    """[(lo, hi, name)]: where the fastest candidate per measured length differs from the
    fallback, the lengths it wins, split halfway (geometrically) between measured lengths;
    the first range starts at 0, the last runs to the end."""
    from generator.spec import SEQLEN_MAX

    order = sorted(range(len(seqlens)), key=lambda i: seqlens[i])
    best = []
    for i in order:
        ok = {n: ts[i] for n, ts in times.items() if ts[i]}
        # an exact tie goes to the fallback: no range for a candidate that is not faster
        best.append(min(ok, key=lambda n: (ok[n], n != fallback)) if ok else fallback)
    out, start = [], 0
    for j, i in enumerate(order):
        last = j + 1 == len(order)
        if not last and best[j + 1] == best[j]:
            continue
        hi = SEQLEN_MAX if last else int(math.sqrt(seqlens[i] * seqlens[order[j + 1]]))
        if best[j] != fallback:
            out.append((start, hi, best[j]))
        start = hi + 1
    return out


def replace_dispatch(text: str, block: str) -> str:
    """text with its top-level `dispatch:` block (up to the next top-level key) replaced by
    block, or block appended when there is none. The rest of the file, comments included,
    is kept."""
    if _DISPATCH_BLOCK.search(text):
        return _DISPATCH_BLOCK.sub(lambda m: block, text, count=1)
    return text.rstrip("\n") + "\n" + block


def write_spec(spec_path: Path, winners: dict, notes: dict, ranges: dict | None = None) -> str:
    """The spec text with the winners as defaults (every other multi-candidate key keeps its
    current one) and the seqlen ranges given; raises if the result does not resolve to
    exactly those."""
    from generator.spec import parse_spec
    from generator.variants import enumerate_variants, resolve_dispatch, resolve_seqlen_dispatch

    original = spec_path.read_text()
    before = parse_spec(original, str(spec_path), spec_path.stem)
    before_kept = enumerate_variants(before).kept
    multi, current = _candidates_of(before, before_kept)
    defaults = {k: winners.get(k, current.get(k)) for k in multi}
    missing = [key_str(k) for k, v in defaults.items() if v is None]
    if missing:
        raise Fa3genError(f"no default to write for {', '.join(missing)} (not timed and none in "
                          "the spec)")
    # keys not timed keep their seqlen_k range entries as well as their default
    ranges = {**{k: r for k, r in resolve_seqlen_dispatch(before, before_kept, current).items()
                 if k not in winners}, **(ranges or {})}
    text = replace_dispatch(original, render_dispatch(defaults, notes, ranges))
    spec = parse_spec(text, str(spec_path), spec_path.stem)
    kept = enumerate_variants(spec).kept
    resolved = resolve_dispatch(spec, kept)
    resolved_ranges = resolve_seqlen_dispatch(spec, kept, resolved)
    wrong = [key_str(k) for k, v in defaults.items() if resolved.get(k) != v]
    wrong += [key_str(k) for k, r in ranges.items() if resolved_ranges.get(k) != r]
    if wrong:
        raise Fa3genError(f"the rewritten dispatch does not resolve {', '.join(wrong)} to the "
                          "chosen variants (please report this)")
    if _without_dispatch(text) != _without_dispatch(original):
        raise Fa3genError(f"rewriting the dispatch of {spec_path} would change its other keys "
                          "(an unusual layout): edit its dispatch block by hand")
    return text


def _without_dispatch(text: str) -> dict:
    import yaml

    data = yaml.safe_load(text)
    return {k: v for k, v in data.items() if k != "dispatch"} if isinstance(data, dict) else data


# ---------------------------------------------------------------------------------------------
# GPU measurement.


def _call(key: tuple, shape: dict,
          window: tuple[int, int] = LOCAL_WINDOW) -> Callable[[str], Callable[[], object]]:
    """make(variant name) -> a no-argument call running that candidate on `shape` (local keys
    with window_size `window`)."""
    import torch

    from fa3gen import ops, timing, varlen
    from fa3gen.ops import TORCH_DTYPES

    axes = dict(zip(KEY_AXES, key))
    if axes["paged"]:
        raise Fa3genError(f"fa3gen tune does not time paged keys yet ({key_str(key)}): "
                          "leave them out with --keys")
    direction, dtype, d, causal = axes["direction"], axes["dtype"], axes["head_dim"], axes["causal"]
    local, softcap, packed = axes["local"], axes["softcap"], axes["varlen"]
    b, s, h = shape["batch"], shape["seqlen"], shape["heads"]
    mask = ops.masking(causal, window if local else (-1, -1), SOFTCAP if softcap else 0.0)
    kw = dict(causal=causal, window_size=(mask.window_left, mask.window_right),
              softcap=mask.softcap)
    dt, scale = TORCH_DTYPES[dtype], d ** -0.5

    # the bench's seeded inputs (fp8 ones included: randn has no 8-bit kernels)
    inputs = timing.random_inputs(dict(batch=b, seqlen=s, heads=h, head_dim=d), dt, 4)
    if packed:
        q, k, v, dout = (x.reshape(b * s, h, d) for x in inputs)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        if direction == "fwd":
            return lambda name: lambda: varlen.flash_attn_varlen_func(q, k, v, cu, cu, s, s,
                                                                      variant=name, **kw)
        out, lse = varlen.flash_attn_varlen_func(q, k, v, cu, cu, s, s, return_lse=True, **kw)
        return lambda name: lambda: varlen._backward(dout, q, k, v, out, lse, cu, cu, s, s, mask,
                                                     scale, name, False)
    q, k, v, dout = inputs
    if direction == "fwd":
        return lambda name: lambda: ops.flash_attn_func(q, k, v, variant=name, **kw)
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True, **kw)
    return lambda name: lambda: ops._backward(dout, q, k, v, out, lse, mask, scale, name, False)


def measure(lib, key: tuple, names: list[str], shapes: list[dict], rounds: int,
            min_ms: float, sampler=None, power: dict | None = None,
            window: tuple[int, int] = LOCAL_WINDOW,
            reasons: dict | None = None,
            per_round: dict | None = None) -> dict[str, list[float | None]]:
    """{candidate: [ms per shape]} (None where it failed), candidates interleaved per shape
    (bench.measure_backends, sustained); local keys run with window_size `window`. With a
    PowerSampler, power gets {candidate: [[mean board W, mean SM MHz] per shape]} over that
    candidate's timed batches ([None, None] without samples), and reasons {candidate: [the
    clock-event reasons per shape]} (None without them). per_round, when given, gets
    {candidate: [[ms of each round] per shape]} (None where it failed)."""
    from fa3gen.bench import measure_backends
    from fa3gen.timing import report_failure

    timing = argparse.Namespace(rounds=rounds, min_ms=min_ms)
    times: dict = {n: [] for n in names}
    if sampler is not None and power is not None:
        power.update({n: [] for n in names})
    if sampler is not None and reasons is not None:
        reasons.update({n: [] for n in names})
    if per_round is not None:
        per_round.update({n: [] for n in names})
    for shape in shapes:
        make = _call(key, shape, window)
        fns = {}
        for name in names:
            try:
                fns[name] = make(name)
            except Exception as e:  # a candidate that cannot run this shape cannot win
                report_failure(name, e)
                fns[name] = None
        seen, shape_rounds = {}, {}
        ms, watts, mhz = measure_backends(fns, timing, sampler, seen, shape_rounds)
        for name in names:
            times[name].append(ms.get(name))
            if per_round is not None:
                per_round[name].append(shape_rounds.get(name))
            if sampler is not None and power is not None:
                power[name].append([watts.get(name), mhz.get(name)])
            if sampler is not None and reasons is not None:
                reasons[name].append(seen.get(name))
    return times


# ---------------------------------------------------------------------------------------------
# CLI.


def _spread_text(shapes: list | None) -> str:
    """' (rounds LO-HI)' over every shape's per-round speeds, '' when no round paired up."""
    pairs = [p for p in shapes or [] if p]
    if not pairs:
        return ""
    return f" (rounds {min(p[0] for p in pairs):.3f}-{max(p[1] for p in pairs):.3f})"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="time each key's built candidates on the GPU and write the winners into "
                     "the spec's dispatch section")
    p.add_argument("--spec", required=True,
                   help="spec YAML path or name in specs/ (build it first: fa3gen build --spec SPEC)")
    p.add_argument("--seqlens", type=int_list("1024,4096"), default=list(DEFAULT_SEQLENS),
                   metavar="N,N,...", help="sequence lengths of the timed shapes (default "
                   "1024,4096,16384; batch = 16384 // seqlen, heads = 2048 // head_dim)")
    p.add_argument("--keys", default=None, metavar="REGEX", type=_regex,
                   help="tune only keys whose spelling matches (re.search, so anchor and "
                        "escape it for one key: '^\\(fwd, bf16, d128, causal\\)$'; 'd128' "
                        "takes every d128 key); the others keep their default")
    p.add_argument("--window", type=_window, default=LOCAL_WINDOW, metavar="LEFT,RIGHT",
                   help="window_size of the local keys' calls (default 1024,0): tune at the "
                        "window the model uses (--window=-1,N for a side without limit)")
    p.add_argument("--rounds", type=count(1), default=3, help="sustained rounds (default 3)")
    p.add_argument("--min-ms", type=positive_ms, default=100.0,
                   help="back-to-back launches per round and candidate, ms (default 100)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "tune_<spec>.json",
                   help="measurement JSON (default docs/results/tune_<spec>.json)")
    p.add_argument("--ranges", action="store_true",
                   help="also write seqlen_k range entries where another candidate is the "
                        "fastest at some of the measured lengths (split halfway between them)")
    p.add_argument("--dry-run", action="store_true",
                   help="measure and report, but leave the spec as it is")
    p.add_argument("--no-power", action="store_true",
                   help="do not sample board power and SM clock (nvidia-smi) during the timing")
    p.add_argument("--no-check", action="store_true",
                   help="time every candidate without first checking it against the reference "
                        "(a wrong one could then win)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import torch

    from fa3gen import runtime
    from generator.paths import resolve_spec_path

    spec_path = Path(resolve_spec_path(args.spec))
    every, current = candidates(spec_path)
    multi = {k: v for k, v in every.items() if not args.keys or re.search(args.keys, key_str(k))}
    if not multi:
        if args.keys:  # a typo in the filter is an error, as build's --only that matches nothing
            raise GeneratorError(f"{spec_path}: no key with several candidates matches "
                                 f"--keys {args.keys!r}; the keys with several: "
                                 + (", ".join(key_str(k) for k in every) or "none"))
        print(f"fa3gen tune: {spec_path}: no key with several candidates; nothing to tune")
        return 0
    # write_spec gives every multi-candidate key a default: one --keys leaves out needs the
    # spec's, else the rewrite fails, and that must not come after the timing
    untimed = [key_str(k) for k in every if k not in multi and k not in current]
    if untimed and not args.dry_run:
        raise GeneratorError(f"{spec_path}: --keys {args.keys!r} leaves out {', '.join(untimed)}, "
                             "which ha" + ("s" if len(untimed) == 1 else "ve") + " several "
                             "candidates and no default in the spec's dispatch: the rewritten "
                             "dispatch would have none to write; widen --keys, give "
                             + ("it" if len(untimed) == 1 else "them") + " a dispatch entry, or "
                             "pass --dry-run")
    out = Path(str(args.out).replace("<spec>", spec_path.stem))
    check_output_file("--out", out)  # written after the first key's timing: said before it
    if not torch.cuda.is_available():
        raise Fa3genError("fa3gen tune needs a CUDA GPU (Hopper sm_90)")
    lib = runtime.use_spec(str(spec_path))
    built = {v.name for v in lib.variants}
    absent = [v.name for vs in multi.values() for v in vs if v.name not in built]
    if absent:
        raise Fa3genError(f"{lib.path} lacks {len(absent)} candidate(s) of the spec (e.g. "
                          f"{absent[0]}); build them first: fa3gen build --spec {args.spec}")
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"header": provenance(lib), "keys": []}
    report["header"].update(spec=str(spec_path), seqlens=args.seqlens, window=list(args.window),
                            rounds=args.rounds, min_ms=args.min_ms, complete=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    from fa3gen.timing import PowerSampler

    with PowerSampler(torch.cuda.current_device()) if not args.no_power \
            else contextlib.nullcontext() as sampler:
        return _tune_keys(args, lib, spec_path, multi, current, report, out, sampler)


def check_candidates(lib, variants) -> dict[str, str]:
    """{name: why} of the candidates that fail checks.check_variant, each reported."""
    from fa3gen import checks

    wrong = {}
    for v in variants:
        res = checks.check_variant(lib, v)
        if not res["ok"]:
            wrong[v.name] = res["why"]
            print(f"{v.name}: wrong, not timed: {res['why']}", flush=True)
    return wrong


def _save(report: dict, out: Path) -> None:
    out.write_text(json.dumps(report, indent=1) + "\n")


def _tune_keys(args, lib, spec_path: Path, multi: dict, current: dict, report: dict, out: Path,
               sampler) -> int:
    """Measure every key, write the report after each, then the spec's dispatch section."""
    winners, notes, ranges = {}, {}, {}
    for key, variants in sorted(multi.items(), key=lambda kv: kv[1][0].name):
        shapes = [{"seqlen": s, "batch": max(1, TOKENS // s), "heads": max(1, HIDDEN // key[2])}
                  for s in args.seqlens]
        wrong = {} if args.no_check else check_candidates(lib, variants)
        names = [v.name for v in variants if v.name not in wrong]
        if not names:  # recorded first, so the report says why the run stopped
            report["keys"].append({"key": list(key), "failed_check": wrong})
            _save(report, out)
            raise Fa3genError(f"{key_str(key)}: every candidate failed its check against the "
                              "reference: " + "; ".join(f"{n}: {w}" for n, w in wrong.items())
                              + f"; the report: {out} (leave the key out with --keys, or time "
                              "it unchecked with --no-check)")
        power, reasons, per_round = {}, {}, {}  # power and reasons filled only with a sampler
        times = measure(lib, key, names, shapes, args.rounds, args.min_ms, sampler, power,
                        args.window, reasons=reasons, per_round=per_round)
        best, relative = choose(times)
        spread = round_spread(per_round, best)
        winner = next(v for v in variants if v.name == best)
        old = current.get(key)
        winners[key] = winner
        runner_up = next((f"{n} {r:.3f}" for n, r in relative.items() if n != best), "none")
        axes = dict(zip(KEY_AXES, key))
        window = f", window {args.window[0]},{args.window[1]}" if axes["local"] else ""
        notes[key] = (f"fa3gen tune, seqlens {','.join(map(str, args.seqlens))}{window}: geomean "
                      f"speed vs the winner: runner-up {runner_up}")
        # keys that take ranges only; varlen keys: packed sequences of equal length, so
        # max_seqlen_k
        if args.ranges and takes_seqlen_ranges(key):
            by_name = {v.name: v for v in variants}
            found = seqlen_ranges(list(args.seqlens), times, best)
            if found:
                ranges[key] = [(lo, hi, by_name[n]) for lo, hi, n in found]
        report["keys"].append({"key": list(key), "shapes": shapes, "ms": times,
                               "failed_check": wrong,
                               "relative_speed": relative, "winner": best,
                               "previous_default": old.name if old else None,
                               "seqlen_ranges": [[lo, hi, v.name] for lo, hi, v
                                                 in ranges.get(key, [])],
                               "round_ms": per_round, "round_relative": spread,
                               **({"power_w_sm_mhz": power} if power else {}),
                               **({"clock_reasons": reasons} if reasons else {})})
        change = "" if old is not None and old.name == best else f" (was {old.name if old else 'none'})"
        print(f"{key_str(key)}: {best}{change}; " + ", ".join(
            f"{n}: {r:.3f}{'' if n == best else _spread_text(spread.get(n))}"
            for n, r in relative.items()), flush=True)
        # after every key, so that a run that dies keeps what it measured (complete: false)
        _save(report, out)
    report["header"]["complete"] = True
    _save(report, out)
    if args.dry_run:
        print(f"wrote {out}; --dry-run: {spec_path} unchanged")
        return 0
    write_atomically(spec_path, write_spec(spec_path, winners, notes, ranges))  # never half-written
    print(f"wrote {out} and the dispatch section of {spec_path}; rebuild to use it: "
          f"fa3gen build --spec {args.spec}")
    return 0
