"""Config loading: defaults, YAML + dotted overrides, and errors that name the field, value and file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import (
    REWARD_COMPONENT_NAMES,
    ConfigError,
    TrainConfig,
    apply_overrides,
    flatten_config,
    load_config,
)

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_valid():
    cfg = load_config(None)
    assert isinstance(cfg, TrainConfig)
    assert cfg.algorithm.loss == "grpo"
    assert cfg.model.path == ""
    assert cfg.data.task == "max3"
    assert cfg.batch_size == cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt


def test_yaml_file_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  loss: ppo\n  loss_options: {clip_eps: 0.3}\ntrainer:\n  lr: 0.001\n")
    cfg = load_config(
        path,
        [
            "algorithm.loss_options.clip_eps=0.1",
            "trainer.betas=[0.8, 0.95]",
            "reward.format_sequences=['=', '+']",
            "rollout.top_k=5",
            "run.output_dir=/tmp/x",
        ],
    )
    assert cfg.algorithm.loss == "ppo"  # from the file
    assert cfg.algorithm.loss_options.clip_eps == 0.1  # override beats the file
    assert cfg.trainer.lr == 0.001
    assert cfg.trainer.betas == (0.8, 0.95)  # YAML list -> tuple field
    assert cfg.reward.format_sequences == ["=", "+"]
    assert cfg.rollout.top_k == 5
    assert cfg.run.output_dir == "/tmp/x"
    # overrides parse YAML scalars: an int-looking value stays int, null is None
    assert load_config(None, ["algorithm.loss_options.clip_eps_high=null"]).algorithm.loss_options.clip_eps_high is None
    assert load_config(None, ["algorithm.loss_options.clip_eps_high=0.28"]).algorithm.loss_options.clip_eps_high == 0.28


def test_apply_overrides_creates_sections_and_rejects_scalar_parent():
    data = apply_overrides({}, ["a.b.c=1", "a.d=x"])
    assert data == {"a": {"b": {"c": 1}, "d": "x"}}
    with pytest.raises(ConfigError, match="a.d"):
        apply_overrides(data, ["a.d.e=1"])
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="empty key segment"):
        load_config(None, ["trainer..lr=1"])


@pytest.mark.parametrize(
    "override, path, value",
    [
        ("algorithm.clip_epz=0.1", "algorithm.clip_epz", "0.1"),
        ("bogus_section=1", "bogus_section", "1"),
        ("trainer.nested.deeper=3", "trainer.nested", "3"),
    ],
)
def test_unknown_key_names_dotted_path_and_value(override, path, value):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    msg = str(exc.value)
    assert f"{path}: unknown field" in msg
    assert value in msg


def test_unknown_key_in_yaml_file_names_file_and_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "rollout.temprature" in msg and "0.5" in msg and str(path) in msg


@pytest.mark.parametrize(
    "override, path, value",
    [
        ("trainer.lr=-1", "trainer.lr", "-1"),
        ("rollout.top_p=2", "rollout.top_p", "2"),
        ("rollout.temperature=0", "rollout.temperature", "0"),
        ("trainer.total_steps=abc", "trainer.total_steps", "'abc'"),
        ("algorithm.loss=sgd", "algorithm.loss", "'sgd'"),
        ("algorithm.loss_options.clip_eps=1.5", "algorithm.loss_options.clip_eps", "1.5"),
        ("trainer.betas=[0.9]", "trainer.betas", "0.9"),
    ],
)
def test_wrong_type_or_range_names_field_and_value(override, path, value):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    msg = str(exc.value)
    assert path in msg
    assert f"(got {value}" in msg or value in msg.split(path, 1)[1]


def test_bad_yaml_names_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("trainer: {lr: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as exc:
        load_config(path)
    assert str(path) in str(exc.value)


def test_non_mapping_file_names_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping") as exc:
        load_config(path)
    assert str(path) in str(exc.value) and "list" in str(exc.value)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == load_config(None)


def test_unknown_reward_component_is_named():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["reward.components={exact_match: 1.0, exactmatch: 0.5}"])
    msg = str(exc.value)
    assert "exactmatch" in msg and "reward" in msg
    with pytest.raises(ConfigError, match="the reward is empty"):
        load_config(None, ["reward.components={}"])


def test_reward_component_names_are_the_registry_keys():
    """config.py names the components without importing torch; the two lists must not drift apart."""
    from rlhf_core.reward.components import REWARD_COMPONENTS

    assert sorted(REWARD_COMPONENT_NAMES) == sorted(REWARD_COMPONENTS)
    assert len(set(REWARD_COMPONENT_NAMES)) == len(REWARD_COMPONENT_NAMES)


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_loading_a_config_imports_neither_torch_nor_transformers():
    out = _fresh_python(
        "import sys; from rlhf_core.config import load_config; load_config('configs/tiny.yaml'); "
        "print(sorted(m for m in ('torch', 'transformers', 'rlhf_core.reward.components') if m in sys.modules))"
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_bad_command_line_is_refused_without_heavy_imports():
    """`atrlhf train --set trainer.lr=-1` answers in well under a second: nothing heavy is imported."""
    out = _fresh_python(
        "import sys; from flows.cli import main; rc = main(['train', '--set', 'trainer.lr=-1']); "
        "print(rc, sorted(m for m in ('torch', 'transformers', 'prefect', 'ray', 'mlflow') "
        "if m in sys.modules))"
    )
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert "trainer.lr" in out.stderr


def test_jsonl_task_needs_train_path_and_model_path():
    with pytest.raises(ConfigError, match="data.train_path"):
        load_config(None, ["data.task=jsonl"])
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, ["data.task=jsonl", "data.train_path=train.jsonl"])
    cfg = load_config(None, ["data.task=jsonl", "data.train_path=train.jsonl", "model.path=/models/x"])
    assert cfg.data.train_path == "train.jsonl"


def test_flatten_config_gives_dotted_keys():
    cfg = load_config(None, ["algorithm.loss_options.clip_eps=0.1"])
    flat = flatten_config(cfg)
    assert flat["algorithm.loss_options.clip_eps"] == 0.1
    assert flat["trainer.lr"] == cfg.trainer.lr
    assert flat["reward.components.exact_match"] == 1.0
    assert flat["trainer.betas"] == list(cfg.trainer.betas)
    assert all(not isinstance(v, dict) for v in flat.values())
    sections = {k.split(".")[0] for k in flat}
    assert sections == set(TrainConfig.model_fields)


def test_env_defaults_for_addresses(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    cfg = load_config(None)
    assert cfg.cluster.address == "ray://head:10001"
    assert cfg.tracking.tracking_uri == "http://mlflow:5000"
    assert load_config(None, ["cluster.address=auto"]).cluster.address == "auto"  # explicit beats env


def test_tiny_yaml_loads():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.data.task == "max3"
    assert cfg.model.path == ""
    assert cfg.reward.components == {"exact_match": 1.0}
    assert cfg.rollout.samples_per_prompt == 8
    assert cfg.trainer.lr == pytest.approx(3e-4)


# ------------------------------------------------------------- settings that would crash, stall or learn nothing
def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(None, list(overrides))
    return str(exc.value)


@pytest.mark.parametrize("lr", ["1e38", "1.0e+38", "2.0", "inf"])
def test_an_absurd_learning_rate_is_refused(lr):
    msg = _refused(f"trainer.lr={lr}")
    assert "trainer.lr" in msg and "at most 1" in msg
    assert load_config(None, ["trainer.lr=1.0"]).trainer.lr == 1.0


def test_max_new_tokens_beyond_any_context_is_refused():
    msg = _refused("rollout.max_new_tokens=1000000000")
    assert "rollout.max_new_tokens=1000000000" in msg and "131072" in msg and "max_position_embeddings" in msg
    assert "data.max_prompt_tokens=300000" in _refused("data.max_prompt_tokens=300000")
    assert "rollout.max_new_tokens" in _refused("rollout.max_new_tokens=1e9")  # YAML reads 1e9 as a string
    assert load_config(None, ["rollout.max_new_tokens=131072"]).rollout.max_new_tokens == 131072


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_group_advantages_need_two_samples_per_prompt(advantage):
    msg = _refused(f"algorithm.advantage={advantage}", "rollout.samples_per_prompt=1")
    assert f"algorithm.advantage '{advantage}'" in msg and "rollout.samples_per_prompt=1" in msg
    assert "2 or more" in msg
    assert load_config(None, [f"algorithm.advantage={advantage}", "rollout.samples_per_prompt=2"])


def test_async_batches_that_admission_can_never_admit_are_refused():
    msg = _refused("trainer.prompts_per_step=4", "runtime.max_staleness=2", "rollout.prompts_per_batch=16")
    for part in ("rollout.prompts_per_batch=16", "trainer.prompts_per_step=4", "runtime.max_staleness=2", "= 12"):
        assert part in msg
    assert "at most 12" in msg and "stall" in msg
    assert "<root>" not in msg and "(got {" not in msg  # a cross-field message, without a dump of the config
    # the edge fits; lockstep is max_staleness 0 under the same rule (one step's groups at a time)
    assert load_config(None, ["trainer.prompts_per_step=4", "runtime.max_staleness=3", "rollout.prompts_per_batch=16"])
    assert "= 4" in _refused("trainer.prompts_per_step=4", "runtime.max_staleness=0", "rollout.prompts_per_batch=16")


def test_runtime_mode_loads_under_its_replacement_with_one_line(caplog):
    """runtime.mode is gone: lockstep is runtime.max_staleness 0. An old config still loads, with one line naming
    the replacement; 'async' is simply accepted; anything else is refused naming the key."""
    with caplog.at_level("WARNING", logger="rlhf_core.config"):
        cfg = load_config(None, ["runtime.max_staleness=3", "runtime.mode=sync"])  # typed last, it wins
    assert cfg.runtime.max_staleness == 0 and "mode" not in cfg.runtime.model_dump()
    notes = [r.getMessage() for r in caplog.records if r.name == "rlhf_core.config"]
    assert len(notes) == 1 and "runtime.max_staleness: 0" in notes[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhf_core.config"):
        assert load_config(None, ["runtime.mode=async"]).runtime.max_staleness == 2
    assert not [r for r in caplog.records if r.name == "rlhf_core.config"]
    with pytest.raises(ConfigError, match="runtime.mode='lockstep'"):
        load_config(None, ["runtime.mode=lockstep"])
    with pytest.raises(ConfigError, match="filter_groups"):
        load_config(None, ["algorithm.filter_groups=true", "rollout.samples_per_prompt=1", "algorithm.advantage=gae"])


def test_shipped_configs_pass_the_new_rules():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)


def test_cluster_dashboard_is_off_by_default():
    assert load_config(None).cluster.dashboard is False
    assert load_config(None, ["cluster.dashboard=true"]).cluster.dashboard is True


def test_a_chat_task_needs_a_chat_model():
    with pytest.raises(ConfigError, match="model.preset=tiny-chat"):
        load_config(None, ["data.task=max3_chat"])
    assert load_config("configs/chat-smoke.yaml").model.preset == "tiny-chat"


def test_a_batch_a_sharded_trainer_group_cannot_split_is_refused_at_validation():
    """Issue 25 defect: a batch whose rows leave some rank fewer rows than the micro-batches every rank must
    run raised ValueError at the first step, after the whole start-up. The config refuses exactly those
    settings (checked against the trainer's own row split), naming the fields."""
    from rlhf_core.model.sharding import micro_slices, rank_rows

    def splits(rows: int, ranks: int, micro: int) -> bool:
        widest = rank_rows(rows, 0, ranks)
        n_micro = max(1, -(-(widest.stop - widest.start) // micro))
        try:
            for rank in range(ranks):
                micro_slices(rank_rows(rows, rank, ranks), n_micro)
        except ValueError:
            return False
        return True

    checked = refused = 0
    for prompts in (1, 2, 3, 5):
        for g in (2, 3):
            for ranks in (2, 3, 4):
                for micro in (1, 2, 4, 64):
                    overrides = [
                        f"trainer.prompts_per_step={prompts}",
                        f"rollout.prompts_per_batch={prompts}",
                        f"rollout.samples_per_prompt={g}",
                        f"cluster.trainer_workers={ranks}",
                        f"trainer.micro_batch_size={micro}",
                    ]
                    if splits(prompts * g, ranks, micro):
                        load_config(None, overrides)
                    else:
                        refused += 1
                        with pytest.raises(ConfigError) as err:
                            load_config(None, overrides)
                        named = ("trainer.prompts_per_step", "cluster.trainer_workers", "trainer.micro_batch_size")
                        assert all(field in str(err.value) for field in named)
                    checked += 1
    assert 0 < refused < checked


def test_a_recipe_states_only_what_differs_from_its_base(tmp_path):
    """`base: other.yaml` (relative to the file) is read first and the recipe's keys merged on top, section by
    section; a chain works, a loop and a missing base are named errors."""
    (tmp_path / "a.yaml").write_text("trainer: {total_steps: 7, lr: 0.001}\nrollout: {samples_per_prompt: 4}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\ntrainer: {total_steps: 9}\n")
    (tmp_path / "c.yaml").write_text("base: sub/b.yaml\nrollout: {max_new_tokens: 3}\n")
    cfg = load_config(tmp_path / "c.yaml", ["trainer.lr=0.002"])
    assert (cfg.trainer.total_steps, cfg.trainer.lr) == (9, 0.002)
    assert (cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens) == (4, 3)
    (tmp_path / "loop.yaml").write_text("base: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="comes back to it"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere.yaml does not exist \(the base of"):
        load_config(tmp_path / "orphan.yaml")
    # the shipped recipes that inherit load what they stated in full before
    lora = load_config(REPO / "configs" / "tiny-lora.yaml")
    assert lora.model.lora.r == 32 and lora.data.task == "max3" and lora.trainer.prompts_per_step == 16
    assert load_config(REPO / "configs" / "sync_baseline.yaml").runtime.max_staleness == 0


def test_the_restart_budget_is_one_knob(caplog):
    """cluster.max_restarts and supervision.restart_limit were two controllers of one budget: the second loads as
    the first, with one line."""
    with caplog.at_level("WARNING", logger="rlhf_core.config"):
        cfg = load_config(None, ["supervision.restart_limit=7"])
    assert cfg.cluster.max_restarts == 7 and "restart_limit" not in cfg.supervision.model_dump()
    assert any("cluster.max_restarts" in r.getMessage() for r in caplog.records)


def test_checkpoint_and_eval_cadence_live_where_a_user_looks(caplog):
    """checkpoint: {every, keep} and eval.every; the old tracking.* keys load under them, one line each."""
    with caplog.at_level("WARNING", logger="rlhf_core.config"):
        cfg = load_config(None, ["tracking.checkpoint_every=7", "tracking.keep_checkpoints=2", "tracking.eval_every=5"])
    assert (cfg.checkpoint.every, cfg.checkpoint.keep, cfg.eval.every) == (7, 2, 5)
    notes = [r.getMessage() for r in caplog.records if r.name == "rlhf_core.config"]
    assert len(notes) == 3 and all(" is " in n and "now" in n for n in notes)
    with caplog.at_level("WARNING", logger="rlhf_core.config"):
        both = load_config(None, ["tracking.eval_every=5", "eval.every=9"])
    assert both.eval.every == 9  # the new key wins, and the line says so


def test_a_typod_key_gets_did_you_mean():
    with pytest.raises(ConfigError) as exc:
        load_config(
            None,
            ["reward.componets={}", "trainer.totl_steps=3", "reward.functions=[{nmae: x}]", "bogus_section=1"],
        )
    msg = str(exc.value)
    assert "reward.componets: unknown field (value {}); did you mean reward.components?" in msg
    assert "trainer.totl_steps: unknown field (value 3); did you mean trainer.total_steps?" in msg
    assert "reward.functions.0.nmae: unknown field (value 'x'); did you mean reward.functions.0.name?" in msg
    assert "bogus_section: unknown field (value 1)\n" in msg + "\n"  # nothing close: no guess
