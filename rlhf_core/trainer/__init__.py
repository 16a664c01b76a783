"""The trainer: logprobs, loss, optimizer step, weight snapshot."""

from rlhf_core.trainer.trainer import Trainer, build_lr_lambda, sequence_logprobs

__all__ = ["Trainer", "build_lr_lambda", "sequence_logprobs"]
