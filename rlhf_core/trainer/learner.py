"""What the trainer and the critic do alike with the model each of them trains (`Learner`): shard it on the
trainer's process group (`sharding.shard_model`; None: one process), an AdamW over its trainable parameters with
trainer.betas and trainer.weight_decay, this rank's micro-batches of trainer.micro_batch_size rows, the
gradients clipped by their global norm to trainer.grad_clip, and the optimizer's state as whole tensors (the
same layout for N ranks as for one process)."""

from __future__ import annotations

import torch

from rlhf_core.model.sharding import (
    global_grad_norm,
    load_whole_optimizer_state,
    rank_micro_slices,
    shard_model,
    whole_optimizer_state,
    world,
)


class Learner:
    """The base of `Trainer` and `Critic`: they set `model`, `cfg` (the run's TrainConfig), `group` and `device`,
    then call `_shard_and_optimize`."""

    model: torch.nn.Module
    group: object
    device: torch.device
    optimizer: torch.optim.Optimizer

    def _shard_and_optimize(self, lr: float) -> None:
        """Shard the model on the group (in place; nothing without one), then its AdamW."""
        if self.group is not None:
            shard_model(self.model, self.group, self.device.type)
        tcfg = self.cfg.trainer
        self.optimizer = torch.optim.AdamW(
            self._trainable(), lr=lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay
        )

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _micro(self, n: int) -> list[slice]:
        """This rank's rows of an n-row step in micro-batches, as many on every rank (FSDP's collectives)."""
        return rank_micro_slices(n, self.group, self.cfg.trainer.micro_batch_size)

    def _clip_grads(self) -> torch.Tensor:
        """Clip the gradients to trainer.grad_clip by their global norm (of the whole model on every rank);
        returns that norm, before clipping."""
        params = self._trainable()
        grad_norm = global_grad_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.trainer.grad_clip, grad_norm)
        return grad_norm

    @property
    def _rank0(self) -> bool:
        """Whether this process is rank 0 of the group (the one that keeps gathered weights); True without one."""
        return world(self.group)[0] == 0

    def _optimizer_state(self) -> dict:
        """The optimizer's state as whole tensors. Sharded: a collective (every rank calls it)."""
        return whole_optimizer_state(self.optimizer, self.group)

    def _load_optimizer_state(self, state: dict) -> None:
        """Resume the optimizer from `_optimizer_state()`'s layout (written by N ranks or one)."""
        load_whole_optimizer_state(self.optimizer, state, self.group)
