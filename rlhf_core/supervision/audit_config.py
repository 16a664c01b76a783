"""The run audit's checks that the run was as configured (rlhf_core.supervision.audit's RunAudit inherits them):
the learning-rate schedule, dropout off, the seeds, the evaluation metric, the token ledger and the last checkpoint.
Each reads evidence `RunAudit.observe` gathered (per-step metrics, the trainer's and each rollout worker's stats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

WINDOW = 5  # trainer steps of evidence before a configured mechanism with no effect is called inactive
# rlhf_core.run.accounting; carried: generated before the checkpoint a run resumed from, never trained (regenerated)
LEDGER_ACCOUNTS = ("trained", "evicted", "dropped", "filtered", "buffered", "in_flight", "carried")


@dataclass
class Check:
    name: str
    verdict: str  # ok | inactive | failed | pending
    evidence: str
    figures: dict = field(default_factory=dict)


class AsConfigured:
    """Checks of a RunAudit (its cfg, seen, trainer, workers, steps, final, ledger, checkpoint, lr_errors)."""

    def _undecided(self, name: str, evidence: str, figures: Optional[dict] = None, at_end: bool = False) -> Check:
        """A configured mechanism with no effect seen yet: pending until WINDOW steps (`at_end`: until the run ends,
        for a mechanism that may rightly act late: clipping once the policy has moved), then inactive."""
        verdict = "inactive" if self.final or (self.steps >= WINDOW and not at_end) else "pending"
        return Check(name, verdict, evidence, figures or {})

    def _lr(self) -> Check:
        t = self.cfg.trainer
        lr = self.seen.get("policy/lr")
        figures = {"lr_min": lr[0] if lr else None, "lr_max": lr[1] if lr else None, "mismatches": len(self.lr_errors)}
        if self.lr_errors:
            step, logged, expected = self.lr_errors[0]
            return Check(
                "lr_schedule",
                "failed",
                f"trainer.lr_schedule {t.lr_schedule!r} (warmup {t.warmup_steps}): "
                f"step {step} trained at lr {logged:.6g}, the schedule gives {expected:.6g} "
                f"({len(self.lr_errors)} step(s) off)",
                figures,
            )
        if lr is None:
            return self._undecided("lr_schedule", "no learning rate was logged yet", figures)
        return Check(
            "lr_schedule",
            "ok",
            f"{t.lr_schedule} (warmup {t.warmup_steps}): every logged lr equals the "
            f"schedule's ({lr[0]:.6g}..{lr[1]:.6g})",
            figures,
        )

    def _dropout(self) -> Check:
        p = self.trainer.get("dropout_max")
        if p is None:
            return Check("dropout", "pending" if not self.final else "ok", "the trainer reported no dropout module")
        if float(p) > 0:
            return Check(
                "dropout",
                "failed",
                f"a dropout of p = {p} is active in the trained model: the trainer's log-probs are not the engine's",
                {"dropout_max": p},
            )
        return Check("dropout", "ok", "no dropout active in the trained model", {"dropout_max": p})

    def _ledger(self) -> Check:
        led = self.ledger
        if led is None:
            return Check("ledger", "inactive", self.ledger_note)
        units = (("groups", ""), ("samples", "_samples"), ("tokens", "_tokens"))
        off = {u: led[f"unaccounted{k}"] for u, k in units if led.get(f"unaccounted{k}")}
        off.update(
            {f"{u} in flight after the stop": led[f"in_flight{k}"] for u, k in units if led.get(f"in_flight{k}")}
        )
        if off:
            return Check("ledger", "failed", f"not every one accounted for: {off}", led)
        parts = " + ".join(f"{led.get(k + '_tokens', 0)} {k.replace('_', ' ')}" for k in LEDGER_ACCOUNTS)
        tokens = f"; {led['pushed_tokens']} response tokens = {parts}" if "pushed_tokens" in led else ""
        return Check("ledger", "ok", f"{led.get('generated', 0)} groups generated, each in one account{tokens}", led)

    def _checkpoint(self) -> Check:
        c = self.checkpoint or {}
        if c.get("error"):
            return Check(
                "checkpoint", "failed", f"the last checkpoint {c.get('path')} does not read back: {c['error']}", c
            )
        if not c.get("path"):
            return Check("checkpoint", "inactive", "no checkpoint was written (the run ended before checkpoint.every)")
        said = (
            f"the last checkpoint ({c['path']}) reads back and holds version {c.get('version')} at step {c.get('step')}"
        )
        return Check("checkpoint", "ok", said, c)

    def _seeds(self) -> Check:
        """The trainer seeded with trainer.seed; every rollout worker samples with a seed of its own (two workers with
        one seed draw the same samples: half the fleet's work repeated)."""
        want = self.cfg.trainer.seed
        got = self.trainer.get("seed")
        workers = {name: s["seed"] for name, s in self.workers.items() if s.get("seed") is not None}
        figures = {"trainer.seed": want, "trainer": got, "rollout": workers}
        if got is not None and int(got) != int(want):
            return Check("seeds", "failed", f"trainer.seed is {want} but the trainer seeded torch with {got}", figures)
        shared: dict[int, list[str]] = {}
        for name, seed in workers.items():
            shared.setdefault(int(seed), []).append(name)
        twins = {seed: names for seed, names in shared.items() if len(names) > 1}
        if twins:
            return Check("seeds", "failed", f"rollout workers sample with the same seed: {twins}", figures)
        if got is None:
            return Check("seeds", "pending" if not self.final else "inactive", "the trainer reported no seed", figures)
        return Check(
            "seeds", "ok", f"trainer seed {got} as configured; {len(workers)} rollout worker(s), each its own", figures
        )

    def _eval_metric(self) -> Optional[Check]:
        """eval/accuracy is eval.metric's score in the newest held-out evaluation the trainer's host ran (the start
        evaluation, then the pinned ones every eval.every steps); None when there was none."""
        metric = self.cfg.eval.metric
        ev = self.trainer.get("eval_last")
        if not ev:
            return None
        acc, own = ev.get("eval/accuracy"), ev.get(f"eval/{metric}")
        figures = {"metric": metric, "version": ev.get("eval/version"), "eval/accuracy": acc}
        if acc is None or own is None or (metric != "accuracy" and own != acc):
            keys = sorted(k for k in ev if k.startswith("eval/"))
            return Check(
                "eval_metric",
                "failed",
                f"eval.metric is {metric!r} but eval/accuracy is not its score (version {ev.get('eval/version')}: "
                f"{keys})",
                figures,
            )
        return Check(
            "eval_metric",
            "ok",
            f"eval/accuracy is eval.metric {metric!r}: {acc:.4g} at version {ev.get('eval/version')}",
            figures,
        )
