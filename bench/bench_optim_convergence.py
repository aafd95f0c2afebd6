"""Muon against AdamW, and bfloat16 against float32 AdamW states, on the debug models: 200 steps,
same data and seed, each optimizer at its best of three learning rates.

    python -m bench.bench_optim_convergence [--steps 200] [--out bench/results/local] [--models llama3,moe]

Runs ``python -m trainer`` once per (model, optimizer, lr), one process after the other (float32 on
the CPU; seq_len 128, local batch 4, warmup 20 steps then linear decay to 0.1 of the peak), reads
each run's metrics.jsonl and reports the final loss (mean of the last 10 steps) per lr, the best lr
of each optimizer, whether Muon beats AdamW there, and at AdamW's best lr the relative gaps between the
loss curves of AdamW with bfloat16 and with float32 states (titan's fused_adamw_ both; the target:
1%), per step, of 10-step means and of the final loss, next to the floor: the same gaps between two
float32 implementations (titan's and torch's fused AdamW), which differ only in rounding.
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


def smooth(losses: dict[int, float], k: int = 10) -> dict[int, float]:
    """The mean of the last ``k`` steps at each step (the curve without the batch-to-batch noise)."""
    steps = sorted(losses)
    return {s: sum(losses[t] for t in steps[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1))
            for i, s in enumerate(steps)}


def gaps(a: dict[int, float], b: dict[int, float]) -> dict:
    """Largest relative gaps between two loss curves: per step, and of their 10-step means."""
    sa, sb = smooth(a), smooth(b)
    return {"max_step": max(abs(a[s] - b[s]) / b[s] for s in b),
            "max_smoothed": max(abs(sa[s] - sb[s]) / sb[s] for s in sb),
            "final": abs(final(a) - final(b)) / final(b)}


def bf16_check(tmp: pathlib.Path, model: str, lr: str, steps: int, torch_fp32: dict[int, float]) -> dict:
    """AdamW with bf16 states against float32 states (titan's fused_adamw_ both), and the floor: the
    two float32 AdamW implementations (titan's, torch's fused) against each other."""
    base = [*MODELS[model], "--optimizer.name", "adamw", "--optimizer.lr", lr]
    titan32 = run(tmp / model / "adamw-titan-fp32", steps, [*base, "--optimizer.implementation", "titan"])
    bf16 = run(tmp / model / "adamw-titan-bf16", steps, [*base, "--optimizer.state_dtype", "bfloat16"])
    out = {"lr": float(lr), "final": final(bf16), "final_fp32": final(titan32), "vs_fp32": gaps(bf16, titan32),
           "floor": gaps(titan32, torch_fp32), "curve": bf16, "curve_fp32_titan": titan32}
    print(f"{model} adamw @{lr}: bf16 states vs fp32 states: largest gap per step {100 * out['vs_fp32']['max_step']:.2f}%, "
          f"of 10-step means {100 * out['vs_fp32']['max_smoothed']:.2f}%, final {100 * out['vs_fp32']['final']:.2f}%; "
          f"floor (fp32 titan vs fp32 torch): {100 * out['floor']['max_step']:.2f}% / "
          f"{100 * out['floor']['max_smoothed']:.2f}% / {100 * out['floor']['final']:.2f}%", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "local"))  # untracked; give bench/results to commit
    ap.add_argument("--models", default="llama3,moe")
    ap.add_argument("--resume", default=None, help="a results .json of an earlier run: add only what it lacks")
    ap.add_argument("--extra", default="", help="more runs, e.g. adamw@3e-4,muon@0.1 (the sweep's edges)")
    ns = ap.parse_args(argv)
    results: dict = {"steps": ns.steps, "config": COMMON, "models": {}}
    if ns.resume:
        results = json.loads(pathlib.Path(ns.resume).read_text())
    wanted = [(opt, lr) for opt, lrs in LRS.items() for lr in lrs]
    wanted += [(x.split("@")[0], float(x.split("@")[1])) for x in ns.extra.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        for model in ns.models.split(","):
            res = results["models"].setdefault(model, {"runs": {}})
            for opt, lr in wanted:
                name = f"{opt}@{lr:g}"
                if name in res["runs"]:
                    continue
                losses = run(pathlib.Path(tmp) / model / name, ns.steps,
                             [*MODELS[model], "--optimizer.name", opt, "--optimizer.lr", str(lr)])
                res["runs"][name] = {"final": final(losses), "curve": losses}
                print(f"{model} {name}: final loss {final(losses):.4f}", flush=True)
            best = {opt: min((n for n in res["runs"] if n.startswith(opt + "@")),
                             key=lambda n: res["runs"][n]["final"]) for opt in LRS}
            res["best"] = {opt: {"run": n, "final": res["runs"][n]["final"]} for opt, n in best.items()}
            res["muon_wins"] = res["runs"][best["muon"]]["final"] < res["runs"][best["adamw"]]["final"]
            q = res.get("bf16_states", {})
            if "vs_fp32" not in q or q["lr"] != float(best["adamw"].split("@")[1]):
                ref = {int(k): v for k, v in res["runs"][best["adamw"]]["curve"].items()}
                res["bf16_states"] = bf16_check(pathlib.Path(tmp), model, best["adamw"].split("@")[1], ns.steps, ref)
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
        b, q = res["best"], res["bf16_states"]
        if "vs_fp32" not in q:  # an older file's check, redone by the next --resume
            lines += ["", f"- best AdamW {b['adamw']['run']} {b['adamw']['final']:.4f}; best Muon {b['muon']['run']} "
                      f"{b['muon']['final']:.4f}", ""]
            continue
        lines += ["", f"- best AdamW {b['adamw']['run']} {b['adamw']['final']:.4f}; best Muon {b['muon']['run']} "
                  f"{b['muon']['final']:.4f}: Muon {'wins' if res['muon_wins'] else 'does not win'}",
                  f"- AdamW with bfloat16 states at lr {q['lr']:g}: final {q['final']:.4f} (float32 states "
                  f"{q['final_fp32']:.4f}); largest relative gap to float32 states per step "
                  f"{100 * q['vs_fp32']['max_step']:.2f}%, of the 10-step means {100 * q['vs_fp32']['max_smoothed']:.2f}%, "
                  f"final {100 * q['vs_fp32']['final']:.2f}%. The floor, two float32 implementations "
                  f"(titan's and torch's fused AdamW: the same math, other rounding): "
                  f"{100 * q['floor']['max_step']:.2f}% / {100 * q['floor']['max_smoothed']:.2f}% / "
                  f"{100 * q['floor']['final']:.2f}%", ""]
    prefix.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {prefix}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
