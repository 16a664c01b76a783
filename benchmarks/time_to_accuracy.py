"""Real asynchrony: wall-clock time to held-out accuracy, async with max_staleness in {1, 2, 4, 8} vs sync.

Each run is the real Ray runtime (`rlhf_core.distributed.DistributedRun`: one rollout worker, the
trainer, local Ray with 2 CPUs) on configs/tiny.yaml. Every --eval-every-s seconds the driver evaluates
held-out greedy accuracy on the trainer's current weights (the evaluation briefly holds the trainer, and
its time is excluded from the clock). A run stops at --target accuracy or at --budget-s of training time.

    python benchmarks/time_to_accuracy.py            # table
    python benchmarks/time_to_accuracy.py --json     # one JSON object
    python benchmarks/time_to_accuracy.py --quick    # sync and max_staleness 2 only
    python benchmarks/time_to_accuracy.py --no-sync --staleness 0 1 2 4 8 --autopilot 1
        # the staleness autopilot (starting at max_staleness 1, range 0..8) against fixed bounds;
        # the autopilot run is driven by the Supervisor (its health checks and the autopilot, as in the flow)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def one_run(
    mode: str,
    max_staleness: int,
    target: float,
    budget_s: float,
    eval_every_s: float,
    overrides: list[str],
    autopilot: bool = False,
) -> dict:
    from rlhf_core.config import load_config
    from rlhf_core.distributed import DistributedRun
    from rlhf_core.supervision import Supervisor

    if autopilot:
        overrides = [
            *overrides,
            "runtime.autopilot.enabled=true",
            "runtime.autopilot.min_staleness=0",
            "runtime.autopilot.max_staleness=8",
        ]

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            "configs/tiny.yaml",
            [
                f"run.output_dir={out}",
                "cluster.num_cpus=2",
                f"runtime.max_staleness={max_staleness if mode == 'async' else 0}",  # lockstep: tau 0
                "trainer.total_steps=100000",
                *overrides,
            ],
        )
        with DistributedRun(cfg) as run:
            run.launch()
            supervisor = Supervisor(cfg, run) if autopilot else None
            curve = [(0.0, 0, run.evaluate()["eval/accuracy"])]
            train_clock, reached = 0.0, None
            run.start()
            last = time.perf_counter()
            next_eval = eval_every_s
            while train_clock < budget_s:
                if supervisor is not None:
                    supervisor.tick()
                time.sleep(0.05)
                now = time.perf_counter()
                train_clock += now - last
                if train_clock >= next_eval:
                    run.throttle(True)  # keep the measurement honest: no generation while the clock is stopped
                    step = run.poll()["step"]
                    acc = run.evaluate()["eval/accuracy"]
                    run.throttle(False)
                    curve.append((round(train_clock, 1), step, acc))
                    next_eval += eval_every_s
                    if acc >= target and reached is None:
                        reached = round(train_clock, 1)
                        break
                last = time.perf_counter()
            final = run.poll()
    return {
        "mode": mode + (" autopilot" if autopilot else ""),
        "max_staleness": max_staleness if mode == "async" else 0,
        "bound_changes": [(e.step, e.action) for e in supervisor.events if e.kind.startswith("autopilot")]
        if supervisor is not None
        else [],
        "seconds_to_target": reached,
        "final_accuracy": curve[-1][2],
        "steps": final["step"],
        # which role is the slower one: the busier (trainer busy ~1 and rollout idle: the trainer is slower)
        "trainer_busy": round(final["trainer"].get("busy_frac", 0.0), 3),
        "rollout_busy": round(
            sum(w.get("busy_frac", 0.0) for w in final["rollout"] if w.get("alive")) / max(1, len(final["rollout"])), 3
        ),
        "curve": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--budget-s", type=float, default=90.0, help="training seconds per run")
    ap.add_argument("--eval-every-s", type=float, default=3.0)
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-sync", action="store_true", help="leave out the lockstep baseline")
    ap.add_argument("--autopilot", type=int, default=None, help="add an autopilot run from this bound")
    args = ap.parse_args()
    staleness = [2] if args.quick else args.staleness
    runs = [] if args.no_sync else [one_run("sync", 0, args.target, args.budget_s, args.eval_every_s, args.overrides)]
    runs += [one_run("async", k, args.target, args.budget_s, args.eval_every_s, args.overrides) for k in staleness]
    if args.autopilot is not None:
        runs.append(
            one_run("async", args.autopilot, args.target, args.budget_s, args.eval_every_s, args.overrides, True)
        )
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"target": args.target, "budget_s": args.budget_s, "runs": runs, "load_avg": load}))
        return
    print(f"{'run':14} {'s to ' + str(args.target):>9} {'final acc':>9} {'steps':>6}  curve (train s, step, acc)")
    for r in runs:
        name = "sync" if r["mode"] == "sync" else f"{r['mode']} tau<={r['max_staleness']}"
        print(f"{name:14} {str(r['seconds_to_target']):>9} {r['final_accuracy']:9.3f} {r['steps']:6d}  {r['curve']}")
        if r["bound_changes"]:
            print(f"{'':14} bound changes (step, change): {r['bound_changes']}")
    print(f"(load average {load:.1f})", file=sys.stderr)


if __name__ == "__main__":
    main()
