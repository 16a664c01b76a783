"""One update, two trainers: the same batches through our Trainer and TRL's GRPOTrainer, compared step by step.

What it compares. Both sides start from the same weights (the tiny policy OUR builder saves, as
benchmarks/trl_side_by_side.py; --warm-steps first trains it that many lockstep steps of ours, so that the batches
have mixed rewards and the grad-norm clip is active) and train --steps AdamW steps on the same --steps batches
(prompt ids, completion ids, rewards: sampled once by our engine from the starting policy). Per step: the
advantages (sorted: TRL shuffles the rows of its generation batch), the loss, the gradient norm before clipping,
the clipped gradient (cosine, norm ratio) and the weights after the step (largest difference, relative norm of
the difference). The optimizers' settings are printed too.

TRL's ratio is exactly 1 (its old log-probs are the loss pass's own, detached, at num_iterations 1); ours divides by
the batch's behaviour log-probs. On fixed batches the policy moves away from the one that sampled them, so our side
replaces each batch's behaviour log-probs with the current policy's before the step (in a run they are equal:
`policy/ratio_max` 1.0 in lockstep); TRL's side gets its generation (`_tokenize_prompts`,
`_generate_single_turn`) replaced by the saved batch and its reward function returns the saved rewards, so the
rest of its step (advantages, loss, clipping, AdamW) is its own code.

    python benchmarks/trl_update_parity.py --trl-python "$TRL_VENV/bin/python"                     # 10 steps
    python benchmarks/trl_update_parity.py --trl-python "$TRL_VENV/bin/python" --warm-steps 60     # clip active
    python benchmarks/trl_update_parity.py --trl-python ... --set algorithm.advantage_options.unbiased=false \\
        --set algorithm.advantage_options.eps=1e-6                                                # the old std

--set applies to our side only (the TRL side is set from the unmodified config, as in trl_side_by_side.py).
The venv: see benchmarks/trl_side_by_side.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def side_config(work: Path, policy: Path, steps: int, overrides=()):
    from trl_side_by_side import arm_config

    return arm_config("ours", 1, max(steps, 1), 10**6, work / "run", policy, 0, overrides)


def rows(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """A saved batch's prompt and completion ids per row, without padding."""
    prompts = [ids[m].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"].bool())]
    completions = [ids[m].tolist() for ids, m in zip(batch["response_ids"], batch["response_mask"].bool())]
    return prompts, completions


# ------------------------------------------------------------------------------------------------ our side
def warm_policy(policy: Path, work: Path, steps: int) -> Path:
    """`steps` lockstep steps of ours from `policy`, saved as a policy directory of their own."""
    from rlhf_core.run.local import build_run, lockstep_step

    parts = build_run(side_config(work / "warm", policy, steps), share_weights=True)
    try:
        for _ in range(steps):
            lockstep_step(parts)
    finally:
        parts.worker.close()
    out = work / "start_policy"
    shutil.copytree(policy, out, dirs_exist_ok=True)
    parts.model.save_pretrained(out)
    return out


def run_ours(policy: Path, work: Path, steps: int, overrides) -> dict:
    import torch

    from rlhf_core.loop import build_run, generate_step_batch
    from rlhf_core.trainer.logprobs import sequence_logprobs

    parts = build_run(side_config(work / "ours", policy, steps, overrides), share_weights=True)
    try:
        batches = [generate_step_batch(parts)[0] for _ in range(steps)]  # sampling trains nothing
        torch.save([{f.name: getattr(b, f.name) for f in dataclasses.fields(b)} for b in batches], work / "batches.pt")
        trainer, model = parts.trainer, parts.model
        opt = trainer.optimizer
        record = {"optimizer": {**_settings(opt.defaults), "param_groups": len(opt.param_groups)}, "steps": []}
        record["start"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        for batch in batches:
            with torch.no_grad():  # TRL's ratio of 1: the current policy's log-probs as the old ones
                current = sequence_logprobs(
                    model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                    sampling=trainer.sampling,
                )[0]  # fmt: skip
            batch = dataclasses.replace(
                batch, behavior_logprobs=torch.where(batch.response_mask, current, batch.behavior_logprobs)
            )
            advantages = trainer.advantages(batch)
            m = trainer.train_step(batch)
            record["steps"].append(_step_record(model, advantages, m["loss/total"], m["policy/grad_norm"]))
        return record
    finally:
        parts.worker.close()


def _settings(defaults: dict) -> dict:
    return {k: defaults[k] for k in ("lr", "betas", "eps", "weight_decay") if k in defaults}


def _step_record(model, advantages, loss, grad_norm) -> dict:
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {
        "advantages": advantages.detach().float().cpu().clone(),
        "loss": float(loss),
        "grad_norm": float(grad_norm),
        "grads": {n: p.grad.detach().clone() for n, p in trained},
        "weights": {n: p.detach().clone() for n, p in trained},
    }


# ----------------------------------------------------------------------------------------------- TRL's side
def run_trl(policy: Path, work: Path, steps: int) -> dict:
    import logging

    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from trl_side_by_side import trl_args

    from rlhf_core.run import build

    transformers.utils.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    cfg = side_config(work / "trl", policy, steps)
    build.setup_process(cfg, cfg.trainer.seed)
    model, tokenizer = build.build_policy(cfg, build.resolve_policy_dir(cfg))
    train, _ = build.build_prompts(cfg, tokenizer)
    dataset = Dataset.from_list([{"prompt": tokenizer.decode(p.prompt_ids)} for p in train])
    saved = torch.load(work / "batches.pt", weights_only=False)
    at = {"step": 0}
    record: dict = {"steps": [], "start": {n: p.detach().clone() for n, p in model.named_parameters()}}

    def saved_rewards(prompts, completions, completion_ids, **kwargs) -> list[float]:
        batch = saved[at["step"]]
        if [list(c) for c in completion_ids] != rows(batch)[1]:
            raise RuntimeError("TRL scored other completions than the saved batch's")
        return batch["rewards"].float().tolist()

    args = trl_args(cfg, work / "trl" / "out", logging_steps=1)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[saved_rewards], args=args, train_dataset=dataset, processing_class=tokenizer
    )

    def tokenize_prompts(self, prompts):
        return rows(saved[at["step"]])[0], None, {}

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        prompts, completions = rows(saved[at["step"]])
        if prompt_ids != prompts:
            raise RuntimeError("TRL generated for other prompts than the saved batch's")
        return completions, None

    compute_loss = trainer._compute_loss

    def loss_of(model, inputs):
        loss = compute_loss(model, inputs)
        pending["advantages"], pending["loss"] = inputs["advantages"].detach().float().cpu().clone(), float(loss)
        return loss

    pending: dict = {}
    trainer._tokenize_prompts = types.MethodType(tokenize_prompts, trainer)
    trainer._generate_single_turn = types.MethodType(generate_single_turn, trainer)
    trainer._compute_loss = loss_of

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # after the clip
            pending["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            record["steps"].append({**pending, "weights": weights})
            at["step"] += 1

    trainer.add_callback(Capture())
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    for step, norm in zip(record["steps"], norms):
        step["grad_norm"] = float(norm)
    opt = trainer.optimizer
    defaults = getattr(opt, "defaults", None) or opt.optimizer.defaults
    groups = opt.param_groups
    record["optimizer"] = {
        **_settings(defaults),
        "weight_decay_per_group": [g["weight_decay"] for g in groups],
        "param_groups": len(groups),
        "lr_schedule": type(trainer.lr_scheduler).__name__,
    }
    return record


# ------------------------------------------------------------------------------------------------- compare
def compare(ours: dict, theirs: dict) -> list[dict]:
    import torch

    if any(not torch.equal(ours["start"][n], theirs["start"][n]) for n in ours["start"]):
        raise RuntimeError("the two sides did not start from the same weights")
    out = []
    for k, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        names = sorted(a["grads"])
        if names != sorted(b["grads"]):
            raise RuntimeError(f"step {k + 1}: the trained parameters differ")
        ga = torch.cat([a["grads"][n].flatten() for n in names])
        gb = torch.cat([b["grads"][n].flatten() for n in names])
        wa = torch.cat([a["weights"][n].flatten() for n in names])
        wb = torch.cat([b["weights"][n].flatten() for n in names])
        both = bool(ga.norm() > 0 and gb.norm() > 0)
        adv_a, adv_b = a["advantages"].flatten().sort().values, b["advantages"].flatten().sort().values
        out.append(
            {
                "step": k + 1,
                "adv_max_abs_diff": float((adv_a - adv_b).abs().max()),
                "adv_scale_trl_over_ours": float(adv_b.abs().max() / adv_a.abs().max()) if adv_a.abs().max() else None,
                "loss": (a["loss"], b["loss"]),
                "grad_norm_before_clip": (a["grad_norm"], b["grad_norm"]),
                "clipped_grad_cosine": float(torch.nn.functional.cosine_similarity(ga, gb, dim=0)) if both else None,
                "clipped_grad_norm_ratio": float(gb.norm() / ga.norm()) if both else None,
                "weights_max_abs_diff": float((wa - wb).abs().max()),
                "weights_rel_diff": float((wa - wb).norm() / wa.norm()),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON"), help="the TRL venv's python")
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps (one saved batch each)")
    parser.add_argument("--warm-steps", type=int, default=0, help="lockstep steps of ours before the batches")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of ours")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.child:  # TRL's side, in the TRL venv
        torch.save(run_trl(Path(args.policy), Path(args.work), args.steps), Path(args.work) / "trl.pt")
        return
    if not args.trl_python:
        parser.error("--trl-python (or TRL_PYTHON): the python of the venv trl is installed in")
    from trl_side_by_side import build_policy

    with tempfile.TemporaryDirectory(prefix="trl_update_parity_") as tmp:
        work = Path(tmp)
        policy = build_policy(work)
        if args.warm_steps:
            policy = warm_policy(policy, work, args.warm_steps)
        ours = run_ours(policy, work, args.steps, args.set)
        cmd = [args.trl_python, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        child = [*cmd, "--work", str(work), "--policy", str(policy)]
        subprocess.run(child, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)  # TRL prints its logs
        theirs = torch.load(work / "trl.pt", weights_only=False)
    steps = compare(ours, theirs)
    result = {"optimizer": {"ours": ours["optimizer"], "trl": theirs["optimizer"]}, "steps": steps}
    result.update({"warm_steps": args.warm_steps, "set": args.set})
    if args.json:
        print(json.dumps(result))
        return
    print(f"optimizers: ours {ours['optimizer']}\n            trl  {theirs['optimizer']}")
    head = "step  adv diff  loss ours / trl        grad norm ours / trl  cos(g)     |g| trl/ours  weights max diff  rel"
    print(head)
    for s in steps:
        cos = "-" if s["clipped_grad_cosine"] is None else f"{s['clipped_grad_cosine']:.6f}"
        ratio = "-" if s["clipped_grad_norm_ratio"] is None else f"{s['clipped_grad_norm_ratio']:.5f}"
        print(
            f"{s['step']:4d}  {s['adv_max_abs_diff']:.1e}  {s['loss'][0]:9.6f} / {s['loss'][1]:9.6f}  "
            f"{s['grad_norm_before_clip'][0]:8.5f} / {s['grad_norm_before_clip'][1]:8.5f}  {cos:>9s}  {ratio:>9s}  "
            f"{s['weights_max_abs_diff']:.2e}  {s['weights_rel_diff']:.2e}"
        )


if __name__ == "__main__":
    main()
