"""Trainer: learning on a fixed batch, versions, non-finite steps, micro-batching, schedules, weight sync, KL."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhf_core.algorithms import AGG_MODES, compute_policy_loss
from rlhf_core.config import load_config
from rlhf_core.data import collate_prompts
from rlhf_core.rollout import HFEngine, SamplingParams
from rlhf_core.rollout import probe as sync_probe
from rlhf_core.trainer import Trainer, build_lr_lambda, sequence_logprobs

G = 4


def make_cfg(*overrides):
    return load_config(
        None, [f"rollout.samples_per_prompt={G}", "trainer.prompts_per_step=8", "rollout.max_new_tokens=4", *overrides]
    )


@pytest.fixture
def batch(tiny_model, tiny_tokenizer, max3_prompts):
    """32 sampled rows (8 prompts x G=4) with rewards 1, 0, 1, 0 in every group; version 0."""
    tok = tiny_tokenizer
    engine = HFEngine(tiny_model, 10_000, tok.pad_token_id, seed=0)  # no EOS: all rows 4 tokens
    pb = collate_prompts(max3_prompts[0][:8], tok.pad_token_id)
    b = engine.generate(pb, G, SamplingParams(max_new_tokens=4))
    b.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0] * 8)
    return b


@pytest.fixture
def eos_batch(tiny_model, tiny_tokenizer, max3_prompts):
    """Rows of different lengths (EOS is live), for aggregation and micro-batching."""
    tok = tiny_tokenizer
    engine = HFEngine(tiny_model, tok.eos_token_id, tok.pad_token_id, seed=3)
    pb = collate_prompts(max3_prompts[0][8:20], tok.pad_token_id)
    b = engine.generate(pb, G, SamplingParams(max_new_tokens=8))
    assert b.response_lengths.min() < b.response_lengths.max()
    b.rewards = (torch.arange(len(b)) % 3 == 0).float()
    return b


def params_of(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def seq_logprob(model, b):
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    return (lp * b.response_mask).sum(-1)


def test_steps_on_a_fixed_batch_lower_the_loss(tiny_model, batch):
    trainer = Trainer(tiny_model, make_cfg("trainer.lr=3e-3"), pad_token_id=0)
    before = seq_logprob(tiny_model, batch)
    losses = [trainer.train_step(batch)["loss/policy"] for _ in range(6)]
    after = seq_logprob(tiny_model, batch)
    assert losses[-1] < losses[0] - 0.05
    assert losses[0] == pytest.approx(0.0, abs=1e-5)  # on-policy at the start: ratio 1, advantages sum to 0
    positive = batch.rewards > 0
    assert bool((after[positive] > before[positive]).all())
    assert bool((after[~positive] < before[~positive]).all())
    assert trainer.version == 6 and trainer.step == 6 and trainer.skipped_steps == 0


def test_metrics_version_and_staleness(tiny_model, batch):
    trainer = Trainer(tiny_model, make_cfg(), pad_token_id=0)
    m1 = trainer.train_step(batch)
    assert m1["version"] == 1 and trainer.version == 1
    assert m1["async/staleness_mean"] == 0 and m1["async/staleness_max"] == 0
    m2 = trainer.train_step(batch)  # data of version 0 consumed at trainer version 1
    assert m2["version"] == 2 and m2["async/staleness_max"] == 1
    for key in (
        "loss/policy",
        "policy/entropy",
        "policy/grad_norm",
        "policy/lr",
        "policy/clip_frac",
        "reward/mean",
        "reward/std",
        "response/length_mean",
        "trainer/skipped_steps",
        "trainer/step_finite",
    ):
        assert key in m2 and math.isfinite(m2[key]), key
    assert m2["reward/mean"] == pytest.approx(0.5) and m2["reward/std"] == pytest.approx(0.5)
    assert m2["response/length_mean"] == 4.0
    assert 0 < m2["policy/entropy"] <= math.log(19) + 1e-4
    s = trainer.stats()
    assert s["samples"] == 64 and s["tokens"] == 2 * 32 * 4 and s["version"] == 2


def test_advantages_need_whole_groups(tiny_model, batch):
    trainer = Trainer(tiny_model, make_cfg(), pad_token_id=0)
    adv = trainer.advantages(batch)
    assert adv.shape == (32,)
    # rewards [1, 0, 1, 0]: ±.5 over the sample std √(1/3) (+ eps 1e-4), the grpo default
    half = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(adv.view(-1, G), torch.tensor([[half, -half, half, -half]] * 8), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="whole groups"):
        trainer.advantages(batch.select(torch.arange(30)))


@pytest.mark.parametrize("poison", ["behavior_logprobs", "parameter"])
def test_non_finite_step_is_skipped(tiny_model, batch, poison):
    trainer = Trainer(tiny_model, make_cfg(), pad_token_id=0)
    trainer.train_step(batch)
    before = params_of(tiny_model)
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    lr_before = trainer.scheduler.get_last_lr()
    bad = copy.copy(batch)
    if poison == "behavior_logprobs":
        bad.behavior_logprobs = batch.behavior_logprobs.clone()
        bad.behavior_logprobs[3, 1] = float("nan")
    else:  # a NaN weight that only the forward pass sees: every logit and gradient goes NaN
        with torch.no_grad():
            tiny_model.model.norm.weight[0] = float("nan")
        before = params_of(tiny_model)
    m = trainer.train_step(bad)
    assert m["trainer/step_finite"] == 0.0 and m["trainer/skipped_steps"] == 1
    assert trainer.skipped_steps == 1 and trainer.consecutive_skips == 1
    assert trainer.version == 1 and m["version"] == 1
    assert trainer.scheduler.get_last_lr() == lr_before
    after = params_of(tiny_model)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, equal_nan=True)
    assert trainer.optimizer.state_dict()["state"][0]["step"] == opt_state["state"][0]["step"]
    assert all(p.grad is None for p in tiny_model.parameters())
    if poison == "behavior_logprobs":  # the next finite step goes through and resets the streak
        m = trainer.train_step(batch)
        assert m["trainer/step_finite"] == 1.0 and trainer.version == 2 and trainer.consecutive_skips == 0
        assert trainer.skipped_steps == 1


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_matches_one_big_batch(tiny_model, eos_batch, agg):
    base = ["trainer.lr=1e-4", "trainer.grad_clip=1e9", f"algorithm.agg={agg}", "trainer.prompts_per_step=12"]
    big_model, small_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    big = Trainer(big_model, make_cfg(*base, "trainer.micro_batch_size=64"), pad_token_id=0)
    small = Trainer(small_model, make_cfg(*base, "trainer.micro_batch_size=7"), pad_token_id=0)
    mb = big.train_step(eos_batch)
    ms = small.train_step(eos_batch)
    assert mb["loss/policy"] == pytest.approx(ms["loss/policy"], abs=1e-6)
    assert mb["policy/entropy"] == pytest.approx(ms["policy/entropy"], abs=1e-5)
    assert mb["policy/grad_norm"] == pytest.approx(ms["policy/grad_norm"], rel=1e-4)
    for (name, p), q in zip(big_model.named_parameters(), small_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    # and the step really moved the weights
    assert any(not torch.equal(p, q) for p, q in zip(big_model.parameters(), tiny_model.parameters()))


def stale(b, scale=0.5, seed=0):
    """`b` with behaviour log-probs moved ~`scale` nats off the policy on valid tokens (ratios != 1)."""
    out = copy.copy(b)
    noise = scale * torch.randn(b.behavior_logprobs.shape, generator=torch.Generator().manual_seed(seed))
    out.behavior_logprobs = torch.where(b.response_mask, b.behavior_logprobs + noise, b.behavior_logprobs)
    return out


def with_empty_rows(b, rows=(5, 20, 41)):
    """`b` with the responses of `rows` masked out entirely: sequences without a valid token, which the
    seq-mean modes leave out of their denominator (so a micro-batch's share is not its row count)."""
    out = copy.copy(b)
    out.response_mask = b.response_mask.clone()
    out.response_mask[list(rows)] = False
    out.response_lengths = out.response_mask.sum(-1)
    return out


def perturbed(model, scale=0.02, seed=1):
    """A frozen copy of `model` with slightly different weights, as a reference the KL term sees."""
    ref = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
            p.requires_grad_(False)
    return ref


MICRO_CASES = [(loss, agg) for loss in ("ppo", "grpo", "m2po-trust_region", "m2po-ratio_sq") for agg in AGG_MODES]
MICRO_CASES += [("ppo-drop", agg) for agg in AGG_MODES]  # mis, its rejected tokens dropped from the step's mask


@pytest.mark.parametrize("loss,agg", MICRO_CASES, ids=[f"{loss}-{agg}" for loss, agg in MICRO_CASES])
def test_micro_batch_size_does_not_change_the_update(tiny_model, eos_batch, loss, agg):
    """One step with micro_batch_size 8 (6 micro-batches) and 128 (one) from the same weights on the same
    stale batch (KL to a reference on, three rows without valid tokens) gives the same gradient and
    weights. The M2PO mask and the kept-token count are the step's in both, the denominators those of the
    whole batch. M2PO trust_region runs unclipped, as in the paper: with clipping, the tokens it masks are
    mostly clipped anyway and carry no gradient.
    Tolerance: float32, different summation order only; gradients agree to atol 1e-6 / rtol 1e-4 and the
    weights after AdamW (lr 1e-4; its first step is ~lr·g/(|g|+eps), which amplifies float32 noise in
    near-zero gradients) to atol 5e-6, 5 % of lr."""
    name, _, masking = loss.partition("-")
    base = [
        "trainer.lr=1e-4",
        "trainer.grad_clip=1e9",
        f"algorithm.agg={agg}",
        f"algorithm.loss={name}",
        "trainer.prompts_per_step=12",
        "rollout.max_new_tokens=8",
        "algorithm.kl_coef=0.05",
    ]
    if masking == "drop":
        base.append("algorithm.rollout_correction={mode: mis, upper: 1.05, rejected: drop}")
    elif masking:
        base.append(f"algorithm.loss_options.masking={masking}")
    if masking == "trust_region":
        base.append("algorithm.loss_options.clip_eps=null")
    b = with_empty_rows(stale(eos_batch))
    ref = perturbed(tiny_model)
    models = {size: copy.deepcopy(tiny_model) for size in (8, 128)}
    metrics = {
        size: Trainer(
            models[size], make_cfg(*base, f"trainer.micro_batch_size={size}"), pad_token_id=0, ref_model=ref
        ).train_step(b)
        for size in (8, 128)
    }
    small, big = metrics[8], metrics[128]
    for key in (
        "loss/policy",
        "loss/kl",
        "loss/total",
        "policy/ratio_max",
        "policy/clip_frac",
        "policy/approx_kl",
        "policy/entropy",
    ):
        assert small[key] == pytest.approx(big[key], rel=1e-5, abs=1e-6), key
    if name == "m2po":
        assert small["m2po/masked_frac"] == pytest.approx(big["m2po/masked_frac"], abs=1e-6)
        assert big["m2po/masked_frac"] > 0  # the mask is active
    if masking == "drop":
        assert small["correction/masked_frac"] == pytest.approx(big["correction/masked_frac"], abs=1e-6)
        assert 0 < big["correction/masked_frac"] < 1  # some tokens are rejected, hence dropped
    assert small["policy/grad_norm"] == pytest.approx(big["policy/grad_norm"], rel=1e-4)
    for (pname, p), q in zip(models[128].named_parameters(), models[8].parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=pname: f"{n}: {m}")
        torch.testing.assert_close(q, p, atol=5e-6, rtol=0, msg=lambda m, n=pname: f"{n}: {m}")
    assert any(not torch.equal(p, q) for p, q in zip(models[8].parameters(), tiny_model.parameters()))


def test_loss_metrics_and_ratio_max_are_of_the_whole_batch(tiny_model, eos_batch):
    """loss/policy is the policy-gradient term alone, loss/kl the KL, loss/total what is backpropagated, all
    of the whole batch; policy/ratio_max is the batch's maximum, not a mean of micro-batch maxima."""
    cfg = make_cfg(
        "trainer.prompts_per_step=12",
        "rollout.max_new_tokens=8",
        "trainer.micro_batch_size=7",
        "algorithm.kl_coef=0.1",
        "algorithm.agg=seq-mean-token-mean",
    )
    b = stale(eos_batch)
    ref = perturbed(tiny_model)
    trainer = Trainer(tiny_model, cfg, pad_token_id=0, ref_model=ref)
    with torch.no_grad():  # the full-batch values at the weights the step starts from
        lp, _ = sequence_logprobs(tiny_model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
        ref_lp, _ = sequence_logprobs(ref, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    total, stats = compute_policy_loss(
        cfg.algorithm, lp, b.behavior_logprobs, trainer.advantages(b), b.response_mask, ref_logprobs=ref_lp, norm_len=8
    )
    ratio = torch.where(b.response_mask, torch.exp(lp - b.behavior_logprobs), torch.zeros_like(lp))
    per_micro_max = [float(ratio[s : s + 7].max()) for s in range(0, len(b), 7)]
    assert min(per_micro_max) < max(per_micro_max)  # a mean of them would fall short of the maximum

    m = trainer.train_step(b)
    assert m["policy/ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert m["loss/kl"] == pytest.approx(float(stats["loss/kl"]), rel=1e-4) and m["loss/kl"] > 1e-4
    assert m["loss/policy"] == pytest.approx(float(stats["loss/policy"]), abs=1e-6)
    assert m["loss/total"] == pytest.approx(float(total), abs=1e-6)
    assert m["loss/total"] == pytest.approx(m["loss/policy"] + 0.1 * m["loss/kl"], abs=1e-6)
    assert abs(m["loss/total"] - m["loss/policy"]) > 1e-5
    for key in ("policy/ratio_mean", "policy/clip_frac", "policy/approx_kl"):  # token means over the batch
        assert m[key] == pytest.approx(float(stats[key]), rel=1e-4, abs=1e-6), key
    no_kl = Trainer(copy.deepcopy(tiny_model), make_cfg(), 0)
    assert "loss/kl" not in no_kl.train_step(b.select(torch.arange(32)))


def test_lr_schedule_cosine_with_warmup():
    fn = build_lr_lambda("cosine", warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert [fn(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert fn(4) == pytest.approx(1.0)
    assert fn(12) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert fn(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert fn(20) == pytest.approx(0.1) and fn(30) == pytest.approx(0.1)  # floor after the end
    values = [fn(s) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    const = build_lr_lambda("constant", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert [const(s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert build_lr_lambda("constant", 0, 10, 0.1)(0) == 1.0


def test_trainer_follows_the_schedule(tiny_model, batch):
    cfg = make_cfg(
        "trainer.lr=0.01",
        "trainer.lr_schedule=cosine",
        "trainer.warmup_steps=2",
        "trainer.total_steps=6",
        "trainer.min_lr_ratio=0.2",
    )
    trainer = Trainer(tiny_model, cfg, pad_token_id=0)
    fn = build_lr_lambda("cosine", 2, 6, 0.2)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * fn(0))
    for step in range(1, 4):
        m = trainer.train_step(batch)
        assert m["policy/lr"] == pytest.approx(0.01 * fn(step - 1))  # the rate step `step`'s update used
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * fn(step))  # the next step's


def test_state_dict_for_sync(tiny_model, tiny_tokenizer, batch):
    trainer = Trainer(tiny_model, make_cfg(), pad_token_id=0)
    trainer.train_step(batch)
    sync, probe = sync_probe.split(trainer.state_dict_for_sync())
    assert probe is not None and probe[1].shape[:2] == (sync_probe.PROBE_ROWS, probe[0].shape[1] - 1)
    named = dict(tiny_model.named_parameters())
    assert set(named) <= set(sync)
    for t in sync.values():
        assert t.device.type == "cpu" and t.is_contiguous()
    for name, p in named.items():
        assert torch.equal(sync[name], p.detach())
        assert sync[name].data_ptr() != p.data_ptr()  # a copy: later steps do not change what was shipped
    # an engine with an older copy of the model picks the new weights up exactly
    engine = HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer.eos_token_id, 0)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    engine.load_weights(sync, trainer.version)
    for (name, p), q in zip(engine.model.named_parameters(), tiny_model.parameters()):
        assert torch.equal(p, q), name
    assert engine.version == 1


def test_kl_reference_path(tiny_model, batch):
    trainer = Trainer(tiny_model, make_cfg("algorithm.kl_coef=0.1", "trainer.lr=3e-3"), pad_token_id=0)
    assert trainer.ref_model is not None and trainer.ref_model is not tiny_model
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())
    ref_before = params_of(trainer.ref_model)
    m1 = trainer.train_step(batch)
    assert "loss/kl" in m1 and m1["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first
    for _ in range(3):
        m = trainer.train_step(batch)
    assert m["loss/kl"] > 1e-5 and math.isfinite(m["loss/policy"])
    for k, v in params_of(trainer.ref_model).items():  # the reference stays frozen
        assert torch.equal(v, ref_before[k])
    assert "loss/kl" not in Trainer(copy.deepcopy(tiny_model), make_cfg(), 0).train_step(batch)


def test_trainer_state_dict_round_trip(tiny_model, batch):
    trainer = Trainer(tiny_model, make_cfg("trainer.lr_schedule=cosine", "trainer.total_steps=10"), pad_token_id=0)
    trainer.train_step(batch)
    trainer.train_step(batch)
    state = trainer.state_dict()
    other = Trainer(copy.deepcopy(tiny_model), make_cfg("trainer.lr_schedule=cosine", "trainer.total_steps=10"), 0)
    other.load_state_dict(state)
    assert (other.version, other.step, other.skipped_steps) == (2, 2, 0)
    assert other.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
    assert other.optimizer.state_dict()["state"][0]["step"] == 2


# ---------------------------------------------------------------------------------------------------
# Sampling-consistent log-probs: the trainer's distribution is the one the engine sampled from
# ---------------------------------------------------------------------------------------------------

SAMPLING_SETTINGS = [
    pytest.param(["rollout.temperature=0.7"], id="temperature0.7"),
    pytest.param(["rollout.top_k=3"], id="top_k3"),
    pytest.param(["rollout.top_p=0.5"], id="top_p0.5"),
    pytest.param(["rollout.min_p=0.2"], id="min_p0.2"),
    pytest.param(["rollout.temperature=0.7", "rollout.top_k=3", "rollout.top_p=0.5"], id="combined"),
    pytest.param(
        ["rollout.temperature=1.3", "rollout.top_k=5", "rollout.top_p=0.8", "rollout.min_p=0.05"], id="all_four"
    ),
]


def _policy(which, tiny_policy_dir, chat_policy_dir):
    from rlhf_core.model.policy import load_policy

    return load_policy(tiny_policy_dir if which == "tiny" else chat_policy_dir, dtype="float32", device="cpu")


def _on_policy_batch(model, tok, cfg, seed=1):
    """Prompts of different lengths (left padding exercised), G completions each, sampled as cfg.rollout says."""
    from rlhf_core.data import Prompt

    texts = ["max 1 2 3 =", "sum 4 5 =", "max 9 =", "sum 1 2 3 4 5 6 7 8 9 ="]
    pb = collate_prompts(
        [Prompt(uid=i, prompt_ids=tok(t)["input_ids"], answers=[[4]]) for i, t in enumerate(texts)], tok.pad_token_id
    )
    sampling = SamplingParams.from_config(cfg.rollout)
    b = HFEngine(model, [tok.eos_token_id], tok.pad_token_id, seed=seed).generate(pb, G, sampling)
    b.rewards = (torch.arange(len(b)) % 2).float()
    return b


@pytest.mark.parametrize("which", ["tiny", "chat"])
@pytest.mark.parametrize("overrides", SAMPLING_SETTINGS)
def test_on_policy_ratios_are_one_for_every_sampling_setting(which, overrides, tiny_policy_dir, chat_policy_dir):
    """HFEngine samples with temperature / top-k / top-p / min-p; the Trainer's log-probs of those tokens under
    the same weights equal the recorded behaviour log-probs, so every on-policy ratio is 1."""
    model, tok = _policy(which, tiny_policy_dir, chat_policy_dir)
    with torch.no_grad():  # sharpen the random model so that the filters bite
        model.model.embed_tokens.weight.mul_(4)
    cfg = make_cfg("rollout.max_new_tokens=10", *overrides)
    b = _on_policy_batch(model, tok, cfg)
    m = b.response_mask
    assert int(m.sum()) > 40
    trainer = Trainer(model, cfg, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        logprobs, entropy = trainer._logprobs(model, b, slice(None), with_entropy=True)
    ratio = (logprobs - b.behavior_logprobs)[m].exp()
    assert float((ratio - 1).abs().max()) <= 1e-4
    assert bool(torch.isfinite(entropy[m]).all()) and float(entropy[m].min()) >= 0
    if cfg.rollout.top_k or cfg.rollout.top_p < 1 or cfg.rollout.min_p:
        # what the trainer computed before (temperature only) is a different distribution: the test bites
        with torch.no_grad():
            plain, _ = sequence_logprobs(
                model, b.prompt_ids, b.prompt_mask, b.response_ids, m, temperature=cfg.rollout.temperature
            )
        assert float((plain - b.behavior_logprobs)[m].abs().max()) > 0.05
    metrics = trainer.train_step(b)  # the step's own ratios (before its update) are 1 too
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["policy/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["policy/clip_frac"] == 0.0 and metrics["trainer/step_finite"] == 1.0


def test_truncated_logprobs_renormalise_and_keep_the_sampled_token():
    """processed_logits with `keep`: the truncation set is the engine's, renormalised; a kept token outside it
    joins the set; gradients reach exactly the tokens of the set (and the kept one), nothing else."""
    from rlhf_core.rollout import processed_logits, removed_tokens

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, requires_grad=True)
    sp = SamplingParams(temperature=0.7, top_k=4, top_p=0.6)
    drop = removed_tokens(logits.detach() / 0.7, sp)
    outside = drop.float().argmax(-1)  # a filtered-out token at every position
    assert bool(drop.gather(-1, outside[..., None]).all())
    lp = torch.log_softmax(processed_logits(logits, sp, keep=outside), -1)
    chosen = lp.gather(-1, outside[..., None]).squeeze(-1)
    assert bool(torch.isfinite(chosen).all())
    # by hand: log-softmax of the temperature-scaled logits over the kept set plus the chosen token
    support = ~drop.scatter(-1, outside[..., None], False)
    z = (logits.detach() / 0.7).masked_fill(~support, float("-inf"))
    torch.testing.assert_close(chosen.detach(), torch.log_softmax(z, -1).gather(-1, outside[..., None]).squeeze(-1))
    chosen.sum().backward()
    assert bool((logits.grad[~support] == 0).all()) and bool((logits.grad[support] != 0).all())
    torch.testing.assert_close(logits.grad.sum(-1), torch.zeros(2, 3), atol=1e-6, rtol=0)  # softmax gradient


def test_off_policy_token_outside_the_current_set_keeps_a_finite_loss(tiny_model, tiny_tokenizer, max3_prompts):
    """Data sampled by other weights may hold tokens the current policy's top-k would filter out: their
    log-probability stays finite (ratio < 1, not 0 or NaN) and the step is finite."""
    tok = tiny_tokenizer
    cfg = make_cfg("rollout.top_k=1", "rollout.max_new_tokens=6")
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    pb = collate_prompts(max3_prompts[0][:8], tok.pad_token_id)
    b = HFEngine(other, 10_000, tok.pad_token_id, seed=0).generate(pb, G, SamplingParams(max_new_tokens=6))
    b.rewards = (torch.arange(len(b)) % 2).float()
    trainer = Trainer(tiny_model, cfg, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        current, entropy = trainer._logprobs(tiny_model, b, slice(None), with_entropy=True)
        argmax_ok = sequence_logprobs(tiny_model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)[0]
    m = b.response_mask
    assert bool(torch.isfinite(current[m]).all()) and bool((current[m] <= 0).all())
    assert float(current[m].min()) < -0.1  # some sampled tokens are not the current argmax
    assert bool((current[m] >= argmax_ok[m] - 1e-5).all())  # a set of two (argmax + token) is never less likely
    assert bool(torch.isfinite(entropy[m]).all())
    metrics = trainer.train_step(b)
    assert metrics["trainer/step_finite"] == 1.0 and math.isfinite(metrics["loss/total"])


def test_entropy_is_of_the_sampled_distribution(tiny_model, tiny_tokenizer, max3_prompts):
    """policy/entropy measures the truncated, renormalised distribution sampled from: 0 with top_k=1,
    below the temperature-only entropy with top_k=3, and equal to it without filters."""
    tok = tiny_tokenizer
    pb = collate_prompts(max3_prompts[0][:4], tok.pad_token_id)
    b = HFEngine(tiny_model, 10_000, tok.pad_token_id, seed=0).generate(pb, G, SamplingParams(max_new_tokens=4))
    args = (tiny_model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    m = b.response_mask
    with torch.no_grad():
        _, plain = sequence_logprobs(*args, with_entropy=True)
        _, same = sequence_logprobs(*args, with_entropy=True, sampling=SamplingParams())
        _, top3 = sequence_logprobs(*args, with_entropy=True, sampling=SamplingParams(top_k=3))
        _, top1 = sequence_logprobs(*args, with_entropy=True, sampling=SamplingParams(temperature=0.5, top_k=1))
    torch.testing.assert_close(same, plain)
    # (these tokens were sampled without a filter: the response token joins the top 3 where it is not among them)
    assert bool((top3[m] < plain[m]).all()) and bool((top3[m] <= math.log(4) + 1e-5).all())
    # top_k=1 keeps the argmax and the response token: 0 where they coincide, at most log 2 elsewhere
    assert bool((top1[m] <= math.log(2) + 1e-5).all()) and float(top1[m].min()) == pytest.approx(0.0, abs=1e-6)


def test_reward_components_are_step_metrics(tiny_model, batch):
    """reward/<component>: the batch mean of each configured component, from the per-row values on the batch."""
    cfg = make_cfg()
    cfg = cfg.model_copy(
        update={"reward": cfg.reward.model_copy(update={"components": {"format": 0.1, "exact_match": 1.0}})}
    )
    trainer = Trainer(tiny_model, cfg, pad_token_id=0)
    fmt = torch.ones(len(batch))
    correct = (torch.arange(len(batch)) % 4 == 0).float()
    batch.reward_components = torch.stack([fmt, correct], -1)
    batch.rewards = 0.1 * fmt + correct
    m = trainer.train_step(batch)
    assert m["reward/format"] == pytest.approx(1.0) and m["reward/exact_match"] == pytest.approx(0.25)
    assert m["reward/mean"] == pytest.approx(0.35)
    batch.reward_components = None  # a batch without them (an older producer) just logs none
    assert not any(k in trainer.train_step(batch) for k in ("reward/format", "reward/exact_match"))


# ---------------------------------------------------------------------------------------------------
# Padding-free training and per-token staleness
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss,agg", MICRO_CASES, ids=[f"{loss}-{agg}" for loss, agg in MICRO_CASES])
def test_padding_free_matches_the_padded_path(tiny_model, eos_batch, loss, agg):
    """Padding-free training (sequences packed end to end) gives the padded path's losses, metrics, gradients and
    weights, for every loss and aggregation, with a KL reference, rows without tokens and 3 micro-batches."""
    name, _, masking = loss.partition("-")
    base = [
        "trainer.lr=1e-4",
        "trainer.grad_clip=1e9",
        f"algorithm.agg={agg}",
        f"algorithm.loss={name}",
        "trainer.prompts_per_step=12",
        "rollout.max_new_tokens=8",
        "algorithm.kl_coef=0.05",
        "trainer.micro_batch_size=16",
    ]
    if masking == "drop":
        base.append("algorithm.rollout_correction={mode: mis, upper: 1.05, rejected: drop}")
    elif masking:
        base.append(f"algorithm.loss_options.masking={masking}")
    if masking == "trust_region":
        base.append("algorithm.loss_options.clip_eps=null")
    b = with_empty_rows(stale(eos_batch))
    from rlhf_core.trainer.logprobs import shared_prefix_plan

    # the padding-free micro-batches share their groups' prompts (shared_prefix_logprobs), not merely pack them
    assert shared_prefix_plan(b.prompt_ids[:16], b.prompt_mask[:16], b.response_mask[:16]) is not None
    ref = perturbed(tiny_model)
    models = {free: copy.deepcopy(tiny_model) for free in (True, False)}
    trainers = {free: Trainer(models[free], make_cfg(*base), pad_token_id=0, ref_model=ref) for free in (True, False)}
    assert trainers[True].padding_free  # the default
    trainers[False].padding_free = False  # as ASYNCTENSORRLHF_NO_PADDING_FREE=1 makes it
    metrics = {free: trainers[free].train_step(b) for free in (True, False)}
    packed, padded = metrics[True], metrics[False]
    for key in (
        "loss/policy",
        "loss/kl",
        "loss/total",
        "policy/ratio_max",
        "policy/clip_frac",
        "policy/approx_kl",
        "policy/entropy",
    ):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
    if name == "m2po":
        assert packed["m2po/masked_frac"] == pytest.approx(padded["m2po/masked_frac"], abs=1e-6)
    assert packed["policy/grad_norm"] == pytest.approx(padded["policy/grad_norm"], rel=1e-4)
    for (pname, p), q in zip(models[False].named_parameters(), models[True].parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=pname: f"{n}: {m}")
        torch.testing.assert_close(q, p, atol=5e-6, rtol=0, msg=lambda m, n=pname: f"{n}: {m}")


@pytest.mark.parametrize("which", ["tiny", "chat"])
def test_packed_logprobs_equal_padded_and_models_isolate_packed_sequences(which, tiny_policy_dir, chat_policy_dir):
    from rlhf_core.trainer.logprobs import packed_sequence_logprobs, packing_isolates

    model, tok = _policy(which, tiny_policy_dir, chat_policy_dir)
    assert packing_isolates(model)
    cfg = make_cfg("rollout.max_new_tokens=10", "rollout.top_k=3", "rollout.temperature=0.7")
    b = _on_policy_batch(model, tok, cfg)
    sampling = SamplingParams.from_config(cfg.rollout)
    args = (model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    with torch.no_grad():
        padded, ent_padded = sequence_logprobs(*args, with_entropy=True, sampling=sampling)
        packed, ent_packed = packed_sequence_logprobs(*args, with_entropy=True, sampling=sampling)
    m = b.response_mask
    torch.testing.assert_close(packed[m], padded[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed[m], ent_padded[m], atol=1e-5, rtol=0)
    assert bool((packed[~m] == 0).all())


@pytest.mark.parametrize("which", ["tiny", "chat"])
def test_rows_sharing_a_prompt_compute_it_once_with_the_same_logprobs_and_gradients(
    which, tiny_policy_dir, chat_policy_dir
):
    """shared_prefix_logprobs (one sequence per distinct prompt, the group's responses after it under a 4D mask)
    gives the padded pass's log-probs and entropies, 0 off the mask, and the same gradients: what reaches the
    shared prompt sums over its responses as it would over copies. Rows shuffled: groups need not be adjacent."""
    from rlhf_core.trainer.logprobs import (
        padding_free_logprobs,
        prefix_sharing_works,
        shared_prefix_logprobs,
        shared_prefix_plan,
    )

    model, tok = _policy(which, tiny_policy_dir, chat_policy_dir)
    assert prefix_sharing_works(model) and padding_free_logprobs(model) is shared_prefix_logprobs
    cfg = make_cfg("rollout.max_new_tokens=10", "rollout.top_k=3", "rollout.temperature=0.7")
    b = _on_policy_batch(model, tok, cfg)
    perm = torch.randperm(len(b), generator=torch.Generator().manual_seed(0))
    args = (b.prompt_ids[perm], b.prompt_mask[perm], b.response_ids[perm], b.response_mask[perm])
    plan = shared_prefix_plan(*args[:2], args[3])
    assert plan is not None and plan["G"] == 4 and plan["S"] < int(args[1].sum() + args[3].sum())
    sampling = SamplingParams.from_config(cfg.rollout)
    results = {}
    for name, fn in (("padded", sequence_logprobs), ("shared", shared_prefix_logprobs)):
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, *args, with_entropy=True, sampling=sampling)
        ((lp * args[3]).sum() + (lp * args[3]).square().sum()).backward()
        results[name] = (lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    m = args[3].bool()
    (lp_p, ent_p, grad_p), (lp_s, ent_s, grad_s) = results["padded"], results["shared"]
    torch.testing.assert_close(lp_s[m], lp_p[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_s[m], ent_p[m], atol=1e-5, rtol=0)
    assert bool((lp_s[~m] == 0).all())
    for n in grad_p:
        torch.testing.assert_close(grad_s[n], grad_p[n], atol=1e-5, rtol=1e-4, msg=lambda msg, n=n: f"{n}: {msg}")


def test_sharing_prompts_is_used_only_where_it_saves_tokens():
    """No shared prompt, or responses so long that the prompt is a small part: the plan is None (packing)."""
    from rlhf_core.trainer.logprobs import shared_prefix_plan

    prompts = torch.arange(1, 25).view(4, 6)
    ones = torch.ones_like(prompts)
    short = torch.ones((4, 3), dtype=torch.long)
    assert shared_prefix_plan(prompts, ones, short) is None  # four distinct prompts
    grouped = prompts[:2].repeat_interleave(2, 0)
    assert shared_prefix_plan(grouped, ones, short)["G"] == 2  # 2 x (6 + 2 x 3) tokens instead of 4 x 9
    long = torch.ones((4, 60), dtype=torch.long)
    assert shared_prefix_plan(grouped, ones, long) is None  # 252 tokens instead of 264: not worth a 4D mask
    assert shared_prefix_plan(grouped, ones, long, force=True)["S"] == 126


def test_pack_rows_places_whole_sequences_within_the_budget():
    from rlhf_core.trainer.logprobs import pack_rows

    lengths = [5, 9, 2, 4, 9, 1, 3]
    rows, offsets = pack_rows(lengths)
    budget = max(lengths)
    spans = {}
    for n, (r, o) in enumerate(zip(rows, offsets)):
        assert o + lengths[n] <= budget
        spans.setdefault(r, []).append((o, o + lengths[n]))
    for r, s in spans.items():  # no two sequences of a row overlap
        s.sort()
        assert all(a[1] <= b[0] for a, b in zip(s, s[1:])), r
    assert len(spans) == 4  # 33 tokens in rows of 9: four rows, where padding needs seven


class _NoPacking(torch.nn.Module):
    """A policy that attends across the whole row (an explicit all-ones mask): packed sequences leak."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask=None, **kw):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()


def test_padding_free_falls_back_where_the_model_does_not_isolate_sequences(tiny_model, eos_batch):
    from rlhf_core.trainer.logprobs import packing_isolates

    leaky = _NoPacking(copy.deepcopy(tiny_model))
    assert not packing_isolates(leaky)
    plain = copy.deepcopy(tiny_model)
    cfg = make_cfg("trainer.lr=1e-4", "trainer.prompts_per_step=12", "rollout.max_new_tokens=8")
    with pytest.warns(RuntimeWarning, match="does not keep packed sequences apart"):
        got = Trainer(leaky, cfg, pad_token_id=0).train_step(eos_batch)
    base = ["trainer.lr=1e-4", "trainer.prompts_per_step=12", "rollout.max_new_tokens=8"]
    padded = Trainer(plain, make_cfg(*base), pad_token_id=0)
    padded.padding_free = False
    want = padded.train_step(eos_batch)
    assert got["loss/total"] == pytest.approx(want["loss/total"], rel=1e-5, abs=1e-6)


def test_token_staleness_metrics(tiny_model, batch):
    """async/token_staleness_*: the trainer's version minus the version that produced each kept token; with
    token_versions absent, every token is of its row's policy_version."""
    trainer = Trainer(copy.deepcopy(tiny_model), make_cfg(), pad_token_id=0)
    trainer.version = 5
    b = copy.copy(batch)
    b.policy_version = torch.full((len(b),), 2)
    b.token_versions = None
    m = trainer.train_step(b)
    assert m["async/token_staleness_mean"] == 3 and m["async/token_staleness_max"] == 3
    b.token_versions = torch.full_like(b.response_ids, 4)
    b.token_versions[:, 0] = 2  # each row's first token came from an older version
    trainer.version = 5
    m = trainer.train_step(b)
    tokens = b.response_mask.sum()
    first = b.response_mask[:, 0].sum()
    expected = float((3 * first + 1 * (tokens - first)) / tokens)
    assert m["async/token_staleness_mean"] == pytest.approx(expected)
    assert m["async/token_staleness_max"] == 3
    assert m["async/staleness_max"] == 3
