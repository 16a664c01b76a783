"""A learned reward model: a local sequence-classification model giving one score per [prompt + response].

`RewardModelScorer` is the core, plain torch: it loads an `AutoModelForSequenceClassification` directory
(`reward.model.path`, num_labels=1), decides once whether it shares the policy's tokenizer (same vocabulary),
and scores rollout rows in batches of `reward.model.batch_size`:

- shared tokenizer (the tensor-native path): the policy's prompt and response token ids are scored as they
  are, no decode. The left-padded prompt and the right-padded response are packed into one row of real
  tokens each (a stable sort of the masks, batched), right-padded, so positions start at 0 as in the
  model's own forward; the score is read at the last real token (what the model's head does with its
  pad_token_id, without relying on the pad id differing from EOS);
- another tokenizer: prompt and response are decoded with the policy's tokenizer (the response up to the
  stop set) and re-tokenized with the RM's own chat template (a user turn, an assistant turn), or as plain
  prompt text + response text when the RM has no template.

Sequences longer than `reward.model.max_length` (or the RM's context, if shorter) keep their last tokens
(the response's end is what the head reads). `reward.model.normalize: running` standardises scores by the
running mean and std of every score so far. `LocalRewardModel` is the in-process external reward the rollout
worker calls (the single-process loop); the Ray runtime runs the same scorer in its own actor
(`rlhf_core.distributed.reward_model_actor.RewardModelActor`).
`build_tiny_reward_model` builds a small random RM from a policy directory (tests, benchmark, README demo).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.config import ConfigError, RewardModelConfig
from rlhf_core.model.directory import check_reward_model_config, model_context_length
from rlhf_core.model.policy import ModelLoadError, check_model_dir, load_tokenizer, resolve_device, resolve_dtype

REWARD_MODEL_NAME = "reward_model"  # the component name: logged as reward/reward_model
FIELD = "reward.model.path"


def check_reward_model_dir(path: str | Path) -> Path:
    """The RM directory is a sequence-classification model with one label (`model.directory.check_reward_model_config`)
    whose weights and tokenizer files are there and readable; ConfigError naming reward.model.path otherwise."""
    check_reward_model_config(path)
    try:
        return check_model_dir(path)
    except ModelLoadError as exc:
        raise ConfigError(f"{FIELD}={str(path)!r}: {exc}") from None


def vocab_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (token -> id, added tokens included)."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


class RunningMoments:
    """Running mean and variance of every value seen (Chan et al.'s batch update, float64)."""

    def __init__(self, eps: float = 1e-6):
        self.count, self.mean, self.m2, self.eps = 0, 0.0, 0.0, eps

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        mean, m2 = float(x.mean()), float(((x - x.mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count else 1.0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.std + self.eps)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}


def pack_token_rows(
    ids: torch.Tensor, mask: torch.Tensor, max_length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tokens (mask True) of each row moved to the front in order, right-padded with `pad_id`; rows longer
    than `max_length` keep their last `max_length` tokens. Returns (ids [N, W], lengths [N]); batched."""
    lengths = mask.sum(-1)
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices  # real tokens first, in order
    packed = ids.gather(1, order)
    width = int(min(int(lengths.max()) if len(lengths) else 0, max_length))
    start = (lengths - max_length).clamp(min=0)
    cols = start[:, None] + torch.arange(width, device=ids.device)[None, :]
    out = packed.gather(1, cols.clamp(max=max(ids.shape[1] - 1, 0)))
    lengths = lengths.clamp(max=max_length)
    out = out.masked_fill(torch.arange(width, device=ids.device)[None, :] >= lengths[:, None], pad_id)
    return out, lengths


def prompt_messages(prompt, policy_tokenizer) -> list[dict]:
    """The conversation of a prompt, for an RM with its own chat template: `Prompt.messages` when the data
    has them, else the prompt's text (as the policy saw it) as one user turn."""
    messages = getattr(prompt, "messages", None)
    if messages:
        return [dict(m) for m in messages]
    text = prompt.text or policy_tokenizer.decode(prompt.prompt_ids, skip_special_tokens=True)
    return [{"role": "user", "content": text}]


class RewardModelScorer:
    """Scores [prompt + response] rows with a sequence-classification reward model (see the module doc).

    `shares_tokenizer` is decided once, here: the RM's vocabulary equals the policy tokenizer's.
    `trust_remote_code`: the run's model.trust_remote_code (code shipped in the RM directory may run)."""

    def __init__(
        self, cfg: RewardModelConfig, policy_tokenizer, stop_ids: Sequence[int], device=None, trust_remote_code=False
    ):
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        p = check_reward_model_dir(cfg.path)
        self.cfg = cfg
        self.device = resolve_device(device or cfg.device)
        dtype = resolve_dtype(cfg.dtype)
        self.tokenizer = load_tokenizer(p, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "right"
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                str(p), dtype=dtype or "auto", trust_remote_code=trust_remote_code, local_files_only=True
            )
        except Exception as exc:
            raise ConfigError(f"{FIELD}={cfg.path!r}: could not load the reward model: {exc}") from exc
        self.model.to(self.device).eval()
        self.policy_tokenizer = policy_tokenizer
        self.stop_ids = torch.tensor(sorted(set(int(i) for i in stop_ids)), dtype=torch.long)
        self.shares_tokenizer = vocab_fingerprint(policy_tokenizer) == vocab_fingerprint(self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id)
        context = model_context_length(p)  # rows never exceed what the RM's positions cover
        self.max_length = min(cfg.max_length, context[0]) if context else cfg.max_length
        # decoder RMs (Llama, Qwen2, Mistral, Gemma, GPT-2...) have a `score` head over the backbone's hidden
        # states: read it at each row's last real token ourselves; other heads pool as the model does
        self.backbone = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        self.head = getattr(self.model, "score", None) if self.backbone is not None else None
        self.moments = RunningMoments() if cfg.normalize == "running" else None
        self.lock = threading.Lock()  # the running moments: one update at a time
        self.rows = 0
        self.forward_s = 0.0

    @torch.no_grad()
    def score_token_rows(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Raw scores [N] (float32, CPU) of right-padded RM token rows `ids` [N, W] with `lengths` [N] real tokens."""
        out = []
        start = time.perf_counter()
        for s in range(0, len(ids), self.cfg.batch_size):
            n = lengths[s : s + self.cfg.batch_size].to(self.device)
            width = max(int(n.max()), 1)
            x = ids[s : s + self.cfg.batch_size, :width].to(self.device)
            attention = torch.arange(width, device=self.device)[None, :] < n[:, None]
            if self.head is not None:
                hidden = self.backbone(input_ids=x, attention_mask=attention.long()).last_hidden_state
                last = hidden[torch.arange(len(x), device=self.device), (n - 1).clamp(min=0)]
                out.append(self.head(last)[:, 0].float())
            else:
                out.append(self.model(input_ids=x, attention_mask=attention.long()).logits[:, 0].float())
        self.forward_s += time.perf_counter() - start
        self.rows += len(ids)
        return torch.cat(out).cpu() if out else torch.zeros(0)

    def shared_rows(self, prompt_ids, prompt_mask, response_ids, response_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """RM rows from the policy's token ids as they are: prompt then response (its stop token included)."""
        ids = torch.cat([prompt_ids, response_ids], dim=1)
        mask = torch.cat([prompt_mask, response_mask], dim=1).bool()
        return pack_token_rows(ids, mask, self.max_length, self.pad_id)

    def response_texts(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """Responses decoded with the policy's tokenizer, up to (without) the stop token, special tokens skipped."""
        keep = response_mask.bool() & ~torch.isin(response_ids, self.stop_ids.to(response_ids.device))
        rows = [r[k].tolist() for r, k in zip(response_ids.cpu(), keep.cpu())]
        return self.policy_tokenizer.batch_decode(rows, skip_special_tokens=True)

    def texts(self, messages: Sequence[list[dict]], responses: Sequence[str]) -> list[str]:
        """[prompt + response] as the RM reads them: its chat template, else prompt text + response text."""
        if getattr(self.tokenizer, "chat_template", None):
            return [
                self.tokenizer.apply_chat_template([*m, {"role": "assistant", "content": r}], tokenize=False)
                for m, r in zip(messages, responses)
            ]
        return ["\n\n".join(t["content"] for t in m) + r for m, r in zip(messages, responses)]

    def text_rows(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """RM rows of texts tokenized by the RM's own tokenizer (its template already holds the specials)."""
        add_special = not getattr(self.tokenizer, "chat_template", None)
        encoded = self.tokenizer(list(texts), add_special_tokens=add_special)["input_ids"]
        rows = [r[-self.max_length :] for r in encoded]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        ids = torch.full((len(rows), max(int(lengths.max()), 1) if rows else 1), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return ids, lengths

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        messages: Optional[Sequence[list[dict]]] = None,
    ) -> torch.Tensor:
        """Scores [N] (float32, CPU) of rollout rows; normalised when reward.model.normalize is 'running'.
        `messages` (one conversation per row) is needed only when the RM has its own tokenizer."""
        if self.shares_tokenizer:
            raw = self.score_token_rows(*self.shared_rows(prompt_ids, prompt_mask, response_ids, response_mask))
        else:
            if messages is None:
                raise ValueError("the reward model has its own tokenizer: score() needs each row's prompt messages")
            texts = self.texts(messages, self.response_texts(response_ids, response_mask))
            raw = self.score_token_rows(*self.text_rows(texts))
        if self.moments is None:
            return raw
        with self.lock:
            self.moments.update(raw)
            return self.moments.normalize(raw).float()

    def stats(self) -> dict:
        return {
            "rows": self.rows,
            "forward_s": self.forward_s,
            "shares_tokenizer": self.shares_tokenizer,
            **({"running": self.moments.state_dict()} if self.moments is not None else {}),
        }


def reward_model_inputs(prompts: Sequence, batch, policy_tokenizer, with_messages: bool) -> dict:
    """What the scorer needs from a rollout batch (CPU tensors) and its row-aligned prompts."""
    out = {
        "prompt_ids": batch.prompt_ids.cpu(),
        "prompt_mask": batch.prompt_mask.cpu(),
        "response_ids": batch.response_ids.cpu(),
        "response_mask": batch.response_mask.cpu(),
        "messages": None,
    }
    if with_messages:
        out["messages"] = [prompt_messages(p, policy_tokenizer) for p in prompts]
    return out


class LocalRewardModel:
    """The reward model as an external reward of the rollout worker, scored in this process."""

    def __init__(self, scorer: RewardModelScorer):
        self.scorer = scorer
        self.weights = {REWARD_MODEL_NAME: scorer.cfg.weight}

    def score(self, prompts: Sequence, batch) -> dict[str, torch.Tensor]:
        inputs = reward_model_inputs(prompts, batch, self.scorer.policy_tokenizer, not self.scorer.shares_tokenizer)
        return {REWARD_MODEL_NAME: self.scorer.score(**inputs)}


def build_tiny_reward_model(source_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A reward model with the architecture, size and tokenizer of the model in `source_dir` (a causal LM
    such as the tiny policy or the chat model), a one-label score head and random weights; saved to `out_dir`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source_dir), local_files_only=True)
    config = AutoConfig.from_pretrained(str(source_dir), local_files_only=True)
    config.num_labels = 1
    config.architectures = None
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
        if getattr(model, "score", None) is not None:  # a visible spread of scores from a random model
            torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
