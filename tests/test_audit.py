"""The run audit (rlhf_core.supervision.audit): silent failures injected into real (small) training runs on the
threads host are each caught by their check within a few steps, and a healthy run's audit is all ok; `atrlhf audit`
prints it. The injections are the failures peers' users met: a rollout worker that ignores weight updates, a LoRA
adapter the engine never applies, a correction whose ratio is 1 by construction, a reward function that always
returns the same value, a learning-rate schedule that never moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.audit import cmd_audit
from flows.cli import main as cli
from rlhf_core.config import load_config
from rlhf_core.distributed import run_distributed
from rlhf_core.supervision.audit import AUDIT_FILE, RunAudit

REPO = Path(__file__).resolve().parents[1]

SMALL = [
    "cluster.host=threads",
    "data.eval_size=20",
    "eval.every=0",
    "rollout.prompts_per_batch=4",
    "trainer.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "supervision.supervise_interval_s=0.2",
    "checkpoint.every=4",
]


def train(tmp_path: Path, *overrides: str, steps: int = 8) -> tuple[dict, dict]:
    """(run_distributed's result, the final audit report) of a small run on the threads host."""
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        [f"run.output_dir={tmp_path}", "run.name=run", *SMALL, f"trainer.total_steps={steps}", *overrides],
    )
    result = run_distributed(cfg, poll_interval_s=0.2)
    report = json.loads((Path(cfg.run.run_dir) / AUDIT_FILE).read_text())
    assert report["final"], report
    return result, report


def verdicts(report: dict) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in report["checks"]}


def evidence(report: dict, name: str) -> str:
    return next(c["evidence"] for c in report["checks"] if c["name"] == name)


def audit_events(result: dict) -> dict[str, dict]:
    return {e["kind"]: e for e in result["health_events"] if e["kind"].startswith("audit_")}


# ---------------------------------------------------------------------------------------------- healthy run
@pytest.mark.slow
def test_a_healthy_run_is_all_ok_and_atrlhf_audit_prints_it(tmp_path, capsys):
    result, report = train(
        tmp_path,
        "algorithm.kl_coef=0.05",
        # a run where every configured mechanism has reason to act within 16 steps: 64 samples a step (some
        # right answers), weights published every 2 steps (stale tokens, whose ratios leave a 0.05 clip range)
        "rollout.prompts_per_batch=8",
        "trainer.prompts_per_step=8",
        "rollout.samples_per_prompt=8",
        "runtime.sync_every=2",
        "algorithm.loss_options.clip_eps=0.05",
        "trainer.lr=0.003",
        "trainer.lr_schedule=cosine",
        "trainer.warmup_steps=2",
        steps=16,
    )
    assert result["steps"] == 16
    v = verdicts(report)
    assert set(v) >= {"weights", "staleness", "kl", "clipping", "reward", "lr_schedule", "dropout",
                      "ledger", "checkpoint", "seeds", "eval_metric"}, v  # fmt: skip
    assert set(v.values()) == {"ok"}, report
    assert report["verdict"] == "ok" and not audit_events(result)
    checkpoint = next(c for c in report["checks"] if c["name"] == "checkpoint")["figures"]
    assert checkpoint["step"] == checkpoint["version"] == 12  # the last periodic one (checkpoint.every 4), read back

    code = cli(["audit", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "run audit, final: ok" in out and "lr_schedule" in out and "clipping" in out
    (tmp_path / "latest").symlink_to(tmp_path / "run")  # what the flow points at its newest run
    assert cmd_audit("latest", str(tmp_path)) == 0
    assert cmd_audit(str(tmp_path / "nowhere"), str(tmp_path)) == 2


# ---------------------------------------------------------------------------------------------- injections
@pytest.mark.slow
def test_a_rollout_worker_that_ignores_weight_updates_fails_the_weights_check(tmp_path, monkeypatch):
    from rlhf_core.rollout.hf import HFEngine

    def ignore(self, state_dict, version):  # claims the version, keeps its weights
        self.version = int(version)

    monkeypatch.setattr(HFEngine, "load_weights", ignore)
    result, report = train(tmp_path, "supervision.sync_check.action=warn", steps=6)
    assert verdicts(report)["weights"] == "failed", report
    assert "did not land as published" in evidence(report, "weights")
    event = audit_events(result)["audit_weights"]
    assert event["severity"] == "error" and "weights failed" in event["detail"], event


@pytest.mark.slow
def test_a_lora_adapter_the_engine_never_applies_fails_the_lora_check(tmp_path, monkeypatch):
    from rlhf_core.rollout.hf import HFEngine

    real = HFEngine.load_weights

    def base_only(self, state_dict, version):  # the adapter tensors go nowhere
        real(self, None, version)

    monkeypatch.setattr(HFEngine, "load_weights", base_only)
    overrides = ["model.lora={r: 8, alpha: 16}", "trainer.lr=0.02", "supervision.sync_check.action=warn"]
    result, report = train(tmp_path, *overrides, steps=6)
    v = verdicts(report)
    assert v["lora"] == "failed" and v["weights"] == "failed", report
    assert "adapter the engine uses is not the trainer's" in evidence(report, "lora")


@pytest.mark.slow
def test_an_applied_lora_adapter_is_ok_and_only_its_bytes_travel(tmp_path):
    result, report = train(tmp_path, "model.lora={r: 8, alpha: 16}", "trainer.lr=0.02", steps=6)
    lora = next(c for c in report["checks"] if c["name"] == "lora")
    assert lora["verdict"] == "ok", report
    assert 0 < lora["figures"]["sync_bytes"] < 0.5 * lora["figures"]["model_bytes"], lora


@pytest.mark.slow
def test_a_correction_on_stale_tokens_is_ok_and_the_clipping_it_makes_redundant_says_why(tmp_path):
    result, report = train(tmp_path, "algorithm.rollout_correction.mode=tis", steps=6)  # τ up to 2
    v = verdicts(report)
    assert v["correction"] == "ok" and v["clipping"] == "inactive", report
    assert "decoupled PPO" in evidence(report, "clipping")


@pytest.mark.slow
def test_a_correction_whose_ratio_is_one_by_construction_is_inactive(tmp_path):
    result, report = train(tmp_path, "algorithm.rollout_correction.mode=tis", "runtime.max_staleness=0", steps=6)
    assert verdicts(report)["correction"] == "inactive", report
    assert "by construction" in evidence(report, "correction")
    event = audit_events(result)["audit_correction"]
    assert event["severity"] == "warning" and "correction inactive" in event["detail"]


@pytest.mark.slow
def test_a_reward_function_that_always_returns_the_same_value_is_inactive(tmp_path):
    fn = tmp_path / "constant.py"
    fn.write_text("def half(prompts, completions, **columns):\n    return [0.5 for _ in completions]\n")
    functions = json.dumps([{"path": str(fn), "name": "half", "weight": 1.0}])
    result, report = train(tmp_path, f"reward.functions={functions}", steps=6)
    assert verdicts(report)["reward"] == "inactive", report
    assert "reward/half = 0.5" in evidence(report, "reward")


@pytest.mark.slow
def test_a_learning_rate_schedule_that_never_moves_fails_with_the_step_and_both_rates(tmp_path, monkeypatch):
    from rlhf_core.trainer import trainer

    monkeypatch.setattr(trainer, "build_lr_lambda", lambda *args: lambda step: 1.0)  # the peak rate throughout
    result, report = train(tmp_path, "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", steps=6)
    assert verdicts(report)["lr_schedule"] == "failed", report
    assert "the schedule gives" in evidence(report, "lr_schedule")


@pytest.mark.slow
def test_supervision_audit_fail_ends_the_run_at_the_finding(tmp_path):
    from rlhf_core.supervision import SupervisionError

    with pytest.raises(SupervisionError, match="correction inactive"):
        train(
            tmp_path,
            "algorithm.rollout_correction.mode=tis",
            "runtime.max_staleness=0",
            "supervision.audit=fail",
            steps=40,
        )
    report = json.loads((tmp_path / "run" / AUDIT_FILE).read_text())
    assert report["final"] and verdicts(report)["correction"] == "inactive"
    assert report["steps"] < 40


# ---------------------------------------------------------------------------------------------- unit
def _cfg(*overrides):
    return load_config(REPO / "configs" / "tiny.yaml", list(overrides))


def _poll(step: int, **metrics) -> dict:
    return {"step": step, "metrics": [{"step": step, **metrics}], "rollout": [], "trainer": {"version": step}}


def test_a_mechanism_is_pending_for_a_window_then_inactive_and_turns_ok_when_its_effect_shows():
    audit = RunAudit(_cfg("algorithm.rollout_correction.mode=tis", "algorithm.kl_coef=0.1"))
    unit = {"correction/weight_mean": 1.0, "correction/weight_max": 1.0, "loss/kl": 0.0}
    audit.observe(_poll(1, **unit))
    assert {c.name: c.verdict for c in audit.checks()}["correction"] == "pending"
    for s in range(2, 7):
        audit.observe(_poll(s, **unit))
    verdicts = {c.name: c.verdict for c in audit.checks()}
    assert verdicts["correction"] == "inactive" and verdicts["kl"] == "pending"  # the KL term may act late: at the end
    assert "correction" in [c.name for c in audit.findings()]
    assert audit.findings() == []  # each verdict reported once
    audit.observe(_poll(7, **{**unit, "correction/weight_max": 1.5}))
    assert {c.name: c.verdict for c in audit.checks()}["correction"] == "ok"
    audit.finish()
    assert {c.name: c.verdict for c in audit.checks()}["kl"] == "inactive"


def test_seeds_shared_by_two_rollout_workers_and_an_evaluation_metric_other_than_the_configured_one_fail():
    audit = RunAudit(_cfg("eval.metric=exact_match"))
    poll = _poll(1)
    poll["trainer"].update(seed=0, eval_last={"eval/accuracy": 0.5, "eval/exact_match": 0.5, "eval/version": 0})
    poll["rollout"] = [{"index": 0, "seed": 0}, {"index": 1, "seed": 1000}]
    audit.observe(poll)
    v = {c.name: c for c in audit.checks()}
    assert v["seeds"].verdict == "ok" and v["eval_metric"].verdict == "ok", v
    poll["trainer"].update(seed=7, eval_last={"eval/accuracy": 0.5, "eval/version": 3})  # accuracy, not the metric
    poll["rollout"] = [{"index": 0, "seed": 0}, {"index": 1, "seed": 0}]
    audit.observe(poll)
    v = {c.name: c for c in audit.checks()}
    assert v["eval_metric"].verdict == "failed" and "'exact_match'" in v["eval_metric"].evidence, v
    assert v["seeds"].verdict == "failed" and "trainer seeded torch with 7" in v["seeds"].evidence, v
    poll["trainer"]["seed"] = 0
    audit.observe(poll)
    seeds = {c.name: c for c in audit.checks()}["seeds"]
    assert seeds.verdict == "failed" and "same seed: {0: ['0', '1']}" in seeds.evidence, seeds


def test_a_bound_in_force_other_than_the_one_set_and_an_unbalanced_ledger_fail():
    audit = RunAudit(_cfg("runtime.max_staleness=2"))
    audit.observe(_poll(1, **{"async/max_staleness": 4, "async/token_staleness_max": 3}))
    audit.finish(ledger={"generated": 10, "trained": 8, "unaccounted": 2})
    v = {c.name: c for c in audit.checks()}
    assert v["staleness"].verdict == "failed" and "bound in force at step 1 was 4" in v["staleness"].evidence
    assert v["ledger"].verdict == "failed" and "{'groups': 2}" in v["ledger"].evidence
    assert audit.report()["verdict"] == "failed"
