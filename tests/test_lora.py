"""LoRA (model.lora): adapters-only training, the KL reference without a second model, adapter-only weight
syncs, exact engine logits after a sync, checkpoints and resume, export (PEFT adapter + merged model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError, load_config
from rlhf_core.loop import build_run, export_run, generate_step_batch, run_sync
from rlhf_core.model.lora import LoraConfigError, adapter_state_dict, is_lora
from rlhf_core.rollout import probe as sync_probe
from rlhf_core.run import build
from rlhf_core.run.checkpoint import CheckpointError, load_checkpoint, read_checkpoint
from rlhf_core.trainer import sequence_logprobs
from tests.test_checkpoint import small_cfg as checkpoint_cfg

LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def small_cfg(output_dir, *overrides):
    """test_checkpoint's small run, with LoRA adapters, a higher lr and the sync loop."""
    return checkpoint_cfg(output_dir, "trainer.lr=3e-2", "runtime.max_staleness=0", *LORA, *overrides)


def adapter_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if "lora_" in n}


# ---------------------------------------------------------------------------------------------- config
def test_config_lora_is_optional_and_validated():
    assert load_config(None, []).model.lora is None
    assert load_config(None, ["model.lora={}"]).model.lora is None  # empty: full fine-tuning
    cfg = load_config(None, ["model.lora.r=8"])
    assert cfg.model.lora.r == 8 and cfg.model.lora.alpha == 16 and "q_proj" in cfg.model.lora.target_modules
    with pytest.raises(ConfigError, match=r"model\.lora\.r"):
        load_config(None, ["model.lora.r=0"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules"):
        load_config(None, ["model.lora.target_modules=[]"])


def test_target_modules_matching_nothing_name_the_field_and_the_linear_modules(tiny_policy_dir):
    cfg = load_config(None, ["model.lora.target_modules=[q_proj,c_attn]", "model.device=cpu"])
    with pytest.raises(LoraConfigError) as err:
        build.build_policy(cfg, tiny_policy_dir)
    msg = str(err.value)
    assert "model.lora.target_modules" in msg and "c_attn" in msg
    for name in ("q_proj", "down_proj", "lm_head"):  # the model's linear modules are listed
        assert name in msg


# ---------------------------------------------------------------------------------------------- trainer
def test_trainer_optimises_the_adapters_only(tmp_path):
    parts = build_run(small_cfg(tmp_path))
    model, trainer = parts.model, parts.trainer
    assert is_lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapter_names(model) and trainable
    optimised = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimised == {id(p) for n, p in model.named_parameters() if n in trainable}
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batch, _ = generate_step_batch(parts)
    metrics = trainer.train_step(batch)
    assert metrics["trainer/step_finite"] == 1.0 and trainer.version == 1
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), f"frozen base weight {n} changed"
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # optimizer state for adapters only
    adam_numel = sum(s["exp_avg"].numel() for s in state.values())
    assert adam_numel == sum(p.numel() for n, p in model.named_parameters() if n in trainable)


def test_kl_reference_is_the_base_model_without_a_second_copy(tmp_path, tiny_policy_dir):
    cfg = small_cfg(tmp_path, "algorithm.kl_coef=0.1", f"model.path={tiny_policy_dir}")
    parts = build_run(cfg)
    trainer = parts.trainer
    assert trainer.ref_model is None and trainer.ref_is_base
    assert not any(isinstance(m, torch.nn.Module) and m is not parts.model for m in vars(trainer).values())
    batch, _ = generate_step_batch(parts)
    with torch.no_grad():  # adapters away from zero (as after training): the policy moves, the reference not
        for n, p in parts.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    metrics = trainer.train_step(batch)
    assert metrics["loss/kl"] > 0
    base, _ = build.build_policy(cfg, tiny_policy_dir, adapters=False)
    b = batch.to(trainer.device)
    ref = trainer.reference_logprobs(b)
    with torch.no_grad():
        expected, _ = sequence_logprobs(
            base, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, sampling=trainer.sampling
        )
        current, _ = sequence_logprobs(
            parts.model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, sampling=trainer.sampling
        )
    mask = b.response_mask
    torch.testing.assert_close(ref[mask], expected[mask], rtol=0, atol=1e-6)
    assert (current[mask] - expected[mask]).abs().max() > 1e-4  # the adapters do change the policy
    assert parts.model.training is False  # train_step leaves eval mode; the reference pass restores it


# ---------------------------------------------------------------------------------------------- sync
def test_sync_ships_adapters_only_and_the_engine_matches_the_trainer(tmp_path):
    parts = build_run(small_cfg(tmp_path), share_weights=False)
    trainer, engine = parts.trainer, parts.engine
    assert engine.model is not parts.model and is_lora(engine.model)
    batch, _ = generate_step_batch(parts)
    with torch.no_grad():  # adapters away from zero, as after some training
        for n, p in parts.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    trainer.train_step(batch)
    payload, probe = sync_probe.split(trainer.state_dict_for_sync())  # the adapters and the sync probe's reference
    assert probe is not None and payload and all("lora_A" in k or "lora_B" in k for k in payload)
    n_adapter = sum(p.numel() for n, p in parts.model.named_parameters() if p.requires_grad)
    assert sum(t.numel() for t in payload.values()) == n_adapter
    assert sum(t.numel() for t in payload.values()) < sum(p.numel() for p in parts.model.parameters()) / 5
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in payload.values())

    b = batch.to(trainer.device)
    ids = torch.cat([b.prompt_ids, b.response_ids], 1)
    attn = torch.cat([b.prompt_mask, b.response_mask], 1).long()

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=attn).logits

    assert not torch.allclose(logits(engine.model), logits(parts.model))  # before the sync: stale engine
    engine.load_weights(payload, trainer.version)
    assert engine.version == trainer.version
    assert torch.equal(logits(engine.model), logits(parts.model))  # the same peft computation: exact
    merged = build.build_policy(parts.cfg, parts.policy_dir, adapters=False)[0]
    merged.load_state_dict(_merged_state_dict(parts.model))  # W0 + alpha/r * B A
    torch.testing.assert_close(logits(engine.model), logits(merged), rtol=1e-5, atol=1e-5)

    with pytest.raises(KeyError, match="adapter"):
        engine.load_weights({"base_model.model.model.layers.0.self_attn.q_proj.weight": torch.zeros(1)}, 9)


def _merged_state_dict(model):
    import copy

    return copy.deepcopy(model).merge_and_unload().state_dict()


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_run")
    cfg = small_cfg(out)
    parts = build_run(cfg)
    result = run_sync(cfg, parts=parts)
    return cfg, out, result, adapter_state_dict(parts.model), [dict(m) for m in parts.history]


def test_checkpoint_holds_the_adapters_in_peft_format(lora_run):
    cfg, out, *_ = lora_run
    ckpt = out / "checkpoints" / "step_000002"
    assert not (ckpt / "policy.safetensors").exists()
    adapter_cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["lora_alpha"] == 8
    # a local base model by its absolute path (peft resolves the name from the working directory)
    base = adapter_cfg["base_model_name_or_path"]
    assert Path(base).is_absolute() and Path(base) == (out / "tiny_policy").resolve()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format_version"] == 2 and meta["lora"]["r"] == 4
    assert meta["params"] and all("lora_" in k for k in meta["params"])
    state, _ = read_checkpoint(ckpt)
    assert state.lora == {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": sorted(cfg.model.lora.target_modules)}
    assert len(state.trainer["optimizer"]["state"]) == len(meta["params"])  # adapters' optimizer state


def test_lora_resume_equals_the_uninterrupted_run(lora_run, tmp_path):
    cfg, out, result, final, history = lora_run
    parts = build_run(small_cfg(out))
    resumed = run_sync(
        cfg, resume_from=str(out / "checkpoints" / "step_000002"), parts=parts, checkpoint_dir=tmp_path / "c"
    )
    assert resumed["steps"] == 4 and parts.trainer.version == 4
    now = adapter_state_dict(parts.model)
    assert now.keys() == final.keys()
    for k, v in final.items():
        assert torch.equal(now[k], v), f"{k} differs after resuming"
    for a, b in zip(parts.history, history[2:]):
        for key in ("loss/policy", "reward/mean", "policy/lr", "version"):
            assert a[key] == b[key], key


def test_lora_and_full_checkpoints_do_not_cross(lora_run, tmp_path):
    cfg, out, *_ = lora_run
    full_parts = build_run(small_cfg(out, "model.lora=null"))
    with pytest.raises(CheckpointError, match="holds LoRA adapters"):
        read_checkpoint(out / "checkpoints" / "step_000002", full_parts.model)
    from rlhf_core.loop import save_run_checkpoint

    full_ckpt = save_run_checkpoint(full_parts, tmp_path / "full")
    lora_parts = build_run(small_cfg(out))
    with pytest.raises(CheckpointError, match="holds full weights"):
        read_checkpoint(full_ckpt, lora_parts.model)
    state, weights = read_checkpoint(full_ckpt, full_parts.model)  # a full checkpoint still loads
    assert state.lora is None and weights and not any("lora_" in k for k in weights)


# ---------------------------------------------------------------------------------------------- export
def test_export_writes_the_peft_adapter_and_a_merged_model(lora_run, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from flows.cli import main

    cfg, out, result, final, _ = lora_run
    parts = build_run(small_cfg(out))
    load_checkpoint(out / "checkpoints" / "step_000004", parts.model)
    path = export_run(parts, tmp_path / "policy")
    assert (path / "adapter" / "adapter_config.json").is_file()
    assert (path / "adapter" / "adapter_model.safetensors").is_file()
    assert (path / "config.json").is_file() and (path / "train_config.yaml").is_file()
    base = json.loads((path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base).is_absolute() and Path(base) == parts.policy_dir.resolve()  # found from any directory

    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = parts.model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(path))  # plain transformers, no peft
        assert not is_lora(merged)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(str(parts.policy_dir))
        with_adapter = PeftModel.from_pretrained(base, str(path / "adapter"))  # the PEFT adapter loads too
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

    assert main(["evaluate", "--checkpoint", str(path), "--json"]) == 0

    # loaded by peft alone, from another working directory: the adapter names its base by absolute path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with torch.no_grad():
        reloaded = AutoPeftModelForCausalLM.from_pretrained(str(path / "adapter"))
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_the_adapter_names_its_base_model_portably(tmp_path, monkeypatch):
    from rlhf_core.model.lora import portable_base_path

    cache = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/7ae557604adf67be"
    assert portable_base_path(cache, tmp_path) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert portable_base_path("/x/hub/models--gpt2/snapshots/abc", tmp_path) == "gpt2"
    assert portable_base_path("Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"  # a hub id stays
    local = tmp_path / "models" / "base"
    local.mkdir(parents=True)
    adapter = tmp_path / "run" / "policy" / "adapter"
    assert portable_base_path(str(local), adapter) == str(local.resolve())  # absolute: any working directory
    monkeypatch.chdir(tmp_path)
    assert portable_base_path("models/base", adapter) == str(local.resolve())  # relative: from the cwd


def test_evaluate_a_lora_checkpoint(lora_run, capsys):
    from flows.cli import main

    cfg, out, result, *_ = lora_run
    assert main(["evaluate", "--checkpoint", str(out / "checkpoints" / "step_000004"), "--json"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line)["eval/accuracy"] == pytest.approx(result["eval/accuracy"])


# ---------------------------------------------------------------------------------------------- Ray
@pytest.mark.slow
def test_lora_on_the_ray_runtime_checkpoints_resumes_and_exports(ray_local, tmp_path):
    """The Ray runtime with LoRA: the trainer publishes adapters, a checkpoint holds them, the loop and a new
    Ray run both resume it, and the export loads in transformers."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.distributed import DistributedRun
    from tests.conftest import drive

    overrides = ["cluster.num_cpus=2", "runtime.wait_timeout_s=60", "supervision.supervise_interval_s=0.2"]
    cfg = small_cfg(tmp_path, *overrides, "trainer.total_steps=2")
    with DistributedRun(cfg) as run:
        run.launch()
        drive(run)
        ckpt = Path(run.checkpoint(tmp_path / "ray_ckpt", run={}))
        exported = run.export(tmp_path / "policy")
    state, _ = read_checkpoint(ckpt)
    assert state.step == 2 and state.lora["r"] == 4 and (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(exported)
    assert not is_lora(merged)

    result = run_sync(small_cfg(tmp_path, *overrides), resume_from=str(ckpt), checkpoint_dir=tmp_path / "loop_ckpts")
    assert result["steps"] == 4
    more = small_cfg(tmp_path, *overrides, "trainer.total_steps=5")
    with DistributedRun(more) as run:
        info = run.launch(resume_from=str(tmp_path / "loop_ckpts" / "step_000004"))
        assert (info["step"], info["version"]) == (4, 4)
        assert drive(run)[-1]["step"] == 5


def test_a_tied_lm_head_adapter_checkpoints_adapters_only(tmp_path, tiny_policy_dir):
    """Adapting the tied lm_head: peft would save the (frozen) embeddings too; the checkpoint holds the
    adapters only and reads back into the same model."""
    from safetensors.torch import load_file

    from rlhf_core.run.checkpoint import CheckpointState, save_checkpoint

    cfg = load_config(None, ["model.device=cpu", "model.lora.r=4", "model.lora.target_modules=[q_proj,lm_head]"])
    model, _ = build.build_policy(cfg, tiny_policy_dir)
    path = save_checkpoint(tmp_path / "ckpt", model, CheckpointState(trainer={}, data={}, rng={}))
    saved = load_file(str(path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    state, weights = read_checkpoint(path, model)
    assert weights.keys() == saved.keys() and state.lora["target_modules"] == ["lm_head", "q_proj"]
    # the merged export of a tied, adapted lm_head: embeddings stay the base's, logits are the peft model's
    from transformers import AutoModelForCausalLM

    from rlhf_core.model.lora import save_merged

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    merged = AutoModelForCausalLM.from_pretrained(str(save_merged(model, tmp_path / "merged")))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_the_adapter_cache_follows_sharding(tiny_policy_dir):
    """fully_shard replaces every parameter object: after sharding, the adapter tensors that syncs and
    checkpoints read are the sharded model's live ones, not the ones cached before (a one-rank gloo group)."""
    import socket

    import torch.distributed as dist

    from rlhf_core.model.lora import _adapter_params, adapter_shapes, apply_lora
    from rlhf_core.model.policy import load_policy
    from rlhf_core.model.sharding import shard_model

    cfg = load_config(None, LORA)
    model = apply_lora(load_policy(tiny_policy_dir, dtype="float32", device="cpu")[0], cfg.model.lora)
    assert adapter_shapes(model)  # fills the cache with the unsharded parameters
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        shard_model(model, dist.group.WORLD)
        live = {n: p for n, p in model.named_parameters() if "lora_" in n}
        cached = _adapter_params(model)
        assert len(cached) == len(live) and cached
        live_ids = {id(p) for p in live.values()}
        assert all(id(p) in live_ids for p in cached.values())  # the sharded model's own parameters
        assert all(hasattr(p, "device_mesh") for p in cached.values())  # DTensors: sharded
    finally:
        dist.destroy_process_group()


def test_dropout_never_makes_on_policy_ratios_differ_from_one(tmp_path):
    """The trainer computes log-probs in train mode, the rollout in eval mode: a policy with dropout (here LoRA
    dropout 0.3, as a peft model built elsewhere would have) gets it disabled by the Trainer, so the first
    step on its own fresh samples has ratios of 1 (with dropout on, ratio_max was ~1.4). The config has no LoRA
    dropout: an old model.lora.dropout > 0 is refused, naming the key."""
    from rlhf_core.data import collate_prompts
    from rlhf_core.model.lora import apply_lora
    from rlhf_core.model.policy import load_policy
    from rlhf_core.rollout import HFEngine, SamplingParams
    from rlhf_core.trainer import Trainer

    with pytest.raises(ConfigError, match=r"model\.lora\.dropout"):
        load_config(None, [*LORA, "model.lora.dropout=0.3"])
    cfg = small_cfg(tmp_path, "algorithm.loss=m2po", "trainer.micro_batch_size=4")  # M2PO's step mask pass too
    policy_dir = build.resolve_policy_dir(cfg)
    torch.manual_seed(0)
    model = load_policy(policy_dir, dtype="float32", device="cpu")[0]
    model = apply_lora(model, cfg.model.lora, dropout=0.3)
    with torch.no_grad():  # adapters away from zero, so that their dropout changes the output
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.3 for m in model.modules())
    tokenizer = build.build_tokenizer(cfg, policy_dir)
    trainer = Trainer(model, cfg, tokenizer.pad_token_id)
    train_prompts, _ = build.build_prompts(cfg, tokenizer)
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=1)
    batch = engine.generate(
        collate_prompts(train_prompts[:4], tokenizer.pad_token_id),
        cfg.rollout.samples_per_prompt,
        SamplingParams(max_new_tokens=8),
    )
    batch.rewards = (torch.arange(len(batch)) % 2 == 0).float()
    metrics = trainer.train_step(batch)
    assert metrics["policy/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
