"""The run's agent error texts in MLflow: each distinct error that ended agent episodes ("failed: ..." when the
episode was left out, "raised: ..." when it was scored agent.error_reward), how many episodes it ended and the
steps it was first and last seen at. Read from each poll's rollout workers (`agent_error_texts` of their stats)
and kept as the artifact agent_errors.json, rewritten whenever it changes; the console prints each once per
batch (rlhf_core.agent.runner.report_errors)."""

from __future__ import annotations

import collections

ARTIFACT = "agent_errors.json"


class ErrorTexts:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def update(self, poll: dict, tracker, step: int) -> bool:
        """Merge a poll's error texts (summed over its workers); log the artifact when something is new. Returns
        whether it changed. A restarted worker counts from 0 again: a count only grows."""
        merged: collections.Counter = collections.Counter()
        for stats in poll.get("rollout") or []:
            merged.update(stats.get("agent_error_texts") or {})
        changed = False
        for text, n in merged.items():
            row = self.rows.get(text)
            if row is None:
                self.rows[text] = {"error": text, "episodes": int(n), "first_step": step, "last_step": step}
                changed = True
            elif n > row["episodes"]:
                row.update(episodes=int(n), last_step=step)
                changed = True
        if changed:
            tracker.log_dict(sorted(self.rows.values(), key=lambda r: (-r["episodes"], r["error"])), ARTIFACT)
        return changed
