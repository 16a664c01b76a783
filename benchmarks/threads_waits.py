"""Where each role of the threads host waits (cluster.host: threads): per-step and per-batch phase times.

    python benchmarks/threads_waits.py                    # the tiny task, 60 steps, 1 and 2 rollout workers
    python benchmarks/threads_waits.py --json --steps 100

Per run: the trainer's busy fraction and, per step (median over the steps after the 5th), its train time, its
wait for the batch (time/wait_s), the weights snapshot (sync/snapshot_s) and the publish (sync/latency_s); per
rollout worker its busy fraction, generation per batch and the time outside generation by phase (weights, prompts,
split, push: RolloutRole.phase_s).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(steps: int, workers: int, out_dir: str) -> dict:
    from rlhf_core.config import load_config
    from rlhf_core.distributed import run_distributed

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"run.output_dir={out_dir}", "cluster.host=threads", f"trainer.total_steps={steps}", "data.eval_size=20",
         "eval.every=0", "checkpoint.every=0", f"rollout.num_workers={workers}"],
    )  # fmt: skip
    result = run_distributed(cfg, poll_interval_s=0.5)
    per_step = result["metrics"][5:]

    def ms(key: str) -> float:
        return 1000 * statistics.median([m[key] for m in per_step if key in m])

    trainer = result["final_poll"]["trainer"]
    return {
        "workers": workers,
        "samples_per_s": steps * cfg.batch_size / result["wall_s"],
        "trainer_busy": trainer["busy_frac"],
        "train_ms": ms("time/train_s"),
        "wait_ms": ms("time/wait_s"),
        "snapshot_ms": ms("sync/snapshot_s"),
        "publish_ms": ms("sync/latency_s"),
        "rollout": [
            {
                "busy": w["busy_frac"],
                "generate_ms": 1000 * w["batch_s_mean"],
                **{f"{k}_ms": 1000 * v for k, v in w["phase_s_per_batch"].items()},
            }
            for w in result["final_poll"]["rollout"]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="threads_waits_") as tmp:
        runs = [measure(args.steps, n, f"{tmp}/w{n}") for n in (1, 2)]
    if args.json:
        print(json.dumps({"runs": runs}))
        return
    for r in runs:
        print(
            f"{r['workers']} worker(s): {r['samples_per_s']:.0f} samples/s, trainer busy {r['trainer_busy']:.3f}, "
            f"per step train {r['train_ms']:.1f} ms, wait {r['wait_ms']:.2f}, snapshot {r['snapshot_ms']:.2f}, "
            f"publish {r['publish_ms']:.2f}"
        )
        for i, w in enumerate(r["rollout"]):
            print(f"  rollout {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in w.items()))


if __name__ == "__main__":
    main()
