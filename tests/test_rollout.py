"""Rollout engines and the rollout worker, on the real tiny policy (no mocks)."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

from rlhf_core.config import RewardConfig
from rlhf_core.data import Prompt, collate_prompts
from rlhf_core.reward.components import build_reward_fn
from rlhf_core.rollout import (
    HFEngine,
    RandomEngine,
    RolloutWorker,
    SamplingParams,
    response_mask_from_eos,
    sampling_logprobs,
    split_groups,
)
from rlhf_core.trainer import sequence_logprobs
from rlhf_core.types import Experience

EOS, PAD = 2, 0


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return HFEngine(tiny_model, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id, seed=0)


@pytest.fixture
def prompt_batch(max3_prompts, tiny_tokenizer):
    train, _ = max3_prompts
    return collate_prompts(train[:6], tiny_tokenizer.pad_token_id)


@pytest.fixture
def mixed_length_batch(tiny_tokenizer):
    """Prompts of different lengths, so that left padding is exercised."""
    tok = tiny_tokenizer
    texts = ["max 1 2 3 =", "sum 4 5 =", "max 9 =", "sum 1 2 3 4 5 6 7 8 9 ="]
    return collate_prompts(
        [Prompt(uid=i, prompt_ids=tok(t)["input_ids"], answers=[[4]]) for i, t in enumerate(texts)], tok.pad_token_id
    )


def _check_batch_invariants(batch, n_rows: int, max_new_tokens: int, eos: int = EOS, pad: int = PAD):
    N, L = batch.response_ids.shape
    assert N == n_rows and 1 <= L <= max_new_tokens
    for t in (batch.response_mask, batch.behavior_logprobs, batch.response_ids):
        assert t.shape == (N, L)
    assert batch.response_mask.dtype == torch.bool
    assert torch.equal(batch.response_mask, response_mask_from_eos(batch.response_ids, eos))
    assert torch.equal(batch.response_lengths, batch.response_mask.sum(-1))
    assert bool((batch.response_ids[~batch.response_mask] == pad).all())
    assert bool((batch.behavior_logprobs[~batch.response_mask] == 0).all())
    assert bool((batch.behavior_logprobs[batch.response_mask] <= 0).all())
    assert bool(torch.isfinite(batch.behavior_logprobs).all())


# ---------------------------------------------------------------------------------------------------
# HFEngine: behaviour logprobs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_full_forward(engine, tiny_model, mixed_length_batch, temperature):
    sampling = SamplingParams(max_new_tokens=8, temperature=temperature, top_p=1.0, top_k=0)
    batch = engine.generate(mixed_length_batch, 4, sampling)
    _check_batch_invariants(batch, 16, 8)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(
            tiny_model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            temperature=temperature,
        )
    m = batch.response_mask
    assert m.sum() > 16
    torch.testing.assert_close(logprobs[m], batch.behavior_logprobs[m], atol=1e-4, rtol=0)


def test_left_padding_does_not_change_logprobs(engine, tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    short = Prompt(uid=0, prompt_ids=tok("max 3 1 4 =")["input_ids"], answers=[[4]])
    long = Prompt(uid=1, prompt_ids=tok("sum 1 2 3 4 5 6 7 8 9 1 2 3 =")["input_ids"], answers=[[4]])
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    alone = engine.generate(collate_prompts([short], PAD), 1, greedy)
    padded = engine.generate(collate_prompts([short, long], PAD), 1, greedy)
    assert padded.prompt_mask[0].sum() < padded.prompt_mask.shape[1]  # the short prompt really is padded
    L = alone.response_ids.shape[1]
    assert torch.equal(padded.response_ids[0, :L], alone.response_ids[0])
    torch.testing.assert_close(padded.behavior_logprobs[0, :L], alone.behavior_logprobs[0], atol=1e-5, rtol=0)

    # sampled responses, scored again without any padding, give the behaviour logprobs back
    sampled = engine.generate(collate_prompts([short, long], PAD), 3, SamplingParams(max_new_tokens=6))
    rows = slice(0, 3)  # the short prompt's group
    P = len(short.prompt_ids)
    with torch.no_grad():
        unpadded, _ = sequence_logprobs(
            tiny_model,
            sampled.prompt_ids[rows, -P:],
            sampled.prompt_mask[rows, -P:],
            sampled.response_ids[rows],
            sampled.response_mask[rows],
        )
    m = sampled.response_mask[rows]
    torch.testing.assert_close(unpadded[m], sampled.behavior_logprobs[rows][m], atol=1e-4, rtol=0)


def test_uniform_model_gives_exact_uniform_logprobs(tiny_model, mixed_length_batch):
    """With the final norm zeroed every logit is 0: the behaviour logprob of every token is -log V."""
    with torch.no_grad():
        tiny_model.model.norm.weight.zero_()
    engine = HFEngine(tiny_model, EOS, PAD, seed=0)
    batch = engine.generate(mixed_length_batch, 8, SamplingParams(max_new_tokens=6))
    V = tiny_model.config.vocab_size
    m = batch.response_mask
    torch.testing.assert_close(batch.behavior_logprobs[m], torch.full_like(batch.behavior_logprobs[m], -math.log(V)))
    top_k = engine.generate(
        mixed_length_batch, 8, SamplingParams(max_new_tokens=6, top_k=0, top_p=1.0, temperature=0.5)
    )
    torch.testing.assert_close(
        top_k.behavior_logprobs[top_k.response_mask],
        torch.full_like(top_k.behavior_logprobs[top_k.response_mask], -math.log(V)),
    )


# ---------------------------------------------------------------------------------------------------
# HFEngine: EOS, lengths, determinism
# ---------------------------------------------------------------------------------------------------


def test_eos_mask_and_padding(engine, prompt_batch):
    batch = engine.generate(prompt_batch, 16, SamplingParams(max_new_tokens=12))
    _check_batch_invariants(batch, 96, 12)
    ids, mask = batch.response_ids, batch.response_mask
    ended = (ids == EOS).any(-1)
    assert ended.any() and (~ended).any()  # both kinds of rows are present
    for row in range(len(batch)):
        r = ids[row].tolist()
        if EOS in r:
            first = r.index(EOS)
            assert mask[row].tolist() == [True] * (first + 1) + [False] * (len(r) - first - 1)
            assert all(t == PAD for t in r[first + 1 :])
            assert batch.response_lengths[row] == first + 1
        else:
            assert bool(mask[row].all()) and batch.response_lengths[row] == len(r)
    assert batch.group_ids.tolist() == [g for g in range(6) for _ in range(16)]
    assert torch.equal(batch.prompt_uids, prompt_batch.uids.repeat_interleave(16))
    assert torch.equal(batch.prompt_ids, prompt_batch.prompt_ids.repeat_interleave(16, 0))
    assert bool((batch.policy_version == 0).all())


@pytest.mark.parametrize("max_new_tokens", [1, 3, 7])
def test_max_new_tokens_respected(engine, prompt_batch, max_new_tokens):
    batch = engine.generate(prompt_batch, 2, SamplingParams(max_new_tokens=max_new_tokens))
    assert batch.response_ids.shape[1] <= max_new_tokens
    assert int(batch.response_lengths.max()) <= max_new_tokens
    # with EOS made unreachable every row runs to exactly max_new_tokens
    never = HFEngine(engine.model, stop_token_ids=10_000, pad_token_id=PAD, seed=0)
    full = never.generate(prompt_batch, 2, SamplingParams(max_new_tokens=max_new_tokens))
    assert full.response_ids.shape == (12, max_new_tokens)
    assert bool((full.response_lengths == max_new_tokens).all())


def test_generation_stops_when_every_row_has_ended(engine, prompt_batch):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    first = engine.generate(prompt_batch, 1, greedy).response_ids[:, 0]
    # treat the first greedy token of prompt 0 as EOS: the greedy rows that emit it stop at once
    prompt0 = collate_prompts([Prompt(uid=0, prompt_ids=prompt_batch.prompt_ids[0].tolist(), answers=[[4]])], PAD)
    stop = HFEngine(engine.model, stop_token_ids=int(first[0]), pad_token_id=PAD, seed=0)
    out = stop.generate(prompt0, 3, greedy)
    assert out.response_ids.shape == (3, 1)
    assert bool(out.response_mask.all()) and out.response_lengths.tolist() == [1, 1, 1]


def test_greedy_is_deterministic(engine, prompt_batch):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    a = engine.generate(prompt_batch, 2, greedy)
    engine.generate(prompt_batch, 2, SamplingParams(max_new_tokens=6))  # advances the generator
    b = engine.generate(prompt_batch, 2, greedy)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.behavior_logprobs, b.behavior_logprobs)
    assert torch.equal(a.response_ids[0::2], a.response_ids[1::2])  # both samples of a prompt agree


def test_same_seed_same_samples(tiny_model, prompt_batch):
    sampling = SamplingParams(max_new_tokens=6)
    a = HFEngine(tiny_model, EOS, PAD, seed=7).generate(prompt_batch, 4, sampling)
    b = HFEngine(tiny_model, EOS, PAD, seed=7).generate(prompt_batch, 4, sampling)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.behavior_logprobs, b.behavior_logprobs)
    # another seed samples differently (EOS unreachable so that both have every row at full length)
    c7 = HFEngine(tiny_model, 10_000, PAD, seed=7).generate(prompt_batch, 4, sampling)
    c8 = HFEngine(tiny_model, 10_000, PAD, seed=8).generate(prompt_batch, 4, sampling)
    assert not torch.equal(c7.response_ids, c8.response_ids)
    # the global torch RNG plays no part
    torch.manual_seed(123)
    torch.rand(5)
    d = HFEngine(tiny_model, EOS, PAD, seed=7).generate(prompt_batch, 4, sampling)
    assert torch.equal(a.response_ids, d.response_ids)


# ---------------------------------------------------------------------------------------------------
# HFEngine: top-k / top-p
# ---------------------------------------------------------------------------------------------------


def _reference_filtered_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Independent per-row reference: temperature, drop tokens below min_p x the top probability, keep the
    top-k, then the smallest prefix of the sorted (renormalised) distribution whose mass reaches top_p;
    renormalise. logits [V] -> logprobs [V]."""
    z = logits.double() / temperature
    full = torch.softmax(z, 0)
    order = [t for t in torch.argsort(z, descending=True).tolist() if full[t] >= min_p * full.max()]
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(z[keep], 0).tolist()
    kept, mass = [], 0.0
    for tok, p in zip(keep, probs):
        if mass >= top_p:
            break
        kept.append(tok)
        mass += p
    out = torch.full_like(z, float("-inf"))
    out[kept] = torch.log_softmax(z[kept], 0)
    return out


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (0.7, 5, 0.8, 0.0),
        (1.3, 0, 0.3, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.7, 4, 0.9, 0.1),
    ],
)
def test_top_k_top_p_sampling_and_logprobs(tiny_model, prompt_batch, temperature, top_k, top_p, min_p):
    with torch.no_grad():  # sharpen the random model so that the filters bite
        tiny_model.model.embed_tokens.weight.mul_(4)
    engine = HFEngine(tiny_model, EOS, PAD, seed=1)
    sampling = SamplingParams(max_new_tokens=5, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = engine.generate(prompt_batch, 8, sampling)
    _check_batch_invariants(batch, 48, 5)
    P = batch.prompt_ids.shape[1]
    with torch.no_grad():
        ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
        attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = tiny_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1]
    allowed_sizes = []
    for n in range(len(batch)):
        for t in range(int(batch.response_lengths[n])):
            ref = _reference_filtered_logprobs(logits[n, t], temperature, top_k, top_p, min_p)
            tok = int(batch.response_ids[n, t])
            assert math.isfinite(ref[tok]), f"row {n} step {t}: sampled token {tok} is outside the allowed set"
            assert abs(float(ref[tok]) - float(batch.behavior_logprobs[n, t])) < 1e-4
            allowed_sizes.append(int(torch.isfinite(ref).sum()))
    V = tiny_model.config.vocab_size
    assert max(allowed_sizes) < V  # the filter removed tokens at every step
    if top_k:
        assert max(allowed_sizes) <= top_k
    # the engine's filter agrees with the reference on whole distributions, too
    engine_lp = sampling_logprobs(logits[0, :3], sampling)
    for t in range(3):
        ref = _reference_filtered_logprobs(logits[0, t], temperature, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(engine_lp[t]), torch.isfinite(ref))
        torch.testing.assert_close(
            engine_lp[t][torch.isfinite(ref)].double(), ref[torch.isfinite(ref)], atol=1e-5, rtol=0
        )


# ---------------------------------------------------------------------------------------------------
# HFEngine: weight loading
# ---------------------------------------------------------------------------------------------------


def test_load_weights_changes_outputs_and_version(tiny_model, prompt_batch):
    engine = HFEngine(copy.deepcopy(tiny_model), EOS, PAD, seed=0)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = engine.generate(prompt_batch, 1, greedy)
    assert engine.version == 0

    new = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    state = {k: v.clone() for k, v in new.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    engine.load_weights(state, version=3)
    assert engine.version == 3
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == ptrs  # copied in place
    after = engine.generate(prompt_batch, 1, greedy)
    assert bool((after.policy_version == 3).all())
    assert not torch.allclose(before.behavior_logprobs, after.behavior_logprobs) or not torch.equal(
        before.response_ids, after.response_ids
    )
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, new.state_dict()[k])

    engine.load_weights(None, version=4)  # version-only update (weights shared elsewhere)
    assert engine.version == 4
    with pytest.raises(KeyError, match="unknown parameters"):
        engine.load_weights({"no.such.weight": torch.zeros(1)}, version=5)
    assert engine.version == 4


def test_generate_restores_training_mode(engine, prompt_batch):
    engine.model.train()
    engine.generate(prompt_batch, 1, SamplingParams(max_new_tokens=2))
    assert engine.model.training
    engine.model.eval()
    engine.generate(prompt_batch, 1, SamplingParams(max_new_tokens=2))
    assert not engine.model.training


# ---------------------------------------------------------------------------------------------------
# RandomEngine
# ---------------------------------------------------------------------------------------------------


def test_random_engine_shapes_mask_and_logprobs(prompt_batch):
    V = 19
    engine = RandomEngine(V, EOS, PAD, seed=0)
    batch = engine.generate(prompt_batch, 8, SamplingParams(max_new_tokens=10))
    assert batch.response_ids.shape == (48, 10)
    _check_batch_invariants(batch, 48, 10)
    assert bool((batch.response_ids < V).all())
    torch.testing.assert_close(
        batch.behavior_logprobs[batch.response_mask], torch.full((int(batch.response_mask.sum()),), -math.log(V))
    )
    assert batch.group_ids.tolist() == [g for g in range(6) for _ in range(8)]
    engine.load_weights(None, 2)
    assert engine.version == 2 and engine.weights_loaded == 1
    assert bool((engine.generate(prompt_batch, 1, SamplingParams(max_new_tokens=2)).policy_version == 2).all())
    same = RandomEngine(V, EOS, PAD, seed=0).generate(prompt_batch, 8, SamplingParams(max_new_tokens=10))
    assert torch.equal(same.response_ids, batch.response_ids)


def test_random_engine_rate(prompt_batch):
    rate = 8000.0
    engine = RandomEngine(19, 10_000, PAD, tokens_per_s=rate, seed=0)  # no EOS: every row is full length
    start = time.perf_counter()
    batch = engine.generate(prompt_batch, 8, SamplingParams(max_new_tokens=50))
    elapsed = time.perf_counter() - start
    assert batch.num_tokens == 48 * 50
    assert elapsed >= batch.num_tokens / rate * 0.98  # 0.3 s budget
    assert elapsed < batch.num_tokens / rate + 1.0


# ---------------------------------------------------------------------------------------------------
# RolloutWorker
# ---------------------------------------------------------------------------------------------------


def test_rollout_worker_scores_and_splits_groups(tiny_model, tiny_tokenizer, max3_prompts):
    train, _ = max3_prompts
    tok = tiny_tokenizer
    G, T = 4, 3
    reward_fn = build_reward_fn(RewardConfig(), tok, tok.eos_token_id, T)
    engine = HFEngine(tiny_model, tok.eos_token_id, tok.pad_token_id, seed=0, version=5)
    worker = RolloutWorker(engine, reward_fn, SamplingParams(max_new_tokens=T), G, tok.pad_token_id)
    prompts = train[:32]
    batch, components = worker.rollout(prompts)
    assert batch.rewards.shape == (32 * G,) and components["exact_match"].shape == (32 * G,)
    for n in range(len(batch)):  # reward == exact match of the response up to EOS, checked by hand
        resp = batch.response_ids[n].tolist()
        body = resp[: resp.index(tok.eos_token_id)] if tok.eos_token_id in resp else resp
        expected = float(body == prompts[n // G].answers[0])
        assert float(batch.rewards[n]) == expected
    # hand-made responses: correct + EOS scores 1, a wrong one 0
    right = torch.tensor([prompts[0].answers[0] + [tok.eos_token_id]])
    wrong = torch.tensor([[prompts[0].answers[0][0], prompts[0].answers[0][0], tok.eos_token_id]])
    pats = collate_prompts([prompts[0]], tok.pad_token_id).patterns
    assert float(reward_fn(right, pats)[0][0]) == 1.0 and float(reward_fn(wrong, pats)[0][0]) == 0.0

    groups = worker.generate_groups(prompts[:5])
    assert len(groups) == 5
    for g, exp in enumerate(groups):
        assert isinstance(exp, Experience) and len(exp) == G
        assert exp.prompt_id == prompts[g].uid and exp.policy_version == 5
        assert exp.batch.group_ids.tolist() == [0] * G
        assert exp.batch.rewards.shape == (G,) and exp.batch.response_ids.device.type == "cpu"
        assert exp.reward == pytest.approx(float(exp.batch.rewards.mean()))
    stats = worker.stats()
    assert stats["samples"] == 37 * G and stats["batches"] == 2 and stats["version"] == 5
    assert stats["tokens"] > 0 and stats["busy_s"] > 0
    assert worker.load_weights(None, 6) >= 0 and worker.version == 6


def test_split_groups_views_rows(prompt_batch):
    batch = RandomEngine(19, EOS, PAD, seed=0).generate(prompt_batch, 3, SamplingParams(max_new_tokens=4))
    batch.rewards = torch.arange(len(batch), dtype=torch.float32)
    groups = split_groups(batch, 3)
    assert [len(g) for g in groups] == [3] * 6
    assert [g.prompt_id for g in groups] == prompt_batch.uids.tolist()
    for i, g in enumerate(groups):
        assert g.batch.rewards.tolist() == [3.0 * i, 3.0 * i + 1, 3.0 * i + 2]
        assert torch.equal(g.batch.response_ids, batch.response_ids[3 * i : 3 * i + 3])


def test_build_engine_by_config(tiny_model, tiny_tokenizer):
    from rlhf_core.config import load_config
    from rlhf_core.rollout import build_engine

    rnd = build_engine(
        load_config(None, ["rollout.engine=random", "rollout.engine_kwargs.tokens_per_s=100"]),
        tiny_model,
        tiny_tokenizer,
        seed=3,
    )
    assert isinstance(rnd, RandomEngine)
    assert rnd.vocab_size == len(tiny_tokenizer) and rnd.tokens_per_s == 100.0 and rnd.eos_token_id == EOS
    hf = build_engine(load_config(None), tiny_model, tiny_tokenizer, seed=3)
    assert isinstance(hf, HFEngine) and hf.model is tiny_model
    assert (hf.eos_token_id, hf.pad_token_id, hf.version) == (EOS, PAD, 0)


# ---------------------------------------------------------------------------------------------------
# The stop set: chat models end a response at any of several ids
# ---------------------------------------------------------------------------------------------------

CHAT_STYLES = ["chat_policy_dir", "base_chat_policy_dir"]


def _chat_parts(request, fixture, *overrides):
    """(policy dir, model, tokenizer, cfg, the ids of <|im_end|> and <|endoftext|>) of a chat fixture."""
    from rlhf_core.config import load_config
    from rlhf_core.model.policy import load_policy

    policy_dir = request.getfixturevalue(fixture)
    model, tok = load_policy(policy_dir, dtype="float32", device="cpu")
    cfg = load_config(None, ["rollout.max_new_tokens=24", f"model.path={policy_dir}", *overrides])
    ids = (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
    return policy_dir, model, tok, cfg, ids


def _favour(model, token_ids, bonus: float = 4.0):
    """Add `bonus` to the logits of `token_ids` (a hook on the LM head), so that responses end soon and at each."""
    bias = torch.zeros(model.config.vocab_size)
    bias[list(token_ids)] = bonus
    return model.lm_head.register_forward_hook(lambda _mod, _inp, out: out + bias)


def _chat_prompts(tok, n=8):
    texts = [
        f"<|im_start|>user\nWhat is the maximum of {i}, {i + 3} and 2?<|im_end|>\n<|im_start|>assistant\n"
        for i in range(n)
    ]
    return [
        Prompt(uid=i, prompt_ids=tok(t)["input_ids"], answers=[tok(str(i + 3))["input_ids"]])
        for i, t in enumerate(texts)
    ]


@pytest.mark.parametrize("fixture", CHAT_STYLES)
def test_generation_stops_at_every_id_of_the_stop_set(request, fixture):
    """Both chat styles: the stop set holds <|im_end|> and <|endoftext|> whichever the tokenizer's EOS is; a
    response ends at the first of either, and its mask, length and padding end there."""
    from rlhf_core.run import build

    policy_dir, model, tok, cfg, (im_end, eot) = _chat_parts(request, fixture)
    stops = build.build_stop_ids(cfg, tok, policy_dir)
    assert stops == sorted({im_end, eot}) and tok.eos_token_id in stops
    hook = _favour(model, stops)
    try:
        worker = build.build_rollout_worker(cfg, model, tok, policy_dir, seed=0)
        assert isinstance(worker.engine, HFEngine) and worker.engine.stop_token_ids == stops
        batch, _ = worker.rollout(_chat_prompts(tok))
    finally:
        hook.remove()
    _check_batch_invariants(batch, 8 * cfg.rollout.samples_per_prompt, 24, eos=stops, pad=tok.pad_token_id)
    ends = []
    for row, n in zip(batch.response_ids.tolist(), batch.response_lengths.tolist()):
        body = row[:n]
        assert not set(body[:-1]) & set(stops), "a stop id inside a response: generation ran past it"
        if body[-1] in stops:
            ends.append(body[-1])
    assert len(ends) > len(batch) // 2 and set(ends) == {im_end, eot}  # each id ended some rows
    # the mask ends at the FIRST stop id, whichever: a row with both keeps only the first
    rows = torch.tensor([[5, eot, im_end, 7], [im_end, 6, eot, 8], [5, 6, 7, 8]])
    assert response_mask_from_eos(rows, stops).tolist() == [
        [True, True, False, False],
        [True, False, False, False],
        [True] * 4,
    ]


@pytest.mark.parametrize("fixture", CHAT_STYLES)
def test_engine_evaluator_and_reward_share_the_stop_set(request, fixture):
    """build_rollout_worker and build_evaluator give engine and reward the same set; the reward ends a row at
    whichever stop id comes first, as the engine does."""
    from rlhf_core.run import build

    policy_dir, model, tok, cfg, (im_end, eot) = _chat_parts(request, fixture)
    stops = build.build_stop_ids(cfg, tok, policy_dir)
    worker = build.build_rollout_worker(cfg, model, tok, policy_dir, seed=0)
    evaluator = build.build_evaluator(cfg, model, tok, policy_dir, [])
    assert worker.engine.stop_token_ids == evaluator.engine.stop_token_ids == stops
    assert list(worker.reward_fn.stop_token_ids) == list(evaluator.reward_fn.stop_token_ids) == stops
    prompt = _chat_prompts(tok, 1)[0]
    pats = collate_prompts([prompt], tok.pad_token_id).patterns
    answer = prompt.answers[0]
    for stop in (im_end, eot):  # the answer, then either stop id, then junk: correct under both
        junk = tok("and more words")["input_ids"]
        total, parts = evaluator.reward_fn(torch.tensor([answer + [stop] + junk]), pats)
        assert float(parts["exact_match"][0]) == 1.0, stop


def test_extra_stop_token_ids_are_added_and_stop_generation(request):
    from rlhf_core.run import build

    policy_dir, model, tok, _, (im_end, eot) = _chat_parts(request, "chat_policy_dir")
    extra = tok.convert_tokens_to_ids("<|im_start|>")
    from rlhf_core.config import load_config

    cfg = load_config(None, ["rollout.max_new_tokens=24", f"rollout.stop_token_ids=[{extra}]"])
    stops = build.build_stop_ids(cfg, tok, policy_dir)
    assert stops == sorted({im_end, eot, extra})
    hook = _favour(model, [extra], bonus=5.0)
    try:
        worker = build.build_rollout_worker(cfg, model, tok, policy_dir, seed=0)
        batch, _ = worker.rollout(_chat_prompts(tok))
    finally:
        hook.remove()
    assert worker.engine.stop_token_ids == stops and list(worker.reward_fn.stop_token_ids) == stops
    last = batch.response_ids.gather(1, (batch.response_lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    assert int((last == extra).sum()) > len(batch) // 2  # rows end at the extra id
    assert torch.equal(batch.response_mask, response_mask_from_eos(batch.response_ids, stops))


@pytest.mark.parametrize("bad", [100_000, -1])
def test_stop_id_outside_the_vocabulary_fails_clearly(request, bad):
    from rlhf_core.config import load_config
    from rlhf_core.model.policy import ModelLoadError
    from rlhf_core.run import build

    policy_dir, model, tok, _, _ = _chat_parts(request, "chat_policy_dir")
    cfg = load_config(None, [f"rollout.stop_token_ids=[{bad}]"])
    with pytest.raises(
        ModelLoadError, match=rf"stop token id\(s\) \[{bad}\] are outside the vocabulary.*rollout.stop_token_ids"
    ):
        build.build_stop_ids(cfg, tok, policy_dir)
    with pytest.raises(ModelLoadError, match="outside the vocabulary"):
        build.build_rollout_worker(cfg, model, tok, policy_dir, seed=0)
    with pytest.raises(ModelLoadError, match="outside the vocabulary"):
        build.build_evaluator(cfg, model, tok, policy_dir, [])


def test_random_engine_stops_at_every_stop_id(prompt_batch):
    batch = RandomEngine(19, [EOS, 7], PAD, seed=0).generate(prompt_batch, 8, SamplingParams(max_new_tokens=12))
    assert torch.equal(batch.response_mask, response_mask_from_eos(batch.response_ids, [EOS, 7]))
    ends = {int(r[n - 1]) for r, n in zip(batch.response_ids, batch.response_lengths) if int(r[n - 1]) in (EOS, 7)}
    assert ends == {EOS, 7}


# ---------------------------------------------------------------------------------------------------
# Reward components travel with the batch (the Ray path logs them per trainer step)
# ---------------------------------------------------------------------------------------------------


def test_reward_components_travel_with_groups(tiny_model, tiny_tokenizer, max3_prompts):
    from rlhf_core.distributed.transport import pack_groups, unpack_groups
    from rlhf_core.types import cat_rollouts

    tok = tiny_tokenizer
    cfg = RewardConfig(components={"length_penalty": 0.5, "exact_match": 1.0}, length_target=1)
    reward_fn = build_reward_fn(cfg, tok, tok.eos_token_id, 4)
    engine = HFEngine(tiny_model, tok.eos_token_id, tok.pad_token_id, seed=0)
    worker = RolloutWorker(
        engine, reward_fn, SamplingParams(max_new_tokens=4), 4, tok.pad_token_id, component_names=list(cfg.components)
    )
    batch, components = worker.rollout(max3_prompts[0][:6])
    assert batch.reward_components.shape == (24, 2)
    torch.testing.assert_close(batch.reward_components[:, 0], components["length_penalty"])
    torch.testing.assert_close(batch.reward_components[:, 1], components["exact_match"])
    torch.testing.assert_close(batch.rewards, batch.reward_components @ torch.tensor([0.5, 1.0]))
    assert float(batch.reward_components[:, 0].min()) < 0  # the penalty bites: the columns are really distinct
    groups = unpack_groups(pack_groups(worker.generate_groups(max3_prompts[0][6:10])))
    assert all(g.batch.reward_components.shape == (4, 2) for g in groups)
    whole = cat_rollouts([g.batch for g in groups], tok.pad_token_id)
    assert whole.reward_components.shape == (16, 2)
    torch.testing.assert_close(whole.rewards, whole.reward_components @ torch.tensor([0.5, 1.0]))


def test_top_p_filter_in_chunks_is_the_same_filter(monkeypatch):
    """The top-p sort runs in chunks of rows over large [..., V] logits (the trainer's): same set."""
    import rlhf_core.rollout.base as base
    from rlhf_core.rollout import removed_tokens

    z = torch.randn(3, 7, 50) * 3
    sp = SamplingParams(temperature=0.7, top_p=0.6, top_k=10, min_p=0.01)
    whole = removed_tokens(z, sp)
    monkeypatch.setattr(base, "TOP_P_CHUNK_ELEMENTS", 120)  # 2 rows at a time, the last chunk shorter
    assert torch.equal(removed_tokens(z, sp), whole) and 0 < float(whole.float().mean()) < 1
    assert removed_tokens(z, SamplingParams()) is None and removed_tokens(z, SamplingParams(temperature=0.5)) is None


# ---------------------------------------------------------------------------------------------------
# HFEngine: continuous batching and partial rollouts
# ---------------------------------------------------------------------------------------------------

LIVE_STOPS = [EOS, 5, 7]  # common tokens of the random tiny model: rows end at many different lengths


def _decode_batch_sizes(model):
    """Record the batch size of every forward pass of `model` (prefills and decode steps)."""
    sizes = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kw: sizes.append(kw["input_ids"].shape), with_kwargs=True
    )
    return sizes, handle


@pytest.mark.parametrize("max_active_rows", [None, 5, 1])
def test_continuous_batching_logprobs_are_exact(tiny_model, mixed_length_batch, max_active_rows):
    """Rows leave when they end and waiting rows join (their prompts prefilled into the running cache):
    the recorded behaviour log-probs are still those of the distribution sampled from (top-k / top-p)."""
    sampling = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=3, top_p=0.9)
    engine = HFEngine(tiny_model, LIVE_STOPS, PAD, seed=0, max_active_rows=max_active_rows)
    batch = engine.generate(mixed_length_batch, 4, sampling)
    _check_batch_invariants(batch, 16, 12, eos=LIVE_STOPS)
    assert batch.response_lengths.min() < batch.response_lengths.max()
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            tiny_model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, sampling=sampling
        )
    assert float(((lp - batch.behavior_logprobs) * batch.response_mask).abs().max()) < 1e-4
    assert torch.equal(batch.token_versions, torch.zeros_like(batch.response_ids))
    assert torch.equal(batch.group_ids, torch.arange(4).repeat_interleave(4))


def test_continuous_batching_greedy_equals_batch_at_a_time(tiny_model, mixed_length_batch):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    ref = HFEngine(tiny_model, LIVE_STOPS, PAD, continuous_batching=False).generate(mixed_length_batch, 1, greedy)
    for rows in (None, 2, 1):
        got = HFEngine(tiny_model, LIVE_STOPS, PAD, max_active_rows=rows).generate(mixed_length_batch, 1, greedy)
        assert torch.equal(got.response_ids, ref.response_ids), rows
        torch.testing.assert_close(got.behavior_logprobs, ref.behavior_logprobs, atol=1e-5, rtol=0)


def test_continuous_batching_keeps_at_most_max_active_rows_and_drops_ended_rows(tiny_model, mixed_length_batch):
    """No forward pass holds more than max_active_rows rows; decode work follows the tokens generated (each
    row decodes once per token it keeps), where batch at a time computes every row until the longest ends."""
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    engine = HFEngine(tiny_model, LIVE_STOPS, PAD, seed=2, max_active_rows=3)
    sizes, handle = _decode_batch_sizes(tiny_model)
    try:
        batch = engine.generate(mixed_length_batch, 4, sampling)
    finally:
        handle.remove()
    assert max(s[0] for s in sizes) <= 3
    decoded_rows = sum(s[0] for s in sizes if s[1] == 1)  # decode steps feed one token per row
    assert decoded_rows == int(batch.response_lengths.sum())  # no row decodes past its end
    assert int(batch.response_lengths.max()) * len(batch) > decoded_rows  # what batch at a time would cost

    sizes, handle = _decode_batch_sizes(tiny_model)
    try:
        HFEngine(tiny_model, LIVE_STOPS, PAD, seed=2, continuous_batching=False).generate(
            mixed_length_batch, 4, sampling
        )
    finally:
        handle.remove()
    assert all(s[0] == 16 for s in sizes)  # today's path: every row, every step


def test_partial_rollout_adopts_weights_between_decode_steps(tiny_model, mixed_length_batch):
    """between_steps hands new weights mid-generation: tokens before carry version 0, after version 1, each with
    the behaviour log-prob of the weights that produced it (the cache is recomputed under the new weights);
    policy_version is the oldest version in the row, and a group is as old as its oldest row."""
    new = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    state = {k: v.clone() for k, v in new.state_dict().items()}
    engine = HFEngine(copy.deepcopy(tiny_model), LIVE_STOPS, PAD, seed=0, max_active_rows=6)
    calls = []

    def between_steps():
        calls.append(1)
        return (state, 1) if len(calls) == 4 else None

    sampling = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=3)
    batch = engine.generate(mixed_length_batch, 4, sampling, between_steps=between_steps)
    assert engine.version == 1 and engine.weight_updates == 1
    versions, mask = batch.token_versions, batch.response_mask
    assert bool((versions[mask] == 0).any()) and bool((versions[mask] == 1).any())
    # within a row, versions never go back
    assert bool((versions[:, 1:] >= versions[:, :-1])[mask[:, 1:]].all())
    first_rows = versions[:6, :3][mask[:6, :3]]
    assert bool((first_rows == 0).all())  # the first three tokens of the first rows came before the update
    with torch.no_grad():
        args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, mask)
        lp0, _ = sequence_logprobs(tiny_model, *args, sampling=sampling)
        lp1, _ = sequence_logprobs(new, *args, sampling=sampling)
    expected = torch.where(versions == 0, lp0, lp1)
    assert float(((expected - batch.behavior_logprobs) * mask).abs().max()) < 1e-4
    oldest = versions.masked_fill(~mask, 99).amin(-1)
    assert torch.equal(batch.policy_version[batch.response_lengths > 0], oldest[batch.response_lengths > 0])
    batch.rewards = torch.zeros(len(batch))
    groups = split_groups(batch, 4)
    assert [g.policy_version for g in groups] == batch.policy_version.view(4, 4).amin(1).tolist()


def test_batch_at_a_time_stamps_every_token_with_the_version(tiny_model, prompt_batch):
    engine = HFEngine(tiny_model, EOS, PAD, seed=0, version=3, continuous_batching=False)
    batch = engine.generate(prompt_batch, 2, SamplingParams(max_new_tokens=4))
    assert torch.equal(batch.token_versions, torch.full_like(batch.response_ids, 3))


def test_a_group_with_a_token_older_than_the_bound_is_evicted(tiny_model, mixed_length_batch):
    """The staleness bound holds per token by eviction: a group is as old as its oldest token, so the buffer
    evicts a group of which one token is older than max_staleness even if its other tokens are fresh."""
    from rlhf_core.buffer import VersionedReplayBuffer

    batch = HFEngine(tiny_model, LIVE_STOPS, PAD, seed=0).generate(mixed_length_batch, 2, SamplingParams(8))
    batch.rewards = torch.zeros(len(batch))
    batch.token_versions = torch.full_like(batch.response_ids, 3)
    batch.token_versions[1, 0] = 1  # one token of group 0 is of version 1
    batch.policy_version = batch.token_versions.masked_fill(~batch.response_mask, 99).amin(-1)
    groups = split_groups(batch, 2)
    assert [g.policy_version for g in groups] == [1, 3, 3, 3]
    buffer = VersionedReplayBuffer(max_size=10, max_staleness=1, version=3)
    assert buffer.push_many(groups) == 3  # group 0 (a token 2 versions old) refused; the rest fresh


def test_an_engine_without_mid_generation_updates_ignores_between_steps(max3_prompts, tiny_tokenizer):
    """rollout.partial_rollout with the random engine: the hook is not passed (weights change between batches)."""
    tok = tiny_tokenizer
    engine = RandomEngine(len(tok), [tok.eos_token_id], tok.pad_token_id, seed=0)
    reward = build_reward_fn(RewardConfig(), tok, tok.eos_token_id, 4)
    worker = RolloutWorker(engine, reward, SamplingParams(max_new_tokens=4), 2, tok.pad_token_id)
    batch, _ = worker.rollout(max3_prompts[0][:3], between_steps=lambda: pytest.fail("called"))
    assert len(batch) == 6


def test_a_model_whose_cache_rows_cannot_be_edited_falls_back_and_says_so(mixed_length_batch):
    """A sliding-window model's KV cache cannot have rows dropped and appended: the HF engine generates batch at a
    time, and its warning says that partial rollouts then adopt weights only between generation calls (the
    hook is not called within one)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0,
    )  # fmt: skip
    engine = HFEngine(Qwen2ForCausalLM(cfg), EOS, PAD, seed=0)
    with pytest.warns(RuntimeWarning, match="partial rollouts") as caught:
        batch = engine.generate(mixed_length_batch, 2, SamplingParams(max_new_tokens=6), lambda: pytest.fail("called"))
    (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    text = str(warning.message)
    assert "rollout.engine_kwargs.continuous_batching has no effect" in text
    assert "partial rollouts (rollout.partial_rollout) adopt new weights only between generation calls" in text
    assert len(batch) == 8 and engine.version == 0
