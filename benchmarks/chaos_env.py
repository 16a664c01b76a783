"""Chaos at the default batch: configs/chat-smoke.yaml (16 prompts x 8 samples = 128 episodes a step, 2 environment
processes per rollout worker) in an environment that, per step, kills its process (2 %), raises (5 %), hangs past
env.step_timeout_s (2 %) or returns a malformed observation (2 %): tests/env_fixtures.py's ChaosEnv, the rates of
tests/test_env_chaos.py. Each host (cluster.host ray and threads) trains --steps steps with chaos and without.

    python benchmarks/chaos_env.py                       # both hosts, chaos and chaos-free, 20 steps each
    python benchmarks/chaos_env.py --hosts threads --steps 5 --json

Per run: whether it completed its steps, wall seconds of the loops (start of supervision to the last step),
samples/s trained, the environment's counts (episodes opened, crashes, raises, hangs, bad observations from the
fixture's event logs; env/* metrics of the run: errors by kind, process restarts, episodes replayed), whether every
episode opened was closed exactly once (but those killed with their process) and whether any environment process
is still alive after the run. Per host: chaos samples/s over chaos-free samples/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RATES = {"crash": 0.02, "raises": 0.05, "hang": 0.02, "bad": 0.02}  # per step, as tests/test_env_chaos.py


def chaos_config(host: str, chaos: bool, steps: int, warm_start: int, tmp: Path, env_workers: int = 2):
    from no_barrier import chat_smoke_config

    events = tmp / "events"
    events.mkdir(parents=True)
    kwargs = {"dir": str(events), "seed": 0, "turns": 3, "hang_s": 2.0, **(RATES if chaos else {})}
    env = [
        f"env.path={ROOT / 'tests' / 'env_fixtures.py'}",
        "env.name=ChaosEnv",
        f"env.kwargs={json.dumps(kwargs)}",
        "env.max_turns=3",
        "env.step_timeout_s=1.0",
        f"env.workers={env_workers}",
    ]
    return chat_smoke_config(host, steps, warm_start, tmp / "run", *env), events


def one_run(host: str, chaos: bool, steps: int, warm_start: int, tmp: Path, env_workers: int = 2) -> dict:
    from equal_cores import run_host
    from test_env_failures import events as read_events

    cfg, events = chaos_config(host, chaos, steps, warm_start, tmp, env_workers)
    start = time.perf_counter()
    out: dict = {"host": host, "chaos": chaos, "steps": steps, "episodes_per_step": cfg.batch_size}
    out["env_workers"] = cfg.env.workers
    try:
        fig = run_host(cfg, target=2.0)  # no accuracy target: throughput only
        out.update(completed=True, samples_per_s=fig["samples_per_s"], loops_s=fig["wall_s"])
        out.update(trainer_busy=fig["trainer_busy"], rollout_busy=fig["rollout_busy"])
    except Exception as exc:  # the figure is whether it completes: report the failure, do not hide it
        out.update(completed=False, error=f"{type(exc).__name__}: {exc}"[:500])
    out["total_s"] = time.perf_counter() - start
    counts, by_instance = read_events(events)
    crashed = {i.split("-")[0] for i, ev in by_instance.items() if "crash" in ev}
    not_once = [
        i for i, ev in by_instance.items() if "close-again" in ev or ("open" in ev and i.split("-")[0] not in crashed
                                                                      and ev.count("close") != 1)
    ]  # fmt: skip
    pids = {int(p.stem) for p in events.glob("*.log")}
    out.update(
        env_steps=counts["step"],
        episodes_opened=counts["open"],
        injected={k: counts[k] for k in ("crash", "raise", "hang", "bad")},
        closed_once=not not_once,
        not_closed_once=len(not_once),
        not_closed_once_examples={i: by_instance[i] for i in not_once[:5]},  # what each one's log says
        processes_alive=sum(1 for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="ray,threads")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-start", type=int, default=0, help="trainer.warm_start.steps (chat-smoke's: 300)")
    parser.add_argument("--env-workers", type=int, default=2, help="env.workers (processes per rollout worker)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout, nothing else")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    runs = []
    with tempfile.TemporaryDirectory(prefix="chaos_env_") as tmp:
        for host in args.hosts.split(","):
            for chaos in (True, False):
                run = one_run(host, chaos, args.steps, args.warm_start, Path(tmp) / f"{host}-{chaos}", args.env_workers)
                runs.append(run)
                say(json.dumps(run))
    ratios = {}
    for host in args.hosts.split(","):
        with_chaos, without = (next(r for r in runs if r["host"] == host and r["chaos"] is c) for c in (True, False))
        if with_chaos.get("completed") and without.get("completed"):
            ratios[host] = with_chaos["samples_per_s"] / without["samples_per_s"]
    report = {"runs": runs, "chaos_over_clean_samples_per_s": ratios, "load_after": os.getloadavg()[0]}
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
