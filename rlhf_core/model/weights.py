"""Whole tensors into a model, as a checkpoint or a trainer's `full_weights` holds them: a full model (tied
parameters get one copy), a LoRA model (its adapter tensors) or a sharded one (FSDP2: each rank keeps its
shard). Below the trainer, the critic and the checkpoint reader, which all load weights through it.
"""

from __future__ import annotations

import torch

from rlhf_core.model.lora import is_lora, load_adapter_state_dict
from rlhf_core.model.sharding import is_dtensor, shard_like


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model or run it is loaded into."""


def load_weights_into(model, weights: dict[str, torch.Tensor]) -> None:
    """Copy validated weights into the model in place (tied parameters share storage and get one copy); a
    LoRA model takes its adapter tensors."""
    if is_lora(model):
        try:
            load_adapter_state_dict(model, weights)
        except KeyError as exc:
            raise CheckpointError(str(exc)) from None
        return
    live = model.state_dict()
    # a sharded model (FSDP2) takes each rank's shard of the whole tensors
    weights = {k: shard_like(v, live[k]) if k in live else v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    real_missing = [k for k in missing if k not in tied and not is_tied(model, k, weights)]
    if real_missing or unexpected:
        raise CheckpointError(
            f"weights do not fit the model: missing {real_missing[:3]}, unexpected {list(unexpected)[:3]}"
        )


def is_tied(model, key: str, weights: dict) -> bool:
    """A missing key is fine when its tensor shares storage with one that was loaded (tied embeddings)."""
    sd = {k: v.to_local() if is_dtensor(v) else v for k, v in model.state_dict().items()}
    ptr = sd[key].data_ptr()
    return any(sd[k].data_ptr() == ptr for k in weights if k in sd)
