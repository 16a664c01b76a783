"""The config diet: keys that became one (model.preset) or moved (rollout.engine_kwargs, trainer.warm_start) still
load from an old config or `--set old.key=value`, with one line naming the new key, into the same validated config
as the new key; a bad value errors naming the new field."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.data import TINY_PRESETS, preset_shape


def _load_noting(caplog, overrides, path=None):
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhf_core.config"):
        cfg = load_config(path, overrides)
    return cfg, [r.getMessage() for r in caplog.records if r.name == "rlhf_core.config"]


# (old overrides, the new overrides they equal, the new key the one line names)
RENAMED = [
    (["model.tiny_layers=1", "model.tiny_hidden=32", "model.tiny_heads=2"], ["model.preset=micro"], "model.preset"),
    (["model.tiny_kind=chat"], ["model.preset=tiny-chat"], "model.preset"),
    (
        ["model.tiny_kind=chat", "model.tiny_hidden=32", "model.tiny_layers=1", "model.tiny_heads=2"],
        ["model.preset=micro-chat"],
        "model.preset",
    ),
    (["model.tiny_hidden=64"], ["model.preset=word:2x64x4"], "model.preset"),
    (["model.tiny_layers=1"], ["model.preset=word:1x128x4"], "model.preset"),
    (["model.tiny_heads=8"], ["model.preset=word:2x128x8"], "model.preset"),
    (["model.tiny_kind=word"], ["model.preset=tiny"], "model.preset"),
    (["model.tiny_layers=2", "model.tiny_hidden=128", "model.tiny_heads=4"], [], "model.preset"),
    (["model.preset=micro", "model.tiny_hidden=64"], ["model.preset=word:1x64x2"], "model.preset"),
]


@pytest.mark.parametrize("old, new, key", RENAMED, ids=[" ".join(o) for o, _, _ in RENAMED])
def test_an_old_key_loads_as_the_new_one_with_one_line(caplog, old, new, key):
    cfg, notes = _load_noting(caplog, old)
    assert len(notes) == 1 and key in notes[0], notes
    want, new_notes = _load_noting(caplog, new)
    assert new_notes == []
    assert cfg.model_dump() == want.model_dump()


def test_the_presets_name_the_shapes_tests_and_recipes_use():
    assert preset_shape("tiny") == ("word", 2, 128, 4)  # the default, as the old defaults
    assert preset_shape("micro") == ("word", 1, 32, 2)
    assert preset_shape("tiny-chat").kind == "chat" and preset_shape("word:1x64x2") == ("word", 1, 64, 2)
    assert load_config(None).model.preset == "tiny"
    assert load_config(None, ["model.preset=chat:1x32x2"]).model.tiny == TINY_PRESETS["micro-chat"]


@pytest.mark.parametrize("bad", ["huge", "word:1x30x4", "llama:1x32x2", "word:0x32x2"])
def test_a_bad_preset_names_the_field_and_the_presets(bad):
    with pytest.raises(ConfigError, match="model.preset") as exc:
        load_config(None, [f"model.preset={bad}"])
    if bad == "huge":
        assert all(name in str(exc.value) for name in TINY_PRESETS)


def test_an_old_bad_tiny_key_errors_naming_model_preset():
    with pytest.raises(ConfigError, match="model.preset"):
        load_config(None, ["model.tiny_kind=bert"])


def test_text_tasks_ask_for_the_chat_preset():
    with pytest.raises(ConfigError, match="model.preset=tiny-chat"):
        load_config(None, ["data.task=max3_chat"])
    with pytest.raises(ConfigError, match="model.preset=tiny-chat"):
        load_config(None, ["data.task=jsonl", "data.train_path=x.jsonl"])
    assert load_config(None, ["data.task=max3_chat", "model.preset=micro-chat"]).model.tiny.kind == "chat"


def test_a_checkpoint_written_with_the_old_keys_restores_its_preset(tmp_path, caplog):
    """An older version's checkpoint stores model.tiny_*: its train_config.yaml loads (evaluate, serve) as the
    preset, and the chat policy built beside it is the one picked."""
    from rlhf_core.policy_eval import policy_to_evaluate
    from rlhf_core.run.checkpoint import META_FILE, inspect_path

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / META_FILE).write_text(json.dumps({"format_version": 2}))
    old = load_config(None, ["model.preset=micro-chat", "data.task=max3_chat"]).model_dump(mode="json")
    del old["model"]["preset"]
    old["model"].update(tiny_kind="chat", tiny_layers=1, tiny_hidden=32, tiny_heads=2)
    (ckpt / "train_config.yaml").write_text(yaml.safe_dump(old))
    chat_policy = run_dir / "tiny_chat_policy"
    chat_policy.mkdir()
    (chat_policy / "config.json").write_text("{}")

    held = inspect_path(ckpt)
    cfg, notes = _load_noting(caplog, [], path=held.run_config)
    assert cfg.model.preset == "micro-chat" and len(notes) == 1 and "model.preset" in notes[0]
    assert policy_to_evaluate(cfg, ckpt) == (chat_policy, ckpt)


ENGINE_RENAMED = [
    (
        ["rollout.engine=random", "rollout.random_tokens_per_s=100"],
        ["rollout.engine=random", "rollout.engine_kwargs.tokens_per_s=100"],
        "rollout.engine_kwargs.tokens_per_s",
    ),
    (
        ["rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.2"],
        ["rollout.engine=vllm", "rollout.engine_kwargs={gpu_memory_utilization: 0.2}"],
        "rollout.engine_kwargs.gpu_memory_utilization",
    ),
    # an option the engine never read was ignored before: it still is, with the line saying so
    (["rollout.vllm_gpu_memory_utilization=0.6"], [], "rollout.engine_kwargs.gpu_memory_utilization"),
    (["rollout.engine=vllm", "rollout.random_tokens_per_s=5"], ["rollout.engine=vllm"], "tokens_per_s"),
    (["trainer.warm_start_steps=30"], ["trainer.warm_start.steps=30"], "trainer.warm_start.steps"),
    (["trainer.warm_start_lr=0.001"], ["trainer.warm_start.lr=0.001"], "trainer.warm_start.lr"),
    (
        ["trainer.warm_start_targets=prompt_number"],
        ["trainer.warm_start.targets=prompt_number"],
        "trainer.warm_start.targets",
    ),
]


@pytest.mark.parametrize("old, new, key", ENGINE_RENAMED, ids=[" ".join(o) for o, _, _ in ENGINE_RENAMED])
def test_a_moved_key_loads_as_the_new_one_with_one_line(caplog, old, new, key):
    test_an_old_key_loads_as_the_new_one_with_one_line(caplog, old, new, key)


def test_an_old_config_file_with_every_old_key_loads_with_a_line_each(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text(
        "model: {tiny_kind: chat, tiny_layers: 1, tiny_hidden: 32, tiny_heads: 2}\n"
        "data: {task: max3_chat}\n"
        "rollout: {engine: vllm, vllm_gpu_memory_utilization: 0.6, random_tokens_per_s: 0}\n"
        "trainer: {warm_start_steps: 300, warm_start_lr: 0.001, warm_start_targets: prompt_number}\n"
    )
    cfg, notes = _load_noting(caplog, [], path=old)
    assert len(notes) == 6  # one line per rewritten key (the four model.tiny_* keys are one preset)
    assert cfg.model.preset == "micro-chat" and cfg.rollout.engine_kwargs == {"gpu_memory_utilization": 0.6}
    assert cfg.trainer.warm_start.model_dump() == {"steps": 300, "lr": 0.001, "targets": "prompt_number"}


def test_engine_kwargs_are_checked_against_the_engine():
    assert load_config(None, ["rollout.engine=random"]).rollout.engine_option("tokens_per_s") == 0.0
    assert load_config(None, ["rollout.engine=vllm"]).rollout.engine_option("gpu_memory_utilization") == 0.5
    cfg = load_config(None, ["rollout.engine=random", "rollout.engine_kwargs.tokens_per_s=7"])
    assert cfg.rollout.engine_option("tokens_per_s") == 7.0
    for overrides, field in (
        (["rollout.engine_kwargs.tokens_per_s=5"], "rollout.engine_kwargs.tokens_per_s"),  # hf takes none
        (["rollout.engine=vllm", "rollout.engine_kwargs.gpu_memory=0.3"], "rollout.engine_kwargs.gpu_memory"),
        (["rollout.engine=vllm", "rollout.engine_kwargs.tokens_per_s=5"], "rollout.engine_kwargs.tokens_per_s"),
        (
            ["rollout.engine=vllm", "rollout.engine_kwargs.gpu_memory_utilization=1.5"],
            "rollout.engine_kwargs.gpu_memory_utilization",
        ),
        (["rollout.engine=random", "rollout.engine_kwargs.tokens_per_s=-1"], "rollout.engine_kwargs.tokens_per_s"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, overrides)


def test_the_warm_start_is_one_section_of_the_trainer():
    cfg = load_config("configs/chat-smoke.yaml")
    assert cfg.trainer.warm_start.steps == 300 and cfg.trainer.warm_start.targets == "prompt_number"
    with pytest.raises(ConfigError, match="trainer.warm_start.targets"):
        load_config(None, ["trainer.warm_start.targets=everything"])
