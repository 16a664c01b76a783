"""Weight sync and trainer memory, full fine-tuning versus LoRA (r = 8 and 64).

For each model and mode it measures, on the CPU:
  sync bytes      the payload of one weight sync: `Trainer.state_dict_for_sync()` (full: every parameter and
                  buffer; LoRA: the adapter tensors only)
  snapshot_s      `Trainer.state_dict_for_sync()`: contiguous CPU copies (what the trainer does after a step)
  pack_s          `transport.pack_state_dict` (numpy views for Ray's object store)
  load_s          `HFEngine.load_weights` of the unpacked payload (the rollout side's in-place copy). To keep
                  the 0.5 B model within memory the engine wraps the trainer's own model object: the copy
                  is the same size and kind as into a second model.
  sync_s          snapshot + pack + load (the Ray object-store hop itself is not included)
  trainer memory  after one real optimizer step (AdamW) on a 2 x 16-token batch: bytes of the parameters,
                  of the gradients that exist, and of the optimizer state (exp_avg, exp_avg_sq, step)
Figures are the best (minimum) of the rounds, the least disturbed on a shared machine.

Models, built locally with random weights (nothing is downloaded), float32:
  llama-512x4   the model of benchmarks/generation.py (Llama, 4 layers, hidden 512, vocab 8192, ~14.7 M)
  qwen2.5-0.5b  Qwen2 with Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864,
                vocab 151936, tied embeddings (~494 M parameters)
LoRA: alpha = 2r, dropout 0, on q/k/v/o/gate/up/down projections (the config's default target_modules).

    python benchmarks/lora_sync.py            # table
    python benchmarks/lora_sync.py --json     # one JSON object on stdout, nothing else
    python benchmarks/lora_sync.py --models llama-512x4 --rounds 3
    python benchmarks/lora_sync.py --device cuda --json  # on a GPU (scripts/gpu_checks.sh)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import build_model as build_llama  # noqa: E402

from rlhf_core.config import LoraConfig, load_config  # noqa: E402
from rlhf_core.distributed.transport import pack_state_dict, unpack_state_dict  # noqa: E402
from rlhf_core.model.lora import apply_lora  # noqa: E402
from rlhf_core.rollout import HFEngine  # noqa: E402
from rlhf_core.trainer import Trainer  # noqa: E402

MODES = {"full": None, "lora-r8": 8, "lora-r64": 64}
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def build_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).eval()


BUILDERS = {
    "llama-512x4": lambda: build_llama(dict(hidden=512, layers=4, heads=8, intermediate=1024, vocab=8192)),
    "qwen2.5-0.5b": build_qwen,
}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(name: str, mode: str, rounds: int, device: str = "cpu") -> dict:
    model = BUILDERS[name]().to(device)
    r = MODES[mode]
    overrides = [f"model.device={device}", "trainer.lr=1e-4"]
    if r is not None:
        model = apply_lora(model, LoraConfig(r=r, alpha=2 * r))
        overrides.append(f"model.lora.r={r}")
    cfg = load_config(None, overrides)
    trainer = Trainer(model, cfg, pad_token_id=0)
    engine = HFEngine(model, [1], 0)
    snap, pack, load, total = [], [], [], []
    payload = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        payload = trainer.state_dict_for_sync()
        t1 = time.perf_counter()
        packed = pack_state_dict(payload)
        t2 = time.perf_counter()
        engine.load_weights(unpack_state_dict(packed), 1)
        _sync(device)
        t3 = time.perf_counter()
        snap.append(t1 - t0)
        pack.append(t2 - t1)
        load.append(t3 - t2)
        total.append(t3 - t0)
        del packed
    sync_bytes = nbytes(payload.values())
    n_tensors = len(payload)
    del payload
    gc.collect()

    # one real optimizer step: gradients and AdamW state come into existence
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model.train()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    trainer.optimizer.step()
    params = {id(p): p for p in model.parameters()}.values()
    grads = [p.grad for p in params if p.grad is not None]
    opt_state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    total_params = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    out = {
        "model": name,
        "mode": mode,
        "params": total_params,
        "trainable_params": trainable,
        "sync_tensors": n_tensors,
        "sync_bytes": sync_bytes,
        "snapshot_s": min(snap),
        "pack_s": min(pack),
        "load_s": min(load),
        "sync_s": min(total),
        "param_bytes": nbytes(params),
        "grad_bytes": nbytes(grads),
        "optimizer_bytes": nbytes(opt_state),
    }
    out["trainer_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]
    del model, trainer, engine, grads, opt_state, params
    gc.collect()
    return out


def run(models: list[str], rounds: int, device: str = "cpu") -> dict:
    torch.set_num_threads(1)
    rows = []
    for name in models:
        for mode in MODES:
            print(f"# {name} {mode} ...", file=sys.stderr, flush=True)
            rows.append(bench(name, mode, rounds, device))
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_avg": os.getloadavg(),
        "torch": torch.__version__,
        "threads": 1,
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "rounds": rounds,
        "rows": rows,
    }


def print_table(report: dict) -> None:
    mib = 1024**2
    print(f"{report['date']}, load {report['load_avg'][0]:.1f}, torch {report['torch']}, best of {report['rounds']}")
    print(
        f"{'model':13} {'mode':9} {'trainable':>12} {'sync MiB':>10} {'snap s':>8} {'pack s':>8} {'load s':>8} "
        f"{'sync s':>8} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'trainer MiB':>12}"
    )
    for r in report["rows"]:
        print(
            f"{r['model']:13} {r['mode']:9} {r['trainable_params']:>12,} {r['sync_bytes'] / mib:>10.3f} "
            f"{r['snapshot_s']:>8.4f} {r['pack_s']:>8.4f} {r['load_s']:>8.4f} {r['sync_s']:>8.4f} "
            f"{r['param_bytes'] / mib:>11.1f} {r['grad_bytes'] / mib:>10.1f} {r['optimizer_bytes'] / mib:>10.1f} "
            f"{r['trainer_bytes'] / mib:>12.1f}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object of all figures, nothing else")
    parser.add_argument("--models", default=",".join(BUILDERS), help=f"comma-separated subset of {list(BUILDERS)}")
    parser.add_argument("--rounds", type=int, default=5, help="sync rounds per model and mode (best is reported)")
    parser.add_argument("--device", default="cpu", help="where the trainer and the engine hold the model (cuda)")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in BUILDERS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(BUILDERS)}")
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        report = run(models, args.rounds, args.device)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
