"""Equal cores: the in-process lockstep loop against the async hosts on the same 2 CPUs, one invocation.

    python benchmarks/equal_cores.py                 # table; --reps 3, arms alternated within each repetition
    python benchmarks/equal_cores.py --quick --json  # fewer steps, 1 repetition (< 6 min); one JSON object on stdout
    python benchmarks/equal_cores.py --workloads tiny,latency --arms loop,threads

Arms (every one the same config but for what the arm names; torch threads: 2 for the loop, 1 per role elsewhere):
  loop          rlhf_core.loop.run_sync: both roles in one thread, lockstep, cluster.torch_threads 2
  threads       cluster.host threads (rlhf_core.hosts.threads.ThreadedRun): each role on a thread, async
  ray_lockstep  the Ray host at runtime.max_staleness 0 (1 CPU per role)
  ray_async     the Ray host, async
  ray_partial   ray_async + rollout.partial_rollout (weights adopted between decode steps)
Async arms run at runtime.max_staleness 2. Each Ray arm starts a local Ray of its own (2 CPUs) and shuts it down,
so that no Ray process runs beside the other arms.

Workloads:
  tiny      configs/tiny.yaml (max3, 16 prompts x 8 samples per step): time to eval/accuracy >= --target too
  long_tail benchmarks/long_tail.py's uniform policy: geometric response lengths (mean ~19, up to 256 tokens),
            continuous batching and padding-free training in every arm (4 layers x 256, 8 steps; --quick: 2 x 128, 4)
  latency   configs/tiny-multiturn.yaml's small chat model in benchmarks/latency_env.py: each env step waits a
            lognormal time (mean 200 ms, p99 2 s, no CPU) for 2-4 turns. The async arms run 4 rollout workers
            (--quick: 2) of half a step's prompts each (Ray: their 1 CPU shared), the lockstep arms one worker of a
            whole step.

Per run: samples_per_s and tokens_per_s trained (steps x rows, the trainer's tokens, over the wall clock from the
loops' start to the last step, evaluations excluded), time_to_target_s (same clock; None when not reached)
and steps_to_target (the step of that evaluation), final_accuracy (the loop's; a host's with run_host(final_eval=True)),
trainer_busy and rollout_busy (util/*: busy seconds over wall seconds; the loop's from its roles' busy seconds),
load_before / load_after (os.getloadavg, 1 min). Per arm and workload: the median over repetitions, and its ratio
to the loop's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARMS = {
    "loop": ["runtime.max_staleness=0", "cluster.torch_threads=2"],
    "threads": ["cluster.host=threads", "runtime.max_staleness=2"],
    "ray_lockstep": ["runtime.max_staleness=0"],
    "ray_async": ["runtime.max_staleness=2"],
    "ray_partial": ["runtime.max_staleness=2", "rollout.partial_rollout=true"],
}
COMMON = [
    "cluster.num_cpus=2",
    "cluster.resources.rollout.CPU=1",
    "cluster.resources.trainer.CPU=1",
    "checkpoint.every=0",
]


def workload_config(name: str, arm: str, quick: bool, tmp: Path, target_every: int):
    from rlhf_core.config import load_config

    out = [f"run.output_dir={tmp / f'{name}-{arm}'}", *COMMON, "cluster.torch_threads=1", *ARMS[arm]]
    if name == "tiny":
        steps = 140 if quick else 250
        extra = [f"trainer.total_steps={steps}", "data.eval_size=100", f"eval.every={target_every}"]
        return load_config(ROOT / "configs" / "tiny.yaml", [*out, *extra])
    if name == "long_tail":
        rows = 8 * 8
        extra = [
            f"model.path={tmp.parent / 'lt_policy'}",
            f"trainer.total_steps={4 if quick else 8}",
            "trainer.prompts_per_step=8",
            "rollout.prompts_per_batch=8",
            "rollout.samples_per_prompt=8",
            f"rollout.engine_kwargs.max_active_rows={rows}",
            f"trainer.micro_batch_size={rows}",
            "rollout.max_new_tokens=256",
            "rollout.engine_kwargs.continuous_batching=true",
            "trainer.lr=1e-7",
            "data.eval_size=4",
            "eval.every=0",
        ]
        return load_config(ROOT / "configs" / "tiny.yaml", [*out, *extra])
    workers, per_batch = ((2 if quick else 4), 4) if arm in ("threads", "ray_async", "ray_partial") else (1, 8)
    extra = [
        "env.path=benchmarks/latency_env.py",
        "env.name=LatencyEnv",
        "env.max_turns=4",
        "env.step_timeout_s=60",
        "reward.function_workers=1",
        "trainer.warm_start.steps=0",
        "model.preset=micro",
        f"trainer.total_steps={3 if quick else 10}",
        "trainer.prompts_per_step=8",
        f"rollout.prompts_per_batch={per_batch}",
        "rollout.samples_per_prompt=4",
        f"rollout.num_workers={workers}",
        f"cluster.resources.rollout.CPU={1.0 / workers}",
        "data.eval_size=4",
        "eval.every=0",
    ]
    return load_config(ROOT / "configs" / "tiny-multiturn.yaml", [*out, *extra])


class Timed:
    """An evaluator (or evaluate()) whose calls are timed, so that evaluations stay off the clock."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run_loop(cfg, target: float) -> dict:
    from rlhf_core.loop import build_run, run_sync

    parts = build_run(cfg, share_weights=True)
    parts.evaluator = timed = Timed(parts.evaluator)
    marks: dict = {"hit": None, "hit_step": None, "end": None}
    t0 = time.perf_counter()

    def on_step(m: dict) -> None:
        now = time.perf_counter() - t0 - timed.seconds
        marks["end"] = now
        if marks["hit"] is None and m.get("eval/accuracy", -1.0) >= target:
            marks["hit"], marks["hit_step"] = now, parts.trainer.step

    try:
        result = run_sync(cfg, parts=parts, on_step=on_step)
    finally:
        parts.worker.close()
    wall = marks["end"]
    t, w = parts.trainer.stats(), parts.worker.stats()
    fig = figures(cfg, wall, t["tokens"], marks["hit"], t["busy_s"] / wall, w["busy_s"] / wall)
    fig.update({"steps_to_target": marks["hit_step"], "final_accuracy": result["eval/accuracy"]})
    return fig


def run_host(cfg, target: float, final_eval: bool = False) -> dict:
    """One run on cfg.cluster.host; final_eval: also evaluate the final weights (off the clock) as final_accuracy."""
    if cfg.cluster.host != "ray":
        return supervised(cfg, target, final_eval)
    import ray

    # a Ray of this arm's own (address "local": never another session's instance on the machine), gone after it
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return supervised(cfg, target, final_eval)
    finally:
        ray.shutdown()


def supervised(cfg, target: float, final_eval: bool = False) -> dict:
    from rlhf_core.hosts import make_runtime
    from rlhf_core.run.supervise import Sinks, supervise

    marks: dict = {"hit": None, "hit_step": None, "end": None, "final": None, "accuracy": None}
    with make_runtime(cfg) as rt:
        rt.launch()
        timed = Timed(rt.evaluate)
        t0 = None

        def evaluate(step: int) -> None:
            acc = timed()["eval/accuracy"]
            if marks["hit"] is None and acc >= target:
                marks["hit"], marks["hit_step"] = time.perf_counter() - t0 - timed.seconds, step

        def on_poll(poll: dict) -> None:
            if poll["done"] and marks["end"] is None:
                marks["end"] = time.perf_counter() - t0 - timed.seconds
            marks["final"] = poll

        sinks = Sinks(on_poll=on_poll, evaluate=evaluate if cfg.eval.every else None)
        t0 = time.perf_counter()
        supervise(cfg, rt, rt.last_step, sinks)
        if final_eval:
            marks["accuracy"] = rt.evaluate()["eval/accuracy"]
    final = marks["final"]
    alive = [s for s in final["rollout"] if s.get("alive")]
    rollout_busy = sum(s["busy_frac"] for s in alive) / max(1, len(alive))
    fig = figures(
        cfg, marks["end"], final["trainer"]["tokens"], marks["hit"], final["trainer"]["busy_frac"], rollout_busy
    )
    fig["steps_to_target"] = marks["hit_step"]
    if final_eval:
        fig["final_accuracy"] = marks["accuracy"]
    return fig


def figures(cfg, wall: float, tokens: int, hit, trainer_busy: float, rollout_busy: float) -> dict:
    samples = cfg.trainer.total_steps * cfg.batch_size
    return {
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "time_to_target_s": hit,
        "trainer_busy": trainer_busy,
        "rollout_busy": rollout_busy,
        "wall_s": wall,
        "steps": cfg.trainer.total_steps,
    }


def median_of(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    parser.add_argument("--quick", action="store_true", help="fewer steps, 1 repetition (~6 minutes)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--workloads", default="tiny,long_tail,latency")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy target of the tiny task")
    parser.add_argument("--eval-every", type=int, default=10)
    args = parser.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    began = time.perf_counter()
    arms, workloads = args.arms.split(","), args.workloads.split(",")

    logging.disable(logging.WARNING)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    runs: dict = {w: {a: [] for a in arms} for w in workloads}
    with tempfile.TemporaryDirectory(prefix="equal_cores_") as tmp:
        tmp = Path(tmp)
        if "long_tail" in workloads:
            from long_tail import build_uniform_policy

            layers, hidden = (2, 128) if args.quick else (4, 256)
            build_uniform_policy(tmp / "lt_policy", layers, hidden, 4)
        for rep in range(reps):
            for workload in workloads:
                order = arms[rep % len(arms) :] + arms[: rep % len(arms)]  # alternated: each arm leads once
                for arm in order:
                    cfg = workload_config(workload, arm, args.quick, tmp / f"r{rep}", args.eval_every)
                    load_before = os.getloadavg()[0]
                    fig = (run_loop if arm == "loop" else run_host)(cfg, args.target)
                    fig.update({"load_before": load_before, "load_after": os.getloadavg()[0], "rep": rep})
                    runs[workload][arm].append(fig)
                    say(
                        f"{workload:9s} {arm:12s} rep {rep}: {fig['samples_per_s']:8.1f} samples/s, "
                        f"{fig['tokens_per_s']:8.1f} tokens/s, busy T {fig['trainer_busy']:.2f} "
                        f"R {fig['rollout_busy']:.2f}, load {load_before:.1f}->{fig['load_after']:.1f}"
                    )
    out: dict = {"quick": args.quick, "reps": reps, "cpus": os.cpu_count(), "target": args.target}
    out.update({"wall_s_total": time.perf_counter() - began, "workloads": {}})
    for workload in workloads:
        med = {a: median_of(runs[workload][a]) for a in arms}
        base = med.get("loop")
        ratios = {
            a: {k: med[a][k] / base[k] for k in ("samples_per_s", "tokens_per_s")} for a in arms if base is not None
        }
        out["workloads"][workload] = {"median": med, "vs_loop": ratios, "runs": runs[workload]}
    if args.json:
        print(json.dumps(out))
        return
    keys = ["samples_per_s", "tokens_per_s", "time_to_target_s", "trainer_busy", "rollout_busy", "load_before"]
    for workload, res in out["workloads"].items():
        print(f"\n{workload}\n{'arm':14s}" + "".join(f"{k:>18s}" for k in keys) + f"{'x loop':>10s}")
        for arm, fig in res["median"].items():
            cells = "".join(f"{fig[k]:18.3f}" if fig[k] is not None else f"{'-':>18s}" for k in keys)
            ratio = res["vs_loop"].get(arm, {}).get("samples_per_s")
            print(f"{arm:14s}{cells}{ratio:10.2f}" if ratio is not None else f"{arm:14s}{cells}")


if __name__ == "__main__":
    main()
