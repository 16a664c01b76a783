"""Algorithms by registration: a loss and an advantage estimator defined here, with the decorators and no table
edited, are accepted by the config and trained with through the real Trainer; options are validated against the
class each algorithm registered; 'grpo' is ppo's loss under another name; the old flat option keys still load."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import Field

from rlhf_core.algorithms import (
    POLICY_LOSSES,
    AlgorithmOptions,
    LossInputs,
    M2POOptions,
    PPOOptions,
    advantages_from_config,
    compute_grpo_loss,
    compute_policy_loss,
    compute_ppo_loss,
    policy_loss_spec,
    register_advantage,
    register_policy_loss,
)
from rlhf_core.algorithms.options import FLAT_KEYS
from rlhf_core.config import AlgorithmConfig, ConfigError, load_config, read_config_file, validate_config
from rlhf_core.data import collate_prompts
from rlhf_core.rollout import HFEngine, SamplingParams
from rlhf_core.trainer import Trainer, sequence_logprobs

REPO = Path(__file__).resolve().parents[1]
G = 4


class ScaledPGOptions(AlgorithmOptions):
    scale: float = Field(1.0, gt=0, description="Weight of the policy-gradient term.")


CALLS: list[float] = []


@register_policy_loss("scaled_pg_test", options=ScaledPGOptions)
def scaled_pg(inputs: LossInputs, options: ScaledPGOptions):
    """REINFORCE without a ratio: ℓ_t = −scale · A · log π(y_t), aggregated like the built-ins, KL term included."""
    CALLS.append(options.scale)
    valid = inputs.valid() > 0
    adv = inputs.advantages.reshape(inputs.logprobs.shape[0], -1)
    per_token = torch.where(valid, -options.scale * adv * inputs.logprobs, torch.zeros_like(inputs.logprobs))
    stats: dict[str, torch.Tensor] = {}
    return inputs.add_kl(inputs.aggregate(per_token), stats), stats


@register_advantage("centred_test", grouped=True)
def centred(inputs, options):
    """The reward minus its group's mean (no scaling, no options)."""
    rewards = inputs.grouped()
    return (rewards - rewards.mean(-1, keepdim=True)).reshape(-1)


def make_cfg(*overrides):
    return load_config(
        None, [f"rollout.samples_per_prompt={G}", "trainer.prompts_per_step=8", "rollout.max_new_tokens=4", *overrides]
    )


@pytest.fixture
def batch(tiny_model, tiny_tokenizer, max3_prompts):
    """32 sampled rows (8 prompts x G=4) with rewards 1, 0, 0, 0 in every group."""
    tok = tiny_tokenizer
    engine = HFEngine(tiny_model, tok.eos_token_id, tok.pad_token_id, seed=0)
    b = engine.generate(collate_prompts(max3_prompts[0][:8], tok.pad_token_id), G, SamplingParams(max_new_tokens=4))
    b.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0] * 8)
    return b


def test_a_loss_registered_here_trains_from_a_config(tiny_model, batch):
    """No table edited: the config accepts the name and its option, the Trainer calls the function, and the loss
    it reports is what the function computes, over several steps and micro-batches."""
    cfg = make_cfg(
        "algorithm.loss=scaled_pg_test",
        "algorithm.loss_options.scale=0.5",
        "algorithm.advantage=centred_test",
        "trainer.micro_batch_size=12",
        "trainer.lr=1e-3",
    )
    assert isinstance(cfg.algorithm.loss_options, ScaledPGOptions) and cfg.algorithm.loss_options.scale == 0.5
    trainer = Trainer(tiny_model, cfg, pad_token_id=0)
    CALLS.clear()
    for step in range(3):
        with torch.no_grad():
            lp, _ = sequence_logprobs(
                trainer.model,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.response_ids,
                batch.response_mask,
                sampling=trainer.sampling,
            )
        mask = batch.trained_mask.float()
        adv = batch.rewards.view(-1, G) - batch.rewards.view(-1, G).mean(-1, keepdim=True)
        assert torch.equal(trainer.advantages(batch), adv.reshape(-1))  # the registered estimator
        want = (-0.5 * adv.reshape(-1, 1) * lp * mask).sum() / mask.sum()  # token-mean
        metrics = trainer.train_step(batch)
        assert metrics["loss/total"] == pytest.approx(float(want), rel=1e-5, abs=1e-6), step
        assert metrics["loss/policy"] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert CALLS == [0.5] * 9  # 3 micro-batches of 12 rows (the last one 8) per step
    assert trainer.version == 3


def test_a_registered_loss_is_called_by_name_with_its_options():
    logp, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3)
    mask = torch.rand(3, 5) > 0.3
    cfg = AlgorithmConfig(loss="scaled_pg_test", loss_options={"scale": 2.0})
    got, _ = compute_policy_loss(cfg, logp, old, adv, mask)
    want = (-2.0 * adv[:, None] * logp * mask).sum() / mask.sum()
    assert torch.allclose(got, want, atol=1e-6)
    assert "scaled_pg_test" in POLICY_LOSSES and POLICY_LOSSES["scaled_pg_test"] is scaled_pg


@pytest.mark.parametrize(
    "overrides, named",
    [
        # an option of another loss
        (["algorithm.loss=scaled_pg_test", "algorithm.loss_options.clip_eps=0.1"], "algorithm.loss_options.clip_eps"),
        (["algorithm.loss=ppo", "algorithm.loss_options.scale=2.0"], "algorithm.loss_options.scale"),
        (["algorithm.loss=grpo", "algorithm.loss_options.m2_threshold=0.02"], "algorithm.loss_options.m2_threshold"),
        # an option of no loss, a value out of range, an estimator's option it does not take
        (["algorithm.loss=m2po", "algorithm.loss_options.m2_treshold=0.02"], "algorithm.loss_options.m2_treshold"),
        (["algorithm.loss=scaled_pg_test", "algorithm.loss_options.scale=-1"], "algorithm.loss_options.scale"),
        (["algorithm.advantage=centred_test", "algorithm.advantage_options.scale=none"], "advantage_options.scale"),
    ],
)
def test_an_option_the_algorithm_does_not_take_is_refused_naming_the_field(overrides, named):
    with pytest.raises(ConfigError) as exc:
        make_cfg(*overrides)
    msg = str(exc.value)
    assert named in msg, msg
    if "has no effect" in msg:  # the message names the algorithm too, and the one the option belongs to
        name = overrides[0].split("=")[1]
        assert f"'{name}'" in msg


def test_unknown_names_are_refused_listing_the_registered_ones():
    with pytest.raises(ConfigError, match=r"unknown policy loss 'a2c'; registered: .*m2po.*scaled_pg_test"):
        make_cfg("algorithm.loss=a2c")
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'vtrace'; registered: .*centred_test"):
        make_cfg("algorithm.advantage=vtrace")
    with pytest.raises(ConfigError, match="compares the completions of one prompt"):  # grouped=True's rule
        make_cfg("algorithm.advantage=centred_test", "rollout.samples_per_prompt=1")


def test_grpo_is_ppos_loss_under_another_name():
    assert policy_loss_spec("grpo") is policy_loss_spec("ppo")
    assert POLICY_LOSSES["grpo"] is POLICY_LOSSES["ppo"]
    cfg = make_cfg("algorithm.loss=grpo", "algorithm.loss_options.dual_clip=2.0")
    assert cfg.algorithm.loss == "grpo" and type(cfg.algorithm.loss_options) is PPOOptions  # kept as written
    logp, old, adv, ref = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4), torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.2
    got, _ = compute_policy_loss(cfg.algorithm, logp, old, adv, mask, ref_logprobs=ref)
    ppo = cfg.algorithm.model_copy(update={"loss": "ppo"})
    assert torch.equal(got, compute_policy_loss(ppo, logp, old, adv, mask, ref_logprobs=ref)[0])
    direct = compute_grpo_loss(logp, old, adv, mask, dual_clip=2.0, ref_logprobs=ref)[0]
    assert torch.equal(got, direct) and torch.equal(direct, compute_ppo_loss(logp, old, adv, mask, dual_clip=2.0)[0])


def test_a_registered_estimator_gives_the_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 1.0, 1.0]])
    got = advantages_from_config(AlgorithmConfig(advantage="centred_test"), r)
    assert torch.equal(got, r - r.mean(-1, keepdim=True))


def _flat(algorithm: dict) -> dict:
    """An algorithm section written the old way: the options as flat keys of algorithm:."""
    old = {option_of: key for key, option_of in FLAT_KEYS.items()}
    out = {k: v for k, v in algorithm.items() if not k.endswith("_options")}
    for kind in ("loss", "advantage"):
        for option, value in algorithm.get(f"{kind}_options", {}).items():
            out[old[(kind, option)]] = value
    return out


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads_and_so_does_its_old_flat_form(path, tmp_path):
    new = load_config(path)
    data = read_config_file(path)  # with its base: merged in
    data["algorithm"] = _flat(data["algorithm"])
    old_path = tmp_path / path.name
    old_path.write_text(yaml.safe_dump(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = load_config(old_path)
    assert old == new
    notes = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    for key in set(data["algorithm"]) & set(FLAT_KEYS):
        kind, option = FLAT_KEYS[key]
        assert f"algorithm.{key} is now algorithm.{kind}_options.{option}" in notes


def test_old_flat_keys_and_old_dumped_configs_load():
    # every flat field of the old AlgorithmConfig, at its old default, as a checkpoint of a grpo run held them
    old_dump = {"loss": "grpo", "advantage": "grpo", "clip_eps": 0.2, "clip_eps_high": None, "dual_clip": None}
    old_dump |= {"m2_threshold": 0.04, "masking": "trust_region", "ratio_sq_threshold": 4.0, "adv_scale": "group"}
    old_dump |= {"adv_eps": 1e-6, "gamma": 1.0, "lam": 1.0, "whiten_advantages": True, "kl_coef": 0.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = AlgorithmConfig(**old_dump)
    # the old defaults, but adv_eps: the grpo default is TRL's 1e-4 since 2026-12-06 (and the sample std)
    assert cfg == AlgorithmConfig(advantage_options={"eps": 1e-6})
    notes = sorted(str(w.message) for w in caught)  # only for the options that apply
    assert len(notes) == 5 and "algorithm.adv_scale is now algorithm.advantage_options.scale" in notes
    # an override by the old key beats the value at the new home (a sweep's grid over a dumped base)
    with pytest.warns(FutureWarning, match="algorithm.clip_eps is now algorithm.loss_options.clip_eps"):
        cfg = load_config(REPO / "configs" / "tiny.yaml", ["algorithm.clip_eps=0.1", "algorithm.loss=m2po"])
    assert cfg.algorithm.loss_options == M2POOptions(clip_eps=0.1)
    # an old key that does not apply, at a value that matters, is refused naming the key and the loss
    with pytest.raises(ConfigError, match="algorithm.m2_threshold has no effect with algorithm.loss 'ppo'"):
        load_config(None, ["algorithm.loss=ppo", "algorithm.m2_threshold=0.02"])
    with pytest.raises(ConfigError, match=r"algorithm.clip_eps: Input should be less than 1 \(got 1.5\)"):
        with pytest.warns(FutureWarning):
            load_config(None, ["algorithm.clip_eps=1.5"])


def test_a_dumped_config_switches_algorithm_and_assignment_follows():
    base = load_config(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml").model_dump(mode="json")
    assert base["algorithm"]["loss_options"]["m2_threshold"] == 0.04
    switched = copy.deepcopy(base)
    switched["algorithm"]["loss"] = "grpo"  # a sweep point over algorithm.loss: its defaults are left out
    assert validate_config(switched).algorithm.loss_options == PPOOptions(clip_eps=None)
    base["algorithm"]["loss_options"]["m2_threshold"] = 0.02
    base["algorithm"]["loss"] = "grpo"  # a value that matters is not
    with pytest.raises(ConfigError, match="m2_threshold has no effect with algorithm.loss 'grpo'"):
        validate_config(base)
    cfg = AlgorithmConfig(loss_options={"clip_eps": 0.1})
    cfg.loss = "m2po"
    assert cfg.loss_options == M2POOptions(clip_eps=0.1)
    cfg.loss_options = {"masking": "ratio_sq"}
    assert cfg.loss_options == M2POOptions(masking="ratio_sq")


def test_registration_is_checked():
    class Loose(AlgorithmOptions):
        model_config = {"extra": "allow"}

    with pytest.raises(ValueError, match="'ppo' is already registered"):
        register_policy_loss("ppo")(lambda inputs, options: None)
    with pytest.raises(TypeError, match="subclass of rlhf_core.algorithms.AlgorithmOptions"):
        register_policy_loss("x_test", options=dict)
    with pytest.raises(TypeError, match="extra='forbid'"):
        register_policy_loss("x_test", options=Loose)
    with pytest.raises(TypeError, match="step_mask"):
        register_policy_loss("x_test", step_mask=True)
    register_policy_loss("scaled_pg_test", options=ScaledPGOptions)(scaled_pg)  # its module imported again: fine
    assert policy_loss_spec("scaled_pg_test").fn is scaled_pg


def test_every_public_name_of_the_package_resolves_to_what_it_names():
    """The package loads its tensor functions on first access; none is shadowed by a submodule of its name."""
    import types

    import rlhf_core.algorithms as algorithms

    for name in algorithms.__all__:
        assert not isinstance(getattr(algorithms, name), types.ModuleType), name
    assert callable(algorithms.value_loss) and callable(algorithms.compute_gae_advantages)


def test_a_loss_given_as_a_file_path_loads_with_its_options_and_bad_paths_name_the_key(tmp_path):
    """algorithm.loss '<file.py>:<name>': the file is imported (once per process; the Ray trainer imports it in its
    own, tests/test_algo_ray.py) and registers the loss; a missing file or a name it does not register is a
    ConfigError naming algorithm.loss."""
    from tests.test_algo_ray import USER_LOSS

    path = tmp_path / "my_losses.py"
    path.write_text(USER_LOSS)
    cfg = load_config(None, [f"algorithm.loss={path}:user_pg_test", "algorithm.loss_options={scale: 0.25}"])
    assert cfg.algorithm.loss_spec.name == "user_pg_test" and cfg.algorithm.loss_options.scale == 0.25
    assert f"{path}:user_pg_test" not in list(POLICY_LOSSES)  # listed under its own name only
    with pytest.raises(ConfigError, match=r"algorithm\.loss.*nowhere\.py does not exist"):
        load_config(None, [f"algorithm.loss={tmp_path / 'nowhere.py'}:user_pg_test"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss.*registers no policy loss 'other'"):
        load_config(None, [f"algorithm.loss={path}:other"])
