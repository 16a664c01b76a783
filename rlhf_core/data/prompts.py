"""Prompts and the seeded, resumable source that yields them."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from rlhf_core.config.base import PRIORITY_FLOOR

if TYPE_CHECKING:  # torch is imported where tensors are made: the prompt queue's process never needs it
    import torch

    from rlhf_core.types import PackedPatterns

log = logging.getLogger("rlhf_core.data")


def _check_size(state: dict, size: int) -> None:
    """A saved data position belongs to a source of this many prompts (ValueError naming both otherwise)."""
    if state.get("size") != size:
        raise ValueError(
            f"data position was saved for a source of {state.get('size')} prompts, "
            f"but this source has {size}: the dataset changed"
        )


@dataclass
class Prompt:
    """One prompt: its token ids, the token patterns that count as a correct answer, and metadata.

    uid:        stable integer id (index into its split).
    prompt_ids: token ids of the prompt, special tokens / chat template already applied.
    answers:    alternative token-id sequences of the answer (any of them scores).
    text:       the rendered prompt text (chat template applied), as the model sees it.
    answer_text: the ground truth the answers were made from (verl: reward_model.ground_truth).
    meta:       the dataset row's other columns by name (verl: data_source, ability, reward_model,
                extra_info), for reward functions; a JSONL line also its 'line' number.
    messages:   the chat messages rendered (system prompt included) when the row's prompt was a
                conversation; None for a plain-text prompt.
    prompt_text: a plain-text prompt as the row wrote it, before any chat template or system prompt ('' for
                a conversation: see messages); what a multi-turn environment's reset gets as row['prompt'].
    """

    uid: int
    prompt_ids: list[int]
    answers: list[list[int]]
    text: str = ""
    answer_text: str = ""
    meta: dict = field(default_factory=dict)
    messages: Optional[list[dict]] = None
    prompt_text: str = ""


@dataclass
class PromptBatch:
    """Prompts collated as tensors.

    prompt_ids:  LongTensor [n, P] LEFT-padded.
    prompt_mask: BoolTensor [n, P].
    patterns:    PackedPatterns [n, K, Q].
    uids:        LongTensor [n].
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    patterns: PackedPatterns
    uids: torch.Tensor

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def collate_prompts(
    prompts: Sequence[Prompt], pad_token_id: int, max_prompt_tokens: Optional[int] = None
) -> PromptBatch:
    """Left-pad prompts into tensors and pack their answer patterns (not a hot path: runs once per batch)."""
    import torch

    from rlhf_core.types import PackedPatterns

    if not prompts:
        raise ValueError("collate_prompts needs at least one prompt")
    rows = [p.prompt_ids[-max_prompt_tokens:] if max_prompt_tokens else p.prompt_ids for p in prompts]
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, P - len(r) :] = True
    K = max(1, max(len(p.answers) for p in prompts))
    Q = max(1, max((len(a) for p in prompts for a in p.answers), default=1))
    tokens = torch.zeros((len(rows), K, Q), dtype=torch.long)
    lengths = torch.zeros((len(rows), K), dtype=torch.long)
    for i, p in enumerate(prompts):
        for k, a in enumerate(p.answers):
            if a:
                tokens[i, k, : len(a)] = torch.tensor(a, dtype=torch.long)
                lengths[i, k] = len(a)
    uids = torch.tensor([p.uid for p in prompts], dtype=torch.long)
    return PromptBatch(ids, mask, PackedPatterns(tokens, lengths), uids)


class PromptSource:
    """Yields prompts in a seeded shuffled order, epoch after epoch (endlessly, or for `epochs`).

    The position is (epoch, index); `state_dict()` / `load_state_dict()` save and restore it so that a
    resumed run sees exactly the prompts an uninterrupted run would have seen. `resume_trained` restores from
    how often each prompt was trained on instead (exactly-once resume of an asynchronous run, where prompts
    served but still buffered or in flight at the checkpoint were never trained on).
    """

    sampler = "epochs"

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0, epochs: Optional[int] = None, shuffle: bool = True):
        if not prompts:
            raise ValueError("a prompt source needs at least one prompt")
        self.prompts = list(prompts)
        self.seed = seed
        self.epochs = epochs
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)
        self._skip: Optional[dict[int, int]] = None  # set by resume_trained

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs

    def next(self, n: int) -> list[Prompt]:
        """The next `n` prompts (fewer only when a finite source runs out)."""
        out: list[Prompt] = []
        while len(out) < n and not self.exhausted:
            if self._skip is None:
                take = min(n - len(out), len(self.prompts) - self.index)
                out.extend(self.prompts[i] for i in self._order[self.index : self.index + take])
                self.index += take
            else:  # resumed from trained counts: a prompt trained on more than `epoch` times is not served
                p = self.prompts[self._order[self.index]]
                self.index += 1
                if self._skip.get(p.uid, 0) <= self.epoch:
                    out.append(p)
            if self.index >= len(self.prompts):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
                if self._skip is not None and self.epoch >= max(self._skip.values(), default=0):
                    self._skip = None
        return out

    def __iter__(self) -> Iterable[Prompt]:
        while not self.exhausted:
            yield from self.next(1)

    def observe(self, scores: dict[int, float]) -> None:
        """Epochs serve every prompt once each, whatever its rewards: nothing to record."""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        _check_size(state, len(self.prompts))
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)
        self._skip = None

    def trained_estimate(self, queued: Sequence[int] = ()) -> dict[int, int]:
        """How often each prompt uid was served, less `queued` (served but not yet taken): what a checkpoint
        without a record of trained prompts implies was trained on (the estimate for older checkpoints)."""
        counts = {p.uid: self.epoch for p in self.prompts}
        for i in self._order[: self.index]:
            counts[self.prompts[i].uid] += 1
        for uid in queued:
            counts[uid] -= 1
        return counts

    def resume_trained(self, trained: dict[int, int], epoch: int) -> None:
        """Go on from `trained` (prompt uid -> times trained on) at source epoch `epoch` (the epoch the source
        was serving at the checkpoint): starting at the oldest epoch a prompt still owes, each epoch e serves
        its permutation less the prompts trained on more than e times, then the next epochs whole. A prompt
        never trained in an epoch before `epoch - 1` (the buffer dropped its group) is not served again for it.
        """
        floor = max(0, int(epoch) - 1)
        counts = {p.uid: max(floor, int(trained.get(p.uid, 0))) for p in self.prompts}
        self.epoch = min(counts.values())
        self.index = 0
        self._order = self._permutation(self.epoch)
        self._skip = counts if max(counts.values()) > self.epoch else None


SAMPLERS = ("epochs", "prioritized")


class PrioritizedSource:
    """Yields prompts drawn by how far from solved each one last was: prioritized sampling (Kimi k1.5, arXiv
    2501.12599, section 2.3.3), the `data.sampler: prioritized` of a run.

    A prompt's success is the mean reward of its latest group (`observe`, as the rollout pushes it), read as a
    success rate in [0, 1] (clamped); a prompt not yet observed counts as unsolved. Each call of `next(n)` draws
    n distinct prompts, without replacement within the call, with probability proportional to max(floor, 1 -
    success): a solved prompt still comes back, floor times as often as an unsolved one. Draw k uses the
    generator seeded [seed, k], so the position is the draw count and the table of successes: `state_dict()` /
    `load_state_dict()` save and restore both, and a resumed lockstep run draws what the uninterrupted one drew.
    There are no epochs to owe prompts to (a prompt is drawn again while it is not solved): `resume_trained` has
    nothing to do, and `epoch` counts prompts served in units of the dataset's size."""

    sampler = "prioritized"

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0, floor: float = PRIORITY_FLOOR):
        if not prompts:
            raise ValueError("a prompt source needs at least one prompt")
        if not 0 < floor <= 1:
            raise ValueError(f"data.priority_floor={floor:g} must be in (0, 1]: the weight of a solved prompt")
        self.prompts = list(prompts)
        self.seed, self.floor = seed, float(floor)
        self.draws = self.served = 0
        self.success: dict[int, float] = {}
        self._slot = {p.uid: i for i, p in enumerate(self.prompts)}
        self._weights = np.ones(len(self.prompts))
        self.clamped = 0  # observed means outside [0, 1]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def epoch(self) -> int:
        return self.served // len(self.prompts)

    exhausted = False

    def observe(self, scores: dict[int, float]) -> None:
        """Record prompt uid -> its latest group's mean reward (uids of other datasets are ignored)."""
        for uid, score in scores.items():
            slot = self._slot.get(int(uid))
            if slot is None:
                continue
            s = float(score)
            if not 0.0 <= s <= 1.0:
                if not self.clamped:
                    log.warning(
                        "data.sampler=prioritized reads a group's mean reward as a success rate in [0, 1], but prompt "
                        "%s's group had %.4g: clamped (rewards on another scale draw by the clamped value; use "
                        "data.sampler=epochs, or rewards in [0, 1])",
                        uid,
                        s,
                    )
                self.clamped += 1
                s = min(1.0, max(0.0, s))
            self.success[int(uid)] = s
            self._weights[slot] = max(self.floor, 1.0 - s)

    def next(self, n: int) -> list[Prompt]:
        """n prompts: distinct within each dataset-sized chunk, drawn by priority."""
        out: list[Prompt] = []
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        while len(out) < n:
            k = min(n - len(out), len(self.prompts))
            picked = rng.choice(len(self.prompts), size=k, replace=False, p=self._weights / self._weights.sum())
            out.extend(self.prompts[i] for i in picked)
        self.served += len(out)
        return out

    def __iter__(self) -> Iterable[Prompt]:
        while True:
            yield from self.next(1)

    def solved_frac(self) -> float:
        """The fraction of the dataset whose latest group was solved (mean reward 1)."""
        return sum(1 for s in self.success.values() if s >= 1.0) / len(self.prompts)

    def state_dict(self) -> dict:
        return {
            "sampler": self.sampler,
            "seed": self.seed,
            "size": len(self.prompts),
            "epoch": self.epoch,
            "draws": self.draws,
            "served": self.served,
            "success": {str(uid): s for uid, s in self.success.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        _check_size(state, len(self.prompts))
        self.seed = int(state["seed"])
        self.draws, self.served = int(state["draws"]), int(state["served"])
        self.success, self._weights = {}, np.ones(len(self.prompts))
        self.observe({int(uid): s for uid, s in state["success"].items()})

    def resume_trained(self, trained: dict[int, int], epoch: int) -> None:
        """Nothing is owed: a prompt in flight at the checkpoint is drawn again while it is not solved."""

    def trained_estimate(self, queued: Sequence[int] = ()) -> dict[int, int]:
        return {}


def prompt_source(prompts: Sequence[Prompt], seed: int = 0, sampler: str = "epochs", floor: float = PRIORITY_FLOOR):
    """The prompt source `data.sampler` names: 'epochs' (`PromptSource`: seeded shuffled epochs, each prompt
    once per epoch; exactly-once across a resume) or 'prioritized' (`PrioritizedSource`)."""
    if sampler == "epochs":
        return PromptSource(prompts, seed=seed)
    if sampler == "prioritized":
        return PrioritizedSource(prompts, seed=seed, floor=floor)
    raise ValueError(f"data.sampler={sampler!r} is not a sampler: choose one of {', '.join(SAMPLERS)}")


def prompt_row(prompt: Prompt) -> dict:
    """The dataset row an environment's reset sees, as data: the row's other columns (`Prompt.meta`), `prompt`
    (the row's prompt as written: its text, or its messages when it was a conversation), `messages` (a
    conversation's messages, data.system_prompt included), `answer` and `index` (the row's index in its split);
    never the chat-template rendering."""
    row = dict(prompt.meta)
    if prompt.messages:
        row.setdefault("prompt", prompt.messages)
        row.setdefault("messages", prompt.messages)
    else:  # `text`: a Prompt made without prompt_text (by hand)
        row.setdefault("prompt", prompt.prompt_text or prompt.text)
    row.setdefault("answer", prompt.answer_text)
    row.setdefault("index", prompt.uid)
    return row
