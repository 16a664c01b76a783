"""VLLMEngine: the fallback where vLLM is missing, the output packing, and (where vLLM and CUDA exist) the
engine itself against the same checks as HFEngine."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import rlhf_core.rollout as rollout
from rlhf_core.config import load_config
from rlhf_core.data import collate_prompts
from rlhf_core.rollout import HFEngine, SamplingParams, build_engine, response_mask_from_eos, vllm_available
from rlhf_core.rollout.vllm import pack_completions
from rlhf_core.trainer import sequence_logprobs


@pytest.mark.skipif(vllm_available(), reason="vllm is importable here: no fallback happens")
def test_build_engine_falls_back_to_hf_with_one_warning(tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(rollout, "_warned_vllm", False)
    cfg = load_config(None, ["rollout.engine=vllm"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = build_engine(cfg, tiny_model, tiny_tokenizer, model_path="/unused", seed=0)
        second = build_engine(cfg, tiny_model, tiny_tokenizer, model_path="/unused", seed=0)
    assert isinstance(first, HFEngine) and isinstance(second, HFEngine)
    relevant = [w for w in caught if "vllm" in str(w.message)]
    assert len(relevant) == 1 and issubclass(relevant[0].category, RuntimeWarning)
    assert "falling back to HFEngine" in str(relevant[0].message)
    assert first.model is tiny_model and first.eos_token_id == tiny_tokenizer.eos_token_id


def test_pack_completions(max3_prompts, tiny_tokenizer):
    pb = collate_prompts(max3_prompts[0][:2], tiny_tokenizer.pad_token_id)
    eos = tiny_tokenizer.eos_token_id
    completions = [
        [([5, eos], [-0.5, -0.1]), ([6, 7, 8], [-1.0, -2.0, -3.0])],
        [([eos], [-0.2]), ([4, 4], [-0.3, -0.4])],
    ]
    batch = pack_completions(completions, pb, pad_token_id=0, version=7)
    assert batch.response_ids.tolist() == [[5, eos, 0], [6, 7, 8], [eos, 0, 0], [4, 4, 0]]
    assert batch.response_lengths.tolist() == [2, 3, 1, 2]
    assert batch.response_mask.tolist() == [[True, True, False], [True] * 3, [True, False, False], [True, True, False]]
    assert batch.behavior_logprobs[1].tolist() == [-1.0, -2.0, -3.0]
    assert batch.behavior_logprobs[2].tolist() == pytest.approx([-0.2, 0.0, 0.0])
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.policy_version.tolist() == [7] * 4
    assert torch.equal(batch.prompt_ids, pb.prompt_ids.repeat_interleave(2, 0))
    assert batch.prompt_uids.tolist() == pb.uids.repeat_interleave(2).tolist()
    with pytest.raises(ValueError, match="same number"):
        pack_completions([completions[0], completions[1][:1]], pb, 0, 0)
    with pytest.raises(ValueError, match="logprobs"):
        pack_completions([[([1, 2], [-1.0])], [([1], [-1.0])]], pb, 0, 0)


# ---------------------------------------------------------------------------------------------------
# The real engine: only where vLLM imports and a GPU is present
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(tiny_policy_dir, tiny_tokenizer):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    from rlhf_core.rollout.vllm import VLLMEngine

    cfg = load_config(
        None, ["rollout.engine=vllm", "model.dtype=float32", "rollout.engine_kwargs.gpu_memory_utilization=0.2"]
    )
    return VLLMEngine(tiny_policy_dir, cfg, tiny_tokenizer, seed=0)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 0.8, 0.0), (0.7, 3, 0.5, 0.0), (1.0, 0, 1.0, 0.2)],
)
def test_vllm_logprobs_match_full_forward(
    vllm_engine, tiny_policy_dir, max3_prompts, tiny_tokenizer, temperature, top_k, top_p, min_p
):
    from rlhf_core.model.policy import load_policy
    from rlhf_core.rollout import sampling_logprobs

    model, _ = load_policy(tiny_policy_dir, dtype="float32", device="cuda")
    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = vllm_engine.generate(pb, 4, sampling)
    assert batch.response_ids.shape[0] == 32 and batch.response_ids.shape[1] <= 6
    assert torch.equal(batch.response_mask, response_mask_from_eos(batch.response_ids, tiny_tokenizer.eos_token_id))
    m = batch.response_mask
    with torch.no_grad():
        P = batch.prompt_ids.shape[1]
        ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
        attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        ref = sampling_logprobs(logits[:, P - 1 : -1].reshape(-1, logits.shape[-1]), sampling).view(
            32, -1, logits.shape[-1]
        )
        ref = ref.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    assert bool(torch.isfinite(ref[m]).all())  # every sampled token is inside the filtered set
    torch.testing.assert_close(batch.behavior_logprobs[m], ref[m], atol=2e-3, rtol=0)
    # the trainer's log-probs (same truncation, same weights) give on-policy ratios of 1
    with torch.no_grad():
        trainer_lp, _ = sequence_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, m, sampling=sampling
        )
    torch.testing.assert_close(batch.behavior_logprobs[m], trainer_lp[m], atol=2e-3, rtol=0)


@pytest.mark.cuda
def test_vllm_load_weights_changes_outputs_and_version(vllm_engine, tiny_policy_dir, max3_prompts, tiny_tokenizer):
    from rlhf_core.model.policy import load_policy

    model, _ = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = vllm_engine.generate(pb, 1, greedy)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    vllm_engine.load_weights({k: v.detach() for k, v in new.named_parameters()}, version=3)
    after = vllm_engine.generate(pb, 1, greedy)
    assert vllm_engine.version == 3 and bool((after.policy_version == 3).all())
    assert not torch.equal(before.behavior_logprobs, after.behavior_logprobs)
    hf = HFEngine(new.cuda(), tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id).generate(pb, 1, greedy)
    assert torch.equal(hf.response_ids.cpu(), after.response_ids.cpu())  # greedy agrees with the new weights
    vllm_engine.load_weights({k: v.detach() for k, v in model.named_parameters()}, version=4)  # restore for other tests


@pytest.mark.cuda
def test_in_flight_weight_update(vllm_engine, tiny_policy_dir, max3_prompts, tiny_tokenizer):
    """Partial rollouts on vLLM: weights handed over between engine steps are loaded while requests run; tokens
    are stamped with the version in effect when produced, policy_version is each row's oldest, and the tokens
    produced before the update have the old weights' log-probs."""
    from rlhf_core.model.policy import load_policy

    model, _ = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    state = {k: v.detach() for k, v in new.named_parameters()}
    vllm_engine.load_weights({k: v.detach() for k, v in model.named_parameters()}, version=10)
    calls = []

    def between_steps():
        calls.append(1)
        return (state, 11) if len(calls) == 3 else None

    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    batch = vllm_engine.generate(pb, 2, sampling, between_steps=between_steps).to("cpu")
    m = batch.response_mask
    assert vllm_engine.version == 11
    tv = batch.token_versions
    assert bool((tv[m] == 10).any()) and bool((tv[m] == 11).any())
    assert torch.equal(batch.policy_version, tv.masked_fill(~m, 99).amin(-1).clamp(max=11))
    with torch.no_grad():
        old_lp, _ = sequence_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, m, sampling=sampling
        )
    first = m & (tv == 10)
    torch.testing.assert_close(batch.behavior_logprobs[first], old_lp[first], atol=2e-3, rtol=0)
    vllm_engine.load_weights({k: v.detach() for k, v in model.named_parameters()}, version=12)  # restore


# ---------------------------------------------------------------------------------------------------
# What VLLMEngine asks of vLLM, checked against a stand-in module (runs where vLLM is not installed)
# ---------------------------------------------------------------------------------------------------


def _fake_vllm(monkeypatch, knows_logprobs_mode: bool = True, version: str = "0.11.0"):
    """A `vllm` module whose LLM records its arguments and answers generate() with fixed completions."""
    import sys
    import types

    record: dict = {"llm": None, "sampling": [], "generate": [], "removed": []}

    class FakeSamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            record["sampling"].append(kwargs)

    class FakeLLM:
        def __init__(self, **kwargs):
            if "logprobs_mode" in kwargs and not knows_logprobs_mode:
                raise TypeError("__init__() got an unexpected keyword argument 'logprobs_mode'")
            record["llm"] = kwargs
            self.llm_engine = types.SimpleNamespace(remove_lora=record["removed"].append)

        def generate(self, requests, params, use_tqdm=False, **kwargs):
            record["generate"].append(kwargs)
            Lp = types.SimpleNamespace
            out = []
            for _ in requests:
                comps = [
                    Lp(index=g, token_ids=[5, 2], logprobs=[{5: Lp(logprob=-0.5)}, {2: Lp(logprob=-0.25)}])
                    for g in range(params.kwargs["n"])
                ]
                out.append(Lp(outputs=comps))
            return out

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = FakeLLM, FakeSamplingParams, version
    monkeypatch.setitem(sys.modules, "vllm", fake)

    class FakeLoRARequest:
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    lora_pkg, request_mod = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request_mod.LoRARequest = FakeLoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", lora_pkg)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request_mod)
    for var in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # what the engine sets, undone after
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return record


def test_vllm_engine_asks_for_processed_logprobs_and_passes_the_stop_set(
    monkeypatch, tiny_policy_dir, tiny_tokenizer, max3_prompts
):
    import os

    from rlhf_core.rollout.vllm import VLLMEngine

    record = _fake_vllm(monkeypatch)
    cfg = load_config(None, ["rollout.engine=vllm"])
    engine = VLLMEngine(tiny_policy_dir, cfg, tiny_tokenizer, seed=3, stop_token_ids=[2, 7])
    assert record["llm"]["logprobs_mode"] == "processed_logprobs" and engine.processed_logprobs
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"  # its sampler returns no processed logprobs
    pb = collate_prompts(max3_prompts[0][:3], tiny_tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.5, min_p=0.1)
    batch = engine.generate(pb, 2, sampling)
    asked = record["sampling"][-1]
    assert asked["stop_token_ids"] == [2, 7] and asked["n"] == 2 and asked["max_tokens"] == 5
    assert (asked["temperature"], asked["top_k"], asked["top_p"], asked["min_p"], asked["logprobs"]) == (
        0.7,
        3,
        0.5,
        0.1,
        0,
    )
    assert batch.response_ids.tolist() == [[5, 2]] * 6 and batch.behavior_logprobs[0].tolist() == [-0.5, -0.25]
    engine.generate(pb, 1, SamplingParams(max_new_tokens=5))
    assert record["sampling"][-1]["top_k"] == -1 and record["sampling"][-1]["min_p"] == 0.0  # vLLM's "off"
    # build_engine hands it the run's stop set
    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    built = build_engine(cfg, None, tiny_tokenizer, model_path=str(tiny_policy_dir), stop_token_ids=[2, 9])
    assert isinstance(built, VLLMEngine) and built.stop_token_ids == [2, 9]


@pytest.mark.parametrize("truncation", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.1), dict(temperature=0.7)])
def test_vllm_without_processed_logprobs_refuses_truncated_sampling(
    monkeypatch, tiny_policy_dir, tiny_tokenizer, max3_prompts, truncation
):
    from rlhf_core.rollout.vllm import VLLMEngine

    _fake_vllm(monkeypatch, knows_logprobs_mode=False, version="0.9.2")
    engine = VLLMEngine(tiny_policy_dir, load_config(None), tiny_tokenizer, stop_token_ids=[2])
    assert not engine.processed_logprobs
    pb = collate_prompts(max3_prompts[0][:2], tiny_tokenizer.pad_token_id)
    engine.generate(pb, 1, SamplingParams(max_new_tokens=3))  # temperature 1, no filter: raw == processed
    with pytest.raises(RuntimeError, match="raw model distribution"):
        engine.generate(pb, 1, SamplingParams(max_new_tokens=3, **truncation))


def test_vllm_engine_with_lora_loads_adapters_through_lora_requests(
    monkeypatch, tiny_policy_dir, tiny_tokenizer, max3_prompts
):
    """model.lora: the engine enables vLLM's LoRA, a sync writes a PEFT adapter directory, and generation
    names it in a LoRARequest (a new id per version; the previous one is removed)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from rlhf_core.model.lora import adapter_state_dict
    from rlhf_core.rollout.vllm import VLLMEngine
    from rlhf_core.run import build

    record = _fake_vllm(monkeypatch)
    cfg = load_config(None, ["rollout.engine=vllm", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"])
    engine = VLLMEngine(tiny_policy_dir, cfg, tiny_tokenizer, seed=0, stop_token_ids=[2])
    assert record["llm"]["enable_lora"] is True and record["llm"]["max_lora_rank"] == 8  # vLLM's smallest >= 4
    assert record["llm"]["max_loras"] == 1
    pb = collate_prompts(max3_prompts[0][:2], tiny_tokenizer.pad_token_id)
    engine.generate(pb, 1, SamplingParams(max_new_tokens=3))
    assert record["generate"][-1] == {}  # no adapter before the first sync: fresh adapters are zero

    model, _ = build.build_policy(cfg, tiny_policy_dir)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    payload = adapter_state_dict(model)
    engine.load_weights(payload, version=3)
    engine.generate(pb, 1, SamplingParams(max_new_tokens=3))
    request = record["generate"][-1]["lora_request"]
    assert request.lora_int_id == 4 and engine.version == 3
    written = load_file(str(Path(request.lora_path) / "adapter_model.safetensors"))
    assert written.keys() == payload.keys() and all(torch.equal(written[k], payload[k]) for k in payload)
    adapter_cfg = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["target_modules"] == ["q_proj", "v_proj"]
    assert adapter_cfg["peft_type"] == "LORA" and adapter_cfg["base_model_name_or_path"] == str(tiny_policy_dir)

    engine.load_weights(payload, version=4)
    assert engine.lora_request.lora_int_id == 5 and record["removed"] == [4]
    assert not Path(request.lora_path).exists()  # the previous version's directory is gone


@pytest.mark.cuda
def test_vllm_lora_adapter_matches_the_peft_model(tiny_policy_dir, tiny_tokenizer, max3_prompts):
    """Where vLLM and CUDA exist: after a LoRA sync, vLLM's greedy outputs and logprobs are the peft model's."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    from rlhf_core.model.lora import adapter_state_dict
    from rlhf_core.rollout.vllm import VLLMEngine
    from rlhf_core.run import build

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "model.dtype=float32",
            "rollout.engine_kwargs.gpu_memory_utilization=0.2",
            "model.lora.r=8",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        ],
    )
    engine = VLLMEngine(tiny_policy_dir, cfg, tiny_tokenizer, seed=0)
    model, _ = build.build_policy(cfg, tiny_policy_dir)
    model = model.cuda()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    engine.load_weights(adapter_state_dict(model), version=1)
    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    out = engine.generate(pb, 1, greedy)
    hf = HFEngine(model, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id).generate(pb, 1, greedy)
    assert torch.equal(hf.response_ids.cpu(), out.response_ids.cpu())
    m = out.response_mask
    torch.testing.assert_close(out.behavior_logprobs[m].cpu(), hf.behavior_logprobs.cpu()[m.cpu()], atol=2e-3, rtol=0)
