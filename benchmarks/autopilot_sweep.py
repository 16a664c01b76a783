"""The staleness autopilot against fixed bounds, through `atrlhf sweep` (target: within 10 % of the best
fixed bound of {0, 1, 2, 4, 8} in time to 0.9 held-out accuracy, far from the worst).

For each setting and each seed, two sweeps of `configs/staleness_sweep.yaml` (the tiny task, async GRPO, one
rollout worker, the trainer, held-out greedy accuracy on 200 prompts every --eval-every steps), each point a
supervised `atrlhf-train` child flow run with its MLflow child run, run one at a time by the real CLI, in turns
(the autopilot first on odd seeds, so that a drift of the machine's speed does not favour one arm):

- fixed:     --grid runtime.max_staleness=0,1,2,4,8 --set trainer.seed=S
- autopilot: --grid runtime.max_staleness=<start> --set runtime.autopilot.enabled=true --set trainer.seed=S
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
    # more seeds later, into another store, and one table of both (seeds must differ between stores):
    python benchmarks/autopilot_sweep.py --seeds 4 --set trainer.seed=3 --keep /tmp/b --merge /tmp/a
    python benchmarks/autopilot_sweep.py --keep /tmp/b --merge /tmp/a --report-only
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


def children(uri: str, sweep_prefix: str) -> list[dict]:
    """The child runs of the sweeps `sweep_prefix` and `sweep_prefix-s<first seed>` (`<setting>-fixed`: every
    invocation's): bound, seed, time to target (train s, run s), changes of the bound, status."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = client.search_experiments()
    runs = client.search_runs(
        [e.experiment_id for e in exps],
        filter_string=f"tags.`atrlhf.sweep_id` LIKE '{sweep_prefix}%'",
        max_results=5000,
    )
    sid = "atrlhf.sweep_id"
    runs = [r for r in runs if r.data.tags[sid] == sweep_prefix or r.data.tags[sid].startswith(sweep_prefix + "-s")]
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
        # the standard error of the mean: two arms whose means differ by less than about twice it are not ranked
        "train_s_se": round(statistics.stdev(vals) / len(vals) ** 0.5, 1) if len(vals) > 1 else None,
        "run_s_mean": round(statistics.fmean(runs), 1) if runs else None,
        # how many steps, and how fast: a bound changes the second (waiting), luck and staleness the first
        "steps_mean": round(statistics.fmean(r["steps"] for r in rows if r["steps"]), 1) if vals else None,
        "s_per_step": round(statistics.fmean(r["train_s"] / r["steps"] for r in rows if r["steps"]), 3)
        if vals
        else None,
        "reached": f"{sum(r['reached'] for r in rows)}/{len(rows)}",
        "per_seed": rows,
    }


def seed_of(sets: list[str]) -> int:
    """The first seed of an invocation: the last trainer.seed override, else 0 (the config's)."""
    return next((int(x.split("=", 1)[1]) for x in reversed(sets) if x.startswith("trainer.seed=")), 0)


def collect(stores: list[Path], setting: str, start: int, target: float) -> tuple[dict, list]:
    """Every store's points of `setting`, by bound and for the autopilot; a (bound, seed) met twice counts once
    (the first store's)."""
    fixed: dict[int, list] = {}
    pilot: list = []
    seen = set()
    for store in stores:
        uri = f"sqlite:///{store / 'mlflow.db'}"
        for c in children(uri, f"{setting}-fixed"):
            if ("fixed", c["max_staleness"], c["seed"]) not in seen:
                seen.add(("fixed", c["max_staleness"], c["seed"]))
                fixed.setdefault(c["max_staleness"], []).append({"seed": c["seed"], **time_to(c, target)})
        for c in children(uri, f"{setting}-autopilot{start}"):
            if ("pilot", c["seed"]) not in seen:
                seen.add(("pilot", c["seed"]))
                pilot.append({"seed": c["seed"], **time_to(c, target)})
    return fixed, pilot


def compare(fixed: dict, pilot: list, start: int) -> dict:
    """Per bound and for the autopilot, the mean over seeds; the autopilot over the best and the worst bound."""
    table = {
        f"max_staleness {b}": summarise(sorted(rows, key=lambda r: r["seed"])) for b, rows in sorted(fixed.items())
    }
    name = f"autopilot (from {start})"
    table[name] = summarise(sorted(pilot, key=lambda r: r["seed"]))
    means = {k: v["train_s_mean"] for k, v in table.items() if k.startswith("max_") and v["train_s_mean"]}
    best = min(means, key=means.get) if means else None
    worst = max(means, key=means.get) if means else None
    mine = table[name]["train_s_mean"]
    return {
        "runs": table,
        "best_fixed": best,
        "worst_fixed": worst,
        "autopilot_over_best": round(mine / means[best], 3) if best and mine else None,
        "autopilot_over_worst": round(mine / means[worst], 3) if worst and mine else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--bounds", type=int, nargs="+", default=BOUNDS)
    parser.add_argument("--no-autopilot", action="store_true", help="run the fixed bounds only")
    parser.add_argument("--start", type=int, default=1, help="the autopilot's starting bound")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=250, help="trainer.total_steps of every point")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="a further override for every point")
    parser.add_argument("--keep", help="directory for the MLflow store, runs and logs (default: a temporary one)")
    parser.add_argument(
        "--merge",
        action="append",
        default=[],
        help="the --keep directory of an earlier invocation: its points join the table (seeds must differ)",
    )
    parser.add_argument("--report-only", action="store_true", help="run nothing: the table of --keep and --merge")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.report_only and not args.keep:
        parser.error("--report-only needs --keep DIR (the store to read)")

    work = Path(args.keep or tempfile.mkdtemp(prefix="autopilot-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    stores = [work, *(Path(d) for d in args.merge)]
    for store in stores:
        if store != work and not (store / "mlflow.db").exists():
            parser.error(f"--merge {store}: no mlflow.db there")
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
        f"eval.every={args.eval_every}",
        "checkpoint.every=0",
        # a fixed bound stays fixed: the flow's staleness health policy would otherwise narrow admission to
        # floor(staleness_warn x bound) once data sits near the bound (with the autopilot it never narrows)
        "supervision.staleness_warn=1.0",
        f"tracking.tracking_uri={uri}",
        "tracking.experiment=autopilot-sweep",
        f"run.output_dir={work / 'runs'}",
        *args.set,
    ]
    first = seed_of(args.set)
    results: dict = {"machine_load_start": os.getloadavg()[0], "work_dir": str(work), "settings": {}}
    with open(work / "sweeps.log", "a") as log:
        for setting in args.settings:
            t0 = time.time()
            sets = [*common, *SETTINGS[setting]]
            pilot_sets = [*sets, "runtime.autopilot.enabled=true", "runtime.autopilot.min_staleness=0"]
            pilot_sets.append(f"runtime.autopilot.max_staleness={max(args.bounds)}")
            grid = "runtime.max_staleness=" + ",".join(map(str, args.bounds))
            pilot_grid = f"runtime.max_staleness={args.start}"
            # seed by seed, the fixed bounds and the autopilot in turns (the autopilot first on odd seeds), so
            # that a machine whose speed drifts over the hour slows every arm alike: run one after the other,
            # the last arm met the slowest machine (per trainer step 0.18 s at the start of one hour, 0.35 s
            # at its end, with nothing else running)
            for seed in range(first, first + args.seeds) if not args.report_only else []:
                arms = [(f"{setting}-fixed-s{seed}", sets, grid)]
                if not args.no_autopilot:
                    arms.append((f"{setting}-autopilot{args.start}-s{seed}", pilot_sets, pilot_grid))
                for sweep_name, arm_sets, arm_grid in arms[:: -1 if seed % 2 else 1]:
                    run_sweep(sweep_name, [*arm_sets, f"trainer.seed={seed}"], arm_grid, 1, env, log)
            fixed, pilot = collect(stores, setting, args.start, args.target)
            results["settings"][setting] = {
                "overrides": sets,
                **compare(fixed, pilot, args.start),
                "wall_s": round(time.time() - t0),
            }
    results["machine_load_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results))
        return
    for setting, res in results["settings"].items():
        print(f"\n{setting} ({res['wall_s']} s): seconds from the first evaluation to held-out >= {args.target}")
        print("| run | mean train s (sd, se) | mean run s | steps | s/step | reached | per seed (train s @ step) |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for name, row in res["runs"].items():
            seeds = " · ".join(f"{r['train_s']}{'' if r['reached'] else '+'} @ {r['steps']}" for r in row["per_seed"])
            print(
                f"| {name} | {row['train_s_mean']} ({row['train_s_sd']}, {row['train_s_se']}) | {row['run_s_mean']} "
                f"| {row['steps_mean']} | {row['s_per_step']} | {row['reached']} | {seeds} |"
            )
        print(
            f"autopilot / best fixed ({res['best_fixed']}): {res['autopilot_over_best']}; "
            f"/ worst ({res['worst_fixed']}): {res['autopilot_over_worst']}"
        )


if __name__ == "__main__":
    main()
