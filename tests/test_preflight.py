"""Launch-time checks that need the model or the machine: refused before anything starts, naming the field,
the file and what to do (rlhf_core/run/preflight.py, rlhf_core.model.policy.check_model_dir)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.model.directory import model_context_length
from rlhf_core.model.policy import ModelLoadError, check_model_dir, load_policy
from rlhf_core.run.preflight import (
    LATEST,
    LOCK_FILE,
    check_lengths,
    check_output_dir,
    claim_run_dir,
)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------ output_dir
def test_a_writable_output_dir_is_created(tmp_path):
    out = check_output_dir(tmp_path / "a" / "b")
    assert out.is_dir() and out == (tmp_path / "a" / "b").resolve()
    assert not list(out.iterdir())  # the write test leaves nothing behind


def test_an_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"run.output_dir=.*taken.*not a directory"):
        check_output_dir(f)
    with pytest.raises(ConfigError, match=r"run.output_dir=.*cannot create"):
        check_output_dir(f / "sub")


def _refusal(path) -> str:
    """check_output_dir(path)'s ConfigError message ('' when it passes). As root (which writes through any
    permission bits: this machine and CI) it runs in a forked child that has dropped to the user nobody."""

    def check() -> str:
        try:
            check_output_dir(path)
        except ConfigError as exc:
            return str(exc)
        return ""

    if os.geteuid() != 0:
        return check()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, then the check; os._exit skips the parent's exit hooks (Prefect's, pytest's)
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, check().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as answer:
        message = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the check as nobody did not complete"
    return message


def test_a_read_only_output_dir_is_refused():
    import tempfile

    parent = tempfile.mkdtemp(prefix="atrlhf-ro-")  # under /tmp: traversable by nobody (pytest's basetemp is not)
    ro = os.path.join(parent, "ro")
    os.mkdir(ro)
    os.chmod(parent, 0o755)
    os.chmod(ro, 0o555)
    try:
        assert re.search(r"run.output_dir=.*ro.*cannot be written", _refusal(ro)), _refusal(ro)
        os.chmod(ro, 0o777)
        assert _refusal(ro) == ""  # the same directory, writable: accepted (the refusal was the permission bits)
    finally:
        shutil.rmtree(parent)


def test_a_read_only_file_system_is_refused(tmp_path):
    """Root ignores permission bits; /proc/self is writable by nobody."""
    with pytest.raises(ConfigError, match=r"run.output_dir"):
        check_output_dir("/proc/self/runs")


# -------------------------------------------------------------------------------------------- lengths
def test_prompt_plus_new_tokens_must_fit_the_models_context(tiny_policy_dir):
    # the tiny policy has max_position_embeddings=128
    cfg = load_config(None, ["data.max_prompt_tokens=100", "rollout.max_new_tokens=64"])
    with pytest.raises(ConfigError) as exc:
        check_lengths(tiny_policy_dir, cfg)
    msg = str(exc.value)
    assert "data.max_prompt_tokens=100" in msg and "rollout.max_new_tokens=64" in msg
    assert "max_position_embeddings=128" in msg and str(tiny_policy_dir / "config.json") in msg
    assert "at most 28" in msg  # what to do
    assert check_lengths(tiny_policy_dir, load_config(None, ["data.max_prompt_tokens=100"])) == 128


def test_the_longest_actual_prompt_counts_when_prompts_are_given(tiny_policy_dir):
    cfg = load_config(None, ["rollout.max_new_tokens=64"])  # data.max_prompt_tokens=256 by default
    assert check_lengths(tiny_policy_dir, cfg, [[1] * 10, [1] * 60]) == 128  # 60 + 64 fits
    with pytest.raises(ConfigError, match=r"longest prompt \(70 tokens\)"):
        check_lengths(tiny_policy_dir, cfg, [[1] * 70])


def test_context_length_from_other_config_layouts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    assert model_context_length(tmp_path) == (1024, "n_positions=1024")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "max_position_embeddings": 32768,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            }
        )
    )
    assert model_context_length(tmp_path)[0] == 131072
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    assert model_context_length(tmp_path) is None
    assert check_lengths(tmp_path, load_config(None)) is None  # nothing to check against


# ----------------------------------------------------------------------------------- model directories
def test_a_json_config_that_is_not_a_model_config_is_named(tiny_policy_dir, tmp_path):
    d = _copy(tiny_policy_dir, tmp_path / "m")
    for text in ('{"name": "my model"}', "[1, 2]"):
        (d / "config.json").write_text(text)
        with pytest.raises(ModelLoadError, match="model_type") as exc:
            check_model_dir(d)
        assert str(d / "config.json") in str(exc.value)


@pytest.mark.parametrize(
    "garbage",
    [os.urandom(4096), b"\x00" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"],
    ids=["random", "zeros", "bad-header"],
)
def test_garbage_weights_name_the_file(tiny_policy_dir, tmp_path, garbage):
    d = _copy(tiny_policy_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(garbage)
    with pytest.raises(ModelLoadError) as exc:
        load_policy(d, device="cpu")
    msg = str(exc.value)
    assert str(d / "model.safetensors") in msg and "Re-download or re-export" in msg


def test_truncated_weights_name_the_file(tiny_policy_dir, tmp_path):
    d = _copy(tiny_policy_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated") as exc:
        check_model_dir(d)
    assert str(weights) in str(exc.value)


def test_a_shard_missing_from_the_index_is_named(tiny_policy_dir, tmp_path):
    d = _copy(tiny_policy_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors") as exc:
        check_model_dir(d)
    assert "incomplete" in str(exc.value)


# ------------------------------------------------------------------------------------------ run directory
HOLD = """
import sys, time
from rlhf_core.run.preflight import claim_run_dir
claim_run_dir(sys.argv[1], sys.argv[2])
print("claimed", flush=True)
time.sleep(60)
"""


def test_each_run_claims_its_own_directory_and_latest_follows_what_produced_something(tmp_path):
    a = claim_run_dir(tmp_path / "out", "20261130-000001-first")
    latest = tmp_path / "out" / LATEST
    assert not latest.exists()  # a claimed directory holds nothing yet
    a.point_latest()
    assert latest.resolve() == a.path.resolve()
    b = claim_run_dir(tmp_path / "out", "20261130-000002-second")
    assert a.path.is_dir() and b.path.is_dir() and a.path != b.path
    assert latest.resolve() == a.path.resolve()  # b produced nothing (yet): latest stays
    b.point_latest()
    assert latest.is_symlink() and latest.resolve() == b.path.resolve()
    assert os.readlink(latest) == "20261130-000002-second"  # relative: the tree can be moved or mounted elsewhere
    a.release()
    b.release()
    assert not (a.path / LOCK_FILE).exists() and not (b.path / LOCK_FILE).exists()


def test_a_directory_held_by_a_live_run_is_refused_then_free_once_it_ends(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "out"), "shared"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(ConfigError, match=rf"run.name='shared'.*in use by another run \(pid {holder.pid}"):
            claim_run_dir(tmp_path / "out", "shared")
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing (kill -9): its stale lock is taken over
    claim = claim_run_dir(tmp_path / "out", "shared")
    assert json.loads((claim.path / LOCK_FILE).read_text())["pid"] == os.getpid()
    claim.release()


def test_run_name_must_be_a_plain_directory_name():
    for bad in ("a/b", "..", "latest"):
        with pytest.raises(ConfigError, match="run.name"):
            load_config(None, [f"run.name={bad}"])
    cfg = load_config(None, ["run.output_dir=/tmp/o", "run.name=exp-1"])
    assert str(cfg.run.run_dir) == "/tmp/o/exp-1"
    assert str(load_config(None, ["run.output_dir=/tmp/o"]).run.run_dir) == "/tmp/o"


def _build_at_the_barrier(output_dir, barrier, results) -> None:
    """One run's start (forked from this process: transformers already imported, so the builds themselves race
    instead of two interpreters' imports): wait for the other, then ensure the tiny policy and report the path."""
    try:
        import torch

        from rlhf_core.config import ModelConfig
        from rlhf_core.model.policy import ensure_policy

        torch.set_num_threads(1)  # no OpenMP pool in a forked child (the parent's threads are not forked)
        barrier.wait(timeout=60)
        results.put(str(ensure_policy(ModelConfig(preset="micro"), "max3", output_dir)))
    except BaseException as exc:
        results.put(f"failed: {exc!r}")  # the test reads it at once instead of waiting for a path
        raise
    # Exit without the interpreter's shutdown hooks: the parent's (Prefect's services, after a flow test ran in this
    # process) were forked without their threads and fail in threading._shutdown, which made the exit code 1.
    results.close()
    results.join_thread()  # the path is in the pipe
    os._exit(0)


def test_two_runs_building_the_tiny_policy_at_once_both_get_a_whole_one(tmp_path, tiny_policy_dir):
    """Two runs starting together in one run.output_dir: the tiny model is built aside and renamed into place.
    (tiny_policy_dir: this process has built one, so the forked runs import nothing.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_at_the_barrier, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0], outs
    assert outs[0] == outs[1] == str(tmp_path / "tiny_policy")
    assert (tmp_path / "tiny_policy" / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny_policy"]  # no temporary build left behind


# ---------------------------------------------------------- LoRA targets, data paths (rlhf_core/run/preflight.py)
def test_lora_targets_from_the_weight_headers_agree_with_the_model_built_on_meta(tiny_policy_dir, chat_policy_dir):
    """The command line reads the linear layers from the safetensors headers (no torch); the workers check
    against the model itself: both give the same names (the tied lm_head included)."""
    from pathlib import Path

    from rlhf_core.model.directory import linear_layer_names
    from rlhf_core.model.lora import config_linear_module_names

    for model_dir in (tiny_policy_dir, chat_policy_dir):
        from_headers = linear_layer_names(Path(model_dir))
        assert from_headers == config_linear_module_names(model_dir) and "lm_head" in from_headers
    # the tiny default before it is built: its architecture on the meta device
    assert config_linear_module_names(model_type="llama") == linear_layer_names(Path(tiny_policy_dir))


def test_lora_targets_are_checked_before_anything_starts(tiny_policy_dir, tmp_path):
    from rlhf_core.run.preflight import check_lora_targets

    check_lora_targets(load_config(None, [f"model.path={tiny_policy_dir}", "model.lora.target_modules=[q_proj]"]))
    with pytest.raises(ConfigError, match=r"\['c_attn'\] match no linear layer.*'v_proj'"):
        check_lora_targets(load_config(None, [f"model.path={tiny_policy_dir}", "model.lora.target_modules=[c_attn]"]))
    unbuilt = [f"run.output_dir={tmp_path / 'fresh'}", "model.lora.target_modules=[c_attn]"]
    with pytest.raises(ConfigError, match="c_attn"):  # the tiny default, not built: read on the meta device
        check_lora_targets(load_config(None, unbuilt))
    assert not (tmp_path / "fresh").exists()


def test_a_hub_dataset_id_is_accepted_offline_when_it_is_in_the_cache(tmp_path, monkeypatch):
    from rlhf_core.run.preflight import check_data_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    with pytest.raises(ConfigError, match="data.train_path='openai/gsm8k'.*Hugging Face cache"):
        check_data_path("openai/gsm8k", "data.train_path", "dataset")
    (tmp_path / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    check_data_path("openai/gsm8k", "data.train_path", "dataset")
    (tmp_path / "datasets" / "gsm8k").mkdir(parents=True)  # `datasets`' own cache
    check_data_path("gsm8k", "data.train_path", "dataset")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the hub is asked when the run loads it
    check_data_path("someone/else", "data.train_path", "dataset")
    with pytest.raises(ConfigError, match="does not exist"):  # a local path is never looked up on the hub
        check_data_path("./data/train.parquet", "data.train_path", "dataset")


def test_checkpoints_near_a_path_climb_to_the_nearest_run(tmp_path):
    from rlhf_core.run.checkpoint_paths import checkpoint_target, checkpoints_near, newest_checkpoint

    for run, steps in (("a", (20, 40)), ("b", (60,))):
        for step in steps:
            (tmp_path / "runs" / run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
            (tmp_path / "runs" / run / "checkpoints" / f"step_{step:06d}" / "meta.json").write_text("{}")
    (tmp_path / "runs" / "a" / "checkpoints" / "step_000080.tmp").mkdir()  # half-written: never a checkpoint
    assert newest_checkpoint(tmp_path / "runs" / "a").name == "step_000040"
    assert [c.name for c in checkpoints_near(tmp_path / "runs" / "a" / "checkpoints" / "step_000010")] == [
        "step_000040",
        "step_000020",
    ]
    assert [c.name for c in checkpoints_near(tmp_path / "runs" / "c" / "x")] == [
        "step_000060",
        "step_000040",
        "step_000020",
    ]
    with pytest.raises(ConfigError, match=r"^--resume-from .*step_000010: it does not exist; checkpoints that"):
        checkpoint_target(tmp_path / "runs" / "a" / "checkpoints" / "step_000010", "--resume-from")
