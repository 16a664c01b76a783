"""VLLMEngine: generation with vLLM's offline `LLM`, behind the same interface as HFEngine.

Written against vLLM's documented offline API (checked against the v0.10-v0.11 docs; not run in this
repository's CI, which has no GPU — see tests/test_vllm.py, which runs it where vLLM imports):

- `LLM(model=path, tokenizer=path, dtype, seed, gpu_memory_utilization, max_model_len,
  logprobs_mode="processed_logprobs")`;
- `LLM.generate([{"prompt_token_ids": ids}, ...], SamplingParams(n=G, temperature, top_p, top_k, min_p,
  max_tokens, logprobs=0, stop_token_ids), use_tqdm=False)`: one RequestOutput per prompt, in order, each holding G
  CompletionOutputs with `token_ids` and `logprobs` (a dict per position that always contains the
  sampled token);
- `LLM.apply_model(fn)` runs `fn(model)` on the model inside every worker (vLLM >= 0.9); the model's own
  `load_weights(iterable of (hf_name, tensor))` maps Hugging Face parameter names onto vLLM's fused
  layers. Older versions reach the model through
  `llm.llm_engine.model_executor.driver_worker.model_runner.model` (the path OpenRLHF used).

LoRA (`model.lora`). The engine is built with `enable_lora=True, max_loras=1, max_lora_rank` (the smallest
rank vLLM accepts that is >= r); a weight sync carries the adapter tensors only (peft's saved names,
`rlhf_core.model.lora`), which `load_weights` writes as a PEFT adapter directory (adapter_model.safetensors +
adapter_config.json) and every later `generate` passes as `lora_request=LoRARequest(name, int_id, path)`,
with a new int id per version so that vLLM loads it afresh (the previous one is removed where the engine
offers `remove_lora`). Before the first sync no adapter is used: fresh adapters are zero (B = 0).
vLLM does not adapt every module peft can (lm_head, for one, depends on the version): keep
model.lora.target_modules to the attention and MLP projections with this engine.

Behaviour logprobs. The trainer's ratios compare against the distribution the rollout sampled from
(temperature, then min-p, top-k, top-p applied and renormalised: `rollout.base.processed_logits`, which
follows vLLM's sampler in filters and order; the trainer computes its log-probs the same way, see
`trainer.sequence_logprobs`). vLLM's V1 engine returns, by default, logprobs of the RAW model
distribution ("raw_logprobs": before temperature and filtering); the engine argument
`logprobs_mode="processed_logprobs"` makes it return the log-softmax of the logits after temperature,
min-p and top-k/top-p, i.e. the log-probability of the sampled token within the truncated, renormalised
distribution, which is what this engine asks for (and why it turns vLLM's FlashInfer sampler off, which
returns no processed logprobs: VLLM_USE_FLASHINFER_SAMPLER=0 unless the user set it). Where the
installed vLLM does not know that argument, the returned logprobs are raw, which equal the processed
ones only for temperature 1 without min-p/top-k/top-p; `generate` then refuses any other sampling
setting with an error saying so rather than return wrong logprobs. (vLLM's old V0 engine,
< 0.8, returned processed logprobs by default and is treated as such.)

Differences from HFEngine worth knowing: vLLM also stops on every EOS id of the model's generation
config (the response mask is built from each completion's real length, so it stays exact); its
random stream differs, so the same seed gives different samples than HFEngine; prompts are sent
without their left padding.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.model.lora import ADAPTER_WEIGHTS
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.types import RolloutBatch

# buffers that vLLM recomputes itself and whose names its load_weights does not know
_SKIPPED_WEIGHTS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def pack_completions(
    completions: Sequence[Sequence[tuple[Sequence[int], Sequence[float]]]],
    prompts: PromptBatch,
    pad_token_id: int,
    version: int,
    device: torch.device | str = "cpu",
) -> RolloutBatch:
    """Build a RolloutBatch from per-prompt lists of G (token_ids, sampled-token logprobs) completions.

    completions[i][g] is the g-th completion of prompt i; every prompt has the same number G. The response
    mask is True on each completion's own tokens (its EOS included when it stopped on one).
    """
    n_prompts = len(completions)
    if n_prompts != len(prompts):
        raise ValueError(f"got completions for {n_prompts} prompts, expected {len(prompts)}")
    G = len(completions[0]) if n_prompts else 0
    if any(len(c) != G for c in completions):
        raise ValueError("every prompt needs the same number of completions")
    rows = [c for per_prompt in completions for c in per_prompt]
    N = len(rows)
    L = max(1, max((len(ids) for ids, _ in rows), default=1))
    tokens = torch.full((N, L), pad_token_id, dtype=torch.long)
    logps = torch.zeros((N, L), dtype=torch.float32)
    lengths = torch.zeros(N, dtype=torch.long)
    for r, (ids, lps) in enumerate(rows):
        if len(ids) != len(lps):
            raise ValueError(f"completion {r}: {len(ids)} tokens but {len(lps)} logprobs")
        if ids:
            tokens[r, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            logps[r, : len(ids)] = torch.tensor(list(lps), dtype=torch.float32)
        lengths[r] = len(ids)
    mask = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    batch = RolloutBatch(
        prompt_ids=prompts.prompt_ids.repeat_interleave(G, 0),
        prompt_mask=prompts.prompt_mask.repeat_interleave(G, 0),
        response_ids=tokens,
        response_mask=mask,
        behavior_logprobs=logps,
        response_lengths=lengths,
        group_ids=torch.arange(n_prompts).repeat_interleave(G),
        policy_version=torch.full((N,), int(version), dtype=torch.long),
        prompt_uids=prompts.uids.repeat_interleave(G),
    )
    return batch.to(device)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


def vllm_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank r."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"model.lora.r={r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def adapter_config_json(lora_cfg, base_model_path: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter for `lora_cfg` (rlhf_core.config.LoraConfig)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_path),
        "r": int(lora_cfg.r),
        "lora_alpha": float(lora_cfg.alpha),
        "lora_dropout": float(lora_cfg.dropout),
        "target_modules": list(lora_cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def _vllm_version() -> tuple[int, ...]:
    import vllm

    parts = []
    for piece in str(getattr(vllm, "__version__", "0")).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class VLLMEngine:
    """Generate with vLLM on a CUDA device; weights are swapped in place by `load_weights`."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        cfg,
        tokenizer,
        seed: int = 0,
        version: int = 0,
        stop_token_ids: Optional[Sequence[int]] = None,
    ):
        # The engine core runs in this process, so that apply_model reaches the model without pickling
        # the weights through a pipe. Set only when the user has not chosen otherwise.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # the FlashInfer top-k/top-p kernel samples without materialising the processed logprobs
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM

        if model_path is None:
            raise ValueError("VLLMEngine needs the policy's model directory (model_path)")
        self.model_path = str(model_path)
        self.stop_token_ids = [int(i) for i in (stop_token_ids or [tokenizer.eos_token_id])]
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.version = int(version)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        max_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
        try:  # vLLM refuses a max_model_len beyond the model's positions
            positions = json.loads((Path(self.model_path) / "config.json").read_text()).get("max_position_embeddings")
            if positions:
                max_len = min(max_len, int(positions))
        except (OSError, ValueError):
            pass
        kwargs = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            seed=seed,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            gpu_memory_utilization=cfg.rollout.engine_option("gpu_memory_utilization"),
            max_model_len=max_len,
        )
        self.lora_cfg = cfg.model.lora
        self.lora_request = None
        self._adapter_root: Optional[tempfile.TemporaryDirectory] = None
        if self.lora_cfg is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(self.lora_cfg.r))
            self._adapter_root = tempfile.TemporaryDirectory(prefix="atrlhf-vllm-lora-")
        try:
            self.llm = LLM(**kwargs, logprobs_mode="processed_logprobs")
            self.processed_logprobs = True
        except TypeError as exc:  # a vLLM without the logprobs_mode engine argument
            if "logprobs_mode" not in str(exc):
                raise
            self.llm = LLM(**kwargs)
            self.processed_logprobs = _vllm_version() < (0, 8)  # V0 returned processed logprobs

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load Hugging Face-named weights into the running engine and adopt their version; with LoRA, the
        adapter tensors become the adapter every later generation uses (a LoRARequest)."""
        if state_dict is not None and self.lora_cfg is not None:
            self._load_adapter(state_dict, int(version))
        elif state_dict is not None:
            weights = [(k, v) for k, v in state_dict.items() if not k.endswith(_SKIPPED_WEIGHTS)]

            def load(model):
                model.load_weights(weights=weights)
                return None

            if hasattr(self.llm, "apply_model"):
                self.llm.apply_model(load)
            else:  # vLLM < 0.9
                load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
            # cached prompt KV was computed with the old weights
            if hasattr(self.llm, "reset_prefix_cache"):
                self.llm.reset_prefix_cache()
        self.version = int(version)

    def _load_adapter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write the adapter as a PEFT directory and make it the one generation uses (vLLM's LoRA API)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = Path(self._adapter_root.name) / f"v{version:08d}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path / ADAPTER_WEIGHTS))
        (path / "adapter_config.json").write_text(json.dumps(adapter_config_json(self.lora_cfg, self.model_path)))
        previous = self.lora_request
        # a new int id per version: vLLM caches adapters by id, the same id would keep the old tensors
        self.lora_request = LoRARequest(f"policy-v{version}", version + 1, str(path))
        if previous is not None:
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None)
            if remove is not None:
                try:
                    remove(previous.lora_int_id)
                except Exception:  # not loaded yet, or a version without removal: the LRU evicts it
                    pass
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, G: int, sampling: SamplingParams):
        from vllm import SamplingParams as VSamplingParams

        plain = sampling.greedy or (sampling.temperature == 1.0 and not sampling.truncates)
        if not self.processed_logprobs and not plain:
            raise RuntimeError(
                "this vLLM returns logprobs of the raw model distribution (it has no logprobs_mode engine "
                "argument), which are not the behaviour logprobs of temperature/min-p/top-k/top-p sampling; use "
                "temperature 1 without min-p/top-k/top-p, upgrade vLLM, or use rollout.engine=hf"
            )
        kwargs = dict(
            n=G,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            min_p=sampling.min_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            stop_token_ids=list(self.stop_token_ids),
        )
        try:
            return VSamplingParams(**kwargs, detokenize=False)  # token ids are all we need
        except TypeError:
            return VSamplingParams(**kwargs)

    def generate(
        self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams, between_steps=None
    ) -> RolloutBatch:
        """between_steps (partial rollouts): see `_generate_in_flight`."""
        if between_steps is not None:
            return self._generate_in_flight(prompts, samples_per_prompt, sampling, between_steps)
        G = samples_per_prompt
        requests = [
            {"prompt_token_ids": row[mask].tolist()}
            for row, mask in zip(prompts.prompt_ids.cpu(), prompts.prompt_mask.cpu())
        ]
        extra = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(requests, self._sampling_params(G, sampling), use_tqdm=False, **extra)
        completions = []
        for out in outputs:
            per_prompt = []
            for comp in sorted(out.outputs, key=lambda c: c.index):
                ids = list(comp.token_ids)
                if comp.logprobs is None:
                    raise RuntimeError("vLLM returned no logprobs (SamplingParams.logprobs=0 was ignored)")
                lps = [float(comp.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
                per_prompt.append((ids, lps))
            completions.append(per_prompt)
        return pack_completions(completions, prompts, self.pad_token_id, self.version, self.device)

    def _generate_in_flight(
        self, prompts: PromptBatch, G: int, sampling: SamplingParams, between_steps
    ) -> RolloutBatch:
        """Partial rollouts on vLLM: the engine is stepped here (`LLMEngine.add_request` / `step`, vLLM's own
        loop), and between two steps between_steps() may hand over (weights, version), loaded in place
        through `load_weights` while requests are in flight. vLLM keeps the running requests' KV cache (as
        PipelineRL does: it has no API to recompute one request's cache), so unlike the HF engine a token
        after an update attends to keys and values of the previous weights; its recorded log-prob is still
        that of the distribution it was sampled from. Each token is stamped with the version in effect at
        the step that produced it. Untested here (no CUDA): scripts/gpu_checks.sh runs
        tests/test_vllm.py::test_in_flight_weight_update."""
        import uuid

        engine = self.llm.llm_engine
        params = self._sampling_params(1, sampling)  # one request per row: per-row token counts are plain
        extra = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        tag = uuid.uuid4().hex
        ids = []
        for i, (row, mask) in enumerate(zip(prompts.prompt_ids.cpu(), prompts.prompt_mask.cpu())):
            for g in range(G):
                rid = f"atrlhf-{tag}-{i}-{g}"
                engine.add_request(rid, {"prompt_token_ids": row[mask].tolist()}, params, **extra)
                ids.append(rid)
        seen: dict[str, list[int]] = {rid: [] for rid in ids}  # the version of each token seen so far
        done: dict[str, object] = {}
        while engine.has_unfinished_requests():
            update = between_steps()
            if update is not None:
                self.load_weights(update[0], update[1])
            for out in engine.step():
                if out.request_id not in seen:
                    continue
                comp = out.outputs[0]
                new = len(comp.token_ids) - len(seen[out.request_id])
                seen[out.request_id].extend([self.version] * max(0, new))
                if out.finished:
                    done[out.request_id] = comp
        completions, versions = [], []
        for i in range(len(prompts)):
            per_prompt = []
            for g in range(G):
                rid = f"atrlhf-{tag}-{i}-{g}"
                comp = done[rid]
                toks = list(comp.token_ids)
                lps = [float(comp.logprobs[t][tok].logprob) for t, tok in enumerate(toks)]
                per_prompt.append((toks, lps))
                versions.append(seen[rid][: len(toks)])
            completions.append(per_prompt)
        batch = pack_completions(completions, prompts, self.pad_token_id, self.version, "cpu")
        L = batch.response_ids.shape[1]
        tv = torch.full((len(versions), L), self.version, dtype=torch.long)
        for r, v in enumerate(versions):
            if v:
                tv[r, : len(v)] = torch.tensor(v, dtype=torch.long)
                tv[r, len(v) :] = min(v)
        batch.token_versions = tv
        batch.policy_version = tv.amin(-1)
        return batch.to(self.device)
