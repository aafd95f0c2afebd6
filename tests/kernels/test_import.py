"""What ``import titan_kernels`` costs and needs, each checked in a fresh interpreter.

- It imports neither Inductor nor Dynamo (``torch._inductor``, ``torch._dynamo``: seconds), nor
  DTensor (``torch.distributed.tensor``), nor triton, even with triton installed: the triton_op
  variant registers on request (``enable_triton_op``), the sharding rules once DTensor is imported,
  the Triton kernels at their first call. The time against ``import torch``: bench/bench_import.py.
- Without the triton package every op runs on its other backends, and the triton family says why.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_KERNELS_TRITON_OP", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_pulls_in_no_compiler_dtensor_or_triton_until_asked():
    out = _run("""
import importlib.util, json, sys
import titan_kernels
heavy = ("torch._inductor", "torch._dynamo", "torch.distributed.tensor", "triton")
before = [m for m in heavy if m in sys.modules]
import torch
from torch.distributed.tensor import DTensor  # the rules follow DTensor's import
prop = DTensor._op_dispatcher.sharding_propagator
rules = sorted(str(op) for op in prop.op_strategy_funcs if str(op).startswith("titan."))
variant = hasattr(torch.ops.titan, "rms_norm_triton")
try:
    titan_kernels.enable_triton_op()
    tk_variant = hasattr(torch.ops.titan, "rms_norm_triton")
except RuntimeError as e:  # no triton here: it says so
    tk_variant = "not installed" in str(e) and importlib.util.find_spec("triton") is None
print(json.dumps({"before": before, "rules": rules, "variant": [variant, tk_variant]}))
""")
    assert out["before"] == [], f"import titan_kernels imported {out['before']}"
    assert {"titan.rms_norm.default", "titan.flash_attn.default", "titan.grouped_mm.default"} <= set(out["rules"])
    assert out["variant"] == [False, True]  # the triton_op variant: registered by enable_triton_op()


def test_without_triton_every_op_runs_elsewhere_and_says_why():
    out = _run("""
import json, sys
sys.modules["triton"] = None  # as if not installed: importing it fails, find_spec finds nothing
import torch, titan_kernels as tk
x, w = torch.randn(3, 8), torch.randn(8)
y = tk.rms_norm(x, w)
g = tk.swiglu(torch.randn(3, 8), torch.randn(3, 8))
q = torch.randn(1, 5, 2, 8)
o = tk.flash_attn(q, q, q)
offs = torch.tensor([1, 3], dtype=torch.int32)
m = tk.grouped_mm(torch.randn(3, 16), torch.randn(2, 16, 8), offs)
why = tk.available_backends("cpu")["triton"].reason
try:
    with tk.use_backend("triton"):
        tk.rms_norm(x, w)
    refused = ""
except RuntimeError as e:
    refused = str(e)
ok = bool(torch.allclose(y, torch.nn.functional.rms_norm(x, (8,), w, 1e-6), atol=1e-6))
print(json.dumps({"ok": ok, "shapes": [list(t.shape) for t in (g, o, m)], "why": why, "refused": refused,
                  "triton": "triton" in sys.modules and sys.modules["triton"] is not None}))
""")
    assert out["ok"] and out["shapes"] == [[3, 8], [1, 5, 2, 8], [3, 8]]
    assert out["why"] == "the triton package is not installed"
    assert "not installed" in out["refused"]
    assert not out["triton"]
