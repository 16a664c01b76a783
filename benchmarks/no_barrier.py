"""No batch barrier: the default `atrlhf train` (configs/chat-smoke.yaml: 16 prompts x 8 samples a step, one rollout
worker, async at runtime.max_staleness 2, Ray) on a latency-bound environment, against lockstep at equal cores.

The environment is benchmarks/latency_env.py's LatencyEnv: every step waits a lognormal time (mean 200 ms, p99 2 s,
no CPU) for 2-4 turns. Lockstep (runtime.max_staleness 0) waits for a step's slowest episode before the next
step's episodes may start; the async run keeps rollout.prompts_per_batch groups in flight and pushes each group
as its episodes end (rlhf_core/run/rollout_stream.py), so a slow episode holds only its own group.

    python benchmarks/no_barrier.py                        # Ray, lockstep and async, 10 steps each
    python benchmarks/no_barrier.py --hosts ray,threads --steps 6 --json

Per run: seconds per step (wall clock from the loops' start to the last step, over the steps), samples/s, each
role's busy fraction, the 1-min load before and after. Per host: async seconds per step over lockstep's (the
speed-up is lockstep / async).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARMS = {"lockstep": ["runtime.max_staleness=0"], "async": []}  # async: the recipe's own bound (2)


def chat_smoke_config(host: str, steps: int, warm_start: int, output_dir: Path, *env_and_more: str):
    """configs/chat-smoke.yaml at its default batch on `host` (2 CPUs), `steps` steps, no evaluation or checkpoint,
    with the environment and anything else `env_and_more` sets (benchmarks/chaos_env.py uses it too)."""
    from rlhf_core.config import load_config

    overrides = [
        f"run.output_dir={output_dir}",
        f"cluster.host={host}",
        "cluster.num_cpus=2",
        f"trainer.total_steps={steps}",
        f"trainer.warm_start.steps={warm_start}",
        "data.eval_size=8",
        "eval.every=0",
        "checkpoint.every=0",
        "tracking.log_system_metrics=false",
        *env_and_more,
    ]
    return load_config(ROOT / "configs" / "chat-smoke.yaml", overrides)


def arm_config(host: str, arm: str, steps: int, warm_start: int, tmp: Path):
    env = [f"env.path={ROOT / 'benchmarks' / 'latency_env.py'}", "env.name=LatencyEnv", "env.max_turns=4"]
    return chat_smoke_config(host, steps, warm_start, tmp, *env, "env.step_timeout_s=60", *ARMS[arm])


def main() -> None:
    from equal_cores import run_host

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="ray")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warm-start", type=int, default=0, help="trainer.warm_start.steps (chat-smoke's: 300)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout, nothing else")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    runs = []
    with tempfile.TemporaryDirectory(prefix="no_barrier_") as tmp:
        for host in args.hosts.split(","):
            for arm in ARMS:
                cfg = arm_config(host, arm, args.steps, args.warm_start, Path(tmp) / f"{host}-{arm}")
                load_before = os.getloadavg()[0]
                fig = run_host(cfg, target=2.0)
                run = {
                    "host": host,
                    "arm": arm,
                    "steps": args.steps,
                    "s_per_step": fig["wall_s"] / args.steps,
                    "samples_per_s": fig["samples_per_s"],
                    "trainer_busy": fig["trainer_busy"],
                    "rollout_busy": fig["rollout_busy"],
                    "load_before": load_before,
                    "load_after": os.getloadavg()[0],
                }
                runs.append(run)
                say(json.dumps(run))
    speedup = {}
    for host in args.hosts.split(","):
        lock, asyn = (next(r for r in runs if r["host"] == host and r["arm"] == a) for a in ("lockstep", "async"))
        speedup[host] = lock["s_per_step"] / asyn["s_per_step"]
    print(json.dumps({"runs": runs, "async_speedup_over_lockstep": speedup}, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
