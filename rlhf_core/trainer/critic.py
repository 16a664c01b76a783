"""The critic of PPO with GAE (algorithm.advantage 'gae'): a value model trained in the trainer role.

`ValueModel` is a decoder body (the policy's architecture and weights, or critic.path) with a scalar value
head on every position. `Critic` owns it, its AdamW and its counters: `values` (no gradient, by the current
critic at training time: values are not behaviour quantities, so stale samples need nothing special) and
`update` (one pass of the clipped value loss over the step's batch in micro-batches of
critic.micro_batch_size; the loss of every micro-batch is its exact share of the step's, as for the policy).
Checkpointed inside the trainer's state (`Trainer.state_dict()["critic"]`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from rlhf_core.algorithms import explained_variance, value_loss
from rlhf_core.types import RolloutBatch


class ValueModel(nn.Module):
    """body: a Hugging Face base model (AutoModel: hidden states, no LM head); value_head: hidden -> 1."""

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)  # every value starts at 0: no initial bias in the advantages
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """Values [N, S], one per position (the value of the state after reading tokens up to it)."""
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def load_value_model(path: str | Path, dtype: Optional[torch.dtype], device, trust_remote_code: bool) -> ValueModel:
    """The body of the model at `path` (a causal LM's decoder without its head: AutoModel) plus a value head,
    on `device`; float32 head unless dtype says otherwise."""
    from transformers import AutoModel

    body = AutoModel.from_pretrained(
        str(path), dtype=dtype or "auto", trust_remote_code=trust_remote_code, local_files_only=True
    )
    model = ValueModel(body, int(body.config.hidden_size))
    model.value_head.to(dtype=next(body.parameters()).dtype)
    return model.to(device)


class Critic:
    """The value model, its optimizer and the warm-up counter. cfg: the run's TrainConfig."""

    def __init__(self, model: ValueModel, cfg):
        self.model = model
        self.cfg = cfg
        self.ccfg = cfg.critic
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=self.ccfg.lr,
            betas=tuple(cfg.trainer.betas),
            weight_decay=cfg.trainer.weight_decay,
        )
        self.updates = 0

    @property
    def warmup_steps(self) -> int:
        return self.ccfg.warmup_steps

    def _micro(self, n: int) -> list[slice]:
        size = self.ccfg.micro_batch_size
        return [slice(s, min(n, s + size)) for s in range(0, n, size)]

    def _forward(self, batch: RolloutBatch, idx: slice) -> torch.Tensor:
        """Values [n, L] of the states before each response token of rows `idx`."""
        P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        input_ids = torch.cat([batch.prompt_ids[idx], batch.response_ids[idx]], dim=1)
        attn = torch.cat([batch.prompt_mask[idx], batch.response_mask[idx]], dim=1).long()
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        values = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions)
        return values[:, P - 1 : P - 1 + L].float()

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """Values [N, L] of every row by the current critic, without gradient; 0 where the response is padding."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = torch.cat([self._forward(batch, idx) for idx in self._micro(len(batch))])
        finally:
            self.model.train(was_training)
        return out * batch.response_mask.float()

    def update(
        self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss towards `returns` ([N, L]) on the tokens of `mask`.
        Returns critic/value_loss, critic/vf_clipfrac, critic/explained_variance, critic/values_mean (of the
        values the advantages were computed with) and critic/grad_norm."""
        self.model.train()
        total = mask.float().sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        clip_sum = torch.zeros((), device=self.device)
        for idx in self._micro(len(batch)):
            values = self._forward(batch, idx)
            loss, clipfrac = value_loss(
                values, old_values[idx], returns[idx], mask[idx], self.ccfg.value_clip, total_tokens=total
            )
            loss.backward()
            loss_sum += loss.detach()
            clip_sum += clipfrac
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.trainer.grad_clip)
        if math.isfinite(float(loss_sum)) and math.isfinite(float(grad_norm)):
            self.optimizer.step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        m = mask.float()
        return {
            "critic/value_loss": float(loss_sum),
            "critic/vf_clipfrac": float(clip_sum),
            "critic/explained_variance": float(explained_variance(old_values, returns, m)),
            "critic/values_mean": float((old_values * m).sum() / m.sum().clamp(min=1)),
            "critic/grad_norm": float(grad_norm),
        }

    def state_dict(self) -> dict:
        """Weights (CPU copies), optimizer and counters: everything to resume the critic."""
        return {
            "weights": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state.get("updates", 0))
