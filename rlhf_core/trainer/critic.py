"""The critic of PPO with GAE (algorithm.advantage 'gae'): a value model trained in the trainer role.

`ValueModel` is a decoder body (the policy's architecture and weights, or critic.path) with a scalar value
head on every position. `Critic` owns it, its AdamW and its counters: `values` (no gradient, by the current
critic at training time: values are not behaviour quantities, so stale samples need nothing special) and
`update` (one pass of the clipped value loss over the step's batch in micro-batches of
trainer.micro_batch_size, as the policy's; the loss of every micro-batch is its exact share of the step's).
Checkpointed inside the trainer's state (`Trainer.state_dict()["critic"]`).

Sharded (a `group` of N trainer ranks, the policy's): the value model is sharded with FSDP2 as the policy is
(`sharding.shard_model`) and every rank holds the whole step's batch. Each rank computes the values of its
rows (`rank_rows`), gathered so that GAE, whitening included, sees the whole batch on every rank; its value
loss is its share of the step's (over the whole step's token count), gradients are summed across ranks and
clipped by the global norm, and the metrics are those of the whole batch: the update of one process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from rlhf_core.algorithms import explained_variance, value_loss
from rlhf_core.model.policy import disable_dropout, eval_mode
from rlhf_core.model.sharding import gather_rows, reduce_metrics, whole_cpu_copies
from rlhf_core.model.weights import load_weights_into
from rlhf_core.trainer.learner import Learner
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
        # a tensor of its own, not a view of the head's [N, S, 1]: sharded, FSDP2 hooks the backward on this
        # output, and warns on every forward that returns a view (an in-place op on it would lose the hook)
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).clone()


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


class Critic(Learner):
    """The value model, its optimizer and the warm-up counter. cfg: the run's TrainConfig. group: the policy's
    process group when the trainer is sharded (the value model is then sharded on it, in place, before its
    optimizer is made), None for one process."""

    def __init__(self, model: ValueModel, cfg, group=None):
        # without dropout, as the policy: values in train mode (the update) and eval mode (GAE) are the same
        # function, so the value loss measures the values the advantages were computed from
        self.model = disable_dropout(model)
        self.cfg = cfg
        self.ccfg = cfg.critic
        self.group = group
        self.device = next(model.parameters()).device
        self._shard_and_optimize(self.ccfg.lr)
        self.updates = 0

    @property
    def warmup_steps(self) -> int:
        return self.ccfg.warmup_steps

    def _forward(self, batch: RolloutBatch, idx: slice) -> torch.Tensor:
        """Values [n, L] of the states before each response token of rows `idx`."""
        P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        input_ids = torch.cat([batch.prompt_ids[idx], batch.response_ids[idx]], dim=1)
        attn = torch.cat([batch.prompt_mask[idx], batch.response_mask[idx]], dim=1).long()
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        values = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions)
        return values[:, P - 1 : P - 1 + L].float()

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """Values [N, L] of every row by the current critic, without gradient; 0 where the response is padding.
        Sharded: each rank computes its rows and every rank gets all of them (a collective)."""
        with eval_mode(self.model), torch.no_grad():
            local = torch.cat([self._forward(batch, idx) for idx in self._micro(len(batch))])
        return gather_rows(local, len(batch), self.group) * batch.response_mask.float()

    def update(
        self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss towards `returns` ([N, L]) on the tokens of `mask`.
        Returns critic/value_loss, critic/vf_clipfrac, critic/explained_variance, critic/values_mean (of the
        values the advantages were computed with) and critic/grad_norm, all of the whole batch.

        Sharded: every rank passes the whole batch and trains on its rows; the denominator is the whole
        step's token count, so the losses (and clip fractions) of the ranks' micro-batches add up to the
        step's, and FSDP sums their gradients. A collective: every rank calls it."""
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
        # shares of the step's loss and clip fraction: summed over the ranks, they are the whole batch's
        shares = reduce_metrics({"critic/value_loss": loss_sum, "critic/vf_clipfrac": clip_sum}, self.group)
        grad_norm = self._clip_grads()
        # the same decision on every rank: both figures are the whole batch's
        if math.isfinite(float(shares["critic/value_loss"])) and math.isfinite(float(grad_norm)):
            self.optimizer.step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        m = mask.float()
        return {
            "critic/value_loss": float(shares["critic/value_loss"]),
            "critic/vf_clipfrac": float(shares["critic/vf_clipfrac"]),
            # whole-batch statistics of tensors every rank holds whole (gathered values, the batch's returns)
            "critic/explained_variance": float(explained_variance(old_values, returns, m)),
            "critic/values_mean": float((old_values * m).sum() / m.sum().clamp(min=1)),
            "critic/grad_norm": float(grad_norm),
        }

    def state_dict(self) -> dict:
        """Weights (whole CPU copies), optimizer (whole tensors) and counters: everything to resume the critic,
        the same layout for N ranks as for one process. Sharded: a collective (every rank calls it); rank 0
        gets the weights, the others {}."""
        return {
            "weights": whole_cpu_copies(self.model.state_dict(keep_vars=True).items(), self.group, self._rank0),
            "optimizer": self._optimizer_state(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s layout (written by N ranks or one); sharded, each rank keeps its shard."""
        load_weights_into(self.model, state["weights"])
        self._load_optimizer_state(state["optimizer"])
        self.updates = int(state.get("updates", 0))
