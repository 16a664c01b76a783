"""Pipeline: sync vs async on real Ray actors, and weight-sync bandwidth through the object store.

    python benchmarks/pipeline.py            # table
    python benchmarks/pipeline.py --json     # one JSON object of figures on stdout, nothing else
    python benchmarks/pipeline.py --quick    # ~1.5 min: 30 steps, a 50M-parameter sync
    python benchmarks/pipeline.py --steps 200 --sync-params 100000000

Part 1 runs `rlhf_core.distributed.run_distributed` twice on the same config, async (runtime.max_staleness as
given) then lockstep (runtime.max_staleness=0, the same loops), for the same number of trainer steps: one
rollout worker (1 CPU) and the trainer (1 CPU) on a 2-CPU Ray instance, torch_threads=1. The policy is the
tiny default model; the rollout engine is `random` with `rollout.engine_kwargs.tokens_per_s` calibrated (back-to-back
train steps in a Ray worker, before the runs) so that one rollout batch takes about as long as one train step.
The RandomEngine sleeps instead of computing, so the two roles never compete for a core and the ideal overlap
is known. The sync run's own phase times (rollout seconds and train seconds per step) give the ideal async
speedup (T_rollout + T_train) / max(T_rollout, T_train), which the measured speedup (sync wall / async wall)
is compared with. Busy fractions are reported two ways: the runtime's util/* accounting (busy seconds / wall
clock since the role's first piece of work) and busy seconds / the wall time of the measured run, next to what
the async run's own phase times allow (the faster role must wait for the slower one).

Part 2 measures weight-sync bandwidth for a synthetic fp32 state dict (500M parameters = 2 GB by default)
along the real path: one actor packs it (`pack_state_dict`) and `ray.put`s it, another actor `ray.get`s
it, unpacks it (`unpack_state_dict`) and `copy_`s it into a preallocated tensor set. One 2 GB object
exists at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# Targets on the 2-core reference machine (docs/_sections/pipeline.md).
TARGET_ASYNC_EFFICIENCY = 0.85  # measured speedup / ideal speedup
TARGET_BUSY = 0.85  # busy fraction of each role in async mode
TARGET_STALL_FRAC = 0.05  # rollout stall per weight sync / rollout batch time
TARGET_EVICTED_FRAC = 0.02  # evicted / generated groups
TARGET_SYNC_GBPS = 1.0  # ray.put + ray.get + unpack + copy_, GB/s


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


# --------------------------------------------------------------------------------------------- config
def pipeline_config(args, mode: str, tokens_per_s: float, output_dir: str):
    from rlhf_core.config import load_config

    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            # lockstep is max_staleness 0, the same loops
            f"runtime.max_staleness={0 if mode == 'sync' else args.max_staleness}",
            "rollout.engine=random",
            f"rollout.engine_kwargs.tokens_per_s={tokens_per_s}",
            "rollout.num_workers=1",
            f"rollout.prompts_per_batch={args.prompts_per_step}",
            f"trainer.prompts_per_step={args.prompts_per_step}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"trainer.total_steps={args.steps}",
            "cluster.num_cpus=2",
            "cluster.resources.rollout.CPU=1",
            "cluster.resources.trainer.CPU=1",
            "cluster.torch_threads=1",
            "data.eval_size=32",
            f"run.output_dir={output_dir}",
        ],
    )


def calibrate(cfg, repeats: int = 12) -> dict:
    """Time the tiny model's train step (1 thread, back to back as the async trainer runs) on RandomEngine
    batches; returns the rate at which one rollout batch (prompts_per_step prompts) takes as long.

    Runs as a Ray task (see `pipeline`): on a shared machine the scheduler treats Ray's worker processes
    differently from this driver (Linux autogroups), and the driver's step time misjudged the trainer's."""
    import torch

    from rlhf_core.loop import build_run, generate_step_batch

    threads = torch.get_num_threads()
    parts = build_run(cfg, share_weights=True)  # sets torch threads to cluster.torch_threads
    try:
        times, tokens = [], []
        for i in range(repeats + 2):
            batch, _ = generate_step_batch(parts)
            t0 = time.perf_counter()
            parts.trainer.train_step(batch)
            if i >= 2:  # the first steps warm up the allocator and autograd
                times.append(time.perf_counter() - t0)
                tokens.append(batch.num_tokens)
    finally:
        torch.set_num_threads(threads)
    train_s = statistics.median(times)
    return {
        "calib_train_s": train_s,
        "calib_tokens_per_step": statistics.mean(tokens),
        "tokens_per_s": statistics.mean(tokens) / train_s,
    }


# --------------------------------------------------------------------------------------------- part 1
def run_mode(cfg, poll_interval_s: float) -> dict:
    from rlhf_core.distributed import run_distributed

    load_before = loadavg()
    result = run_distributed(cfg, poll_interval_s=poll_interval_s)
    result["load_before"], result["load_after"] = load_before, loadavg()
    return result


def mean_metric(result: dict, key: str) -> float:
    values = [m[key] for m in result["metrics"] if key in m]
    return statistics.mean(values) if values else float("nan")


def mode_figures(result: dict, batches_per_step: float) -> dict:
    """Per-run figures from run_distributed's result (final poll, metrics, reconciliation)."""
    fp = result["final_poll"]
    t, workers = fp["trainer"], [w for w in fp["rollout"] if w.get("alive")]
    w = workers[0]
    wall, steps = result["wall_s"], result["steps"]
    rec = result["reconcile"]
    hist = {int(k): int(v) for k, v in t["staleness_hist"].items()}
    return {
        "wall_s": wall,
        "steps": steps,
        "samples_per_s": t["samples"] / wall,
        "tokens_per_s": t["tokens"] / wall,
        # the runtime's accounting (util/*): busy seconds / wall clock since the role's first piece of work
        "busy_rollout": w["busy_frac"],
        "busy_trainer": t["busy_frac"],
        # stricter: busy seconds over the wall time of the run (anything not generating/training is lost)
        "busy_rollout_wall": w["busy_s"] / wall,
        "busy_trainer_wall": t["busy_s"] / wall,
        "rollout_s_per_step": w["batch_s_mean"] * batches_per_step,
        "train_s_per_step": mean_metric(result, "time/train_s"),
        "train_step_busy_s": t["busy_s"] / steps,
        "trainer_wait_s_per_step": mean_metric(result, "time/wait_s"),
        "sync_latency_s": mean_metric(result, "sync/latency_s"),
        "rollout_batch_s": w["batch_s_mean"],
        # the rollout's cycle outside generation: denied admission, and everything else (weight checks,
        # prompt and push round trips, packing), per batch, over the worker's time since its first batch
        "rollout_denied_s_per_batch": w["idle_s"] / w["batches"] if w["batches"] else float("nan"),
        "rollout_other_s_per_batch": (
            (w["busy_s"] / w["busy_frac"] if w["busy_frac"] else wall) - w["busy_s"] - w["idle_s"]
        )
        / w["batches"]
        if w["batches"]
        else float("nan"),
        # ... and its parts the worker times itself: weight check + fetch + load, waiting for prompts,
        # splitting into groups, packing + pushing (+ confirming the previous push)
        "rollout_phase_s_per_batch": w.get("phase_s_per_batch", {}),
        "sync_stall_s": w["sync_stall_s_mean"],
        "stall_frac": w["sync_stall_s_mean"] / w["batch_s_mean"] if w["batch_s_mean"] else float("nan"),
        "syncs_loaded": w["syncs"],
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "max_staleness_observed": max(hist) if hist else 0,
        "generated_groups": rec["generated"],
        "evicted_groups": rec["evicted"],
        "dropped_groups": rec["dropped"],
        "evicted_frac": rec["evicted"] / rec["generated"] if rec["generated"] else 0.0,
        "load_before": result["load_before"],
        "load_after": result["load_after"],
    }


def pipeline(args, output_dir: str) -> dict:
    base = pipeline_config(args, "sync", 0.0, output_dir)
    if args.tokens_per_s:
        calib = {"tokens_per_s": args.tokens_per_s}
    else:
        import ray

        calib = ray.get(ray.remote(num_cpus=1)(calibrate).remote(base))
    tps = round(calib["tokens_per_s"], 1)
    out = {
        "config": {
            "steps": args.steps,
            "prompts_per_step": args.prompts_per_step,
            "samples_per_prompt": base.rollout.samples_per_prompt,
            "max_new_tokens": args.max_new_tokens,
            "max_staleness": args.max_staleness,
            "random_tokens_per_s": tps,
            "poll_interval_s": args.poll_s,
        },
        **{k: v for k, v in calib.items() if k != "tokens_per_s"},
    }

    def measure(mode: str) -> dict:
        return mode_figures(run_mode(pipeline_config(args, mode, tps, output_dir), args.poll_s), batches_per_step=1.0)

    # async first, right after the calibration: its busy fractions need the two roles balanced, and the
    # load of a shared machine drifts; the sync run's own phase times give the ideal whatever the balance
    a = measure("async")
    s = measure("sync")
    t_roll, t_train = s["rollout_s_per_step"], s["train_s_per_step"]
    ideal = (t_roll + t_train) / max(t_roll, t_train)
    speedup = s["wall_s"] / a["wall_s"]
    out.update(
        {
            "sync": s,
            "async": a,
            "sync_rollout_s_per_step": t_roll,
            "sync_train_s_per_step": t_train,
            "sync_overhead_s_per_step": s["wall_s"] / s["steps"] - t_roll - t_train,
            "speedup": speedup,
            "ideal_speedup": ideal,
            "async_efficiency": speedup / ideal,
            # against a sync loop with no per-step overhead (phases back to back): the stricter comparison
            "async_efficiency_vs_phases": (s["steps"] * (t_roll + t_train)) / a["wall_s"] / ideal,
            # the async run against its own bottleneck: steps x max(T_rollout, T_train) / wall (load drift cancels)
            "async_pipeline_efficiency": a["steps"] * max(a["rollout_s_per_step"], a["train_s_per_step"]) / a["wall_s"],
            "async_busy_rollout": a["busy_rollout"],
            "async_busy_trainer": a["busy_trainer"],
            "async_busy_rollout_wall": a["busy_rollout_wall"],
            "async_busy_trainer_wall": a["busy_trainer_wall"],
            # what the async run's own phase times allow: the faster role waits for the slower one
            "async_achievable_busy_rollout": a["rollout_s_per_step"]
            / max(a["rollout_s_per_step"], a["train_s_per_step"]),
            "async_achievable_busy_trainer": a["train_s_per_step"]
            / max(a["rollout_s_per_step"], a["train_s_per_step"]),
            "bubble_rollout": 1 - a["busy_rollout"],
            "bubble_trainer": 1 - a["busy_trainer"],
            "evicted_frac": a["evicted_frac"],
            "staleness_hist": a["staleness_hist"],
            "max_staleness_observed": a["max_staleness_observed"],
            "sync_latency_s": a["sync_latency_s"],
            "stall_frac": a["stall_frac"],
            "samples_per_s_sync": s["samples_per_s"],
            "samples_per_s_async": a["samples_per_s"],
            "tokens_per_s_sync": s["tokens_per_s"],
            "tokens_per_s_async": a["tokens_per_s"],
        }
    )
    return out


# --------------------------------------------------------------------------------------------- part 2
class _WeightSender:
    """Holds a synthetic state dict; publishes it the way TrainerActor.publish does."""

    def __init__(self, n_params: int, tensor_numel: int):
        import torch

        torch.set_num_threads(1)
        sizes = [tensor_numel] * (n_params // tensor_numel) + (
            [n_params % tensor_numel] if n_params % tensor_numel else []
        )
        self.state = {f"layer{i}.weight": torch.empty(n).fill_(0.5 + i) for i, n in enumerate(sizes)}
        self.ref = None

    def shapes(self) -> dict:
        return {k: v.numel() for k, v in self.state.items()}

    def put(self) -> tuple[list, float]:
        import ray

        from rlhf_core.distributed.transport import pack_state_dict

        self.ref = None
        start = time.perf_counter()
        ref = ray.put(pack_state_dict(self.state))
        elapsed = time.perf_counter() - start
        self.ref = ref  # the owner keeps the object alive until the receiver has copied it
        return [ref], elapsed

    def release(self) -> None:
        self.ref = None


class _WeightReceiver:
    """Holds a preallocated tensor set; loads published weights the way RolloutActor/HFEngine do."""

    def __init__(self, shapes: dict):
        import torch

        torch.set_num_threads(1)
        self.params = {k: torch.zeros(n).fill_(-1.0) for k, n in shapes.items()}

    def load(self, ref_box: list) -> dict:
        import ray
        import torch

        from rlhf_core.distributed.transport import unpack_state_dict

        start = time.perf_counter()
        packed = ray.get(ref_box[0])
        fetched = time.perf_counter()
        state = unpack_state_dict(packed)
        with torch.no_grad():
            for k, t in state.items():
                self.params[k].copy_(t)
        done = time.perf_counter()
        del state, packed
        ok = all(float(self.params[k][0]) == 0.5 + i for i, k in enumerate(self.params))
        return {"get_s": fetched - start, "copy_s": done - fetched, "ok": ok}


def sync_bandwidth(n_params: int, repeats: int, warmup: int = 3, tensor_numel: int = 4_000_000) -> dict:
    """`warmup` untimed rounds, then `repeats` timed ones. The first rounds fault fresh object-store pages in
    (tmpfs first touch, slow in a VM); a run that publishes every step alternates between two warm regions
    (the published object and the one replacing it), so the headline is the warm median and the very
    first round is reported as `sync_bandwidth_cold_gbps`."""
    import ray

    nbytes = n_params * 4
    sender = ray.remote(_WeightSender).options(num_cpus=0).remote(n_params, tensor_numel)
    receiver = None
    try:
        shapes = ray.get(sender.shapes.remote())
        receiver = ray.remote(_WeightReceiver).options(num_cpus=0).remote(shapes)
        ray.get(receiver.__ray_ready__.remote())
        rounds = []
        for _ in range(warmup + repeats):
            ref_box, put_s = ray.get(sender.put.remote())
            got = ray.get(receiver.load.remote(ref_box))
            del ref_box
            ray.get(sender.release.remote())  # the object is freed before the next one is made
            time.sleep(0.5)  # the store frees it asynchronously; let it, so the next put reuses the space
            if not got["ok"]:
                raise RuntimeError("weights arrived corrupted")
            rounds.append({"put_s": put_s, **got, "total_s": put_s + got["get_s"] + got["copy_s"]})
    finally:
        for actor in (sender, receiver):
            if actor is not None:
                ray.kill(actor)
    warm = rounds[warmup:]
    med = lambda key: statistics.median(key(r) for r in warm)  # noqa: E731
    return {
        "sync_params": n_params,
        "sync_bytes": nbytes,
        "sync_tensors": len(shapes),
        "sync_repeats": repeats,
        "sync_warmup_rounds": warmup,
        "sync_bandwidth_gbps": nbytes / med(lambda r: r["total_s"]) / 1e9,
        "sync_bandwidth_cold_gbps": nbytes / rounds[0]["total_s"] / 1e9,
        "sync_put_gbps": nbytes / med(lambda r: r["put_s"]) / 1e9,
        "sync_get_unpack_copy_gbps": nbytes / med(lambda r: r["get_s"] + r["copy_s"]) / 1e9,
        "sync_rounds": rounds,
    }


# --------------------------------------------------------------------------------------------- main
def targets(fig: dict) -> dict:
    return {
        "async_efficiency": fig["async_efficiency"] >= TARGET_ASYNC_EFFICIENCY,
        "async_busy_rollout": fig["async_busy_rollout"] >= TARGET_BUSY,
        "async_busy_trainer": fig["async_busy_trainer"] >= TARGET_BUSY,
        "stall_frac": fig["stall_frac"] <= TARGET_STALL_FRAC,
        "evicted_frac": fig["evicted_frac"] <= TARGET_EVICTED_FRAC,
        "sync_bandwidth_gbps": fig["sync_bandwidth_gbps"] >= TARGET_SYNC_GBPS,
    }


def print_table(fig: dict) -> None:
    s, a, c = fig["sync"], fig["async"], fig["config"]
    print(
        f"pipeline: sync vs async, {c['steps']} trainer steps, {c['prompts_per_step']} prompts x "
        f"{c['samples_per_prompt']} samples/step, RandomEngine at {c['random_tokens_per_s']:,.0f} tokens/s, "
        f"max_staleness {c['max_staleness']}"
    )
    rows = [
        ("wall (s)", "wall_s", ".2f"),
        ("samples/s", "samples_per_s", ",.1f"),
        ("tokens/s", "tokens_per_s", ",.1f"),
        ("rollout s/step (busy)", "rollout_s_per_step", ".4f"),
        ("train s/step (incl. publish)", "train_s_per_step", ".4f"),
        ("busy rollout (runtime)", "busy_rollout", ".3f"),
        ("busy trainer (runtime)", "busy_trainer", ".3f"),
        ("busy rollout (of wall)", "busy_rollout_wall", ".3f"),
        ("busy trainer (of wall)", "busy_trainer_wall", ".3f"),
        ("sync latency (s, publish)", "sync_latency_s", ".4f"),
        ("rollout stall/sync (s)", "sync_stall_s", ".4f"),
        ("rollout batch (s)", "rollout_batch_s", ".4f"),
        ("evicted / generated", "evicted_frac", ".4f"),
        ("max staleness", "max_staleness_observed", "d"),
    ]
    print(f"{'':<32}{'sync':>12}{'async':>12}")
    for label, key, fmt in rows:
        print(f"{label:<32}{format(s[key], fmt):>12}{format(a[key], fmt):>12}")
    print(f"{'staleness histogram (async)':<32}{a['staleness_hist']}")
    print(
        f"{'load avg before/after':<32}{s['load_before'][0]:>6.1f}/{s['load_after'][0]:<5.1f}"
        f"{a['load_before'][0]:>6.1f}/{a['load_after'][0]:<5.1f}"
    )
    met = fig["targets_met"]

    def line(label, value, target, key):
        print(f"{label:<44}{value:>10}  target {target:<8} {'met' if met[key] else 'MISSED'}")

    print()
    print(f"{'speedup (sync wall / async wall)':<44}{fig['speedup']:>10.3f}")
    print(f"{'ideal speedup (T_r + T_t) / max(T_r, T_t)':<44}{fig['ideal_speedup']:>10.3f}")
    line(
        "async efficiency (speedup / ideal)",
        f"{fig['async_efficiency']:.3f}",
        f">= {TARGET_ASYNC_EFFICIENCY}",
        "async_efficiency",
    )
    print(f"{'  vs an overhead-free sync loop':<44}{fig['async_efficiency_vs_phases']:>10.3f}")
    print(f"{'  async wall vs its own bottleneck phase':<44}{fig['async_pipeline_efficiency']:>10.3f}")
    line("async busy, rollout", f"{fig['async_busy_rollout']:.3f}", f">= {TARGET_BUSY}", "async_busy_rollout")
    line("async busy, trainer", f"{fig['async_busy_trainer']:.3f}", f">= {TARGET_BUSY}", "async_busy_trainer")
    print(
        f"{'  achievable from phase times (r / t)':<44}{fig['async_achievable_busy_rollout']:>10.3f} / "
        f"{fig['async_achievable_busy_trainer']:.3f}"
    )
    line("rollout stall per sync / batch", f"{fig['stall_frac']:.4f}", f"<= {TARGET_STALL_FRAC}", "stall_frac")
    line("evicted fraction", f"{fig['evicted_frac']:.4f}", f"<= {TARGET_EVICTED_FRAC}", "evicted_frac")
    print()
    print(
        f"weight sync: {fig['sync_params'] / 1e6:,.0f}M fp32 params ({fig['sync_bytes'] / 1e9:.2f} GB, "
        f"{fig['sync_tensors']} tensors), median of {fig['sync_repeats']} rounds after "
        f"{fig['sync_warmup_rounds']} warm-up rounds"
    )
    print(f"{'  put (pack + ray.put), GB/s':<44}{fig['sync_put_gbps']:>10.2f}")
    print(f"{'  get + unpack + copy_, GB/s':<44}{fig['sync_get_unpack_copy_gbps']:>10.2f}")
    line("  end to end, GB/s", f"{fig['sync_bandwidth_gbps']:.2f}", f">= {TARGET_SYNC_GBPS}", "sync_bandwidth_gbps")
    print(f"{'  first round (cold store pages), GB/s':<44}{fig['sync_bandwidth_cold_gbps']:>10.2f}")
    print(f"all targets met: {fig['target_met']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object of figures only")
    parser.add_argument("--quick", action="store_true", help="30 steps and a 50M-parameter weight sync (~1.5 min)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per mode (default 120; --quick 30)")
    parser.add_argument(
        "--sync-params",
        type=int,
        default=None,
        help="parameters of the synthetic fp32 state dict (default 500M = 2 GB; --quick 50M)",
    )
    parser.add_argument(
        "--sync-repeats",
        type=int,
        default=None,
        help="timed weight-sync rounds after 3 warm-up rounds (default 3; --quick 3)",
    )
    parser.add_argument(
        "--prompts-per-step", type=int, default=16, help="prompts per trainer step and per rollout batch"
    )
    parser.add_argument("--max-new-tokens", type=int, default=4, help="rollout.max_new_tokens")
    parser.add_argument("--max-staleness", type=int, default=2, help="runtime.max_staleness")
    parser.add_argument(
        "--tokens-per-s",
        type=float,
        default=0.0,
        help="RandomEngine rate (0 = calibrate so that a rollout batch takes as long as a train step)",
    )
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="ASYNCTENSORRLHF_NO_PREFETCH=1 (inherited by the Ray workers): the trainer takes each "
        "batch only after the previous step (for before/after comparisons)",
    )
    parser.add_argument("--poll-s", type=float, default=0.5, help="run_distributed poll interval in async mode")
    parser.add_argument("--skip-pipeline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (30 if args.quick else 120)
    args.sync_params = args.sync_params or (50_000_000 if args.quick else 500_000_000)
    args.sync_repeats = args.sync_repeats or 3

    # Everything but the final figures goes to stderr: Ray, transformers and worker logs included.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import logging

    import ray

    if args.no_prefetch:  # set before Ray starts: its worker processes inherit it
        from rlhf_core.run.trainer_role import NO_PREFETCH_ENV

        os.environ[NO_PREFETCH_ENV] = "1"

    logging.getLogger("ray").setLevel(logging.ERROR)
    output_dir = tempfile.mkdtemp(prefix="pipeline_bench_")
    # One Ray instance for both runs (run_distributed joins it and leaves it up) and for the sync test.
    # A store of 2.5 objects, as a run has (the published weights and the ones replacing them).
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=int(max(2.5 * args.sync_params * 4, 3e8)),
    )
    try:
        fig: dict = {"machine_cpus": os.cpu_count(), "load_start": loadavg(), "prefetch": not args.no_prefetch}
        if not args.skip_pipeline:
            fig.update(pipeline(args, output_dir))
        fig.update(sync_bandwidth(args.sync_params, args.sync_repeats))
        fig["load_end"] = loadavg()
    finally:
        ray.shutdown()
        shutil.rmtree(output_dir, ignore_errors=True)
    if not args.skip_pipeline:
        fig["targets_met"] = targets(fig)
        fig["target_met"] = all(fig["targets_met"].values())

    sys.stdout = real_stdout
    if args.json:
        print(json.dumps(fig))
    elif not args.skip_pipeline:
        print_table(fig)
    else:
        print(json.dumps({k: v for k, v in fig.items() if k.startswith("sync")}, indent=1))
    real_stdout.flush()


if __name__ == "__main__":
    main()
