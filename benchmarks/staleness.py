"""Controlled staleness: held-out accuracy of each loss when the trainer consumes τ-version-old data.

Deterministic stale-k mode (`rlhf_core.staleness.run_stale`, the M2PO paper's setting): before the batch
for trainer version V is generated, the rollout engine is loaded with the trainer's weights of version
max(0, V − τ). Timing plays no part, so every consumed batch is exactly τ versions old after the first τ
steps, and its behaviour log-probs (hence the importance ratios) are those of the τ-stale policy.

Task: configs/tiny.yaml (max3, 2-layer Llama, 16 prompts × 8 samples per step), with the budget below.
Grid: τ × loss × seed. Losses (exactly what each cell runs, the options under algorithm.loss_options;
advantages are GRPO group advantages for all):

    ppo_clip0.2        algorithm.loss=ppo,  clip_eps=0.2                     clipped PPO surrogate
    grpo_noclip        algorithm.loss=grpo, clip_eps=null                    −A·r, no clipping, no masking
    m2po_trust_region  algorithm.loss=m2po, masking=trust_region, m2_threshold=0.04, clip_eps=null
    m2po_ratio_sq      algorithm.loss=m2po, masking=ratio_sq, ratio_sq_threshold=4, clip_eps=0.2

(`algorithm.loss=grpo` with clip_eps=0.2 calls the same function with the same arguments as ppo here,
so it would duplicate the ppo cell; the GRPO cell is therefore the unclipped importance-weighted one.)

Per cell (mean ± std over seeds): final held-out accuracy (greedy, data.eval_size prompts), steps to
0.8 accuracy (first evaluation at or above it; evaluations every --eval-every steps; seeds that never
reach it are counted, not averaged), the variance over steps of the pre-clip gradient norm
("policy/grad_norm"), the mean clip fraction, and for M2PO the mean masked fraction and M2
("m2po/masked_frac", "m2po/m2").

    python benchmarks/staleness.py                       # full grid, table (84 runs: 22 min on 2 idle cores)
    python benchmarks/staleness.py --quick               # τ ∈ {0, 8}, ppo and m2po_trust_region, 1 seed
    python benchmarks/staleness.py --json                # one JSON object on stdout, nothing else
    python benchmarks/staleness.py --plot docs/staleness_accuracy.png
    python benchmarks/staleness.py --taus 0 32 64 --losses ppo_clip0.2 --seeds 0 1 2

Progress lines go to stderr. Runs are spread over --workers processes, one torch thread each.

This is the single-process, controlled-staleness harness. The same question on the real asynchronous
runtime (losses x runtime.max_staleness x seeds, each a supervised atrlhf-train run) is a sweep, compared
in the Prefect and MLflow UIs (docs/benchmarks.md, "The staleness study as a sweep"):

    atrlhf sweep --config configs/staleness_sweep.yaml \
        --grid algorithm.loss=grpo,m2po --grid runtime.max_staleness=1,4 --seeds 2
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when imported
from machine import cpu_model  # noqa: E402

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOSSES: dict[str, list[str]] = {
    "ppo_clip0.2": ["algorithm.loss=ppo", "algorithm.loss_options.clip_eps=0.2"],
    "grpo_noclip": ["algorithm.loss=grpo", "algorithm.loss_options.clip_eps=null"],
    "m2po_trust_region": [
        "algorithm.loss=m2po",
        "algorithm.loss_options.masking=trust_region",
        "algorithm.loss_options.m2_threshold=0.04",
        "algorithm.loss_options.clip_eps=null",
    ],
    "m2po_ratio_sq": [
        "algorithm.loss=m2po",
        "algorithm.loss_options.masking=ratio_sq",
        "algorithm.loss_options.ratio_sq_threshold=4.0",
        "algorithm.loss_options.clip_eps=0.2",
    ],
}
FULL_TAUS = [0, 2, 4, 8, 16, 32]
QUICK_TAUS = [0, 8]
QUICK_LOSSES = ["ppo_clip0.2", "m2po_trust_region"]
TARGET_ACCURACY = 0.8
MAX_EXTEND_TAU = 128
DEGRADED_DROP = 0.10  # plain clipping "clearly degrades": final accuracy this far below its τ = 0 value


def cell_key(tau: int, loss: str) -> str:
    return f"tau={tau}/loss={loss}"


def build_cfg(loss: str, seed: int, steps: int, lr: float, eval_size: int, policy_root: str):
    from rlhf_core.config import load_config

    return load_config(
        ROOT / "configs" / "tiny.yaml",
        LOSSES[loss]
        + [
            f"trainer.total_steps={steps}",
            f"trainer.lr={lr}",
            f"trainer.seed={seed}",
            f"data.eval_size={eval_size}",
            "cluster.torch_threads=1",
            "eval.every=0",
            "checkpoint.every=0",
            f"run.output_dir={policy_root}/seed{seed}",
        ],
    )


def run_cell(job: dict) -> dict:
    """One (τ, loss, seed) run; returns its per-seed summary."""
    import torch

    from rlhf_core.staleness import run_stale

    torch.set_num_threads(1)
    cfg = build_cfg(job["loss"], job["seed"], job["steps"], job["lr"], job["eval_size"], job["policy_root"])
    t0 = time.perf_counter()
    out = run_stale(cfg, job["tau"], eval_every=job["eval_every"])
    wall = time.perf_counter() - t0
    hist = out["history"]
    curve = [(step, ev["eval/accuracy"]) for step, ev in out["evals"]]
    reached = next((step for step, acc in curve if acc >= TARGET_ACCURACY), None)
    grad_norms = [m["policy/grad_norm"] for m in hist if math.isfinite(m["policy/grad_norm"])]
    # consumed-batch staleness once V >= τ (before that the data is version 0, less stale)
    settled = [m["async/staleness_mean"] for m in hist if m["trainer_version"] >= job["tau"]]

    def mean_of(key: str):
        vals = [m[key] for m in hist if key in m and math.isfinite(m[key])]
        return statistics.fmean(vals) if vals else None

    return {
        "tau": job["tau"],
        "loss": job["loss"],
        "seed": job["seed"],
        "final_accuracy": out["eval/accuracy"],
        "start_accuracy": out["eval/accuracy_start"],
        "steps_to_target": reached,
        "curve": curve,
        "grad_norm_var": statistics.pvariance(grad_norms) if len(grad_norms) > 1 else None,
        "grad_norm_mean": statistics.fmean(grad_norms) if grad_norms else None,
        "clip_frac_mean": mean_of("policy/clip_frac"),
        "ratio_max_mean": mean_of("policy/ratio_max"),
        "approx_kl_mean": mean_of("policy/approx_kl"),
        "masked_frac_mean": mean_of("m2po/masked_frac"),
        "m2_mean": mean_of("m2po/m2"),
        "staleness_settled": sorted(set(settled)),
        "skipped_steps": hist[-1]["trainer/skipped_steps"] if hist else 0,
        "wall_s": wall,
    }


def _mean_std(values: list) -> tuple:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0)


def summarise(runs: list[dict]) -> dict:
    """Per-cell aggregates over seeds."""
    cells: dict[str, dict] = {}
    for r in runs:
        cells.setdefault(cell_key(r["tau"], r["loss"]), []).append(r)
    out = {}
    for key, rs in sorted(cells.items(), key=lambda kv: (kv[1][0]["tau"], list(LOSSES).index(kv[1][0]["loss"]))):
        rs = sorted(rs, key=lambda r: r["seed"])
        acc_m, acc_s = _mean_std([r["final_accuracy"] for r in rs])
        # mean of the last three evaluations: less sensitive to where the last step happens to land
        last3_m, last3_s = _mean_std([statistics.fmean(a for _, a in r["curve"][-3:]) for r in rs])
        st_m, st_s = _mean_std([r["steps_to_target"] for r in rs])
        gv_m, gv_s = _mean_std([r["grad_norm_var"] for r in rs])
        steps_curve = [s for s, _ in rs[0]["curve"]]
        mean_curve = (
            [statistics.fmean(r["curve"][i][1] for r in rs) for i in range(len(steps_curve))]
            if all(len(r["curve"]) == len(steps_curve) for r in rs)
            else None
        )
        out[key] = {
            "tau": rs[0]["tau"],
            "loss": rs[0]["loss"],
            "seeds": [r["seed"] for r in rs],
            "final_accuracy_mean": acc_m,
            "final_accuracy_std": acc_s,
            "final_accuracy_per_seed": [r["final_accuracy"] for r in rs],
            "last3_accuracy_mean": last3_m,
            "last3_accuracy_std": last3_s,
            "steps_to_target_mean": st_m,
            "steps_to_target_std": st_s,
            "steps_to_target_per_seed": [r["steps_to_target"] for r in rs],
            "reached_target": sum(r["steps_to_target"] is not None for r in rs),
            "grad_norm_var_mean": gv_m,
            "grad_norm_var_std": gv_s,
            "grad_norm_mean": _mean_std([r["grad_norm_mean"] for r in rs])[0],
            "clip_frac_mean": _mean_std([r["clip_frac_mean"] for r in rs])[0],
            "approx_kl_mean": _mean_std([r["approx_kl_mean"] for r in rs])[0],
            "masked_frac_mean": _mean_std([r["masked_frac_mean"] for r in rs])[0],
            "m2_mean": _mean_std([r["m2_mean"] for r in rs])[0],
            "staleness_settled": sorted({s for r in rs for s in r["staleness_settled"]}),
            "skipped_steps": sum(r["skipped_steps"] for r in rs),
            "curve_steps": steps_curve,
            "curve_accuracy_mean": mean_curve,
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in rs),
        }
    return out


def check_claim(cells: dict) -> dict:
    """The hypothesis under test: M2PO at τ=8 within 5 % of its τ=0 accuracy while PPO clipping falls behind."""

    def acc(tau, loss):
        c = cells.get(cell_key(tau, loss))
        return None if c is None else c["final_accuracy_mean"]

    out = {}
    for loss in LOSSES:
        a0, a8 = acc(0, loss), acc(8, loss)
        if a0 is None or a8 is None:
            continue
        out[loss] = {
            "acc_tau0": a0,
            "acc_tau8": a8,
            "relative_drop": (a0 - a8) / a0 if a0 else None,
            "within_5pct": a8 >= 0.95 * a0,
        }
    m2 = [out[k]["within_5pct"] for k in ("m2po_trust_region", "m2po_ratio_sq") if k in out]
    ppo = out.get("ppo_clip0.2")
    ppo_behind = None
    if ppo is not None:
        best_m2_tau8 = max(
            (out[k]["acc_tau8"] for k in ("m2po_trust_region", "m2po_ratio_sq") if k in out), default=None
        )
        ppo_behind = (not ppo["within_5pct"]) and (best_m2_tau8 is None or ppo["acc_tau8"] < best_m2_tau8)
    out["m2po_within_5pct_at_tau8"] = all(m2) if m2 else None
    out["ppo_falls_behind_at_tau8"] = ppo_behind
    out["claim_holds"] = bool(m2) and all(m2) and bool(ppo_behind)
    return out


def ppo_degraded(cells: dict, tau: int) -> bool:
    base = cells.get(cell_key(0, "ppo_clip0.2"))
    cur = cells.get(cell_key(tau, "ppo_clip0.2"))
    if base is None or cur is None:
        return True  # nothing to extend for
    return cur["final_accuracy_mean"] <= base["final_accuracy_mean"] - DEGRADED_DROP or cur["reached_target"] * 2 < len(
        cur["seeds"]
    )


def run_jobs(jobs: list[dict], workers: int, log) -> list[dict]:
    results = []
    if workers <= 1:
        for i, job in enumerate(jobs):
            results.append(run_cell(job))
            log(results[-1], i + 1, len(jobs))
        return results
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, maxtasksperchild=None) as pool:
        for i, res in enumerate(pool.imap_unordered(run_cell, jobs)):
            results.append(res)
            log(res, i + 1, len(jobs))
    return results


def prebuild_policies(seeds: list[int], policy_root: str) -> None:
    """Build each seed's tiny policy once, here, so parallel runs never race to create it."""
    from rlhf_core.config import load_config
    from rlhf_core.model.policy import ensure_policy

    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    for seed in seeds:
        ensure_policy(cfg.model, cfg.data.task, f"{policy_root}/seed{seed}", seed=seed)


def plot(cells: dict, path: str, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = sorted({c["tau"] for c in cells.values()})
    xs = {t: i for i, t in enumerate(taus)}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, loss in enumerate(LOSSES):
        cs = sorted((c for c in cells.values() if c["loss"] == loss), key=lambda c: c["tau"])
        if not cs:
            continue
        jitter = (i - (len(LOSSES) - 1) / 2) * 0.06  # side by side, so that the error bars stay readable
        ax.errorbar(
            [xs[c["tau"]] + jitter for c in cs],
            [c["final_accuracy_mean"] for c in cs],
            yerr=[c["final_accuracy_std"] for c in cs],
            marker="o",
            capsize=3,
            label=loss,
        )
        ax2.plot([xs[c["tau"]] for c in cs], [c["grad_norm_var_mean"] for c in cs], marker="o", label=loss)
    for a in (ax, ax2):
        a.set_xticks(range(len(taus)), [str(t) for t in taus])
        a.set_xlabel("staleness τ (trainer consumes data from version V − τ)")
        a.grid(alpha=0.3)
    ax.set_ylabel("final held-out accuracy (mean ± std over seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.axhline(TARGET_ACCURACY, color="grey", lw=0.8, ls=":")
    ax.set_title(f"max3, tiny Llama, {meta['steps']} steps, lr {meta['lr']}, seeds {meta['seeds']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    ax2.set_yscale("log")
    ax2.set_ylabel("variance over steps of policy/grad_norm (pre-clip)")
    ax2.set_title("gradient-norm variance (mean over seeds)", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def print_table(out: dict) -> None:
    meta = out["meta"]
    print(
        f"controlled staleness (stale-k), max3 tiny Llama: {meta['steps']} steps × {meta['batch']} samples, "
        f"lr {meta['lr']}, eval every {meta['eval_every']} on {meta['eval_size']} held-out prompts, "
        f"seeds {meta['seeds']}; wall {meta['wall_s'] / 60:.1f} min on {meta['workers']} workers ({meta['cpu']})"
    )
    print(
        f"{'tau':>4} {'loss':<18} {'final acc':<12} {'last-3 acc':<11} {'steps→0.8':>14} {'reached':>7} "
        f"{'var|g|':>9} {'clip':>6} {'masked':>7} {'M2':>8}"
    )
    for c in out["cells"].values():
        steps = (
            f"{fmt(c['steps_to_target_mean'], '.0f')}±{fmt(c['steps_to_target_std'], '.0f')}"
            if c["steps_to_target_mean"] is not None
            else "—"
        )
        final = f"{fmt(c['final_accuracy_mean'])}±{fmt(c['final_accuracy_std'])}"
        last3 = f"{fmt(c['last3_accuracy_mean'])}±{fmt(c['last3_accuracy_std'])}"
        reached = f"{c['reached_target']}/{len(c['seeds'])}"
        print(
            f"{c['tau']:>4} {c['loss']:<18} {final:<12} {last3:<11} {steps:>14} {reached:>7} "
            f"{fmt(c['grad_norm_var_mean'], '.4f'):>9} {fmt(c['clip_frac_mean'], '.3f'):>6} "
            f"{fmt(c['masked_frac_mean'], '.3f'):>7} {fmt(c['m2_mean'], '.4f'):>8}"
        )
    claim = out["claim"]
    print(
        "staleness claim (M2PO at τ=8 within 5% of τ=0, PPO clipping behind): "
        f"m2po within 5%: {claim.get('m2po_within_5pct_at_tau8')}, ppo behind: {claim.get('ppo_falls_behind_at_tau8')}"
        f" -> {'holds' if claim.get('claim_holds') else 'does not hold'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="τ ∈ {0, 8}, two losses, one seed, shorter runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else on stdout")
    parser.add_argument("--plot", default=None, help="write accuracy vs τ per loss to this PNG")
    parser.add_argument("--taus", type=int, nargs="+", default=None, help=f"staleness values (default {FULL_TAUS})")
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=None, help="losses (default all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 400, 250 with --quick)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--eval-every", type=int, default=20, help="evaluate every this many steps")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument("--workers", type=int, default=2, help="parallel processes (one torch thread each)")
    parser.add_argument(
        "--no-extend",
        action="store_true",
        help=f"do not extend τ upward (doubling, up to {MAX_EXTEND_TAU}) when plain clipping "
        "has not clearly degraded at the largest τ",
    )
    parser.add_argument(
        "--save", default=None, help="also write the JSON object to this file, and each finished run to PATH.runs.jsonl"
    )
    parser.add_argument(
        "--resume",
        default=None,
        help="a PATH.runs.jsonl of an interrupted run: its (τ, loss, seed) runs are reused as they "
        "are, not rerun (pass the same --steps, --lr and --eval-* as that run)",
    )
    args = parser.parse_args()

    taus = args.taus or (QUICK_TAUS if args.quick else FULL_TAUS)
    losses = args.losses or (QUICK_LOSSES if args.quick else list(LOSSES))
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    steps = args.steps or (250 if args.quick else 400)
    extend = not (args.no_extend or args.quick or args.taus)

    done: dict[tuple, dict] = {}
    if args.resume:
        for line in Path(args.resume).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["tau"], r["loss"], r["seed"])] = r
    runs_log = Path(args.save + ".runs.jsonl") if args.save else None

    def log(res, i, n):
        if runs_log is not None:
            with runs_log.open("a") as fh:
                fh.write(json.dumps(res) + "\n")
        print(
            f"[{i}/{n}] tau={res['tau']:<3} {res['loss']:<18} seed={res['seed']} acc={res['final_accuracy']:.3f} "
            f"steps→0.8={res['steps_to_target']} var|g|={fmt(res['grad_norm_var'], '.4f')} "
            f"({res['wall_s']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="staleness_") as policy_root:
        prebuild_policies(seeds, policy_root)

        def run_taus(ts):
            """Run (or reuse from --resume) every (τ, loss, seed) of these τ."""
            reused = [done[(t, loss, s)] for t in ts for loss in losses for s in seeds if (t, loss, s) in done]
            jobs = [
                {
                    "tau": t,
                    "loss": loss,
                    "seed": s,
                    "steps": steps,
                    "lr": args.lr,
                    "eval_every": args.eval_every,
                    "eval_size": args.eval_size,
                    "policy_root": policy_root,
                }
                # seed-major order: an interrupted grid still holds whole τ × loss grids for its first seeds
                for s in seeds
                for t in sorted(ts, reverse=True)
                for loss in losses
                if (t, loss, s) not in done
            ]
            return reused + run_jobs(jobs, args.workers, log)

        runs = run_taus(taus)
        extended = []
        while (
            extend
            and "ppo_clip0.2" in losses
            and not ppo_degraded(summarise(runs), max(taus))
            and max(taus) * 2 <= MAX_EXTEND_TAU
        ):
            nxt = max(taus) * 2
            print(
                f"plain clipping has not clearly degraded by τ={max(taus)}; extending to τ={nxt}",
                file=sys.stderr,
                flush=True,
            )
            taus = taus + [nxt]
            extended.append(nxt)
            runs += run_taus([nxt])

    cells = summarise(runs)
    import torch

    meta = {
        "task": "max3",
        "config": "configs/tiny.yaml",
        "steps": steps,
        "lr": args.lr,
        "batch": "16 prompts × 8",
        "eval_every": args.eval_every,
        "eval_size": args.eval_size,
        "taus": sorted(taus),
        "extended_taus": extended,
        "losses": {k: LOSSES[k] for k in losses},
        "seeds": seeds,
        "workers": args.workers,
        "target_accuracy": TARGET_ACCURACY,
        "wall_s": time.perf_counter() - start,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "loadavg_1min": os.getloadavg()[0],
        "quick": args.quick,
    }
    out = {"benchmark": "staleness", "meta": meta, "cells": cells, "claim": check_claim(cells), "runs": runs}
    if args.plot:
        plot(cells, args.plot, meta)
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)


if __name__ == "__main__":
    main()
