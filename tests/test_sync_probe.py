"""The sync probe (rlhf_core.rollout.probe) on the HF engine: a sync that lands passes at noise level, one that is
ignored or lands in part is named for what it is, `warn` goes on, the reference stays small for a large vocabulary,
and the poll reports the probe's KL as mismatch/engine_kl where a step has no fresh token. The vLLM engine's
probe: tests/test_vllm.py; a whole run with an engine that ignores updates: tests/test_vllm_runs.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from rlhf_core.model.sharding import whole_cpu_copies
from rlhf_core.rollout import HFEngine, probe


def published(model) -> dict:
    """What a trainer publishes: parameters and buffers (a tied tensor once), with the probe attached."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    return probe.attach(whole_cpu_copies(named, None), model)


def perturbed(model, scale: float, only: str = ""):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if only in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return new


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    """An HF engine over its own copy of the tiny policy (as a rollout worker holds one)."""
    return HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id)


def test_a_sync_that_lands_passes_at_noise_level(engine, tiny_model):
    check = probe.SyncCheck("fail")
    for version, model in enumerate([tiny_model, perturbed(tiny_model, 0.2), perturbed(tiny_model, 0.5)]):
        weights, sync_probe = probe.split(published(model))
        engine.load_weights(weights, version)
        check.check(engine, sync_probe, version)
        assert check.last_diff < 1e-6 and 0 <= check.last_kl < 1e-10, (version, check.last_diff, check.last_kl)
    stats = check.stats()
    assert stats["sync_checks"] == 3 and stats["sync_check_failures"] == 0 and stats["sync_probe_kl"] is not None


def test_an_ignored_update_is_named(engine, tiny_model):
    check = probe.SyncCheck("fail")
    weights, sync_probe = probe.split(published(tiny_model))
    engine.load_weights(weights, 0)
    check.check(engine, sync_probe, 0)
    _, newer = probe.split(published(perturbed(tiny_model, 0.3)))
    engine.version = 1  # the version adopted, the weights not loaded
    with pytest.raises(probe.SyncCheckError, match=r"version 1.*still computes version 0 .*did not land"):
        check.check(engine, newer, 1, "rollout worker 0")
    assert check.failures == 1 and check.last_kl > 1e-4


def test_an_ignored_first_update_is_named_from_what_the_engine_computed_before(tiny_model, tiny_tokenizer):
    """The first checked sync has no previous reference: the worker samples the probe before loading, and an
    engine that computes the same afterwards is named."""
    from rlhf_core.rollout.worker import RolloutWorker

    engine = HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id)
    engine.load_weights = lambda state_dict, version: setattr(engine, "version", int(version))  # ignores them
    worker = RolloutWorker(engine, None, None, 1, tiny_tokenizer.pad_token_id, sync_check=probe.SyncCheck("fail"))
    with pytest.raises(probe.SyncCheckError, match=r"before the load \(version 0\).*did not land"):
        worker.load_weights(published(perturbed(tiny_model, 0.3)), 1)


def test_a_partial_load_is_told_from_an_ignored_one(engine, tiny_model):
    """Only some tensors land (here: all but the output embedding's tied tensor): neither version's log-probs."""
    check = probe.SyncCheck("fail")
    check.check(engine, probe.split(published(tiny_model))[1], 0)
    new = perturbed(tiny_model, 0.3)
    weights, sync_probe = probe.split(published(new))
    partial = {k: v for k, v in weights.items() if "embed_tokens" not in k}
    engine.load_weights(partial, 1)
    with pytest.raises(probe.SyncCheckError, match="computes neither version 1 nor 0"):
        check.check(engine, sync_probe, 1)


def test_warn_goes_on_and_off_checks_nothing(engine, tiny_model, caplog):
    _, stale = probe.split(published(perturbed(tiny_model, 0.3)))
    warn = probe.SyncCheck("warn")
    with caplog.at_level(logging.WARNING, logger="rlhf_core.rollout"):
        warn.check(engine, stale, 4, "rollout worker 1")
    assert warn.failures == 1 and "rollout worker 1: after loading version 4" in caplog.text
    off = probe.SyncCheck("off")
    off.check(engine, stale, 4)
    assert off.checks == 0
    with pytest.raises(ValueError, match="supervision.sync_check.action"):
        probe.SyncCheck("sometimes")


def test_the_reference_stays_small_for_a_large_vocabulary():
    assert probe.probe_positions(19) == probe.PROBE_LENGTH - 1  # the tiny task: every position
    k = probe.probe_positions(151_936)  # Qwen2.5's vocabulary
    assert 1 <= k < probe.PROBE_LENGTH - 1 and probe.PROBE_ROWS * k * 151_936 <= probe.REFERENCE_FLOATS
    assert probe.prefix_lengths(16, 3) == [13, 14, 15]
    ids = probe.probe_ids(151_936)
    assert ids.shape == (probe.PROBE_ROWS, probe.PROBE_LENGTH) and torch.equal(ids, probe.probe_ids(151_936))


def test_the_trainer_publishes_the_probe_unless_it_is_off(tiny_policy_dir):
    from rlhf_core.config import load_config
    from rlhf_core.run import build

    for action, attached in (("fail", True), ("off", False)):
        cfg = load_config(None, [f"supervision.sync_check.action={action}", "model.dtype=float32"])
        model, tok = build.build_policy(cfg, tiny_policy_dir)
        trainer = build.build_trainer(cfg, model, tok, tiny_policy_dir)
        snapshot = trainer.state_dict_for_sync()
        assert (probe.PROBE_IDS in snapshot) is attached
        if attached:  # the reference is the published weights' own
            torch.testing.assert_close(
                snapshot[probe.PROBE_LOGPROBS], probe.reference(model, snapshot[probe.PROBE_IDS], 15), atol=0, rtol=0
            )


def test_the_poll_reports_the_probe_kl_where_a_step_has_no_fresh_token():
    from types import SimpleNamespace

    from rlhf_core.run.control import assemble_poll

    run = SimpleNamespace(done=False, failed=None, _new_events=[], last_step=0, last_version=0)
    buffer = {"size": 0, "evicted_stale": 0, "dropped_overflow": 0}
    trainer = {"busy_frac": 0.5, "step": 2, "version": 2}
    workers = [
        {"alive": True, "sync_probe_kl": 2e-9, "sync_probe_diff": 1e-5},
        {"alive": True, "sync_probe_kl": 5e-9, "sync_probe_diff": 3e-5},
    ]
    stale_step, fresh_step = {"version": 1}, {"version": 2, "mismatch/engine_kl": 1e-7}
    poll = assemble_poll(run, [stale_step, fresh_step], trainer, buffer, {}, workers)
    assert stale_step["mismatch/engine_kl"] == 5e-9 and stale_step["sync/probe_diff"] == 3e-5  # the worst worker's
    assert fresh_step["mismatch/engine_kl"] == 1e-7  # the step's own fresh tokens win
    assert poll["metrics"] == [stale_step, fresh_step]
