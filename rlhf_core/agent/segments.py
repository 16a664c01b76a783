"""What the endpoint recorded of an episode, as training data: token-in/token-out segments.

Per request the endpoint records the exact prompt ids it built and, per choice, the ids it generated with
their log-probs and the version of the weights that generated each (`Call`). The episode's requests are
joined into segments by their token ids alone (`EpisodeLog.record`):

- a request whose prompt ids start with a segment's ids so far (its first prompt, every completion and the
  tokens between them) extends that segment: the ids in between are observation tokens (the tool results,
  the next user turn, the template's markup), attended to and masked out of the loss; the completion is
  appended as the model's tokens;
- a request that extends no segment (the agent rewrote, trimmed or re-rendered history) starts a new
  segment and counts one prefix break;
- a request with n > 1 choices extends (or starts) a segment with its first choice and forks a copy of that
  segment for each other choice (a branch, not a prefix break).

Every segment of an episode trains with the episode's reward. A group of G episodes becomes K x G rows,
where K is the most segments an episode of the group has: row block k holds each episode's k-th segment, or,
for an episode with fewer, a filler row with no trained token and the episode's reward. The trainer computes
group advantages over every G contiguous rows, so each block sees the G episodes' rewards exactly once and
each segment gets its episode's advantage, as a one-segment episode does (`episode_batch`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlhf_core.data.prompts import Prompt
from rlhf_core.rollout.multiturn_batch import Trajectory, trajectory_batch
from rlhf_core.types import Experience, RolloutBatch


@dataclass
class Completion:
    """One generated choice: the ids as generated (a stop id included), their behaviour log-probs, the
    version of the weights that generated each, and whether it ended on a stop id or stop string."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stopped: bool = False
    cut: Optional[str] = None  # the text before a stop string, when one ended it


@dataclass
class Call:
    """One request: the prompt ids the endpoint built and each choice's completion. For a chat request, the
    messages sent and each choice's reply (normalised, `rlhf_core.agent.api.signature`), so that the next
    request that continues the conversation reuses these ids instead of re-tokenizing; for a text completion,
    the prompt text and each choice's returned text. `started_ns` (wall clock, ns) and `latency_s` (from the
    request's arrival to its answer) are the endpoint's timing; `new_segment` and `prefix_break` are set when
    the episode records it (it started a segment; it started one although the episode had one: a prefix
    break)."""

    prompt_ids: list[int]
    completions: list[Completion]
    messages: Optional[list[dict]] = None
    replies: list = field(default_factory=list)
    tools: str = ""
    text: Optional[str] = None
    texts: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # per choice: the text of the ids generated (a stop string kept)
    started_ns: Optional[int] = None
    latency_s: Optional[float] = None
    new_segment: bool = False
    prefix_break: bool = False


@dataclass
class Segment:
    """A multi-turn trajectory of one episode: its first request's prompt ids, then every id after it, with
    which are the model's (trained) and their log-probs and versions (observation ids: 0 and the version of
    the model token before them)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    requests: int = 0

    @property
    def full(self) -> list[int]:
        return self.prompt_ids + self.ids

    def copy(self) -> Segment:
        return Segment(
            list(self.prompt_ids), list(self.ids), list(self.model), list(self.logprobs), list(self.versions),
            self.requests,
        )  # fmt: skip

    def extend(self, observation: list[int], c: Completion) -> None:
        before = self.versions[-1] if self.versions else (c.versions[0] if c.versions else 0)
        self.ids += observation + c.ids
        self.model += [False] * len(observation) + [True] * len(c.ids)
        self.logprobs += [0.0] * len(observation) + list(c.logprobs)
        self.versions += [before] * len(observation) + list(c.versions)
        self.requests += 1


class EpisodeLog:
    """One agent episode as the endpoint sees it: its requests, their segments, a reward posted to it, and
    (set by the runner) its outcome. The endpoint's thread records; the runner reads once it is closed."""

    def __init__(self, eid: str, row: dict, prompt: Optional[Prompt] = None):
        self.eid, self.row, self.prompt = eid, row, prompt
        self.calls: list[Call] = []
        self.segments: list[Segment] = []
        self.prefix_breaks = 0
        self.inflight = 0  # requests accepted, not yet answered (the endpoint's batching reads it)
        self.closed = False
        self.posted: Optional[dict] = None  # {"reward": float, "metrics": {...}} posted to .../reward
        self.reward: Optional[float] = None
        self.metrics: dict[str, float] = {}
        self.error: Optional[str] = None
        self.timed_out = False
        self.latency_s = 0.0
        self.raised: Optional[str] = None  # the agent's error when agent.error_reward scored it instead of failing it
        self.lock = threading.Lock()

    @property
    def requests(self) -> int:
        return len(self.calls)

    # ------------------------------------------------------------------ continuing a conversation
    def chat_base(self, messages: list[dict], tools: str, signature) -> Optional[tuple[list[int], int, list[dict]]]:
        """When `messages` continue a recorded conversation (a previous request's messages, then one of its
        replies, then new messages) with the same tools: (that request's prompt ids + the reply's ids, the
        reply's last id, the new messages). The newest and longest such conversation wins; None if none."""
        sigs = [signature(m) for m in messages]
        with self.lock:
            calls = list(self.calls)
        for call in reversed(calls):
            if call.messages is None or call.tools != tools or len(call.messages) >= len(messages):
                continue
            n = len(call.messages)
            if [signature(m) for m in call.messages] != sigs[:n]:
                continue
            for reply, c in zip(call.replies, call.completions):
                if signature(reply) == sigs[n] and c.ids:
                    return call.prompt_ids + c.ids, c.ids[-1], messages[n + 1 :]
        return None

    def text_base(self, text: str, stop_ids: Sequence[int]) -> Optional[tuple[list[int], str]]:
        """When a text prompt continues a recorded one (its prompt text and the text of the ids generated, then
        more): (those ids, the rest of the text). A completion cut at a stop string was generated with the stop
        string (returned without it): the prompt continues it only where it has the stop string back (a ReAct
        agent appending 'Observation: ...' after stop=['Observation:']), and then the stop string is not
        tokenized a second time. A completion that ended on a stop id is not continued (its text lacks the
        stop token the model saw)."""
        with self.lock:
            calls = list(self.calls)
        for call in reversed(calls):
            if call.text is None:
                continue
            seen = call.seen or call.texts
            for returned, c in zip(seen, call.completions):
                head = call.text + returned
                if c.ids and c.ids[-1] not in stop_ids and text.startswith(head) and len(text) > len(head):
                    return call.prompt_ids + c.ids, text[len(head) :]
        return None

    # ------------------------------------------------------------------ recording
    def close(self) -> None:
        """The episode ended: from now on nothing is recorded (a request still in flight is answered, not kept),
        so that what the runner reads stays as it was when the episode returned."""
        with self.lock:
            self.closed = True

    def record(self, call: Call) -> bool:
        """Add a request and join it into the segments (the module's rules). False when the episode was closed
        first (the request is not part of it)."""
        with self.lock:
            if self.closed:
                return False
            self.calls.append(call)
            prompt = call.prompt_ids
            base = None
            for seg in reversed(self.segments):  # the newest segment this prompt extends
                full = seg.full
                if len(full) <= len(prompt) and prompt[: len(full)] == full:
                    base = seg
                    break
            call.new_segment = base is None
            call.prefix_break = base is None and bool(self.segments)
            if call.prefix_break:
                self.prefix_breaks += 1
            start = base.copy() if base is not None else Segment(list(prompt))
            observation = prompt[len(start.full) :]
            for j, c in enumerate(call.completions):
                if j == 0 and base is not None:
                    seg = base
                else:
                    seg = start.copy()
                    self.segments.append(seg)
                seg.extend(observation, c)
        return True

    def post(self, reward: Any, metrics: Any = None) -> None:
        """A reward posted to the episode's `.../reward` endpoint (the agent may return None instead)."""
        self.posted = {"reward": as_reward(reward), "metrics": as_metrics(metrics)}


def as_reward(value: Any) -> float:
    """A finite reward (bool, int or float), or ValueError saying what it was."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        value = float(value)
        if math.isfinite(value):
            return value
    raise ValueError(f"the reward must be a finite number, got {value!r}")


def as_metrics(value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"metrics must be a mapping of names to numbers, got {type(value).__name__}")
    return {str(k): float(v) for k, v in value.items()}


# ---------------------------------------------------------------------------------------------- tensors
def episode_batch(groups: Sequence[Sequence[EpisodeLog]], pad_token_id: int, version: int, device="cpu"):
    """Groups of G episodes (each of one prompt) as one RolloutBatch (`trajectory_batch`, rows block-major as
    the module says) and, per row, (its episode, whether the row is the episode's first). group_ids: one per
    group, contiguous."""
    trajs, owners, group_ids = [], [], []
    for g, episodes in enumerate(groups):
        blocks = max(1, max(len(e.segments) for e in episodes))
        for k in range(blocks):
            for e in episodes:
                if k < len(e.segments):
                    s = e.segments[k]
                    t = Trajectory(e.prompt, e.row, prompt_ids=s.prompt_ids, ids=s.ids, model=s.model)
                    t.logprobs, t.versions = s.logprobs, s.versions
                else:  # a filler: no trained token, the episode's reward (keeps each block a whole group)
                    first = e.segments[0].prompt_ids if e.segments else list(e.prompt.prompt_ids)
                    t = Trajectory(e.prompt, e.row, prompt_ids=first)
                trajs.append(t)
                owners.append((e, k == 0))
                group_ids.append(g)
    batch = trajectory_batch(trajs, pad_token_id, version, device)
    batch.group_ids = torch.tensor(group_ids, dtype=torch.long, device=batch.group_ids.device)
    return batch, owners


def split_by_group(batch: RolloutBatch) -> list[Experience]:
    """One Experience per group of a batch whose groups are contiguous (`group_ids`), of any number of rows."""
    groups = []
    ids = batch.group_ids.tolist()
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or ids[end] != ids[start]:
            sub = batch.select(torch.arange(start, end))
            sub.group_ids = torch.zeros(end - start, dtype=torch.long)
            uid = int(sub.prompt_uids[0]) if sub.prompt_uids is not None else ids[start]
            groups.append(Experience(batch=sub, prompt_id=uid, policy_version=int(sub.policy_version.min())))
            start = end
    return groups
