"""Deterministic stale-k mode: every consumed batch is exactly τ versions old; τ = 0 is the on-policy loop."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.loop import build_run, run_sync
from rlhf_core.staleness import WeightHistory, run_stale


def tiny_cfg(tmp_path, steps: int = 8, *extra: str):
    return load_config(
        None,
        [
            "model.preset=micro",
            "data.eval_size=16",
            "rollout.prompts_per_batch=4",
            "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=3",
            "trainer.prompts_per_step=4",
            f"trainer.total_steps={steps}",
            "trainer.lr=0.01",
            "eval.every=0",
            "checkpoint.every=0",
            f"run.output_dir={tmp_path}",
            # a reward that varies from the first step (length), so advantages are non-zero and weights move
            "reward.components={length_penalty: 1.0, exact_match: 1.0}",
            "reward.length_target=1",
            *extra,
        ],
    )


def test_weight_history_keeps_tau_plus_one_versions():
    h = WeightHistory(3)
    for v in range(10):
        h.record(v, {"w": torch.full((1,), float(v))})
        assert h.versions == list(range(max(0, v - 3), v + 1))
    assert h.source_version(9) == 6 and h.source_version(2) == 0
    v, sd = h.weights_for(9)
    assert v == 6 and float(sd["w"]) == 6.0
    with pytest.raises(KeyError):
        h.weights_for(20)
    with pytest.raises(ValueError):
        WeightHistory(-1)


def test_stale_k_consumes_data_exactly_tau_versions_old(tmp_path):
    tau = 3
    cfg = tiny_cfg(tmp_path, 8, "algorithm.loss=m2po")
    parts = build_run(cfg, share_weights=False)
    assert parts.engine.model is not parts.model
    out = run_stale(cfg, tau, eval_every=4, parts=parts)
    hist = out["history"]
    assert len(hist) == 8 and parts.trainer.version == 8
    for m in hist:
        V = m["trainer_version"]
        assert m["data_version"] == max(0, V - tau)
        assert m["async/staleness_mean"] == m["async/staleness_max"] == min(V, tau)
    # after warm-up, every consumed batch is exactly tau versions behind the trainer
    assert all(m["async/staleness_mean"] == tau for m in hist if m["trainer_version"] >= tau)
    # behaviour logprobs really come from a stale policy: ratios move away from 1
    assert max(m["m2po/m2"] for m in hist if m["trainer_version"] >= tau) > 1e-6
    assert [s for s, _ in out["evals"]] == [0, 4, 8]
    assert 0.0 <= out["eval/accuracy"] <= 1.0


def test_stale_k_engine_weights_are_the_old_snapshot(tmp_path):
    """After trainer step k the engine already holds what it generates step k + 1's batch with: the snapshot of
    version max(0, k - tau), exactly (the host's lockstep cycle adopts weights when a step ends)."""
    tau = 2
    cfg = tiny_cfg(tmp_path, 5)
    parts = build_run(cfg, share_weights=False)
    snapshots = {}
    held, data_versions = [], []

    def on_step(m):  # record the trainer's weights at every version, and what the engine held
        snapshots[parts.trainer.version] = {k: v.clone() for k, v in parts.model.state_dict().items()}
        held.append((parts.engine.version, {k: v.clone() for k, v in parts.engine.model.state_dict().items()}))
        data_versions.append(m["data_version"])

    snapshots[0] = {k: v.clone() for k, v in parts.model.state_dict().items()}
    run_stale(cfg, tau, parts=parts, on_step=on_step)
    assert not all(torch.equal(v, snapshots[5][k]) for k, v in snapshots[0].items())  # the policy did change
    assert data_versions == [0, 0, 0, 1, 2]
    assert [v for v, _ in held] == [max(0, k - tau) for k in range(1, 6)] == [0, 0, 1, 2, 3]
    for version, engine_sd in held:
        for k, v in engine_sd.items():
            assert torch.equal(v, snapshots[version][k]), (version, k)


def test_tau_zero_equals_the_on_policy_loop(tmp_path):
    cfg = tiny_cfg(tmp_path, 6)
    on_policy = build_run(cfg, share_weights=True)
    run_sync(cfg, parts=on_policy)
    stale0 = build_run(cfg, share_weights=False)
    out = run_stale(cfg, 0, parts=stale0)
    keys = ("loss/policy", "reward/mean", "policy/grad_norm", "policy/entropy", "async/staleness_mean", "version")
    for a, b in zip(on_policy.history, out["history"], strict=True):
        for k in keys:
            assert a[k] == b[k], (k, a[k], b[k])
    for (name, p), q in zip(on_policy.model.named_parameters(), stale0.model.parameters()):
        assert torch.equal(p, q), name


def _load_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "staleness.py"
    spec = importlib.util.spec_from_file_location("staleness_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_summary_and_claim():
    bench = _load_benchmark()

    def run(tau, loss, seed, acc, reached):
        return {
            "tau": tau,
            "loss": loss,
            "seed": seed,
            "final_accuracy": acc,
            "steps_to_target": reached,
            "curve": [(0, 0.0), (10, acc), (20, acc)],
            "grad_norm_var": 0.1 * (tau + 1),
            "grad_norm_mean": 0.3,
            "clip_frac_mean": 0.0,
            "approx_kl_mean": 0.0,
            "masked_frac_mean": None,
            "m2_mean": None,
            "staleness_settled": [float(tau)],
            "skipped_steps": 0,
            "wall_s": 1.0,
        }

    runs = []
    for seed in (0, 1):
        runs += [
            run(0, "ppo_clip0.2", seed, 0.9, 10),
            run(8, "ppo_clip0.2", seed, 0.6, None),
            run(0, "m2po_trust_region", seed, 0.9, 10),
            run(8, "m2po_trust_region", seed, 0.88 + 0.02 * seed, 20),
        ]
    cells = bench.summarise(runs)
    c = cells["tau=8/loss=m2po_trust_region"]
    assert c["final_accuracy_mean"] == pytest.approx(0.89) and c["final_accuracy_std"] == pytest.approx(0.01)
    assert c["steps_to_target_mean"] == 20 and c["reached_target"] == 2
    assert cells["tau=8/loss=ppo_clip0.2"]["reached_target"] == 0
    claim = bench.check_claim(cells)
    assert claim["m2po_within_5pct_at_tau8"] is True and claim["ppo_falls_behind_at_tau8"] is True
    assert claim["claim_holds"] is True
    assert bench.ppo_degraded(cells, 8)
