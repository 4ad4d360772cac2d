"""Host time of one eager forward + backward of fa3gen beside cuDNN through SDPA on a tiny
problem (batch 1, seqlen 128, 1 head, d64, bf16), the backends timed in turns
(host_time.interleaved_us); prints one JSON line. To A/B two trees of the fa3gen package on one
library, run it in alternating processes with each tree first on PYTHONPATH:

    FA3GEN_LIB=generated/h100/lib/libfa3gen_h100.so PYTHONPATH=<tree> \\
        python3 tests/gpu/host_fwd_bwd.py [--calls 100] [--rounds 9]

Rows: "dout" (backward(dout), a contiguous gradient) and "sum" (.sum().backward(): an expanded
gradient, which both backends copy before their kernels). Not a pytest module.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import PEER, PEER_CONTEXTS, interleaved_us, sdpa  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import fa3gen
    from fa3gen.ops import flash_attn_func

    shape = (1, 128, 1, 64)
    q, k, v = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    backends = {"fa3gen": lambda: flash_attn_func(q, k, v),
                PEER: lambda: sdpa(q, k, v).transpose(1, 2)}  # dout's layout
    rows = {
        "dout": interleaved_us({n: (lambda f=f: f().backward(dout)) for n, f in backends.items()},
                               PEER_CONTEXTS, args.calls, args.rounds),
        "sum": interleaved_us({n: (lambda f=f: f().sum().backward()) for n, f in backends.items()},
                              PEER_CONTEXTS, args.calls, args.rounds),
    }
    print(json.dumps({"package": os.path.dirname(fa3gen.__file__), "per_call_us": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
