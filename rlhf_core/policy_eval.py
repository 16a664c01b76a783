"""A trained policy scored on held-out prompts, outside training: which policy a local path names (through
`rlhf_core.run.checkpoint.inspect_path`) and its greedy accuracy (`atrlhf evaluate` without the command line).

A checkpoint holds weights (or adapters) only: its architecture comes from model.path, or for the tiny default
from the tiny policy the run built beside its `checkpoints/` (else the one the config builds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf_core.config import TrainConfig
from rlhf_core.run import build
from rlhf_core.run.checkpoint import inspect_path, load_checkpoint


def policy_to_evaluate(cfg: TrainConfig, path: str | Path) -> tuple[Path, Optional[Path]]:
    """(Hugging Face policy directory, checkpoint directory or None) for a local path; FileNotFoundError names
    what the path holds when it is not a policy."""
    held = inspect_path(path)
    if held.kind == "model":
        return held.path, None
    if held.kind == "adapter":
        raise FileNotFoundError(
            f"--checkpoint {str(path)!r} holds a LoRA adapter only (PEFT format, in adapter/): export with "
            "model.lora.export_merged=true for a merged model to evaluate, or load the adapter with peft"
        )
    if held.kind == "checkpoint":
        beside = held.policy_beside(cfg.model.tiny.kind)
        if not cfg.model.path and beside is not None:
            return beside, held.path
        return build.resolve_policy_dir(cfg), held.path
    raise FileNotFoundError(
        f"--checkpoint {str(path)!r} is not a checkpoint directory, a Hugging Face model directory or an MLflow run id"
    )


def evaluate_policy(cfg: TrainConfig, policy_dir: Path, checkpoint: Optional[Path] = None) -> dict:
    """Greedy accuracy and mean reward on cfg's held-out prompts (the same scoring as eval/accuracy), and
    eval/pass@k and eval/mean@k when eval.n_samples > 0."""
    build.setup_process(cfg, cfg.trainer.seed)
    # LoRA adapters (model.lora) come from a checkpoint; an exported policy has them merged already
    model, tokenizer = build.build_policy(cfg, policy_dir, adapters=checkpoint is not None)
    if checkpoint is not None:
        load_checkpoint(checkpoint, model)
    _, heldout = build.build_prompts(cfg, tokenizer)
    evaluator = build.build_evaluator(cfg, model, tokenizer, policy_dir, heldout)
    try:
        result = evaluator()
    finally:
        evaluator.close()
    result["eval/prompts"] = len(heldout)
    return result
