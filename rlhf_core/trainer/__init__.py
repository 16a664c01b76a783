"""The trainer: logprobs, loss, optimizer step, weight snapshot."""

from rlhf_core.trainer.logprobs import sequence_logprobs
from rlhf_core.trainer.trainer import Trainer, build_lr_lambda

__all__ = ["Trainer", "build_lr_lambda", "sequence_logprobs"]
