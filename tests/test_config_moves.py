"""The config diet, second part: knobs that were two of one idea became one, engine-only options moved into
rollout.engine_kwargs, environment knobs moved under env:, a benchmark switch left the config. Every old key
still loads, from a file, an override or an old checkpoint's train_config.yaml, with one line naming the new
key; the field count is pinned so that growth is a decision."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from rlhf_core.config import ConfigError, TrainConfig, load_config
from tests.test_config_diet import _load_noting
from tests.test_config_diet import test_an_old_key_loads_as_the_new_one_with_one_line as _loads_as_the_new_key

MOVED = [
    (["rollout.max_total_tokens=64"], ["env.max_total_tokens=64"], "env.max_total_tokens"),
    (
        ["rollout.continuous_batching=false"],
        ["rollout.engine_kwargs.continuous_batching=false"],
        "rollout.engine_kwargs.continuous_batching",
    ),
    (
        ["rollout.max_active_rows=5"],
        ["rollout.engine_kwargs.max_active_rows=5"],
        "rollout.engine_kwargs.max_active_rows",
    ),
    (["rollout.dtype=bfloat16"], ["rollout.engine_kwargs={dtype: bfloat16}"], "rollout.engine_kwargs.dtype"),
    # an HF-engine option under another engine was never read: dropped, the line says so
    (["rollout.engine=random", "rollout.dtype=bfloat16"], ["rollout.engine=random"], "read by rollout.engine 'hf'"),
    (["critic.micro_batch_size=8"], ["trainer.micro_batch_size=8"], "trainer.micro_batch_size"),
    (  # what is typed last wins, whichever spelling
        ["critic.micro_batch_size=8", "trainer.micro_batch_size=16"],
        ["trainer.micro_batch_size=16"],
        "trainer.micro_batch_size now; loaded as such",
    ),
    (
        ["trainer.micro_batch_size=16", "critic.micro_batch_size=8"],
        ["trainer.micro_batch_size=8"],
        "(given after trainer.micro_batch_size, it wins)",
    ),
    (["runtime.prefetch=false"], [], "ASYNCTENSORRLHF_NO_PREFETCH"),
    (["data.messages_key=conv"], ["data.prompt_key=conv"], "data.prompt_key"),
    (["data.messages_key=messages"], [], "data.prompt_key 'prompt'"),  # the old default: what prompt does now
    (
        ["data.prompt_key=question", "data.messages_key=conv"],
        ["data.prompt_key=conv"],
        "loaded as data.prompt_key: conv",
    ),
    (
        ["data.messages_key=conv", "data.prompt_key=question"],
        ["data.prompt_key=question"],
        "data.prompt_key now",
    ),
    *(
        (
            [f"{section}.max_consecutive_failures=3"],
            ["supervision.max_consecutive_failures=3"],
            "supervision.max_consecutive_failures",
        )
        for section in ("reward", "env", "agent")
    ),
]


@pytest.mark.parametrize("old, new, key", MOVED, ids=[" ".join(o) for o, _, _ in MOVED])
def test_a_moved_key_loads_as_its_new_home_with_one_line(caplog, old, new, key):
    _loads_as_the_new_key(caplog, old, new, key)


def test_env_factory_is_env_path_and_name(caplog, tmp_path):
    game = tmp_path / "game.py"
    game.write_text("class Countdown:\n    pass\n")
    old = ["env.adapter=gym", f"env.factory={game}:Countdown"]
    cfg, notes = _load_noting(caplog, old)
    assert len(notes) == 1 and "env.path: " in notes[0] and "env.name: Countdown" in notes[0], notes
    assert (cfg.env.path, cfg.env.name, cfg.env.factory) == (str(game), "Countdown", f"{game}:Countdown")
    assert cfg.env.class_name == "GymAdapter" and cfg.env.class_path == ""  # the adapter is built in
    assert cfg.env.instance_kwargs()["factory"] == f"{game}:Countdown"
    new, notes = _load_noting(caplog, ["env.adapter=gym", f"env.path={game}", "env.name=Countdown"])
    assert notes == [] and new.model_dump() == cfg.model_dump()
    with pytest.raises(ConfigError, match="env.factory 'nocolon'"):
        load_config(None, ["env.adapter=gym", "env.factory=nocolon"])
    with pytest.raises(ConfigError, match="env.adapter: gym needs env.path"):
        load_config(None, ["env.adapter=gym"])
    with pytest.raises(ConfigError, match=r"env.path/env.name: .* defines no 'Nope'"):
        load_config(None, ["env.adapter=gym", f"env.path={game}", "env.name=Nope"])


def test_an_old_config_file_with_this_rounds_old_keys_loads_with_a_line_each(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text(
        "rollout: {max_total_tokens: 300, continuous_batching: false, max_active_rows: 4, dtype: float32}\n"
        "runtime: {prefetch: true}\n"
        "critic: {micro_batch_size: 32}\n"
        "data: {messages_key: dialog}\n"
        "reward: {max_consecutive_failures: 7}\n"
    )
    cfg, notes = _load_noting(caplog, [], path=old)
    assert len(notes) == 8, notes
    assert cfg.env.max_total_tokens == 300 and cfg.trainer.micro_batch_size == 32
    assert cfg.rollout.engine_kwargs == {"continuous_batching": False, "max_active_rows": 4, "dtype": "float32"}
    assert cfg.data.prompt_key == "dialog" and cfg.supervision.max_consecutive_failures == 7


def test_the_hf_engine_options_are_checked_and_read_where_they_live():
    from rlhf_core.rollout import build_engine, max_active_rows
    from rlhf_core.run.build import rollout_casts

    cfg = load_config(None, ["rollout.engine_kwargs={continuous_batching: false, max_active_rows: 3}"])
    assert cfg.rollout.engine_option("continuous_batching") is False and max_active_rows(cfg) == 3
    assert max_active_rows(load_config(None)) == 16 * 8  # prompts_per_batch x samples_per_prompt
    for bad, field in (
        ("rollout.engine_kwargs.max_active_rows=0", "rollout.engine_kwargs.max_active_rows"),
        ("rollout.engine_kwargs.dtype=float16", "rollout.engine_kwargs.dtype"),
        ("rollout.engine_kwargs.continuous=false", "rollout.engine_kwargs.continuous"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, [bad])
    assert build_engine is not None
    import torch

    model = torch.nn.Linear(2, 2)
    assert rollout_casts(load_config(None, ["rollout.engine_kwargs.dtype=bfloat16"]), model)
    assert not rollout_casts(load_config(None, ["rollout.engine_kwargs.dtype=float32"]), model)
    assert not rollout_casts(load_config(None), model)


def test_prefetch_is_a_benchmark_switch_read_from_the_environment(monkeypatch):
    from rlhf_core.run.trainer_role import NO_PREFETCH_ENV, prefetch_enabled

    monkeypatch.delenv(NO_PREFETCH_ENV, raising=False)
    assert prefetch_enabled()
    monkeypatch.setenv(NO_PREFETCH_ENV, "1")
    assert not prefetch_enabled()
    assert "prefetch" not in load_config(None).runtime.model_dump()


def test_padding_free_training_is_a_benchmark_switch_read_from_the_environment(monkeypatch):
    import torch

    from rlhf_core.trainer import Trainer
    from rlhf_core.trainer.logprobs import NO_PADDING_FREE_ENV, padding_free_enabled

    monkeypatch.delenv(NO_PADDING_FREE_ENV, raising=False)
    assert padding_free_enabled()
    monkeypatch.setenv(NO_PADDING_FREE_ENV, "1")
    assert not padding_free_enabled()
    assert not Trainer(torch.nn.Linear(2, 2), load_config(None), pad_token_id=0).padding_free


def test_prompt_key_takes_messages_by_default_and_only_its_key_otherwise():
    from rlhf_core.data.errors import DatasetError
    from rlhf_core.data.rows import RowKeys, prompt_messages

    chat = [{"role": "user", "content": "hi"}]
    default = RowKeys.from_config(load_config(None).data)
    assert prompt_messages({"messages": chat, "answer": "1"}, "row 0", default) == ("messages", chat, True)
    assert prompt_messages({"prompt": "hi", "answer": "1"}, "row 0", default)[0] == "prompt"
    custom = RowKeys.from_config(load_config(None, ["data.prompt_key=dialog"]).data)
    assert prompt_messages({"dialog": chat, "messages": [], "answer": "1"}, "row 0", custom)[1] == chat
    with pytest.raises(DatasetError, match="no prompt: needs a 'dialog' string or chat list; the row has keys"):
        prompt_messages({"messages": chat, "answer": "1"}, "row 0", custom)


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if arg is not type(None) and isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def config_fields(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Every key a user sets: the leaf fields of each section, Optional sections (lora, overlong) included;
    a list of entries (reward.functions, env.tools) and a mapping of options (engine_kwargs, loss_options) count
    once."""
    out = []
    for name, field in model.model_fields.items():
        section = _model_in(field.annotation)
        if section is not None and typing.get_origin(field.annotation) is not list:
            out += config_fields(section, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_the_config_has_the_fields_it_has():
    """The count moves only on purpose: 164 before last round's moves, 156 after them, 158 with
    supervision.sync_check.{action, tolerance}, 159 with algorithm.rollout_correction.rejected, 160 with
    agent.error_reward, 161 with supervision.audit, 162 with cluster.resources.eval (the evaluation actor); 160
    without runtime.autopilot.wait_frac (a constant, as the autoscaler's) and model.lora.dropout (only 0 was
    allowed), 159 without reward.model.trust_remote_code (model.trust_remote_code covers every model directory),
    158 without trainer.padding_free (a benchmark switch: ASYNCTENSORRLHF_NO_PADDING_FREE), 160 with
    data.{sampler, priority_floor} (prioritized prompt sampling). Change the number with the field."""
    fields = config_fields()
    assert len(fields) == len(set(fields)) == 160, len(fields)
    for gone in (
        "trainer.padding_free",
        "reward.model.trust_remote_code",
        "runtime.autopilot.wait_frac",
        "model.lora.dropout",
        "runtime.prefetch",
        "rollout.max_total_tokens",
        "rollout.continuous_batching",
        "rollout.max_active_rows",
        "rollout.dtype",
        "critic.micro_batch_size",
        "data.messages_key",
        "env.factory",
        "reward.max_consecutive_failures",
        "env.max_consecutive_failures",
        "agent.max_consecutive_failures",
    ):
        assert gone not in fields
    assert {"env.max_total_tokens", "env.workers", "supervision.max_consecutive_failures"} <= set(fields)


@pytest.mark.parametrize(
    "key, kept, other, now",
    [
        ("runtime.autopilot.wait_frac", 0.2, 0.3, "rlhf_core.autopilot.WAIT_FRAC"),
        ("model.lora.dropout", 0.0, 0.3, "no LoRA dropout"),
        ("trainer.padding_free", True, False, "ASYNCTENSORRLHF_NO_PADDING_FREE=1"),
    ],
)
def test_a_key_whose_value_is_fixed_now_loads_at_that_value_and_refuses_another(caplog, key, kept, other, now):
    lora = ["model.lora={r: 4}"] if key.startswith("model.lora") else []
    cfg, notes = _load_noting(caplog, [*lora, f"{key}={kept}"])
    assert len(notes) == 1 and key in notes[0] and now in notes[0], notes
    assert cfg.model_dump() == load_config(None, lora).model_dump()
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}={other} cannot be kept.*{now}"):
        load_config(None, [*lora, f"{key}={other}"])
    assert load_config(None, [*lora, f"{key}={other}", f"{key}={kept}"]).model_dump() == cfg.model_dump()  # last wins


def test_the_reward_model_trusts_its_code_with_model_trust_remote_code(caplog, tmp_path):
    """reward.model.trust_remote_code is model.trust_remote_code now: the same value loads with one line; trusting
    the RM's code alone cannot be kept (the policy's would be trusted unasked) unless the run trusts code, also when
    a later override says so."""
    for old, new in (
        (["reward.model.trust_remote_code=false"], []),
        (["model.trust_remote_code=true", "reward.model.trust_remote_code=true"], ["model.trust_remote_code=true"]),
        (["reward.model.trust_remote_code=true", "model.trust_remote_code=true"], ["model.trust_remote_code=true"]),
    ):
        cfg, notes = _load_noting(caplog, old)
        assert len(notes) == 1 and "model.trust_remote_code now" in notes[0], notes
        assert cfg.model_dump() == load_config(None, new).model_dump()
    with pytest.raises(ConfigError, match=r"reward.model.trust_remote_code=true cannot be kept alone.*model.trust_rem"):
        load_config(None, ["reward.model.trust_remote_code=true"])
    path = tmp_path / "old.yaml"
    path.write_text("reward: {model: {trust_remote_code: true}}\n")
    with pytest.raises(ConfigError, match="set model.trust_remote_code=true"):
        load_config(str(path))
    assert load_config(str(path), ["model.trust_remote_code=true"]).model.trust_remote_code is True


@pytest.mark.parametrize(
    "in_file, typed, expected",
    [
        ({"trainer": {"warm_start": {"steps": 300}}}, "trainer.warm_start_steps=0", 0),  # old key typed, new in file
        ({"trainer": {"warm_start_steps": 300}}, "trainer.warm_start.steps=0", 0),  # new key typed, old in file
        ({"trainer": {"warm_start_steps": 300}}, "trainer.warm_start_steps=7", 7),  # old key in both
        ({"trainer": {"warm_start": {"steps": 300}}}, "trainer.warm_start.steps=5", 5),
    ],
)
def test_the_command_line_wins_over_the_file_whatever_spelling_either_uses(tmp_path, in_file, typed, expected):
    """`--set` is the last word on a key, whether the file or the override spells it the old way or the new."""
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(in_file))
    assert load_config(str(path), [typed]).trainer.warm_start.steps == expected
    assert load_config(str(path)).trainer.warm_start.steps == 300  # the file alone, either spelling


def test_the_last_of_two_overrides_wins_whatever_spelling_and_the_engine_is_read_in_context(tmp_path):
    """Overrides apply in order, each migrated against everything before it: a later spelling wins over an earlier
    one, and an old engine option typed after the file chose the engine still lands under that engine."""
    path = tmp_path / "recipe.yaml"
    path.write_text("rollout:\n  engine: vllm\n  engine_kwargs: {gpu_memory_utilization: 0.3}\n")
    cfg = load_config(str(path), ["rollout.vllm_gpu_memory_utilization=0.7"])
    assert cfg.rollout.engine_kwargs["gpu_memory_utilization"] == 0.7
    cfg = load_config(None, ["tracking.eval_every=3", "eval.every=4", "tracking.eval_every=5"])
    assert cfg.eval.every == 5
