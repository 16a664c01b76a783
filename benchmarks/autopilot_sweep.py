"""The staleness autopilot against fixed bounds, through `atrlhf sweep` (target: within 10 % of the best
fixed bound of {0, 1, 2, 4, 8} in time to 0.9 held-out accuracy, far from the worst).

For each setting, two sweeps of `configs/staleness_sweep.yaml` (the tiny task, async GRPO, one rollout worker,
the trainer, held-out greedy accuracy on 200 prompts every --eval-every steps), each point a supervised
`atrlhf-train` child flow run with its MLflow child run, run one at a time by the real CLI:

- fixed:     --grid runtime.max_staleness=0,1,2,4,8 --seeds N
- autopilot: --grid runtime.max_staleness=<start> --set runtime.autopilot.enabled=true --seeds N
             (range 0..8; the Supervisor of the flow raises and lowers the bound)

Settings: `trainer_slower` (the task as configured: the trainer is the slower role) and `rollout_slower`
(rollout.prompts_per_batch=1: one prompt's group per generation call, so the trainer waits for data).

Time to target is read back from each child's MLflow history: seconds from its first evaluation (step 0,
after start-up) to its first evaluation at or above --target (`train s`), and the sweep's own figure, from the
MLflow run's start (`run s`, start-up included). Every point runs with supervision.staleness_warn=1.0 so that a
fixed bound stays fixed (the flow's staleness policy otherwise narrows admission below it). A point that
never reaches the target counts as its whole run (a lower bound) and is marked. Per setting the table gives
each bound's mean over seeds, the autopilot's, and the autopilot's mean over the best and the worst fixed
bound's.

    python benchmarks/autopilot_sweep.py                          # both settings, 3 seeds (about an hour here)
    python benchmarks/autopilot_sweep.py --settings rollout_slower --seeds 2
    python benchmarks/autopilot_sweep.py --json                   # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "trainer_slower": [],
    "rollout_slower": ["rollout.prompts_per_batch=1"],
}
BOUNDS = [0, 1, 2, 4, 8]


def atrlhf() -> str:
    here = Path(sys.executable).parent / "atrlhf"
    return str(here) if here.exists() else "atrlhf"


def run_sweep(name: str, sets: list[str], grid: str, seeds: int, env: dict, log) -> None:
    """One `atrlhf sweep` (a subprocess, the real CLI); its output goes to `log`."""
    cmd = [atrlhf(), "sweep", "--config", "configs/staleness_sweep.yaml", "--sweep-id", name, "--grid", grid]
    cmd += ["--seeds", str(seeds)]
    for s in sets:
        cmd += ["--set", s]
    print("$ " + " ".join(cmd), file=log, flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


def children(uri: str, sweep_id: str) -> list[dict]:
    """The sweep's child runs: bound, seed, time to target (train s, run s), changes of the bound, status."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = client.search_experiments()
    runs = client.search_runs(
        [e.experiment_id for e in exps], filter_string=f"tags.`atrlhf.sweep_id` = '{sweep_id}'", max_results=500
    )
    parents = {r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags}
    out = []
    for r in runs:
        if r.data.tags.get("mlflow.parentRunId") not in parents:
            continue
        acc = sorted(
            ((m.step, m.value, m.timestamp) for m in client.get_metric_history(r.info.run_id, "eval/accuracy")),
            key=lambda x: (x[2], x[0]),
        )
        bounds = sorted(
            ((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "async/max_staleness")),
        )
        out.append(
            {
                "max_staleness": int(float(r.data.params.get("runtime.max_staleness", -1))),
                "seed": int(float(r.data.params.get("trainer.seed", 0))),
                "status": r.info.status,
                "acc": acc,
                "start_ms": r.info.start_time,
                "bounds": bounds,
            }
        )
    return out


def time_to(child: dict, target: float) -> dict:
    acc = child["acc"]
    if not acc:
        return {"train_s": None, "run_s": None, "reached": False, "steps": None}
    first_ms = acc[0][2]
    hit = next((a for a in acc if a[1] >= target), None)
    end = hit or acc[-1]
    changes = []
    last = None
    for step, value in child["bounds"]:
        if value != last:
            changes.append((int(step), int(value)))
            last = value
    return {
        "train_s": round((end[2] - first_ms) / 1000.0, 1),
        "run_s": round((end[2] - child["start_ms"]) / 1000.0, 1),
        "reached": hit is not None,
        "steps": int(end[0]),
        "bound_changes": changes[1:],  # after the starting bound
    }


def summarise(rows: list[dict]) -> dict:
    vals = [r["train_s"] for r in rows if r["train_s"] is not None]
    runs = [r["run_s"] for r in rows if r["run_s"] is not None]
    return {
        "train_s_mean": round(statistics.fmean(vals), 1) if vals else None,
        "train_s_sd": round(statistics.pstdev(vals), 1) if len(vals) > 1 else 0.0,
        "run_s_mean": round(statistics.fmean(runs), 1) if runs else None,
        "reached": f"{sum(r['reached'] for r in rows)}/{len(rows)}",
        "per_seed": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--bounds", type=int, nargs="+", default=BOUNDS)
    parser.add_argument("--start", type=int, default=1, help="the autopilot's starting bound")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=250, help="trainer.total_steps of every point")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="a further override for every point")
    parser.add_argument("--keep", help="directory for the MLflow store, runs and logs (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(args.keep or tempfile.mkdtemp(prefix="autopilot-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    common = [
        f"trainer.total_steps={args.steps}",
        f"tracking.eval_every={args.eval_every}",
        "tracking.checkpoint_every=0",
        # a fixed bound stays fixed: the flow's staleness health policy would otherwise narrow admission to
        # floor(staleness_warn x bound) once data sits near the bound (with the autopilot it never narrows)
        "supervision.staleness_warn=1.0",
        f"tracking.tracking_uri={uri}",
        "tracking.experiment=autopilot-sweep",
        f"run.output_dir={work / 'runs'}",
        *args.set,
    ]
    results: dict = {"machine_load_start": os.getloadavg()[0], "work_dir": str(work), "settings": {}}
    with open(work / "sweeps.log", "a") as log:
        for setting in args.settings:
            t0 = time.time()
            sets = [*common, *SETTINGS[setting]]
            fixed_id, pilot_id = f"{setting}-fixed", f"{setting}-autopilot{args.start}"
            run_sweep(fixed_id, sets, "runtime.max_staleness=" + ",".join(map(str, args.bounds)), args.seeds, env, log)
            pilot_sets = [*sets, "runtime.autopilot.enabled=true", "runtime.autopilot.min_staleness=0"]
            pilot_sets.append(f"runtime.autopilot.max_staleness={max(args.bounds)}")
            run_sweep(pilot_id, pilot_sets, f"runtime.max_staleness={args.start}", args.seeds, env, log)
            fixed = {b: [] for b in args.bounds}
            for c in children(uri, fixed_id):
                fixed.setdefault(c["max_staleness"], []).append({"seed": c["seed"], **time_to(c, args.target)})
            pilot = [{"seed": c["seed"], **time_to(c, args.target)} for c in children(uri, pilot_id)]
            table = {
                f"max_staleness {b}": summarise(sorted(rows, key=lambda r: r["seed"])) for b, rows in fixed.items()
            }
            table[f"autopilot (from {args.start})"] = summarise(sorted(pilot, key=lambda r: r["seed"]))
            means = {k: v["train_s_mean"] for k, v in table.items() if k.startswith("max_") and v["train_s_mean"]}
            best = min(means, key=means.get) if means else None
            worst = max(means, key=means.get) if means else None
            mine = table[f"autopilot (from {args.start})"]["train_s_mean"]
            results["settings"][setting] = {
                "overrides": sets,
                "runs": table,
                "best_fixed": best,
                "worst_fixed": worst,
                "autopilot_over_best": round(mine / means[best], 3) if best and mine else None,
                "autopilot_over_worst": round(mine / means[worst], 3) if worst and mine else None,
                "wall_s": round(time.time() - t0),
            }
    results["machine_load_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results))
        return
    for setting, res in results["settings"].items():
        print(f"\n{setting} ({res['wall_s']} s): seconds from the first evaluation to held-out >= {args.target}")
        print("| run | mean train s (sd) | mean run s | reached | per seed (train s @ step) |")
        print("|---|---:|---:|---:|---|")
        for name, row in res["runs"].items():
            seeds = " · ".join(f"{r['train_s']}{'' if r['reached'] else '+'} @ {r['steps']}" for r in row["per_seed"])
            print(
                f"| {name} | {row['train_s_mean']} ({row['train_s_sd']}) | {row['run_s_mean']} | {row['reached']} "
                f"| {seeds} |"
            )
        print(
            f"autopilot / best fixed ({res['best_fixed']}): {res['autopilot_over_best']}; "
            f"/ worst ({res['worst_fixed']}): {res['autopilot_over_worst']}"
        )


if __name__ == "__main__":
    main()
