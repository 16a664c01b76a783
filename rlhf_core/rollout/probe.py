"""The sync probe: every weight sync is checked, not trusted, and measures the engine's numerics.

When the trainer publishes version V it computes, with the weights it publishes, its next-token distributions
(log-softmax over the vocabulary) at the last K positions of a few fixed rows of token ids (`reference`) and ships
them beside the weights (`attach`: two extra entries of the snapshot). A rollout worker that loads the snapshot asks
its engine to sample one token at each of those positions, given the row up to there, with its log-prob
(`engine.probe_sample`: the path generation takes, temperature 1). Looking the sampled tokens up in the trainer's
distributions gives, per sync:

- the mean absolute log-prob difference per token, which `SyncCheck` holds to the tolerance (numerical noise:
  ~1e-6 in float32, ~1e-2 with a bfloat16 engine). Beyond it the sync did not land as published, and the check
  says which way: the engine still computes the previous version's log-probs (the update was ignored or went
  elsewhere), or neither version's (a mangled or partial load, a dtype or adapter that differs).
  `supervision.sync_check.action` decides whether that fails the run (the default) or warns;
- the KL(engine ‖ trainer) by k3 over those engine-sampled tokens, the estimator and direction of
  `mismatch/engine_kl` (`rlhf_core.trainer.ledger`), so that the engine's numerics are measured at every sync even
  when no training token is fresh (an asynchronous run trains on tokens one version old).

The probe rows are random token ids from a fixed generator: they need no tokenizer, and every version sees the
same rows, so that the previous version's reference is comparable with the new one. K is every position for a
small vocabulary and fewer for a large one (the reference is [rows, K, vocab] floats: at most REFERENCE_FLOATS).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from rlhf_core.algorithms.kl import kl_penalty
from rlhf_core.model.policy import eval_mode

log = logging.getLogger("rlhf_core.rollout")

PROBE_IDS = "__sync_probe__.ids"
PROBE_LOGPROBS = "__sync_probe__.logprobs"
PROBE_ROWS, PROBE_LENGTH = 4, 16
REFERENCE_FLOATS = 1 << 21  # 8 MiB of float32 shipped per sync at most


class SyncCheckError(RuntimeError):
    """A weight sync whose engine log-probs disagree with the trainer's for the version it published."""


def probe_ids(vocab_size: int, rows: int = PROBE_ROWS, length: int = PROBE_LENGTH) -> torch.Tensor:
    """The fixed probe rows: LongTensor [rows, length] of ids in [0, vocab_size), the same on every call."""
    generator = torch.Generator().manual_seed(20261205)
    return torch.randint(0, int(vocab_size), (rows, length), generator=generator)


def probe_positions(vocab_size: int, rows: int = PROBE_ROWS, length: int = PROBE_LENGTH) -> int:
    """K: how many of each row's last prefixes are probed (1 to length - 1), within REFERENCE_FLOATS."""
    return max(1, min(length - 1, REFERENCE_FLOATS // max(1, rows * int(vocab_size))))


def prefix_lengths(length: int, k: int) -> list[int]:
    """The prefix lengths probed in a row of `length` ids: the last k, length - k to length - 1."""
    return list(range(length - k, length))


@torch.no_grad()
def reference(model: torch.nn.Module, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The model's next-token log-probs [B, k, V] (float32, CPU) after each of the last k prefixes of ids [B, T]
    (`prefix_lengths`), computed in eval mode and the mode put back."""
    with eval_mode(model):
        device = next(model.parameters()).device
        T = ids.shape[1]
        logits = model(input_ids=ids[:, : T - 1].to(device)).logits[:, T - 1 - k :].float()
        lp = torch.log_softmax(logits, -1)
    return lp.cpu()


def sample_at_prefixes(logits: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, k], their log-probs [B, k]) sampled at temperature 1 from logits [B, k, V] with a generator of
    `seed` (an engine's `probe_sample` over its own forward)."""
    lp = torch.log_softmax(logits.float(), -1)
    generator = torch.Generator(device=lp.device).manual_seed(int(seed))
    flat = lp.reshape(-1, lp.shape[-1])
    tokens = torch.multinomial(flat.exp(), 1, generator=generator)
    return tokens.view(lp.shape[:2]).cpu(), flat.gather(-1, tokens).view(lp.shape[:2]).cpu()


def vocab_size_of(model: torch.nn.Module) -> int:
    """The model's vocabulary (rows of its output embedding)."""
    return int(model.get_output_embeddings().weight.shape[0])


def attach(snapshot: dict, model: torch.nn.Module, keep: bool = True) -> dict:
    """The snapshot with the probe rows and the reference distributions under `model` added (a new dict). A sharded
    model's forward is a collective: every rank computes the reference, the ranks with keep=False get `snapshot`."""
    vocab = vocab_size_of(model)
    ids = probe_ids(vocab)
    ref = reference(model, ids, probe_positions(vocab))
    return {**snapshot, PROBE_IDS: ids, PROBE_LOGPROBS: ref} if keep else snapshot


def split(state_dict: Optional[dict]) -> tuple[Optional[dict], Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """(the weights alone, (probe ids, reference log-probs) or None). The input is not changed: in one process the
    same snapshot may reach several workers."""
    if not state_dict or PROBE_IDS not in state_dict:
        return state_dict, None
    weights = {k: v for k, v in state_dict.items() if k not in (PROBE_IDS, PROBE_LOGPROBS)}
    return weights, (state_dict[PROBE_IDS], state_dict[PROBE_LOGPROBS])


def snapshot_bytes(snapshot: Optional[dict]) -> int:
    """The bytes of the weights a sync ships (the probe's rows and reference left out)."""
    weights = split(snapshot)[0]
    return sum(v.numel() * v.element_size() for v in weights.values()) if weights else 0


class SyncCheck:
    """The rollout side: after a sync, the engine's probe tokens and log-probs against the published reference.

    action: 'fail' (raise SyncCheckError), 'warn' (log a warning), 'off'. tolerance: the largest mean absolute
    log-prob difference per probe token that counts as numerical noise; None: by the engine's `dtype`, 1e-3 in
    float32 and 0.05 in a 16-bit type."""

    def __init__(self, action: str = "fail", tolerance: Optional[float] = None):
        if action not in ("fail", "warn", "off"):
            raise ValueError(f"supervision.sync_check.action must be fail, warn or off, got {action!r}")
        self.action = action
        self.tolerance = None if tolerance is None else float(tolerance)
        self.previous: Optional[tuple[int, torch.Tensor]] = None  # (version, reference) of the last checked sync
        # before the first checked sync there is no previous reference: what the engine sampled before that load
        self._before: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
        self.checks = 0
        self.failures = 0
        self.last_diff: Optional[float] = None
        self.last_kl: Optional[float] = None  # k3 KL(engine ‖ trainer) over the latest sync's probe tokens
        self.max_diff = 0.0
        self.first: Optional[torch.Tensor] = None  # the reference of the first checked sync
        self.moved_max = 0.0  # the most the trainer's probe log-probs moved since then, the engine agreeing

    def before_load(self, engine, probe: Optional[tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        """Before the first checked sync (no previous reference to tell an ignored update by): the engine's probe
        samples under the weights it holds, drawn as `check` will draw them after the load."""
        if self.action == "off" or probe is None or self.previous is not None or not hasattr(engine, "probe_sample"):
            return
        tokens, got = engine.probe_sample(probe[0], probe[1].shape[1], seed=int(version))
        self._before = (int(engine.version), tokens.long().cpu(), got.float().cpu())

    def check(self, engine, probe: Optional[tuple[torch.Tensor, torch.Tensor]], version: int, worker: str = "") -> None:
        """Compare the engine's log-probs of the tokens it samples at the probe's prefixes with the trainer's
        reference for `version`; record the KL(engine ‖ trainer) of those tokens (k3)."""
        if self.action == "off" or probe is None or not hasattr(engine, "probe_sample"):
            return
        ids, ref = probe
        if self.tolerance is None:
            self.tolerance = 1e-3 if getattr(engine, "dtype", torch.float32) == torch.float32 else 0.05
        tokens, got = engine.probe_sample(ids, ref.shape[1], seed=int(version))
        tokens, got = tokens.long().cpu(), got.float().cpu()
        expected = ref.float().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        diff = float((got - expected).abs().mean())
        self.last_kl = float(kl_penalty(got, expected, "k3").mean())
        self.checks += 1
        self.last_diff, self.max_diff = diff, max(self.max_diff, diff)
        previous, self.previous = self.previous, (int(version), ref)
        if self.first is None:
            self.first = ref.float()
        if diff <= self.tolerance:
            self._before = None
            # the engine agreed: how far its log-probs moved since the first sync (an adapter in use moves them)
            then = self.first.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            self.moved_max = max(self.moved_max, float((expected - then).abs().mean()))
            return
        self.failures += 1
        message = (
            f"{worker or 'rollout worker'}: after loading version {version}, the engine's log-probs on the sync probe "
            f"differ from the trainer's for that version by {diff:.3g} per token (supervision.sync_check.tolerance="
            f"{self.tolerance:g}): "
        )
        if previous is not None and previous[0] != version:
            stale = float((got - previous[1].float().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)).abs().mean())
            if stale <= self.tolerance:
                message += (
                    f"it still computes version {previous[0]} (difference {stale:.3g}): the weight update did not land "
                    "in the engine (an engine that ignores in-place updates, or weights loaded under names it skips)"
                )
            else:
                message += (
                    f"it computes neither version {version} nor {previous[0]} (difference {stale:.3g}): the weights "
                    "were loaded wrongly or only in part (names or shapes mapped onto the wrong layers, a tied output "
                    "embedding left on old weights), or the engine's dtype or LoRA adapter differs from the trainer's"
                )
        elif (
            self._before is not None
            and torch.equal(self._before[1], tokens)
            and float((self._before[2] - got).abs().mean()) <= self.tolerance
        ):
            message += (
                f"it still computes what it computed before the load (version {self._before[0]}): the weight update "
                "did not land in the engine (an engine that ignores in-place updates, or weights loaded under names it "
                "skips)"
            )
        else:
            message += (
                "the weights did not land as published (an engine that ignores in-place updates, names it skips), "
                "or the engine's dtype or LoRA adapter differs from the trainer's"
            )
        self._before = None
        if self.action == "fail":
            raise SyncCheckError(message + " (supervision.sync_check.action=warn to go on)")
        log.warning("%s", message)

    def stats(self) -> dict:
        return {
            "sync_checks": self.checks,
            "sync_check_failures": self.failures,
            "sync_probe_diff": self.last_diff,
            "sync_probe_diff_max": self.max_diff,
            "sync_probe_kl": self.last_kl,
            "sync_probe_moved_max": self.moved_max,
        }
