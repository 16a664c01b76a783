"""Weight snapshot of a sharded trainer group: `Trainer.state_dict_for_sync()` with N = 1 (one plain Trainer)
and N = 2 (two FSDP2 ranks over gloo, spawned here), for full fine-tuning and LoRA r = 8.

What a sync costs the trainer before the weights go to Ray's object store: with N ranks every parameter is
gathered whole (a collective) and rank 0 keeps contiguous CPU copies; with one trainer it is the copies only.
The models are those of benchmarks/lora_sync.py (random weights, built locally, float32):
  llama-512x4   Llama, 4 layers, hidden 512, vocab 8192 (~14.7 M parameters)
  qwen2.5-0.5b  Qwen2 with Qwen2.5-0.5B's shape (~494 M parameters, tied embeddings)
Each rank gets cluster.trainer_workers' share of the CPU threads (torch.set_num_threads(max(1, cores // N))).
Figures are the median and the minimum of `--rounds` snapshots after one warm-up, taken on rank 0.

    python benchmarks/sharded_sync.py                     # table
    python benchmarks/sharded_sync.py --json              # one JSON object on stdout, nothing else
    python benchmarks/sharded_sync.py --models llama-512x4 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# lora_sync first: it sets the offline / quiet environment before torch and transformers load (here and in
# every spawned rank, which imports this module again)
from lora_sync import BUILDERS, MODES, nbytes  # noqa: E402, I001

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rlhf_core.config import LoraConfig, load_config  # noqa: E402
from rlhf_core.model.lora import apply_lora  # noqa: E402
from rlhf_core.trainer import Trainer  # noqa: E402

SYNC_MODES = ("full", "lora-r8")


def _trainer(name: str, mode: str, group) -> Trainer:
    model = BUILDERS[name]()
    r = MODES[mode]
    overrides = ["model.device=cpu", "trainer.lr=1e-4"]
    if r is not None:
        torch.manual_seed(0)
        model = apply_lora(model, LoraConfig(r=r, alpha=2 * r))
        overrides.append(f"model.lora.r={r}")
    return Trainer(model, load_config(None, overrides), pad_token_id=0, group=group)


def _measure(trainer: Trainer, rounds: int) -> tuple[list[float], int, int]:
    trainer.state_dict_for_sync()  # warm-up
    times = []
    payload: dict = {}
    for _ in range(rounds):
        if trainer.group is not None:
            dist.barrier(trainer.group)
        t0 = time.perf_counter()
        payload = trainer.state_dict_for_sync()
        times.append(time.perf_counter() - t0)
    return times, len(payload), nbytes(payload.values())


def _rank_main(rank: int, size: int, port: int, cases: list, rounds: int, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        rows = []
        for name, mode in cases:
            times, n, b = _measure(_trainer(name, mode, dist.group.WORLD), rounds)
            rows.append({"model": name, "mode": mode, "ranks": size, "tensors": n, "bytes": b, "times": times})
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(models: list[str], rounds: int) -> list[dict]:
    cases = [(m, mode) for m in models for mode in SYNC_MODES]
    rows = []
    torch.set_num_threads(os.cpu_count() or 1)
    for name, mode in cases:  # one plain Trainer: the copies only
        times, n, b = _measure(_trainer(name, mode, None), rounds)
        rows.append({"model": name, "mode": mode, "ranks": 1, "tensors": n, "bytes": b, "times": times})
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.pt"
        mp.spawn(_rank_main, args=(2, _free_port(), cases, rounds, out), nprocs=2, join=True)
        rows += torch.load(out)
    for r in rows:
        r["median_s"] = statistics.median(r["times"])
        r["min_s"] = min(r["times"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(BUILDERS), help=f"comma-separated subset of {list(BUILDERS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in BUILDERS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {list(BUILDERS)}")
    rows = run(models, args.rounds)
    facts = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps({"facts": facts, "rows": rows}))
        return
    print(f"# {facts}")
    print("| model | mode | ranks | tensors | MB | snapshot median (s) | min (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["model"], r["mode"], r["ranks"])):
        print(
            f"| {r['model']} | {r['mode']} | {r['ranks']} | {r['tensors']} | {r['bytes'] / 1e6:.1f} "
            f"| {r['median_s']:.3f} | {r['min_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
