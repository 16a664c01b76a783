"""The config diet: keys that became one (model.preset) or moved (rollout.engine_kwargs, trainer.warm_start) still
load from an old config or `--set old.key=value`, with one line naming the new key, into the same validated config
as the new key; a bad value errors naming the new field."""

from __future__ import annotations

import importlib
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
    # an option of another engine is set aside (one override switches any recipe's engine); one no engine takes
    for overrides in (
        ["rollout.engine_kwargs.tokens_per_s=5"],
        ["rollout.engine=vllm", "rollout.engine_kwargs.tokens_per_s=5"],
    ):
        assert "tokens_per_s" not in load_config(None, overrides).rollout.engine_kwargs
    for overrides, field in (
        (["rollout.engine=vllm", "rollout.engine_kwargs.gpu_memory=0.3"], "rollout.engine_kwargs.gpu_memory"),
        (["rollout.engine_kwargs.tokens_per_sec=5"], "rollout.engine_kwargs.tokens_per_sec"),
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


# cluster.resources: the eight per-role Ray resource keys are one map per role, in Ray's vocabulary
RESOURCES_RENAMED = [
    (["cluster.rollout_cpus=4"], ["cluster.resources.rollout.CPU=4"], "cluster.resources.rollout.CPU"),
    (["cluster.rollout_gpus=0.5"], ["cluster.resources.rollout.GPU=0.5"], "cluster.resources.rollout.GPU"),
    (["cluster.trainer_cpus=3"], ["cluster.resources.trainer={CPU: 3}"], "cluster.resources.trainer.CPU"),
    (["cluster.trainer_gpus=1"], ["cluster.resources.trainer.GPU=1"], "cluster.resources.trainer.GPU"),
    (["cluster.reward_cpus=2"], ["cluster.resources.reward.CPU=2"], "cluster.resources.reward.CPU"),
    (["cluster.reward_gpus=1"], ["cluster.resources.reward={GPU: 1}"], "cluster.resources.reward.GPU"),
    (
        ["cluster.rollout_resources={rollout_node: 1}"],
        ["cluster.resources.rollout.rollout_node=1"],
        "cluster.resources.rollout",
    ),
    (
        ["cluster.trainer_resources={trainer_node: 1, big: 2}"],
        ["cluster.resources.trainer={CPU: 1, GPU: 0, trainer_node: 1, big: 2}"],
        "cluster.resources.trainer",
    ),
    (["cluster.trainer_resources={}"], [], "cluster.resources.trainer"),
    # the key typed last wins, whichever spelling (as every moved key's)
    (
        ["cluster.resources.rollout.CPU=2", "cluster.rollout_cpus=4"],
        ["cluster.resources.rollout.CPU=4"],
        "(given after cluster.resources.rollout.CPU, it wins)",
    ),
    (
        ["cluster.resources.rollout.a=3", "cluster.rollout_resources={a: 1}"],
        ["cluster.resources.rollout.a=1"],
        "(given after cluster.resources.rollout, it wins)",
    ),
    (
        ["cluster.rollout_cpus=4", "cluster.resources.rollout.CPU=2"],
        ["cluster.resources.rollout.CPU=2"],
        "cluster.resources.rollout.CPU",
    ),
    (
        ["cluster.rollout_resources={a: 1}", "cluster.resources.rollout.a=3"],
        ["cluster.resources.rollout.a=3"],
        "cluster.resources.rollout.a",
    ),
]


@pytest.mark.parametrize("old, new, key", RESOURCES_RENAMED, ids=[" ".join(o) for o, _, _ in RESOURCES_RENAMED])
def test_an_old_resource_key_loads_as_cluster_resources_with_one_line(caplog, old, new, key):
    test_an_old_key_loads_as_the_new_one_with_one_line(caplog, old, new, key)


def test_cluster_resources_defaults_are_the_old_defaults_and_a_left_out_key_keeps_its_own():
    res = load_config(None).cluster.resources
    assert res.rollout == {"CPU": 1.0, "GPU": 0.0} and res.trainer == {"CPU": 1.0, "GPU": 0.0}
    assert res.reward == {"CPU": 0.0, "GPU": 0.0}
    res = load_config(None, ["cluster.resources.rollout={GPU: 1, rollout_node: 2}"]).cluster.resources
    assert res.rollout == {"CPU": 1.0, "GPU": 1.0, "rollout_node": 2.0}
    assert load_config("configs/qwen2.5-0.5b-gsm8k.yaml").cluster.resources.trainer == {"CPU": 4.0, "GPU": 1.0}


@pytest.mark.parametrize(
    "override, field",
    [
        ("cluster.resources.rollout.CPU=-1", "cluster.resources.rollout.CPU"),
        ("cluster.resources.trainer.GPU=-0.5", "cluster.resources.trainer.GPU"),
        ("cluster.resources.reward={CPU: 1, rm_node: -2}", "cluster.resources.reward.rm_node"),
        ("cluster.resources.rollout.rollout_node=0", "cluster.resources.rollout.rollout_node"),
        ("cluster.resources.trainer.gpu=1", "cluster.resources.trainer.gpu"),  # Ray spells it GPU
        ("cluster.resources.rollout.memory=1000", "cluster.resources.rollout.memory"),
        ("cluster.resources.learner={CPU: 1}", "cluster.resources.learner"),  # no such role
        ("cluster.resources.rollout.CPU=lots", "cluster.resources.rollout.CPU"),
        ("cluster.rollout_cpus=-1", "cluster.resources.rollout.CPU"),  # an old key's bad value: the new field
        ("cluster.rollout_resources={CPU: 1}", "cluster.resources.rollout.CPU"),  # was refused, still is
    ],
)
def test_a_bad_resource_amount_or_role_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


# The Ray actor options, request totals and placement bundles exactly as the code before cluster.resources built
# them from the eight old fields (its formulas, frozen here), against what the old keys now load into.
_OLD_DEFAULTS = dict(
    rollout_cpus=1.0,
    rollout_gpus=0.0,
    trainer_cpus=1.0,
    trainer_gpus=0.0,
    reward_cpus=0.0,
    reward_gpus=0.0,
    rollout_resources={},
    trainer_resources={},
)


def _before(old: dict, n: int, t: int, rm: bool) -> dict:
    c = {**_OLD_DEFAULTS, **old}
    rank_cpus = c["trainer_cpus"] / t
    options = {
        "rollout": {"num_cpus": c["rollout_cpus"], "num_gpus": c["rollout_gpus"]},
        "trainer": {"num_cpus": rank_cpus, "num_gpus": c["trainer_gpus"]},
        "reward": {"num_cpus": c["reward_cpus"], "num_gpus": c["reward_gpus"]},
    }
    if c["rollout_resources"]:
        options["rollout"]["resources"] = dict(c["rollout_resources"])
    if c["trainer_resources"]:
        options["trainer"]["resources"] = dict(c["trainer_resources"])
    need = {
        "CPU": n * c["rollout_cpus"] + t * rank_cpus + rm * c["reward_cpus"],
        "GPU": n * c["rollout_gpus"] + t * c["trainer_gpus"] + rm * c["reward_gpus"],
    }
    for per, count in ((c["rollout_resources"], n), (c["trainer_resources"], t)):
        for name, amount in per.items():
            need[name] = need.get(name, 0.0) + amount * count
    bundles = [{"CPU": rank_cpus, "GPU": c["trainer_gpus"], **c["trainer_resources"]} for _ in range(t)]
    bundles += [{"CPU": c["rollout_cpus"], "GPU": c["rollout_gpus"], **c["rollout_resources"]} for _ in range(n)]
    if rm:
        bundles.append({"CPU": c["reward_cpus"], "GPU": c["reward_gpus"]})
    bundles = [{k: v for k, v in b.items() if v > 0} or {"CPU": 0.01} for b in bundles]
    group = not (c["rollout_gpus"] == 0 and c["trainer_gpus"] == 0 and not (rm and c["reward_gpus"] > 0) and t == 1)
    return {"options": options, "need": need, "bundles": bundles, "group": group}


ROLE_CASES = [
    ({}, []),
    ({"rollout_cpus": 4, "rollout_gpus": 1, "trainer_cpus": 4, "trainer_gpus": 1}, []),  # the GPU recipes'
    ({"rollout_resources": {"rollout_node": 1}, "trainer_resources": {"trainer_node": 1}, "trainer_cpus": 1}, []),
    (
        {"trainer_cpus": 3, "trainer_gpus": 0.5, "trainer_resources": {"t": 2}, "rollout_resources": {"t": 1}},
        ["cluster.trainer_workers=2", "rollout.num_workers=3"],
    ),
    ({"reward_cpus": 0.5, "reward_gpus": 0.25, "rollout_gpus": 0.25}, ["reward.model.path=/models/rm"]),
    ({"reward_gpus": 1}, []),  # no reward model: its GPU asks for nothing
    ({"reward_cpus": 2}, ["reward.model.path=/models/rm", "cluster.trainer_workers=2"]),
]


@pytest.mark.parametrize("old, more", ROLE_CASES, ids=[str(o) for o, _ in ROLE_CASES])
def test_each_roles_ray_actor_options_are_what_the_old_keys_built(monkeypatch, old, more):
    from rlhf_core.distributed import cluster as cluster_mod
    from rlhf_core.distributed import fleet as fleet_mod

    overrides = [f"cluster.{k}={json.dumps(v)}" for k, v in old.items()] + more
    cfg = load_config(None, overrides)
    c = cfg.cluster
    want = _before(old, cfg.rollout.num_workers, c.trainer_workers, bool(cfg.reward.model.path))
    assert {role: c.actor_options(role) for role in ("rollout", "trainer", "reward")} == want["options"]
    assert cluster_mod.required_resources(cfg) == want["need"]
    assert cluster_mod.placement_bundles(cfg) == want["bundles"]
    assert cluster_mod.rollout_worker_resources(cfg) == {
        "CPU": want["options"]["rollout"]["num_cpus"],
        "GPU": want["options"]["rollout"]["num_gpus"],
        **want["options"]["rollout"].get("resources", {}),
    }

    class _Grouped(Exception):
        pass

    def _placement_group(bundles, strategy):
        raise _Grouped(bundles)

    monkeypatch.setattr(importlib.import_module("ray.util.placement_group"), "placement_group", _placement_group)
    if want["group"]:
        with pytest.raises(_Grouped):
            cluster_mod.gpu_placement_group(cfg, 1.0)
    else:
        assert cluster_mod.gpu_placement_group(cfg, 1.0) is None

    # the rollout worker's options as the fleet passes them to Ray
    seen: dict = {}

    class _Remote:
        def options(self, **options):
            seen.update(options)
            return self

        def remote(self, *args):
            return None

    monkeypatch.setattr(fleet_mod.ray, "remote", lambda cls: _Remote())
    fleet = type("F", (), {"cfg": cfg, "policy_dir": "p", "peers": {}})()
    fleet_mod.Fleet._new_worker(fleet, 0)
    assert {k: v for k, v in seen.items() if k in ("num_cpus", "num_gpus", "resources")} == want["options"]["rollout"]


def test_an_old_config_file_with_every_old_resource_key_loads_with_a_line_each(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text(
        "cluster:\n  rollout_cpus: 4\n  rollout_gpus: 1\n  trainer_cpus: 4\n  trainer_gpus: 1\n"
        "  reward_cpus: 0.5\n  reward_gpus: 0.5\n  rollout_resources: {rollout_node: 1}\n"
        "  trainer_resources: {trainer_node: 1}\n"
    )
    cfg, notes = _load_noting(caplog, [], path=old)
    assert len(notes) == 8 and all("cluster.resources." in n for n in notes), notes
    assert cfg.cluster.resources.model_dump() == {
        "rollout": {"CPU": 4.0, "GPU": 1.0, "rollout_node": 1.0},
        "trainer": {"CPU": 4.0, "GPU": 1.0, "trainer_node": 1.0},
        "reward": {"CPU": 0.5, "GPU": 0.5},
        "eval": {"CPU": 0.0, "GPU": 0.0},
    }


def test_a_checkpoint_written_with_the_old_resource_keys_restores_them(tmp_path, caplog):
    """An older version's checkpoint stores the eight cluster.*_cpus / _gpus / _resources keys: its
    train_config.yaml loads as cluster.resources, one line per key."""
    from rlhf_core.run.checkpoint import META_FILE, inspect_path

    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / META_FILE).write_text(json.dumps({"format_version": 2}))
    new = load_config(None, ["cluster.resources.rollout={GPU: 1, rollout_node: 1}", "cluster.resources.trainer.CPU=2"])
    old = new.model_dump(mode="json")
    del old["cluster"]["resources"]
    old["cluster"].update(_OLD_DEFAULTS, rollout_gpus=1.0, trainer_cpus=2.0, rollout_resources={"rollout_node": 1.0})
    (ckpt / "train_config.yaml").write_text(yaml.safe_dump(old))

    cfg, notes = _load_noting(caplog, [], path=inspect_path(ckpt).run_config)
    assert len(notes) == 8 and all("cluster.resources." in n for n in notes), notes
    assert cfg.model_dump() == new.model_dump()


def test_too_few_resources_names_each_roles_request_and_cluster_resources(monkeypatch):
    from rlhf_core.distributed import cluster as cluster_mod

    monkeypatch.setattr(cluster_mod.ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 0.0})
    cfg = load_config(None, ["cluster.resources.rollout={CPU: 1, rollout_node: 1}", "rollout.num_workers=2"])
    with pytest.raises(cluster_mod.ClusterError) as exc:
        cluster_mod.check_resources(cfg)
    message = str(exc.value)
    assert "CPU: need 3, cluster has 2" in message and "rollout_node: need 2, cluster has 0" in message
    assert "2 rollout worker(s) x {CPU: 1, GPU: 0, rollout_node: 1}" in message and "reward model" not in message
    assert "cluster.resources.<role>" in message


MISMATCH_RENAMED = [
    (
        ["supervision.engine_mismatch_kl=0.02"],
        ["supervision.engine_mismatch.kl=0.02"],
        "supervision.engine_mismatch.kl",
    ),
    (["supervision.engine_mismatch_polls=5"], ["supervision.engine_mismatch={polls: 5}"], "engine_mismatch.polls"),
]


@pytest.mark.parametrize("old, new, key", MISMATCH_RENAMED, ids=[" ".join(o) for o, _, _ in MISMATCH_RENAMED])
def test_the_engine_mismatch_warning_is_one_section_of_supervision(caplog, old, new, key):
    test_an_old_key_loads_as_the_new_one_with_one_line(caplog, old, new, key)
    assert load_config(None).supervision.engine_mismatch.model_dump() == {"kl": 0.05, "polls": 3}
    with pytest.raises(ConfigError, match=r"supervision\.engine_mismatch\.polls"):
        load_config(None, ["supervision.engine_mismatch_polls=0"])


def test_the_evaluation_actor_reserves_a_bundle_only_when_it_asks_for_something():
    """cluster.resources.eval: the pinned evaluations' actor; by default it asks for nothing and reserves nothing,
    given a GPU share it gets the placement group's last bundle (only when eval.every starts it)."""
    from rlhf_core.distributed.cluster import placement_bundles, role_counts

    shared = ["cluster.resources.trainer={GPU: 0.75}", "cluster.resources.eval={GPU: 0.25}"]
    cfg = load_config(None, shared)
    assert cfg.cluster.actor_options("eval") == {"num_cpus": 0.0, "num_gpus": 0.25}
    assert role_counts(cfg)["eval"] == 1 and placement_bundles(cfg)[-1] == {"GPU": 0.25}
    assert role_counts(load_config(None, [*shared, "eval.every=0"]))["eval"] == 0
    assert role_counts(load_config(None, []))["eval"] == 0
