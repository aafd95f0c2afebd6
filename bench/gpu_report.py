"""The result files of bench/run_gpu.sh: ``<prefix>.json`` and ``<prefix>.md``, rewritten as each stage ends.

The JSON holds one section per stage (``environment``, ``train``, ``correctness``, ``headline``,
``native``, ...) written by the stage's own driver through :func:`update`, plus ``plan`` (the stages
and their time budgets) and ``stages`` (each stage's exit status, wall time and budget, written by
the shell script after the stage, so a stage killed by its time limit is recorded too). The Markdown
is rendered from the JSON every time, so it always shows what has finished.

Command line (used by run_gpu.sh; no torch import, so it costs nothing):

    python -m bench.gpu_report plan PREFIX MODE NAME:BUDGET_S ...
    python -m bench.gpu_report status PREFIX NAME RC ELAPSED_S BUDGET_S
    python -m bench.gpu_report render PREFIX
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

TIMED_OUT_RC = (124, 137)  # `timeout`: the limit passed (TERM), or KILL after the grace period


def load(prefix: str) -> dict:
    path = pathlib.Path(prefix + ".json")
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _write_atomic(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def update(prefix: str, section: str, data) -> None:
    """Set ``section`` of ``prefix.json`` to ``data`` and re-render ``prefix.md``."""
    result = load(prefix)
    result[section] = data
    _write_atomic(pathlib.Path(prefix + ".json"), json.dumps(result, indent=1, default=str))
    _write_atomic(pathlib.Path(prefix + ".md"), render(result))


# ----------------------------------------------------------------------------- Markdown


def run_summary(folder) -> dict:
    """What a trainer run's ``folder/metrics.jsonl`` reports: the mean tokens/s (per device) and MFU
    of the steady steps (all but the first, which compiles and warms up), the peak memory, the losses,
    whether the loss fell and the steps logged; empty when the run logged nothing."""
    metrics = pathlib.Path(folder) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    steady = records[1:] or records
    if not steady:
        return {}
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {"tokens_per_s": sum(r["tps"] for r in steady) / len(steady),
            "mfu_percent": sum(mfus) / len(mfus) if mfus else None,
            "memory_gib": max(r["memory_gib"] for r in records), "losses": [r["loss"] for r in records],
            "loss_falling": len(records) > 1 and records[-1]["loss"] < records[0]["loss"],
            "steps_logged": [r.get("step") for r in records]}


def _fmt(v, spec: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and spec:
        return format(v, spec)
    return str(v)


def _render_stages(result: dict) -> list[str]:
    plan = result.get("plan", {})
    stages = result.get("stages", {})
    lines = [f"## Stages ({plan.get('mode', '?')} run{', dry run on the CPU' if plan.get('dry_run') else ''})", "",
             "| stage | budget (s) | wall (s) | status |", "|---|---|---|---|"]
    for name, budget in plan.get("budgets", {}).items():
        st = stages.get(name)
        if st is None:
            lines.append(f"| {name} | {budget} | | not run (yet) |")
            continue
        lines.append(f"| {name} | {budget} | {st['elapsed_s']:.0f} | {st['status']} |")
    if plan.get("budgets"):
        lines.append(f"| total | {sum(plan['budgets'].values())} | "
                     f"{sum(s['elapsed_s'] for s in stages.values()):.0f} | |")
    return lines


def _render_environment(env: dict) -> list[str]:
    lines = ["## Environment", ""]
    lines += [f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in env.items()]
    return lines


def _render_train(train: dict) -> list[str]:
    lines = ["## Trainer on the device", "",
             "| run | layers | rc | wall (s) | tokens/s | MFU % (datasheet peak) | MFU % (measured matmul) | "
             "peak GiB | loss first -> last | falling |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in train.get("runs", []):
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "n/a"
        lines.append(
            f"| {r['name']} | {_fmt(r.get('layers'))} | {r['rc']} | {_fmt(r.get('wall_s'), '.0f')} | "
            f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('mfu_percent'), '.1f')} | "
            f"{_fmt(r.get('mfu_measured_percent'), '.1f')} | {_fmt(r.get('memory_gib'), '.1f')} | {loss} | "
            f"{_fmt(r.get('loss_falling'))} |")
    for r in train.get("runs", []):
        if r.get("rc") != 0 and r.get("output_tail"):
            lines += ["", f"{r['name']} (rc {r['rc']}), last lines:", "", "```", *r["output_tail"], "```"]
    return lines


def _render_correctness(corr: dict) -> list[str]:
    rows = corr.get("rows", [])
    bad = [r for r in rows if not r["ok"]]
    lines = ["## Correctness against float64", "",
             f"{len(rows) - len(bad)} of {len(rows)} checks within tolerance"
             + (f"; {len(corr.get('skipped', []))} not run (reasons below)" if corr.get("skipped") else ""), "",
             "| op | backend | case | quantity | rel. error | tolerance | ok |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['backend']} | {r['case']} | {r['quantity']} | {r['err']:.2e} | "
                     f"{r['tol']:.0e} | {'yes' if r['ok'] else 'NO'} |")
    for s in corr.get("skipped", []):
        lines.append(f"- not run: {s}")
    return lines


def _render_headline(head: dict) -> list[str]:
    lines = ["## Headline benchmarks", ""]
    ceil = head.get("ceilings")
    if ceil:
        lines += [f"Ceilings measured in the same process: copy {ceil['copy_bandwidth_GBps']:.0f} GB/s, "
                  f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s.", ""]
        if ceil.get("line"):  # each with the load average it was measured under
            lines += [ceil["line"][0].upper() + ceil["line"][1:] + ".", ""]
    if head.get("table"):
        lines += [head["table"], ""]
    for note in head.get("notes", []):
        lines.append(f"- {note}")
    return lines


def _render_generic(name: str, data) -> list[str]:
    lines = [f"## {name}", ""]
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(v, list) and v and isinstance(v[0], str):
                lines += [f"- {k}:", "", "```", *v, "```"]
            else:
                lines.append(f"- {k}: {v}")
    else:
        lines.append(str(data))
    return lines


RENDERERS = {"environment": _render_environment, "train": _render_train, "correctness": _render_correctness,
             "headline": _render_headline}


def render(result: dict) -> str:
    meta = result.get("plan", {})
    lines = [f"# bench/run_gpu.sh results: {meta.get('device', '?')}, {meta.get('date', '?')}", ""]
    lines += _render_stages(result) + [""]
    for key, data in result.items():
        if key in ("plan", "stages"):
            continue
        lines += RENDERERS.get(key, lambda d, k=key: _render_generic(k, d))(data) + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def _status_word(rc: int) -> str:
    if rc == 0:
        return "ok"
    if rc in TIMED_OUT_RC:
        return f"TIMED OUT (rc {rc})"
    return f"FAILED (rc {rc})"


def main(argv: list[str]) -> int:
    cmd, prefix, *rest = argv
    if cmd == "plan":
        mode, *budgets = rest
        import datetime

        plan = {"mode": mode.replace("-dry", ""), "dry_run": mode.endswith("-dry"),
                "device": pathlib.Path(prefix).name.split("-", 3)[-1],
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "budgets": {b.split(":")[0]: int(b.split(":")[1]) for b in budgets}}
        update(prefix, "plan", plan)
        total = sum(plan["budgets"].values())
        print("stage plan (time budgets, enforced with `timeout`):")
        for name, budget in plan["budgets"].items():
            print(f"  {name:<14s} {budget:4d} s")
        print(f"  {'total':<14s} {total:4d} s = {total / 60:.1f} min")
        return 0
    if cmd == "status":
        name, rc, elapsed, budget = rest
        result = load(prefix)
        stages = result.get("stages", {})
        stages[name] = {"rc": int(rc), "status": _status_word(int(rc)), "elapsed_s": float(elapsed),
                        "budget_s": int(budget)}
        update(prefix, "stages", stages)
        return 0
    if cmd == "render":
        _write_atomic(pathlib.Path(prefix + ".md"), render(load(prefix)))
        return 0
    raise SystemExit(f"gpu_report: unknown command {cmd!r} (plan, status, render)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
