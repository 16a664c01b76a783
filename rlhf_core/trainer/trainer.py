"""Trainer: logprobs, advantages, loss, AdamW step, version bump, weight snapshot.

One `train_step` consumes one batch of complete prompt groups (a RolloutBatch whose rows of one prompt
are contiguous, G per prompt). Old logprobs are the behaviour logprobs recorded at generation time, so
the importance ratio measures exactly the drift that staleness introduced (decoupled PPO / M2PO).
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf_core.algorithms import (
    AdvantageInputs,
    advantages_from_config,
    compute_policy_loss,
    global_normalisers,
    kl_penalty,
    step_keep_mask,
)
from rlhf_core.algorithms.correction import step_rejection
from rlhf_core.model.lora import adapter_state_dict, adapters_disabled, is_lora
from rlhf_core.model.policy import disable_dropout, eval_mode
from rlhf_core.model.sharding import gather_rows, reduce_metrics, shard_model, whole_cpu_copies, world
from rlhf_core.model.weights import load_weights_into
from rlhf_core.rollout import probe as sync_probe
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.trainer.learner import Learner
from rlhf_core.trainer.ledger import reward_column_means, step_metrics
from rlhf_core.trainer.logprobs import padding_free_enabled, padding_free_logprobs, sequence_logprobs
from rlhf_core.trainer.schedule import build_lr_lambda
from rlhf_core.types import RolloutBatch


@dataclass
class StepPlan:
    """What a train step settles before any gradient (`Trainer._plan`)."""

    step_mask: torch.Tensor  # the tokens trained on: the step's denominators
    truncated: Optional[torch.Tensor]  # rows cut at max_new_tokens (algorithm.mask_truncated)
    advantages: torch.Tensor
    gae: Optional[dict]  # the critic's values and metrics (algorithm.advantage 'gae')
    returns: Optional[torch.Tensor]
    micro: list  # this rank's micro-batches (row slices)
    keep: Optional[torch.Tensor]  # a whole-step token mask (M2PO)
    loss_kwargs: dict
    rejected_stats: dict  # a dropping correction's
    total_tokens: torch.Tensor


class Trainer(Learner):
    """Owns the policy being optimised, its optimizer and scheduler, and the policy version counter.

    group: a torch.distributed process group of N trainer ranks (`sharding`): every rank builds its Trainer
    from the same model and config, the model (and the KL reference) is sharded with FSDP2, and every rank
    calls `train_step` with the same whole batch, training on its own slice of rows; the update is that of
    one Trainer on the whole batch. None: one process, no sharding. critic: algorithm.advantage 'gae''s
    `Critic`, built on the same group (`build.build_critic`): sharded and trained with the policy."""

    def __init__(self, model, cfg, pad_token_id: int, ref_model=None, group=None, stop_ids=None, critic=None):
        self.model = disable_dropout(model)  # log-probs as the rollout's (eval mode): ratios of 1 on-policy
        # the ids that end a response (algorithm.mask_truncated tells a cut response from a finished one)
        self.stop_ids = None if stop_ids is None else torch.tensor(sorted(stop_ids), dtype=torch.long)
        if critic is not None and critic.group is not group:
            raise ValueError("the critic must be sharded on the trainer's group (build.build_critic(..., group))")
        self.critic = critic  # algorithm.advantage 'gae': rlhf_core.trainer.critic.Critic
        self.group = group
        self.cfg = cfg
        self.algo = cfg.algorithm
        self.tcfg = cfg.trainer
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.temperature = cfg.rollout.temperature
        # the distribution the engines sample from: log-probs are computed under it (sequence_logprobs)
        self.sampling = SamplingParams.from_config(cfg.rollout)
        self.version = 0
        self.step = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.busy_s = 0.0
        self.samples = 0
        self.tokens = 0
        self.lora = is_lora(model)
        self.padding_free, self._warned_padding = padding_free_enabled(), False  # off: ASYNCTENSORRLHF_NO_PADDING_FREE
        if cfg.model.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
            if self.lora:  # frozen embeddings: checkpointed blocks need an input that requires grad
                model.enable_input_require_grads()
        self.ref_model = disable_dropout(ref_model) if ref_model is not None else None
        # With LoRA the KL reference is the same model with its adapters disabled (the frozen base): no copy.
        self.ref_is_base = self.lora and self.algo.kl_coef > 0 and ref_model is None
        if self.algo.kl_coef > 0 and self.ref_model is None and not self.ref_is_base:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self._shard_and_optimize(self.tcfg.lr)  # after the reference copy: that is taken of the whole model
        if group is not None and self.ref_model is not None:
            shard_model(self.ref_model, group, self.device.type)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            build_lr_lambda(
                self.tcfg.lr_schedule, self.tcfg.warmup_steps, self.tcfg.total_steps, self.tcfg.min_lr_ratio
            ),
        )

    # ------------------------------------------------------------------ advantages
    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """Group advantages [N] from the batch's rewards, groups of G contiguous rows."""
        G = self.cfg.rollout.samples_per_prompt
        rewards = batch.rewards.to(self.device).float()
        if rewards.numel() % G:
            raise ValueError(f"batch of {rewards.numel()} rows is not made of whole groups of {G}")
        adv = advantages_from_config(self.algo, rewards.view(-1, G))
        return adv.reshape(-1)

    def truncated_rows(self, batch: RolloutBatch) -> torch.Tensor:
        """BoolTensor [N]: rows cut at rollout.max_new_tokens, i.e. as long as that and not ending with a stop
        id (without the stop set: every row of that length), and the rows the batch marks cut
        (`RolloutBatch.truncated`: trajectories cut by env.max_turns or env.max_total_tokens)."""
        lengths = batch.response_lengths.to(batch.response_ids.device)
        full = lengths >= self.cfg.rollout.max_new_tokens
        if self.stop_ids is not None:
            last = batch.response_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            full = full & ~torch.isin(last, self.stop_ids.to(last.device))
        if batch.truncated is not None:
            full = full | batch.truncated.to(full.device)
        return full

    def gae_advantages(self, batch: RolloutBatch, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(advantages [N, L], returns [N, L], values [N, L]) by the estimator with a critic (algorithm.advantage
        'gae', `AdvantageInputs`) from the current critic's values.

        The sequence reward sits on the last response token; with algorithm.kl_in_reward every token also
        gets -kl_coef x KL(behaviour || reference) (kl_estimator, per token). Advantages are whitened over
        the step's valid tokens when algorithm.advantage_options.whiten. Sharded: the values are gathered from the
        ranks (`Critic.values`), so every rank computes the same whole-batch advantages."""
        values = self.critic.values(batch)
        token_rewards = torch.zeros_like(values)
        last = (batch.response_lengths.to(values.device) - 1).clamp(min=0).unsqueeze(1)
        token_rewards.scatter_(1, last, batch.rewards.float().unsqueeze(1))
        extra: dict = {}
        if self.algo.kl_in_reward:
            ref = self.reference_logprobs(batch)
            kl = kl_penalty(batch.behavior_logprobs, ref, self.algo.kl_estimator)
            kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
            token_rewards = token_rewards - self.algo.kl_coef * kl
            extra["reward/kl_penalty"] = float(kl.sum() / mask.sum().clamp(min=1))
        inputs = AdvantageInputs(
            batch.rewards.float(), self.cfg.rollout.samples_per_prompt, mask, values, token_rewards
        )
        advantages, returns = self.algo.advantage_spec.fn(inputs, self.algo.advantage_options)
        return advantages, returns, {"values": values, **extra}

    # ------------------------------------------------------------------ step
    def _logprobs(self, model, batch: RolloutBatch, idx: slice, with_entropy: bool = False):
        fn = sequence_logprobs
        if self.padding_free:
            if (free := padding_free_logprobs(model)) is not None:
                fn = free
            elif not self._warned_padding:
                self._warned_padding = True
                warnings.warn(
                    f"padding-free training: {type(model).__name__} does not keep packed sequences apart here "
                    "(attention across position-id restarts); training on padded rows",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return fn(
            model,
            batch.prompt_ids[idx],
            batch.prompt_mask[idx],
            batch.response_ids[idx],
            batch.response_mask[idx],
            with_entropy=with_entropy,
            sampling=self.sampling,
        )

    def reference_logprobs(self, batch: RolloutBatch, idx: slice = slice(None)) -> Optional[torch.Tensor]:
        """Log-probs of the KL reference (no gradient): the reference model, or with LoRA this model with its
        adapters disabled, in eval mode as a separate reference model would be; None without a KL term."""
        if self.ref_model is not None:
            with torch.no_grad():
                return self._logprobs(self.ref_model, batch, idx)[0]
        if not self.ref_is_base:
            return None
        with eval_mode(self.model), torch.no_grad(), adapters_disabled(self.model):
            return self._logprobs(self.model, batch, idx)[0]

    def train_step(self, batch: RolloutBatch, advantages: Optional[torch.Tensor] = None) -> dict:
        """One optimizer step on a batch of complete groups: plan (`_plan`), accumulate (`_accumulate`), update
        (`_update`), metrics (`ledger.step_metrics`). Returns metrics (floats) under contract names.

        Micro-batches of trainer.micro_batch_size rows accumulate gradients, each loss normalised by the whole
        step's denominators (`global_normalisers` of the step's mask, rollout.max_new_tokens for
        "seq-mean-token-sum-norm"): the update does not depend on that size. A loss whose token mask is a
        statistic of the whole batch (M2PO) gets it once per step (one extra forward pass without gradient).
        Loss metrics: loss/policy, loss/kl (unweighted, with a reference model), loss/total (what is
        backpropagated: policy + kl_coef·KL), each the full-batch value; policy/ratio_max is the batch's
        maximum, the other policy/*, m2po/* and tis/* statistics means over its valid tokens.

        Sharded (a `group` of N ranks): every rank gets the whole batch and trains on its rows (`rank_rows`), in
        the same number of micro-batches (FSDP's forward and backward are collectives), with the whole batch's
        denominators; gradients are summed across ranks, the clipping norm is the global one and the metrics are
        reduced: the update is that of one process on the whole batch. The critic (GAE) likewise."""
        start = time.perf_counter()
        consumer_version = self.version
        self.model.train()
        batch = batch.to(self.device)
        plan = self._plan(batch, advantages)
        sums, recomputed = self._accumulate(batch, plan)
        finite, grad_norm, lr, policy_trains, critic_metrics = self._update(batch, plan, sums)
        self.model.eval()
        self.busy_s += time.perf_counter() - start
        self.samples += len(batch)
        self.tokens += int(plan.total_tokens)
        metrics = step_metrics(self.cfg, batch, sums, gather_rows(torch.cat(recomputed), len(batch), self.group),
                               plan.step_mask, consumer_version)  # fmt: skip
        metrics.update(critic_metrics)
        if plan.gae is not None:
            metrics.update({k: v for k, v in plan.gae.items() if k != "values"})
            metrics["critic/policy_trains"] = float(policy_trains)
        if plan.truncated is not None:
            metrics["response/truncated_frac"] = float(plan.truncated.float().mean())
        metrics.update({"policy/grad_norm": float(grad_norm), "policy/lr": lr, "version": self.version,
                        "trainer/skipped_steps": self.skipped_steps, "trainer/step_finite": float(finite)})  # fmt: skip
        return metrics

    def _plan(self, batch: RolloutBatch, advantages: Optional[torch.Tensor]) -> StepPlan:
        """What the whole step needs before any gradient: the token mask (truncated rows and rejected tokens out),
        the advantages (the critic's GAE, or the estimator's), this rank's micro-batches, the denominators, and
        the whole-step statistics a loss or a dropping correction takes (current log-probs of every row)."""
        step_mask = batch.trained_mask  # multi-turn: the model's tokens only (observations are context)
        truncated = None
        if self.algo.mask_truncated:  # cut at max_new_tokens without a stop id: no loss tokens
            truncated = self.truncated_rows(batch)
            step_mask = step_mask & ~truncated.unsqueeze(1)
        gae = returns = None
        if advantages is None and self.critic is not None:
            advantages, returns, gae = self.gae_advantages(batch, step_mask)
        elif advantages is None:
            advantages = self.advantages(batch)
        N = len(batch)
        micro = self._micro(N)  # this rank's rows
        current = None
        if self.algo.rollout_correction.drops or (
            self.algo.loss_spec.step_mask is not None and (len(micro) > 1 or world(self.group)[1] > 1)
        ):  # whole-step statistics: M2PO's mask (one micro-batch: the loss takes it from its rows), the drop
            with torch.no_grad():
                current = torch.cat([self._logprobs(self.model, batch, idx)[0] for idx in micro])
            current = gather_rows(current, N, self.group)
        # a dropping correction: the rejected tokens leave the step's mask, hence its denominators
        step_mask, rejected_stats = step_rejection(
            self.algo.rollout_correction, current, batch.behavior_logprobs, step_mask
        )
        loss_kwargs: dict = {"norm_len": self.cfg.rollout.max_new_tokens, "global_norm": global_normalisers(step_mask)}
        keep = None
        if self.algo.loss_spec.step_mask is not None and current is not None:
            keep, loss_kwargs["kept_norm"] = step_keep_mask(
                self.algo, current, batch.behavior_logprobs, advantages, step_mask
            )
        return StepPlan(step_mask, truncated, advantages, gae, returns, micro, keep, loss_kwargs, rejected_stats,
                        step_mask.sum().clamp(min=1))  # fmt: skip

    def _accumulate(self, batch: RolloutBatch, plan: StepPlan) -> tuple[dict, list]:
        """Forward and backward over this rank's micro-batches, each loss its exact share of the step's (the step's
        denominators): the gradients accumulate. Returns the step's statistics reduced over the ranks, and the
        trainer's log-probs of each micro-batch (the mismatch ledger's)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        zero = torch.zeros((), device=self.device)
        entropy_sum, loss_sum, mismatch_kl, mismatch_m2 = zero, zero, zero, zero
        recomputed = []
        loss_kwargs = dict(plan.loss_kwargs)
        for idx in plan.micro:
            mask = plan.step_mask[idx]
            logprobs, entropy = self._logprobs(self.model, batch, idx, with_entropy=True)
            # with kl_in_reward the KL is a reward penalty (gae_advantages), not a loss term
            ref_logprobs = None if self.algo.kl_in_reward else self.reference_logprobs(batch, idx)
            with torch.no_grad():  # behaviour vs current policy on the tokens trained on (k3 of KL(mu || pi))
                valid = mask.bool()
                behaviour, current = batch.behavior_logprobs[idx], logprobs.detach()
                recomputed.append(current)
                k3, none = kl_penalty(behaviour, current, "k3"), torch.zeros_like(behaviour)
                mismatch_kl = mismatch_kl + torch.where(valid, k3, none).sum()
                mismatch_m2 = mismatch_m2 + torch.where(valid, (current - behaviour).square(), none).sum()
            if plan.keep is not None:
                loss_kwargs["keep_mask"] = plan.keep[idx]
            loss, stats = compute_policy_loss(
                self.algo,
                logprobs,
                batch.behavior_logprobs[idx],
                plan.advantages[idx],
                mask=mask,
                ref_logprobs=ref_logprobs,
                **loss_kwargs,
            )
            loss.backward()  # this micro-batch's exact share of the step's loss: no re-weighting
            loss_sum = loss_sum + loss.detach()
            entropy_sum = entropy_sum + (entropy.detach() * mask).sum()
            token_share = mask.sum() / plan.total_tokens
            for k, v in stats.items():
                v = torch.as_tensor(v, device=self.device).detach().float()
                if k.startswith("loss/"):  # shares of the step's loss (global normalisers): they add up
                    sums[k] = sums[k] + v if k in sums else v
                elif k.endswith("_max"):
                    sums[k] = torch.maximum(sums[k], v) if k in sums else v
                else:  # means over this micro-batch's valid tokens
                    sums[k] = sums[k] + v * token_share if k in sums else v * token_share
        sums["loss/total"] = loss_sum
        size = world(self.group)[1]
        for k, v in plan.rejected_stats.items():  # the step's on every rank: summed over ranks, but maxima
            sums[k] = v.detach().float() / (1 if k.endswith("_max") else size)
        sums["policy/entropy"] = entropy_sum / plan.total_tokens
        sums["async/mismatch_kl"] = mismatch_kl / plan.total_tokens
        sums["async/mismatch_m2"] = mismatch_m2 / plan.total_tokens
        return reduce_metrics(sums, self.group), recomputed  # this rank's shares and maxima -> the whole batch's

    def _update(self, batch: RolloutBatch, plan: StepPlan, sums: dict) -> tuple:
        """Clip by the global gradient norm, step the optimizer and the schedule (a non-finite loss or norm skips
        the step and counts it), the critic's update, the version. Returns (finite, grad_norm, the lr this step
        used, whether the policy trained, the critic's metrics)."""
        grad_norm = self._clip_grads()
        finite = bool(torch.isfinite(sums["loss/total"])) and bool(torch.isfinite(grad_norm))
        # critic.warmup_steps: the first steps train the critic only (the policy's weights stay as they are)
        policy_trains = self.critic is None or self.step >= self.critic.warmup_steps
        if finite and not policy_trains:
            self.optimizer.zero_grad(set_to_none=True)
        critic_metrics = (
            {} if plan.gae is None else self.critic.update(batch, plan.gae["values"], plan.returns, plan.step_mask)
        )
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses (the scheduler then moves on)
        if finite:
            if policy_trains:
                self.optimizer.step()
                self.scheduler.step()
            self.version += 1
            self.consecutive_skips = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive_skips += 1
        self.step += 1
        return finite, grad_norm, lr, policy_trains, critic_metrics

    def reward_component_means(self, batch: RolloutBatch) -> dict[str, float]:
        """reward/<column> (and env/*, agent/*): the batch mean of each reward column (`reward_column_means`)."""
        return reward_column_means(self.cfg, batch)

    # ------------------------------------------------------------------ weights and state
    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Contiguous CPU copies of every parameter and buffer (LoRA: of the adapters only, under peft's saved names),
        with the sync probe's reference unless supervision.sync_check is off (rlhf_core.rollout.probe). Sharded: the
        whole tensors, gathered (`iter_full_tensors`); every rank must call it (a collective), rank 0 gets the dict."""
        if self.lora:
            snapshot = adapter_state_dict(self.model, keep=self._rank0)
        else:
            named = list(self.model.named_parameters()) + list(self.model.named_buffers())
            snapshot = whole_cpu_copies(named, self.group, self._rank0)
        probed = self.cfg.supervision.sync_check.action != "off"
        return sync_probe.attach(snapshot, self.model, self._rank0) if probed else snapshot

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict as whole CPU tensors (a tensor tied to an earlier name is left out), for a
        checkpoint's policy.safetensors. Sharded: gathered; every rank must call it (a collective), rank 0
        gets the dict and the others {}."""
        if self.lora:  # the base weights never change: a LoRA checkpoint holds the adapters only
            return adapter_state_dict(self.model, keep=self._rank0)
        named, seen = [], set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                named.append((name, t))
        return whole_cpu_copies(named, self.group, self._rank0)

    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy whole tensors (a state dict, as `full_weights` gives) into the model; sharded, each rank keeps
        its shard (no communication)."""
        load_weights_into(self.model, weights)

    def state_dict(self) -> dict:
        """Everything but the weights: optimizer, scheduler, counters (weights go to safetensors). Sharded:
        whole tensors, the same layout as one process (a collective)."""
        state = {"optimizer": self._optimizer_state(), "scheduler": self.scheduler.state_dict(), **self._counters()}
        if self.critic is not None:  # the critic's weights, optimizer and counters: resumed with the trainer
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._load_optimizer_state(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
        elif self.critic is not None:
            raise ValueError(
                "this checkpoint holds no critic, but algorithm.advantage is 'gae': resume it with the "
                "advantage it was trained with"
            )
        elif "critic" in state:
            warnings.warn(
                "this checkpoint holds a critic (it was trained with algorithm.advantage 'gae'), but this run's "
                "advantage needs none: the critic is not resumed",
                stacklevel=2,
            )

    def _counters(self) -> dict:
        """The counters a checkpoint keeps (`state_dict`), also in `stats`."""
        return {"version": self.version, "step": self.step, "skipped_steps": self.skipped_steps}

    def stats(self) -> dict:
        return {"busy_s": self.busy_s, "samples": self.samples, "tokens": self.tokens, **self._counters()}
