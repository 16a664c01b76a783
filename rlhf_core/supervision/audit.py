"""The run audit: for each mechanism the config turns on, a verdict with its evidence, computed from what the run
measured (its polls: per-step metrics and each role's stats), updated at every poll and final at the end.

Verdicts: `ok` (evidence that it took effect), `inactive` (configured, no effect seen after `WINDOW` trainer steps,
with the reason where one is known), `failed` (evidence against), `pending` (too early to say). A check that was
`inactive` becomes `ok` when its effect shows later; `failed` is final. Each check's evidence is a sentence a user can
read and the figures it rests on. The checks, when each applies and what each verdict means: docs/orchestration.md,
"The run audit". Plain Python: no torch, no Ray, no Prefect (the supervision loop feeds it; the sinks publish it).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from rlhf_core.supervision.audit_config import AsConfigured, Check

__all__ = ["AUDIT_FILE", "Check", "RunAudit", "audit_table"]

AUDIT_FILE = "audit.json"
NOISE = 1e-4  # a correction weight within this of 1 is engine numerics, not a correction


class RunAudit(AsConfigured):
    """Accumulates the evidence of a run's polls (`observe`) and judges it (`checks`)."""

    def __init__(self, cfg, start_step: int = 0):
        from rlhf_core.trainer.schedule import build_lr_lambda  # the trainer's formula (torch: only here)

        self.cfg = cfg
        t = cfg.trainer
        self.lr_at = build_lr_lambda(t.lr_schedule, t.warmup_steps, t.total_steps, t.min_lr_ratio)
        self.start_step = start_step
        self.steps = 0  # trainer steps observed
        self.seen: dict[str, list[float]] = {}  # metric -> [min, max, count of non-zero, last]
        self.lr_errors: list[tuple[int, float, float]] = []  # (step, logged, expected)
        self.bound_errors: list[tuple[int, float]] = []  # (step, bound in force) where it differs from the set one
        self.token_staleness_max = 0
        self.bound_max = 0
        self.workers: dict[str, dict] = {}  # each rollout worker's latest stats
        self.trainer: dict = {}
        self.final_poll: Optional[dict] = None
        self.ledger: Optional[dict] = None
        self.ledger_note = "the host kept no ledger of this run"
        self.checkpoint: Optional[dict] = None  # {path, step, version} or {path, error}
        self.eval_keys: set[str] = set()
        self.final = False
        self.reported: dict[str, str] = {}  # check -> the verdict last reported as a health event
        self.updated = time.time()

    # ------------------------------------------------------------------ evidence
    def _see(self, key: str, value) -> None:
        try:
            v = float(value)
        except (TypeError, ValueError):
            return
        if not math.isfinite(v):
            return
        s = self.seen.get(key)
        if s is None:
            self.seen[key] = [v, v, float(v != 0.0), v]
        else:
            s[0], s[1], s[2], s[3] = min(s[0], v), max(s[1], v), s[2] + (v != 0.0), v

    def observe(self, poll: dict) -> None:
        """One poll's evidence: its per-step metrics and each role's stats."""
        for m in poll.get("metrics", ()):
            self.steps += 1
            for key, value in m.items():
                self._see(key, value)
            self._observe_step(m)
        for s in poll.get("rollout", ()):
            self.workers[str(s.get("index", s.get("name", "?")))] = s
        self.trainer = poll.get("trainer", self.trainer) or {}
        self.updated = time.time()

    def _observe_step(self, m: dict) -> None:
        step = int(m.get("step", 0))
        if "policy/lr" in m and step > 0:
            expected = self.cfg.trainer.lr * self.lr_at(step - 1)  # the rate step `step`'s update used
            logged = float(m["policy/lr"])
            if abs(logged - expected) > 1e-6 * max(abs(expected), 1e-12) + 1e-12:
                self.lr_errors.append((step, logged, expected))
        bound = m.get("async/max_staleness")
        if bound is not None:
            self.bound_max = max(self.bound_max, int(bound))
            if not self.cfg.runtime.autopilot.enabled and int(bound) != self.cfg.runtime.max_staleness:
                self.bound_errors.append((step, int(bound)))
        self.token_staleness_max = max(self.token_staleness_max, int(m.get("async/token_staleness_max", 0) or 0))

    def observe_eval(self, metrics: dict) -> None:
        self.eval_keys.update(k for k in metrics if k.startswith("eval/"))

    def finish(
        self, poll: Optional[dict] = None, ledger: Optional[dict] = None, checkpoint: Optional[dict] = None
    ) -> None:
        """The run ended (finished, failed or cancelled): the last poll's evidence, the ledger and the last
        checkpoint read back. From now on no check is pending."""
        if poll is not None:
            self.observe(poll)
        self.ledger = ledger
        self.checkpoint = checkpoint
        self.final = True

    # ------------------------------------------------------------------ judgement
    def _nonzero(self, key: str) -> int:
        s = self.seen.get(key)
        return int(s[2]) if s else 0

    def checks(self) -> list[Check]:
        cfg, out = self.cfg, []
        out.append(self._weights())
        if cfg.model.lora:
            out.append(self._lora())
        out.append(self._staleness())
        algo = cfg.algorithm
        if algo.rollout_correction.mode != "none":
            out.append(self._correction())
        if algo.kl_coef > 0:
            n = self._nonzero("loss/kl") + self._nonzero("reward/kl_penalty")
            out.append(
                Check("kl", "ok", f"a non-zero KL term at {n} step(s)", {"steps": n})
                if n
                else self._undecided(
                    "kl", f"algorithm.kl_coef {algo.kl_coef}: the KL term was 0 at every step", at_end=True
                )
            )
        if "clip_frac" in " ".join(self.seen) or "clip_eps" in algo.loss_options.model_dump():
            out.append(self._clipping())
        if algo.loss == "m2po":
            out.append(self._m2po())
        if algo.filter_groups:
            n = self._nonzero("buffer/filtered_groups_frac")
            out.append(
                Check("filtering", "ok", f"groups filtered (all rewards equal) at {n} step(s)")
                if n
                else self._undecided("filtering", "algorithm.filter_groups: no group was filtered", at_end=True)
            )
        if cfg.reward.overlong:
            n = self._nonzero("reward/overlong")
            out.append(
                Check("overlong", "ok", f"a non-zero overlong penalty at {n} step(s)")
                if n
                else self._undecided(
                    "overlong",
                    "reward.overlong: the penalty was 0 at every step (no response reached the penalty's range)",
                    at_end=True,
                )
            )
        out.append(self._reward())
        if (evaluated := self._eval_metric()) is not None:
            out.append(evaluated)
        out.append(self._lr())
        out.append(self._dropout())
        out.append(self._seeds())
        if self.final:
            out.append(self._ledger())
            if cfg.checkpoint.every > 0 and self.checkpoint is not None:
                out.append(self._checkpoint())
        return out

    def _weights(self) -> Check:
        checks = sum(int(s.get("sync_checks", 0) or 0) for s in self.workers.values())
        failures = sum(int(s.get("sync_check_failures", 0) or 0) for s in self.workers.values())
        worst = max((float(s.get("sync_probe_diff_max") or 0.0) for s in self.workers.values()), default=0.0)
        version = int(self.trainer.get("version", 0) or 0)
        slack = max(self.bound_max, 1) + self.cfg.runtime.sync_every + 1  # a worker mid-batch lags this much at most
        behind = {
            name: int(s.get("version", 0) or 0)
            for name, s in self.workers.items()
            if self.final and s.get("alive", True) and version - int(s.get("version", 0) or 0) > slack
        }
        figures = {"sync_checks": checks, "sync_check_failures": failures, "probe_diff_max": worst}
        if failures:
            return Check(
                "weights",
                "failed",
                f"{failures} of {checks} weight syncs did not land as published: the "
                f"engine's probe log-probs differed from the trainer's by up to {worst:.3g}",
                figures,
            )
        if behind:
            return Check(
                "weights",
                "failed",
                f"rollout worker(s) {behind} hold versions far behind the trainer's "
                f"{version}: they did not adopt what was published",
                figures,
            )
        if self.cfg.supervision.sync_check.action == "off":
            return Check("weights", "inactive", "supervision.sync_check.action is off: no sync was checked", figures)
        if checks:
            return Check(
                "weights",
                "ok",
                f"{checks} weight syncs checked, the engine's probe log-probs agreed with "
                f"the trainer's (largest mean difference {worst:.3g})",
                figures,
            )
        return self._undecided("weights", "no weight sync was checked yet", figures)

    def _lora(self) -> Check:
        moved = max((float(s.get("sync_probe_moved_max") or 0.0) for s in self.workers.values()), default=0.0)
        sync_bytes = self.seen.get("sync/bytes", [0.0, 0.0, 0.0, 0.0])[1]
        model_bytes = float(self.trainer.get("model_bytes", 0) or 0)
        figures = {"probe_moved_max": moved, "sync_bytes": sync_bytes, "model_bytes": model_bytes}
        if model_bytes and sync_bytes >= 0.5 * model_bytes:
            return Check(
                "lora",
                "failed",
                f"a sync shipped {sync_bytes:.0f} bytes of a {model_bytes:.0f}-byte model: more than the adapter",
                figures,
            )
        weights = self._weights()
        if weights.verdict == "failed":
            return Check(
                "lora", "failed", "the adapter the engine uses is not the trainer's: " + weights.evidence, figures
            )
        if moved > 1e-4:
            return Check(
                "lora",
                "ok",
                f"the engine's probe log-probs moved by up to {moved:.3g} since the first sync "
                f"and agreed with the trainer's; syncs shipped {sync_bytes:.0f} bytes "
                f"(model: {model_bytes:.0f})",
                figures,
            )
        return self._undecided(
            "lora", "the adapter has not changed the engine's log-probs since the first sync", figures, at_end=True
        )

    def _staleness(self) -> Check:
        bound = self.cfg.runtime.max_staleness
        evicted = self.seen.get("buffer/evicted_stale", [0, 0, 0, 0])[1]
        figures = {"bound": bound, "token_staleness_max": self.token_staleness_max, "evicted_stale": evicted}
        if self.bound_errors:
            step, got = self.bound_errors[0]
            return Check(
                "staleness",
                "failed",
                f"runtime.max_staleness is {bound} but the bound in force at step {step} was {got}",
                figures,
            )
        limit = self.bound_max if self.cfg.runtime.autopilot.enabled else bound
        if self.token_staleness_max > limit:
            return Check(
                "staleness",
                "failed",
                f"a token {self.token_staleness_max} versions old was trained on, past the bound {limit}",
                figures,
            )
        return Check(
            "staleness",
            "ok",
            f"bound {limit} in force; token staleness at most {self.token_staleness_max}; "
            f"{evicted:.0f} group(s) evicted as stale",
            figures,
        )

    def _correction(self) -> Check:
        mode = self.cfg.algorithm.rollout_correction.mode
        w, top = self.seen.get("correction/weight_mean"), self.seen.get("correction/weight_max")
        moved = (top is not None and top[1] - 1.0 > NOISE) or (w is not None and 1.0 - w[0] > NOISE)
        cut = self._nonzero("correction/clipped_frac") + self._nonzero("correction/masked_frac")
        figures = {"weight_mean_min": w[0] if w else None, "weight_max": top[1] if top else None, "cut_steps": cut}
        if moved or cut:
            return Check(
                "correction",
                "ok",
                f"{mode}: weights up to {top[1] if top else 1.0:.6g} (step means from "
                f"{w[0] if w else 1.0:.6g}), clipped or masked at {cut} step(s)",
                figures,
            )
        reason = f"every weight was within {NOISE:g} of 1: the engine's log-probs equal the trainer's up to numerics"
        if self.cfg.runtime.max_staleness == 0 and self.cfg.rollout.engine == "hf":
            reason += (
                " (runtime.max_staleness 0 with the HF engine in the trainer's dtype: the ratio is 1 by "
                "construction, so the correction does nothing)"
            )
        return self._undecided("correction", f"{mode}: {reason}", figures)

    def _clipping(self) -> Check:
        n = self._nonzero("policy/clip_frac") + self._nonzero("policy/dual_clip_frac")
        if n:
            return Check("clipping", "ok", f"tokens clipped at {n} step(s)", {"steps": n})
        reason = "the ratio stayed within the clip range at every step"
        if self.cfg.algorithm.rollout_correction.mode != "none":
            reason += (
                " (with a rollout correction the ratio is taken against the trainer's own log-probs at the step, "
                "decoupled PPO: one update per batch makes it 1, and the correction bounds the off-policy part)"
            )
        elif self.cfg.runtime.max_staleness == 0:
            reason += " (runtime.max_staleness 0, one update per batch: the ratio is 1 up to engine numerics)"
        return self._undecided("clipping", reason, at_end=True)

    def _m2po(self) -> Check:
        n = self._nonzero("m2po/masked_frac")
        if n:
            return Check("m2po", "ok", f"tokens masked by the second-moment bound at {n} step(s)", {"steps": n})
        reason = "no token was masked (the second moment stayed under its threshold)"
        if self.cfg.algorithm.rollout_correction.mode != "none":
            reason += "; with a rollout correction as well, M2PO's masking reduces to PPO's clipping"
        return self._undecided("m2po", reason, at_end=True)

    def _reward(self) -> Check:
        columns = sorted(
            k for k in self.seen if k.startswith("reward/") and k not in ("reward/std", "reward/kl_penalty")
        )
        constant = [k for k in columns if self.seen[k][0] == self.seen[k][1]]
        figures = {k: [self.seen[k][0], self.seen[k][1]] for k in columns}
        if constant and self.steps >= 2:
            values = ", ".join(f"{k} = {self.seen[k][0]:.4g}" for k in constant)
            # a column at 0 throughout may be a sparse reward not earned yet: said at the end; another value at once
            late = all(self.seen[k][0] == 0 for k in constant)
            return self._undecided(
                "reward", f"constant at every step: {values} (no learning signal from it)", figures, late
            )
        if not columns:
            return self._undecided("reward", "no reward was logged yet")
        return Check(
            "reward",
            "ok" if self.steps >= 2 or self.final else "pending",
            f"{len(columns)} reward column(s), each varied over the run",
            figures,
        )

    # ------------------------------------------------------------------ reports
    def findings(self) -> list[Check]:
        """Checks whose verdict is inactive or failed and was not reported as such before (each once per
        verdict): the supervision loop turns them into health events."""
        out = []
        for c in self.checks():
            if c.verdict in ("inactive", "failed") and self.reported.get(c.name) != c.verdict:
                self.reported[c.name] = c.verdict
                out.append(c)
        return out

    def report(self) -> dict:
        checks = self.checks()
        verdicts = [c.verdict for c in checks]
        order = ("failed", "inactive") if self.final else ("failed", "inactive", "pending")
        overall = next((v for v in order if v in verdicts), "ok")
        return {
            "verdict": overall,
            "final": self.final,
            "steps": self.steps,
            "updated": self.updated,
            "checks": [asdict(c) for c in checks],
        }

    def write(self, run_dir: str | Path, report: Optional[dict] = None) -> Path:
        """<run_dir>/audit.json, atomically: `report` (default: the audit's report now)."""
        path = Path(run_dir) / AUDIT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report if report is not None else self.report(), indent=2, default=str))
        tmp.replace(path)
        return path


def audit_table(report: dict) -> str:
    """The audit as a markdown table (the Prefect summary artifact's and `atrlhf audit`'s)."""
    rows = ["| check | verdict | evidence |", "|---|---|---|"]
    for c in report.get("checks", ()):
        rows.append(f"| {c['name']} | {c['verdict']} | {str(c['evidence']).replace('|', '/')} |")
    state = "final" if report.get("final") else "so far"
    return f"**Run audit ({state}): {report.get('verdict')}** after {report.get('steps', 0)} steps\n\n" + "\n".join(
        rows
    )
