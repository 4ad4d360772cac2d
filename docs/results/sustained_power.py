"""SM clock, board power and throttle reasons while fa3gen and cuDNN run the 16k headline forward
rows (bf16, non-causal, d128 and d256) back to back for 6 s each: is the clock power-limited,
and equally for both? Writes sustained_16k_power.json to $OUT (default: this directory).
Run from the repo root on the GPU machine: python3 docs/results/sustained_power.py"""
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from fa3gen import flash_attn_func, bench
OUT = os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__)))
res = []
for d in (128, 256):
    s = 16384; b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    fl = bench.attention_flops(b, h, s, s, d, False)
    def cud():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt)
    for name, fn in (("fa3gen", lambda: flash_attn_func(q, k, v)), ("cudnn", cud), ("fa3gen2", lambda: flash_attn_func(q, k, v))):
        for _ in range(20): fn()
        torch.cuda.synchronize()
        log = f"/tmp/smi_{name}_{d}.csv"
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                                "--format=csv,noheader,nounits", "-lms", "100"], stdout=open(log, "w"))
        t0 = time.time(); n = 0
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        while time.time() - t0 < 6:
            for _ in range(20): fn()
            n += 20
            torch.cuda.synchronize()
        en.record(); torch.cuda.synchronize()
        smi.terminate(); smi.wait()
        ms = st.elapsed_time(en) / n
        rows = [l.split(",") for l in open(log) if l.strip()]
        rows = rows[len(rows) // 4:]  # skip the first quarter
        clk = sum(float(r[0]) for r in rows) / len(rows); pw = sum(float(r[1]) for r in rows) / len(rows)
        tmp = max(float(r[2]) for r in rows); thr = sorted({r[3].strip() for r in rows})
        r = dict(head_dim=d, backend=name, tflops=fl / ms / 1e9, sm_mhz=clk, power_w=pw, temp_c=tmp, throttle=thr)
        res.append(r); print(json.dumps(r), flush=True)
json.dump(res, open(os.path.join(OUT, "sustained_16k_power.json"), "w"), indent=1)
