"""Checkpoints: round trip, validation before any weight changes, and exact resume of a run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.loop import build_run, restore_run_checkpoint, run_sync
from rlhf_core.run.checkpoint import (
    CheckpointError,
    CheckpointState,
    capture_rng,
    checkpoint_dir,
    export_policy,
    inspect_path,
    read_checkpoint,
    restore_rng,
    save_checkpoint,
)


def small_cfg(output_dir, *overrides):
    return load_config(
        None,
        [
            f"run.output_dir={output_dir}",
            "model.preset=micro",
            "trainer.total_steps=4",
            "trainer.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "rollout.prompts_per_batch=4",
            "data.eval_size=20",
            "eval.every=0",
            "checkpoint.every=2",
            "trainer.lr=3e-3",
            "trainer.lr_schedule=cosine",
            "trainer.warmup_steps=1",
            *overrides,
        ],
    )


def snapshot(parts):
    return (
        {k: v.detach().clone() for k, v in parts.model.state_dict().items()},
        parts.trainer.version,
        parts.trainer.step,
        parts.prompts.state_dict(),
        [g["lr"] for g in parts.trainer.optimizer.param_groups],
    )


def assert_unchanged(parts, snap):
    weights, version, step, data, lrs = snap
    for k, v in parts.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert (parts.trainer.version, parts.trainer.step) == (version, step)
    assert parts.prompts.state_dict() == data
    assert [g["lr"] for g in parts.trainer.optimizer.param_groups] == lrs


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted 4-step run that checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("full_run")
    cfg = small_cfg(out)
    parts = build_run(cfg)
    result = run_sync(cfg, parts=parts)
    final = {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    return cfg, out, result, final, [dict(m) for m in parts.history]


@pytest.fixture
def fresh_parts(full_run, tmp_path):
    cfg = small_cfg(full_run[1])  # same tiny policy directory: same initial weights
    return build_run(cfg)


def test_save_read_round_trip(tiny_model, tmp_path):
    gen = torch.Generator().manual_seed(5)
    cfg = load_config(None, ["trainer.lr=1e-3"])
    state = CheckpointState(
        trainer={"step": 7, "version": 6, "extra": [1, 2]},
        data={"source": {"epoch": 1, "index": 3}, "queued": [4, 5]},
        rng={"trainer": capture_rng(), "rollout": [gen.get_state()]},
        run={"eval_start": 0.25},
        config=cfg.model_dump(mode="json"),
    )
    path = save_checkpoint(tmp_path / "ckpt", tiny_model, state)
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "policy.safetensors",
        "state.pt",
        "train_config.yaml",
    ]
    assert not (tmp_path / "ckpt.tmp").exists()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["version"] == 6 and meta["format_version"] == 2
    assert meta["params"]["model.embed_tokens.weight"] == list(tiny_model.model.embed_tokens.weight.shape)

    read_state, weights = read_checkpoint(path, tiny_model)
    assert read_state.trainer == state.trainer and read_state.data == state.data and read_state.run == state.run
    assert type(cfg).model_validate(read_state.config) == cfg  # the full config comes back
    sd = tiny_model.state_dict()
    for k, v in weights.items():
        assert torch.equal(v, sd[k]), k
    state_only, none = read_checkpoint(path)
    assert none is None and state_only.step == 7

    # RNG states come back: the same draws follow
    expected = (torch.rand(3), torch.rand(3, generator=gen))
    torch.manual_seed(99)
    gen.manual_seed(99)
    restore_rng(read_state.rng["trainer"])
    gen.set_state(read_state.rng["rollout"][0])
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(torch.rand(3, generator=gen), expected[1])

    # overwriting an existing checkpoint replaces it atomically
    state.trainer["step"] = 8
    save_checkpoint(path, tiny_model, state)
    assert read_checkpoint(path)[0].step == 8
    assert not (tmp_path / "ckpt.old").exists() and not (tmp_path / "ckpt.tmp").exists()


def test_full_run_wrote_checkpoints(full_run):
    cfg, out, result, final, history = full_run
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]
    state, _ = read_checkpoint(out / "checkpoints" / "step_000002")
    assert state.step == 2 and state.version == 2
    assert state.data["source"]["index"] == 8 and state.data["queued"] == []  # two steps of four prompts
    assert state.run["eval_start"] == result["eval/accuracy_start"]
    assert state.config == cfg.model_dump(mode="json")
    assert result["steps"] == 4 and len(history) == 4


def test_the_layout_is_named_and_inspected_in_one_place(full_run, tiny_model, tiny_tokenizer, tmp_path):
    """checkpoint_dir is the one step-directory rule (both runtimes write there); inspect_path tells a
    checkpoint, an exported policy, an adapter-only export and anything else apart."""
    out = full_run[1]
    assert checkpoint_dir(out, 2) == out / "checkpoints" / "step_000002"
    assert checkpoint_dir(out, 2, under=tmp_path) == tmp_path / "step_000002"
    held = inspect_path(checkpoint_dir(out, 4))
    assert held.kind == "checkpoint" and held.run_config == checkpoint_dir(out, 4) / "train_config.yaml"
    assert held.policy_beside("word") == out / "tiny_policy"  # the run's tiny policy holds the architecture
    assert held.policy_beside("chat") is None
    assert inspect_path(out / "tiny_policy").kind == "model"
    exported = export_policy(tiny_model, tiny_tokenizer, {"a": 1}, tmp_path / "policy")
    assert inspect_path(exported).kind == "model" and inspect_path(exported).run_config is not None
    assert inspect_path(exported).policy_beside() is None
    adapter_only = tmp_path / "adapter_only"
    (adapter_only / "adapter").mkdir(parents=True)
    (adapter_only / "adapter" / "adapter_config.json").write_text("{}")
    assert inspect_path(adapter_only).kind == "adapter"
    assert inspect_path(tmp_path / "nothing").kind == "missing"
    assert inspect_path(tmp_path).kind == "unknown"


def test_resume_equals_uninterrupted_run(full_run, fresh_parts, tmp_path):
    cfg, out, result, final, history = full_run
    resumed = run_sync(
        cfg,
        resume_from=str(out / "checkpoints" / "step_000002"),
        parts=fresh_parts,
        checkpoint_dir=tmp_path / "resumed_ckpts",
    )
    assert resumed["steps"] == 4
    assert resumed["eval/accuracy_start"] == result["eval/accuracy_start"]  # carried over from the first run
    sd = fresh_parts.model.state_dict()
    for k, v in final.items():
        assert torch.equal(sd[k], v), f"{k} differs after resuming"
    # the two resumed steps saw the same data and produced the same metrics
    for a, b in zip(fresh_parts.history, history[2:]):
        for key in ("loss/policy", "reward/mean", "policy/entropy", "policy/lr", "version"):
            assert a[key] == b[key], key
    assert resumed["eval/accuracy"] == result["eval/accuracy"]
    assert fresh_parts.trainer.version == 4 and fresh_parts.engine.version == 4


def test_restore_sets_everything(full_run, fresh_parts):
    cfg, out, *_ = full_run
    state = restore_run_checkpoint(fresh_parts, out / "checkpoints" / "step_000002")
    assert fresh_parts.trainer.step == 2 and fresh_parts.trainer.version == 2
    assert fresh_parts.engine.version == 2
    # exactly-once resume: the prompts trained on (two steps of four), and the source serves the rest
    assert fresh_parts.trained == state.data["trained"] and sorted(state.data["trained"].values()) == [1] * 8
    assert fresh_parts.prompts.state_dict()["queued"] == []
    assert fresh_parts.trainer.optimizer.state_dict()["state"][0]["step"] == 2


def _broken_copy(full_run, tmp_path, name="bad"):
    src = full_run[1] / "checkpoints" / "step_000002"
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        ("corrupt_state", "state.pt"),
        ("corrupt_weights", "policy.safetensors"),
        ("corrupt_meta", "meta.json"),
        ("old_format", "layout version 1, written by an older AsyncTensorRLHF"),
        ("unknown_format", "format_version 'x'"),
        ("missing_state", "missing state.pt"),
        ("missing_weights", "missing policy.safetensors"),
        ("not_a_dir", "does not exist"),
    ],
)
def test_bad_checkpoint_fails_before_any_change(full_run, fresh_parts, tmp_path, damage, message):
    path = _broken_copy(full_run, tmp_path)
    if damage == "corrupt_state":
        (path / "state.pt").write_bytes(b"this is not a torch file")
    elif damage == "corrupt_weights":
        data = (path / "policy.safetensors").read_bytes()
        (path / "policy.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "corrupt_meta":
        (path / "meta.json").write_text("{")
    elif damage == "old_format":
        meta = json.loads((path / "meta.json").read_text())
        meta["format_version"] = 1
        (path / "meta.json").write_text(json.dumps(meta))
    elif damage == "unknown_format":
        meta = json.loads((path / "meta.json").read_text())
        meta["format_version"] = "x"
        (path / "meta.json").write_text(json.dumps(meta))
    elif damage == "missing_state":
        (path / "state.pt").unlink()
    elif damage == "missing_weights":
        (path / "policy.safetensors").unlink()
    elif damage == "not_a_dir":
        path = tmp_path / "nowhere"
    snap = snapshot(fresh_parts)
    with pytest.raises(CheckpointError, match=message) as exc:
        restore_run_checkpoint(fresh_parts, path)
    assert str(path) in str(exc.value)
    assert_unchanged(fresh_parts, snap)


def test_mismatched_model_fails_before_any_change(full_run, tmp_path):
    ckpt = full_run[1] / "checkpoints" / "step_000002"
    other = build_run(small_cfg(tmp_path / "wide", "model.preset=word:1x64x2"))
    snap = snapshot(other)
    with pytest.raises(CheckpointError, match="does not match the model") as exc:
        restore_run_checkpoint(other, ckpt)
    assert "different shapes" in str(exc.value) and "model.embed_tokens.weight" in str(exc.value)
    assert_unchanged(other, snap)


def test_swapped_weights_file_fails_before_any_change(full_run, fresh_parts, tmp_path):
    """meta.json matches the model but policy.safetensors comes from another model: caught before copying."""
    from safetensors.torch import save_model

    path = _broken_copy(full_run, tmp_path)
    wide = build_run(small_cfg(tmp_path / "wide", "model.preset=word:1x64x2"))
    save_model(wide.model, str(path / "policy.safetensors"))
    snap = snapshot(fresh_parts)
    with pytest.raises(CheckpointError, match="policy.safetensors"):
        restore_run_checkpoint(fresh_parts, path)
    assert_unchanged(fresh_parts, snap)


def test_a_layout_1_checkpoint_is_refused_saying_so(full_run, fresh_parts, tmp_path):
    """The earlier layout (separate 'result' / 'queue' / 'rollout_rng' keys, format_version 1) fails clearly."""
    path = _broken_copy(full_run, tmp_path)
    torch.save({"trainer": {"step": 2, "version": 2}, "rng": capture_rng(), "queue": {"queued": []}}, path / "state.pt")
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    snap = snapshot(fresh_parts)
    with pytest.raises(CheckpointError, match="older AsyncTensorRLHF.*reads layout 2"):
        restore_run_checkpoint(fresh_parts, path)
    assert_unchanged(fresh_parts, snap)


def test_a_state_without_the_layout_keys_is_refused(full_run, fresh_parts, tmp_path):
    path = _broken_copy(full_run, tmp_path)
    torch.save({"trainer": {"step": 2, "version": 2}}, path / "state.pt")
    with pytest.raises(CheckpointError, match=r"lacks \['data', 'rng'\]"):
        restore_run_checkpoint(fresh_parts, path)


def test_resuming_a_finished_run_says_so_before_training(full_run, fresh_parts):
    cfg, out, *_ = full_run
    with pytest.raises(CheckpointError, match="raise trainer.total_steps to continue"):
        run_sync(cfg, resume_from=str(out / "checkpoints" / "step_000004"), parts=fresh_parts)
