"""The measurement the GPU bench scripts share (bench_features.py, bench_varlen.py): several
backends on one point, each first run once (a failure is reported, not fatal), then timed
together by fa3gen.timing.sustained_ms (rounds of back-to-back launches, order rotated, each
settled before its timed batch)."""

import torch

from fa3gen import timing


def measure(calls: dict, direction: str, rounds: int, min_ms: float) -> dict:
    """{backend: ms or error text}; calls[name] = (fn returning out, inputs needing grad).
    direction "bwd" times autograd.grad of one recorded forward."""
    timed, errors = {}, {}
    for name, (fn, inputs) in calls.items():
        try:
            o = fn()  # compiles / warms the backend up
            if direction == "fwd":
                timed[name] = fn
            else:
                go = torch.randn_like(o)
                timed[name] = lambda o=o, go=go, inputs=inputs: torch.autograd.grad(
                    o, inputs, go, retain_graph=True)
            timed[name]()
            torch.cuda.synchronize()
        except Exception as e:
            errors[name] = repr(e)[:200]
            timed.pop(name, None)
    names = list(timed)
    ms = timing.sustained_ms([timed[n] for n in names], rounds, min_ms) if names else []
    return {**dict(zip(names, ms)), **errors}
