"""The elastic rollout fleet: time to held-out accuracy with cluster.autoscale (1 to --max-workers workers) against a
fixed single rollout worker, on a rollout-bound setting, in one invocation (arms alternated, --reps each).

Rollout-bound by latency: every rollout batch waits on a judge (benchmarks/slow_judge.py: ATRLHF_JUDGE_S seconds
per call, no CPU, weight 0), as a remote judge or sandbox would make it; the tiny task (configs/tiny.yaml)
otherwise. Each run is the Ray runtime on a local instance (num_cpus = 1 trainer + max workers), supervised by
the Supervisor (its autoscaler acts as in the flow). Held-out greedy accuracy is evaluated every --eval-every-s
seconds of training (the clock stops while it runs); a run stops at --target or --budget-s.

    python benchmarks/autoscale.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_run(autoscale: bool, max_workers: int, target: float, budget_s: float, eval_every_s: float) -> dict:
    from rlhf_core.config import load_config
    from rlhf_core.distributed import DistributedRun
    from rlhf_core.supervision import Supervisor

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"run.output_dir={out}",
            f"cluster.num_cpus={1 + max_workers}",
            "trainer.total_steps=100000",
            "rollout.num_workers=1",
            "runtime.max_staleness=2",
            "supervision.supervise_interval_s=0.5",
            f"reward.functions=[{{path: {REPO / 'benchmarks/slow_judge.py'}, name: slow_judge, weight: 0.0}}]",
        ]
        if autoscale:
            overrides += [
                "cluster.autoscale.enabled=true",
                f"cluster.autoscale.max_workers={max_workers}",
                "cluster.autoscale.cooldown_steps=3",
            ]
        cfg = load_config(str(REPO / "configs/tiny.yaml"), overrides)
        with DistributedRun(cfg) as run:
            run.launch()
            supervisor = Supervisor(cfg, run)
            curve = [(0.0, 0, run.evaluate()["eval/accuracy"])]
            sizes: list[tuple[float, int]] = [(0.0, 1)]
            train_clock, reached, next_eval = 0.0, None, eval_every_s
            run.start()
            last = time.perf_counter()
            while train_clock < budget_s:
                poll = supervisor.tick()
                if len(run.workers) != sizes[-1][1]:
                    sizes.append((round(train_clock, 1), len(run.workers)))
                time.sleep(0.2)
                now = time.perf_counter()
                train_clock += now - last
                if train_clock >= next_eval:
                    run.throttle(True)  # no generation while the clock is stopped
                    acc = run.evaluate()["eval/accuracy"]
                    run.throttle(False)
                    curve.append((round(train_clock, 1), run.poll()["step"], acc))
                    next_eval += eval_every_s
                    if acc >= target:
                        reached = round(train_clock, 1)
                        break
                last = time.perf_counter()
            final = run.poll()
    return {
        "arm": f"autoscale (1..{max_workers})" if autoscale else "fixed 1 worker",
        "seconds_to_target": reached,
        "final_accuracy": curve[-1][2],
        "steps": final["step"],
        "fleet": sizes,
        "events": [(e.step, e.kind, e.action) for e in supervisor.events if e.kind.startswith("autoscale")],
        "trainer_busy": round(final["trainer"].get("busy_frac", 0.0), 3),
        "wait_frac_last": poll["metrics"][-1].get("time/wait_s") if poll.get("metrics") else None,
        "curve": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--eval-every-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    runs = []
    for rep in range(args.reps):
        for autoscale in (False, True):  # alternated: drift in the machine's load hits both arms alike
            r = one_run(autoscale, args.max_workers, args.target, args.budget_s, args.eval_every_s)
            r["rep"] = rep
            runs.append(r)
            load.append(os.getloadavg()[0])
            if not args.json:
                print(r["arm"], r["seconds_to_target"], r["final_accuracy"], r["fleet"], flush=True)
    summary = {}
    for arm in sorted({r["arm"] for r in runs}):
        times = [r["seconds_to_target"] for r in runs if r["arm"] == arm]
        summary[arm] = {"seconds_to_target": times, "reached": sum(t is not None for t in times), "runs": len(times)}
    out = {
        "judge_s": float(os.environ.get("ATRLHF_JUDGE_S", "0.3")),
        "loadavg_1m": load,
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(out, indent=1) if args.json else json.dumps(summary))


if __name__ == "__main__":
    main()
