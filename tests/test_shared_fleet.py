"""Sweeps on one shared fleet (rlhf_core/hosts/shared_fleet.py, `atrlhf sweep --shared-fleet`): which grids may
share a fleet; the fleet's mixed-adapter batch against each adapter generating alone; an adapter's sync and the
trainer's per-point lock; and, slow, a 3-point LoRA sweep through the CLI on one fleet (real Prefect, MLflow on
SQLite) with a point whose loss raises: it fails alone, the others finish as runs of their own.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from flows.cli import main
from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.prompts import PromptBatch, collate_prompts
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.sweep_grid import SweepPoint, expand_grid, shared_points
from tests.test_sweep import SMALL, _sweep_runs

ROOT = Path(__file__).resolve().parent.parent
LORA = str(ROOT / "configs" / "tiny-lora.yaml")


def _points(tmp_path, grid: dict, *sets: str) -> dict:
    base = load_config(LORA, [*SMALL, f"run.output_dir={tmp_path / 'runs'}", *sets])
    return shared_points(base, expand_grid(grid, [0]), "sweep-test")


def test_only_points_that_differ_as_adapter_runs_may_share_a_fleet(tmp_path):
    points = _points(tmp_path, {"model.lora.r": [8, 16], "trainer.lr": [0.001], "runtime.max_staleness": [1, 2]})
    assert len(points) == 4 and {c.cluster.host for c in points.values()} == {"threads"}
    assert len({c.run.output_dir for c in points.values()}) == 4  # each point a run of its own
    cases = {
        "rollout.temperature": {"rollout.temperature": [1.0, 0.7]},  # the one engine samples for every point
        "model.preset": {"model.preset": ["micro", "tiny"]},  # another base model
        "data.task": {"data.task": ["max3", "sum2"]},
    }
    for key, grid in cases.items():
        with pytest.raises(ConfigError, match=rf"differ in {key} .*without --shared-fleet"):
            _points(tmp_path, grid)
    with pytest.raises(ConfigError, match="has no model.lora"):
        _points(tmp_path, {"trainer.lr": [0.001]}, "model.lora=null")
    with pytest.raises(ConfigError, match="rollout.engine is 'random'"):
        _points(tmp_path, {"trainer.lr": [0.001]}, "rollout.engine=random")
    with pytest.raises(ConfigError, match="rollout.partial_rollout is on"):
        _points(tmp_path, {"trainer.lr": [0.001]}, "rollout.partial_rollout=true")


def test_cli_refuses_a_grid_that_cannot_share_before_starting(tmp_path, capsys):
    argv = ["sweep", "--config", LORA, "--set", f"run.output_dir={tmp_path}", "--grid", "rollout.top_k=0,5"]
    assert main([*argv, "--shared-fleet"]) == 2
    err = capsys.readouterr().err
    assert "differ in rollout.top_k" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir()), "nothing was created"


@pytest.fixture
def fleet(tmp_path):
    from rlhf_core.hosts.shared_fleet import SharedFleet, fleet_config

    base = fleet_config(load_config(LORA, [*SMALL, f"run.output_dir={tmp_path / 'runs'}"]))
    points = shared_points(base, expand_grid({"model.lora.r": [4, 8]}, [0]), "sweep-test")
    with SharedFleet(points, window_s=5.0, mixed=True) as f:  # the accelerator's engine, here on the CPU
        torch.manual_seed(1)
        with torch.no_grad():  # adapters that change the output (B starts at 0), different per point
            for name, p in f.engine.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        yield f


def test_a_mixed_adapter_batch_generates_what_each_adapter_generates_alone(fleet):
    """Two points' calls of different prompt widths in one mixed-adapter batch (peft's adapter_names per row, the
    accelerator path, forced here on the CPU): each gets exactly the tokens and log-probs its adapter generates
    alone, its own prompt width, group ids from 0 and its adapter's version on every token."""
    from rlhf_core.hosts.shared_fleet import AdapterEngine
    from rlhf_core.run.build import build_prompts

    prompts, _ = build_prompts(fleet.configs["point0"], fleet.tokenizer)
    pad = fleet.tokenizer.pad_token_id
    wide = collate_prompts(prompts[3:5], pad)  # point1's call 2 columns wider (more left padding)
    wide = PromptBatch(
        torch.nn.functional.pad(wide.prompt_ids, (2, 0), value=pad),
        torch.nn.functional.pad(wide.prompt_mask, (2, 0), value=False),
        wide.patterns,
        wide.uids,
    )
    calls = {"point0": collate_prompts(prompts[:3], pad), "point1": wide}
    assert calls["point0"].prompt_ids.shape[1] != calls["point1"].prompt_ids.shape[1]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    views = {a: AdapterEngine(fleet, a) for a in calls}
    views["point0"].version, views["point1"].version = 3, 7
    out = generate_together(views, calls, 2, greedy)
    assert fleet.batcher.batches == 1 and fleet.batcher.rows == 10, "both calls in one batch"
    for adapter, prompts_batch in calls.items():
        fleet.engine.model.set_adapter(adapter)
        alone = fleet.engine.generate(prompts_batch, 2, greedy)
        got = out[adapter]
        assert torch.equal(got.prompt_ids, alone.prompt_ids)
        assert torch.equal(got.response_ids, alone.response_ids) and torch.equal(got.response_mask, alone.response_mask)
        torch.testing.assert_close(got.behavior_logprobs, alone.behavior_logprobs, atol=1e-5, rtol=1e-5)
        assert got.group_ids.tolist() == alone.group_ids.tolist()
        assert (
            set(got.policy_version.tolist()) == set(got.token_versions.flatten().tolist()) == {views[adapter].version}
        )
    fleet.engine.model.set_adapter("point1")  # the other adapter on point0's prompts: the adapters matter here
    other = fleet.engine.generate(calls["point0"], 2, greedy)
    assert not torch.allclose(other.behavior_logprobs, out["point0"].behavior_logprobs)
    for view in views.values():
        view.close()
    assert fleet.batcher.members == 0


def generate_together(views: dict, calls: dict, samples: int, sampling: SamplingParams) -> dict:
    """Each view's generate() of its call, every call on a thread of its own at once (so that the fleet's batcher
    can batch them): {adapter: its RolloutBatch}."""
    out = {}

    def call(adapter):
        out[adapter] = views[adapter].generate(calls[adapter], samples, sampling)

    threads = [threading.Thread(target=call, args=(a,)) for a in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def run_points(points: dict) -> dict:
    """Each point driven as a run of its own (run_distributed, the host factory finding its fleet host), all at once
    on threads: {name: its result}."""
    from rlhf_core.distributed import run_distributed

    results: dict = {}

    def run(name, cfg):
        results[name] = run_distributed(cfg, poll_interval_s=0.2)

    threads = [threading.Thread(target=run, args=item) for item in points.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def test_points_share_the_base_weights_and_each_trains_and_syncs_its_own_adapter(fleet):
    """Every point's trainer model and the engine's hold the one base weights (the same tensors); a step of one
    point's adapter changes neither the base nor the other point's; its sync reaches its adapter on the engine
    alone."""
    from rlhf_core.hosts.shared_fleet import AdapterEngine
    from rlhf_core.model.lora import adapter_state_dict

    m0, m1 = fleet.models["point0"], fleet.models["point1"]
    base = dict(fleet.base.named_parameters())
    for model in (m0, m1, fleet.engine.model):
        for name, p in model.get_base_model().named_parameters():
            if "lora_" not in name:
                key = name.replace(".base_layer", "")
                assert p is base[key], f"{name}: a copy of the base weight"
    trainable = [p for p in m0.parameters() if p.requires_grad]
    before = {k: v.clone() for k, v in adapter_state_dict(m1).items()}
    head = fleet.base.get_output_embeddings().weight.clone()
    optimizer = torch.optim.SGD(trainable, lr=0.1)
    ids = torch.randint(0, fleet.tokenizer.vocab_size, (2, 5))
    m0(input_ids=ids).logits.pow(2).mean().backward()
    optimizer.step()
    assert torch.equal(fleet.base.get_output_embeddings().weight, head), "the base did not train"
    assert all(torch.equal(before[k], v) for k, v in adapter_state_dict(m1).items()), "nor did the other adapter"

    view = AdapterEngine(fleet, "point0")
    other = {k: v.clone() for k, v in adapter_state_dict_of(fleet.engine.model, "point1").items()}
    view.load_weights(adapter_state_dict(m0), 5)
    assert view.version == 5
    synced = adapter_state_dict_of(fleet.engine.model, "point0")
    assert all(torch.equal(synced[k], v) for k, v in adapter_state_dict(m0).items())
    assert all(torch.equal(other[k], v) for k, v in adapter_state_dict_of(fleet.engine.model, "point1").items())
    view.close()


def adapter_state_dict_of(model, adapter: str) -> dict:
    from rlhf_core.model.lora import _adapter_params

    return {k: v.detach().clone() for k, v in _adapter_params(model, adapter).items()}


BOOM_LOSS = """
from rlhf_core.algorithms import register_policy_loss

CALLS = [0]


@register_policy_loss("boom_test")
def boom(inputs, options):
    CALLS[0] += 1
    if CALLS[0] >= 3:
        raise RuntimeError("boom: this point's loss fails at its third call")
    valid = inputs.valid() > 0
    per_token = (-inputs.advantages.reshape(inputs.logprobs.shape[0], -1) * inputs.logprobs) * valid
    return inputs.add_kl(inputs.aggregate(per_token), {}), {}
"""


@pytest.mark.slow
def test_a_shared_fleet_sweep_runs_each_point_as_a_run_of_its_own(prefect_api, tmp_path, mlflow_db, capsys):
    """3 LoRA points on one fleet, one whose loss raises at its third step: it fails alone, the two others finish,
    each an MLflow child run with its adapter, evaluable and resumable by its run id; the comparison lists the
    three."""
    boom = tmp_path / "boom_loss.py"
    boom.write_text(BOOM_LOSS)
    uri = f"sqlite:///{mlflow_db}"
    argv = ["sweep", "--config", LORA, "--set", *SMALL, f"run.output_dir={tmp_path / 'runs'}"]
    argv += [f"tracking.tracking_uri={uri}", "--grid", f"algorithm.loss=grpo,m2po,{boom}:boom_test", "--shared-fleet"]
    assert main(argv) == 1, "a failed point makes the command exit 1"
    out, err = capsys.readouterr()
    assert "3 point(s), 3 ran, 0 skipped (finished before), 1 failed" in out
    assert "boom: this point's loss fails at its third call" in err + out
    client, parent, children = _sweep_runs(mlflow_db)
    assert len(children) == 3
    by_loss = {c.data.params["algorithm.loss"]: c for c in children}
    assert by_loss[f"{boom}:boom_test"].info.status == "FAILED"
    for loss in ("grpo", "m2po"):
        child = by_loss[loss]
        assert child.info.status == "FINISHED", (loss, child.data.tags.get("error"))
        assert [m.step for m in client.get_metric_history(child.info.run_id, "reward/mean")] == [1, 2, 3, 4]
        assert (
            child.data.tags["run.output_dir"]
            != by_loss["grpo" if loss == "m2po" else "m2po"].data.tags["run.output_dir"]
        )
        adapters = list(Path(child.data.tags["run.output_dir"]).rglob("adapter_config.json"))
        assert adapters, f"{loss}: its exported adapter"
        assert json.loads(adapters[0].read_text())["r"] == 32  # its own adapter's config, as a run of its own
    rows = client.download_artifacts(parent.info.run_id, "comparison/comparison.json", str(tmp_path))
    assert len(json.loads(Path(rows).read_text())) == 3
    log = (tmp_path / "runs" / parent.data.tags["atrlhf.sweep_id"] / "sweep.log").read_text()
    assert "shared fleet:" in log and "generation batches for 3 point(s)" in log

    child = by_loss["m2po"]
    assert main(["evaluate", "--checkpoint", child.info.run_id, "--set", f"tracking.tracking_uri={uri}"]) == 0
    assert "accuracy" in capsys.readouterr().out

    # resumable by its run id alone: the point's own config (its checkpoint's), the --set items on top
    resume = ["train", "--resume-from", child.info.run_id, "--set", f"tracking.tracking_uri={uri}"]
    assert main([*resume, "trainer.total_steps=6"]) == 0
    assert "using the run's config, the train_config.yaml of MLflow run" in capsys.readouterr().err
    resumed = [r for r in client.search_runs([child.info.experiment_id]) if r.info.start_time > child.info.start_time]
    resumed = [r for r in resumed if r.data.params.get("algorithm.loss") == "m2po"]
    assert len(resumed) == 1 and resumed[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(resumed[0].info.run_id, "reward/mean")] == [5, 6]


def test_two_points_train_on_one_mixed_adapter_engine_each_within_its_own_bound(tmp_path):
    """The accelerator's fleet (forced on the CPU): two points, each driven as a run of its own on its shared-fleet
    host (the host factory finds it by run.output_dir), generating through the one mixed-adapter engine: each
    reaches its steps within its own staleness bound, its groups and tokens accounted, and the engine's batches
    held both points' rows."""
    from rlhf_core.hosts import make_runtime
    from rlhf_core.hosts.shared_fleet import SharedFleet, SharedPointHost, fleet_config
    from tests.ledger_checks import assert_ledger_balances

    base = fleet_config(
        load_config(LORA, [*SMALL, f"run.output_dir={tmp_path / 'runs'}", "trainer.total_steps=6", "eval.every=0"])
    )
    two = [SweepPoint((("runtime.max_staleness", 0),), 0), SweepPoint((("runtime.max_staleness", 2),), 1)]
    points = shared_points(base, two, "sweep-test")
    with SharedFleet(points, mixed=True) as fleet:
        assert all(isinstance(make_runtime(cfg), SharedPointHost) for cfg in points.values())
        results = run_points(points)
        stats = fleet.stats()
    assert make_runtime(next(iter(points.values()))).__class__.__name__ == "ThreadedRun", "closed: a plain host again"
    for name, cfg in points.items():
        result = results[name]
        assert result["steps"] == 6, name
        hist = result["final_poll"]["trainer"]["staleness_hist"]
        assert max(hist) <= cfg.runtime.max_staleness, (name, hist)
        assert result["final_poll"]["trainer"]["seed"] == cfg.trainer.seed, "the audit's evidence: its own seed"
        rec = result["reconcile"]
        assert rec["trained"] == rec["consumed"] == 6 * cfg.trainer.prompts_per_step
        assert_ledger_balances(rec)
    one_call = 4 * 4  # rollout.prompts_per_batch x rollout.samples_per_prompt
    assert stats["batches"] > 0 and stats["rows_per_batch"] > one_call, "some batches held both points' calls"
