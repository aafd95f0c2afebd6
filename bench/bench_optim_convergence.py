"""Muon against AdamW, and bfloat16 against float32 AdamW states, on the debug models: 200 steps,
same data and seed, each optimizer at its best of three learning rates.

    python -m bench.bench_optim_convergence [--steps 200] [--out bench/results] [--models llama3,moe]

Runs ``python -m trainer`` once per (model, optimizer, lr), one process after the other (float32 on
the CPU; seq_len 128, local batch 4, warmup 20 steps then linear decay to 0.1 of the peak), reads
each run's metrics.jsonl and reports the final loss (mean of the last 10 steps) per lr, the best lr
of each optimizer, whether Muon beats AdamW there, and the largest relative gap between the loss
curves of AdamW with bfloat16 states and with float32 states at AdamW's best lr (the target: 1%).
Models: the Llama 3 debugmodel and the Qwen3 MoE debugmodel_moe. Writes
``<out>/<date>-cpu-optim-convergence.{json,md}``. Not a unit test: about 1-2 minutes per run here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
MODELS = {"llama3": [], "moe": ["--model.name", "qwen3", "--flavor", "debugmodel_moe"]}
LRS = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (3e-3, 1e-2, 3e-2)}
COMMON = ["--training.seq_len", "128", "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "20",
          "--metrics.log_freq", "1", "--metrics.save_plot", "false", "--metrics.enable_color", "false",
          "--training.seed", "0"]


def run(folder: pathlib.Path, steps: int, args: list[str]) -> dict[int, float]:
    """Train in a fresh process; {step: loss}."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "trainer", *COMMON, "--training.steps", str(steps), "--job.dump_folder",
           str(folder), *args]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    out = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def final(losses: dict[int, float], k: int = 10) -> float:
    last = sorted(losses)[-k:]
    return sum(losses[s] for s in last) / len(last)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--models", default="llama3,moe")
    ns = ap.parse_args(argv)
    results: dict = {"steps": ns.steps, "config": COMMON, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in ns.models.split(","):
            res = results["models"][model] = {"runs": {}}
            for opt, lrs in LRS.items():
                for lr in lrs:
                    name = f"{opt}@{lr:g}"
                    losses = run(pathlib.Path(tmp) / model / name, ns.steps,
                                 [*MODELS[model], "--optimizer.name", opt, "--optimizer.lr", str(lr)])
                    res["runs"][name] = {"final": final(losses), "curve": losses}
                    print(f"{model} {name}: final loss {final(losses):.4f}", flush=True)
            best = {opt: min((n for n in res["runs"] if n.startswith(opt + "@")), key=lambda n: res["runs"][n]["final"])
                    for opt in LRS}
            res["best"] = {opt: {"run": n, "final": res["runs"][n]["final"]} for opt, n in best.items()}
            res["muon_wins"] = res["runs"][best["muon"]]["final"] < res["runs"][best["adamw"]]["final"]
            lr = best["adamw"].split("@")[1]
            bf16 = run(pathlib.Path(tmp) / model / "adamw-bf16", ns.steps,
                       [*MODELS[model], "--optimizer.name", "adamw", "--optimizer.lr", lr,
                        "--optimizer.state_dtype", "bfloat16"])
            ref = res["runs"][best["adamw"]]["curve"]
            gap = max(abs(bf16[s] - ref[s]) / ref[s] for s in ref)
            res["bf16_states"] = {"lr": float(lr), "final": final(bf16), "max_rel_gap": gap, "curve": bf16}
            print(f"{model} adamw bf16 states @{lr}: final {final(bf16):.4f}, max relative gap to fp32 states "
                  f"{100 * gap:.2f}%", flush=True)
    out = pathlib.Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / f"{datetime.date.today().isoformat()}-cpu-optim-convergence"
    prefix.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = ["# Muon vs AdamW, bf16 vs fp32 AdamW states (CPU, float32 compute)", "",
             f"{ns.steps} steps, same data and seed; final loss = mean of the last 10 steps. Arguments: "
             f"`{' '.join(COMMON)}`", ""]
    for model, res in results["models"].items():
        lines += [f"## {model}", "", "| run | final loss |", "|---|---|"]
        lines += [f"| {n} | {r['final']:.4f} |" for n, r in res["runs"].items()]
        b = res["best"]
        lines += ["", f"- best AdamW {b['adamw']['run']} {b['adamw']['final']:.4f}; best Muon {b['muon']['run']} "
                  f"{b['muon']['final']:.4f}: Muon {'wins' if res['muon_wins'] else 'does not win'}",
                  f"- AdamW with bfloat16 states at lr {res['bf16_states']['lr']:g}: final "
                  f"{res['bf16_states']['final']:.4f}, largest per-step relative gap to float32 states "
                  f"{100 * res['bf16_states']['max_rel_gap']:.2f}%", ""]
    prefix.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {prefix}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
