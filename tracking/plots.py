"""A run's plots as MLflow artifacts: the reward curve (with held-out accuracy; a resumed run's curve starts
with the runs it resumed) and the staleness histogram."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from tracking.runs import MlflowTracker


@dataclass
class LoggedPlots:
    """What log_plots wrote: the artifact paths, and the reward curve's PNG for summaries elsewhere."""

    artifacts: list[str]
    reward_curve_png: bytes

    @property
    def markdown(self) -> str:
        """The reward curve as an inline markdown image (a Prefect markdown artifact shows it)."""
        data = base64.b64encode(self.reward_curve_png).decode()
        return f"\n![Reward curve: reward/mean and held-out eval/accuracy by step](data:image/png;base64,{data})\n"


def log_plots(tracker: MlflowTracker, history: list[dict], staleness_hist: dict, evals: list[dict]) -> LoggedPlots:
    """Reward curve (with held-out accuracy) and staleness histogram as PNG artifacts; the curve's data as
    plots/reward_curve.json. A resumed run's curve starts with the runs it resumed (lineage_history)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    earlier_history, earlier_evals = tracker.lineage_history()
    history, evals = earlier_history + list(history), earlier_evals + list(evals)
    written = []
    steps = [m["step"] for m in history if "reward/mean" in m]
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    tracker.client.log_dict(
        tracker.run_id,
        {
            "reward/mean": {"step": steps, "value": rewards},
            "eval/accuracy": {"step": [e["step"] for e in evals], "value": [e["eval/accuracy"] for e in evals]},
        },
        "plots/reward_curve.json",
    )
    written.append("plots/reward_curve.json")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, label="reward/mean (train)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval/accuracy"] for e in evals], "o-", label="eval/accuracy (held-out)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("Reward curve")
    ax.legend(loc="best")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=80)
    tracker.client.log_figure(tracker.run_id, fig, "plots/reward_curve.png")
    plt.close(fig)
    written.append("plots/reward_curve.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    if staleness_hist:
        taus = sorted(int(t) for t in staleness_hist)
        ax.bar(taus, [staleness_hist.get(t, staleness_hist.get(str(t), 0)) for t in taus])
        ax.set_xticks(taus)
    ax.set_xlabel("staleness τ = trainer version − sample version")
    ax.set_ylabel("samples consumed")
    ax.set_title("Staleness histogram")
    fig.tight_layout()
    tracker.client.log_figure(tracker.run_id, fig, "plots/staleness_histogram.png")
    plt.close(fig)
    written.append("plots/staleness_histogram.png")
    return LoggedPlots(written, png.getvalue())
