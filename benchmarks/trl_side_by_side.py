"""Side by side with TRL: our trainer and TRL's GRPOTrainer on the same model, task, batch and evaluator.

What it measures, per arm, at each torch thread count: samples/s (prompt-completion samples trained, 128 a step,
over the wall clock from the start of training to the last step, held-out evaluations excluded), the seconds and
steps to held-out greedy accuracy >= --target (same clock; None when not reached) and the final accuracy.

The one setup of every arm: configs/tiny.yaml (max3: "max a b c =" -> the largest digit, then EOS; the reward is
exact_match 1.0; 16 prompts x 8 samples a step; max_new_tokens 4; temperature 1.0; AdamW lr 3e-4 constant, betas
(0.9, 0.99), grad clip 1.0; the GRPO loss, clip 0.2, no KL), the tiny 2-layer Llama that OUR builder saves once
(rlhf_core.model.policy, seed 0) and every arm loads, OUR train / held-out split (rlhf_core.data.synthetic) and
OUR evaluator (rlhf_core.run.build.build_evaluator: greedy accuracy on data.eval_size 200 held-out prompts) called
every --eval-every steps on the arm's current weights, off the clock.

Arms (each runs in a process of its own, alternated within every repetition: each arm leads once in turn):
  ours          rlhf_core.loop.run_sync, in-process lockstep (benchmarks/equal_cores.py's `loop` arm, run_loop),
                cluster.torch_threads = --threads
  ours_threads  cluster.host threads, runtime.max_staleness 2 (equal_cores.py's `threads` arm, run_host): one thread
                per role, cluster.torch_threads = max(1, threads // 2) each, so at --threads 1 it still runs 2
                threads (use --pin to hold it to one core)
  trl           trl.GRPOTrainer (use_vllm False) on the same model object, torch.set_num_threads(--threads); its
                reward function is OUR reward (rlhf_core.scoring.Scorer: the run's configured exact_match on the
                completion ids TRL passes, which stop after the first EOS), so both arms score identically

    python benchmarks/trl_side_by_side.py --trl-python "$TRL_VENV/bin/python"                 # table (the defaults:
        # --threads 1 2 --arms ours ours_threads trl --reps 3 --steps 400 --eval-every 10 --target 0.9)
    python benchmarks/trl_side_by_side.py --trl-python "$TRL_VENV/bin/python" --steps 20 --reps 1 --threads 1  # smoke
    python benchmarks/trl_side_by_side.py --trl-python "$TRL_VENV/bin/python" --json          # one JSON object

trl is NOT in this project's environment: it lives in a venv of its own (the TRL arm runs there, with this
checkout on PYTHONPATH for our builder, split, reward and evaluator); the `ours` arms run in this interpreter
(--ours-python). The venv (pyproject.toml's `trl` extra names the version; torch as in requirements.lock, the CPU
build):
    python3 -m venv "$TRL_VENV"
    "$TRL_VENV/bin/pip" install torch==2.13.0
    "$TRL_VENV/bin/pip" install "trl==1.16.0" "transformers==5.24.0" tokenizers safetensors pydantic pyyaml numpy pebble

Where the arms still differ (TRL set to ours wherever it has a knob; the rest is listed in docs/benchmarks.md):
TRL's ratio is exactly 1 (old log-probs = the trainer's own, detached) where ours divides by the rollout engine's
log-probs (1 up to rounding in the lockstep arm); TRL trains the 128 rows in one micro-batch (ours:
trainer.micro_batch_size 64, two, with the same step normalisers); sampling and RNG streams differ. Which prompts
a step trains on: configs/tiny.yaml draws them prioritized (data.sampler: prioritized, unsolved prompts more often),
for which TRL has no knob (its RepeatSampler serves seeded shuffled epochs of the 800 training prompts); `--set
data.sampler=epochs` gives our arm TRL's kind of order, the parity arm. The group std is the same since 2026-12-06
(ours defaults to TRL's sample std with eps 1e-4: algorithm.advantage_options.unbiased, eps), so on one identical
batch the two updates agree to rounding. Steps to the target vary far more between sampling seeds than between the
epoch-ordered arms: compare them over many seeds (docs/benchmarks.md).
Per run: load_before / load_after (os.getloadavg, 1 min). Per arm and thread count: the median over repetitions, and
samples/s as a ratio to `ours`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ARMS = ("ours", "ours_threads", "trl")
RESULT = "TRL_SIDE_BY_SIDE_RESULT "  # the child's one result line on stdout
KEYS = ("samples_per_s", "time_to_target_s", "steps_to_target", "final_accuracy", "wall_s", "load_before")


# ---------------------------------------------------------------------------------------------- the arms (child)
def arm_config(
    arm: str, threads: int, steps: int, eval_every: int, out: Path, policy: Path, seed: int = 0, overrides=()
):
    """The run config of `arm`: configs/tiny.yaml with the shared policy directory, steps, eval cadence and the
    sampling seed (trainer.seed: torch, sampling, TRL's seed; data.seed: the prompts' shuffle). The policy's
    initialisation is the same in every run (built once, `build_policy`)."""
    from equal_cores import ARMS as EQUAL_ARMS
    from equal_cores import COMMON

    from rlhf_core.config import load_config

    shared = [
        f"run.output_dir={out}",
        f"model.path={policy}",
        f"trainer.total_steps={steps}",
        f"eval.every={eval_every}",
        "trainer.lr_schedule=constant",  # tiny.yaml decays (cosine); TRL's arm runs lr_scheduler_type "constant"
        f"trainer.seed={seed}",
        f"data.seed={seed}",
    ]
    if arm == "ours_threads":
        extra = [*COMMON, *EQUAL_ARMS["threads"], f"cluster.torch_threads={max(1, threads // 2)}"]
    else:  # ours (equal_cores' loop arm) and trl: one process, lockstep, `threads` torch threads
        extra = [*COMMON, *EQUAL_ARMS["loop"], f"cluster.torch_threads={threads}"]
    return load_config(ROOT / "configs" / "tiny.yaml", [*shared, *extra, *overrides])


def run_ours(cfg, arm: str, target: float) -> dict:
    from equal_cores import run_host, run_loop

    if arm == "ours":
        return run_loop(cfg, target)
    return run_host(cfg, target, final_eval=True)


def trl_args(cfg, output_dir: Path, logging_steps: int = 0):
    """TRL's GRPOConfig set to our run config `cfg` wherever TRL has a knob (the list in docs/benchmarks.md).
    logging_steps: 0 logs once, at the end."""
    from trl import GRPOConfig

    loss_options, adv_options = cfg.algorithm.loss_options, cfg.algorithm.advantage_options
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=cfg.trainer.total_steps,
        per_device_train_batch_size=cfg.batch_size,  # 128 rows: one step = one generation batch = one update
        gradient_accumulation_steps=1,
        num_generations=cfg.rollout.samples_per_prompt,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        learning_rate=cfg.trainer.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        adam_beta1=cfg.trainer.betas[0],
        adam_beta2=cfg.trainer.betas[1],
        weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.grad_clip,
        beta=cfg.algorithm.kl_coef,  # 0: no reference model (ours: kl_coef 0)
        loss_type="dapo",  # sum over the step's tokens / the step's token count = our agg 'token-mean'
        scale_rewards=adv_options.scale,  # 'group'; its std is the sample std + 1e-4 (no knob) = our defaults
        epsilon=loss_options.clip_eps,
        epsilon_high=loss_options.clip_eps_high,
        num_iterations=1,
        importance_sampling_level=cfg.algorithm.importance_level,
        mask_truncated_completions=cfg.algorithm.mask_truncated,
        disable_dropout=True,  # ours: disable_dropout on the trainer's model
        gradient_checkpointing=False,  # TRL's default is on; ours never recomputes
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        seed=cfg.trainer.seed,
        shuffle_dataset=True,
        dataloader_num_workers=0,
        report_to="none",
        logging_steps=logging_steps or max(1, cfg.trainer.total_steps),
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
    )


def run_trl(cfg, target: float) -> dict:
    """TRL's GRPOTrainer on our policy directory, prompts, reward and evaluator; figures as equal_cores' arms."""
    import logging

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from equal_cores import Timed
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from rlhf_core.run import build
    from rlhf_core.scoring import Scorer

    transformers.utils.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    build.setup_process(cfg, cfg.trainer.seed)  # torch threads (cluster.torch_threads) and seeds, as ours
    policy_dir = build.resolve_policy_dir(cfg)
    model, tokenizer = build.build_policy(cfg, policy_dir)  # float32, left padding, pad token: as our trainer's
    train, heldout = build.build_prompts(cfg, tokenizer)
    evaluator = build.build_evaluator(cfg, model, tokenizer, policy_dir, heldout)
    timed = Timed(evaluator)
    scorer = Scorer(cfg)
    # TRL tokenizes a text prompt without special tokens: the text is our prompt's ids decoded with them (the
    # tokenizer's BOS included), so that TRL trains on exactly the ids ours trains on and both are evaluated on
    texts = [tokenizer.decode(p.prompt_ids) for p in train]
    for p, text in zip(train, texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(ids) != list(p.prompt_ids):
            raise RuntimeError(f"TRL would train on other ids than ours: {text!r} -> {ids}, ours {p.prompt_ids}")
    dataset = Dataset.from_list([{"prompt": t, "answer": p.answer_text} for t, p in zip(texts, train)])

    def exact_match(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        """OUR reward on TRL's completion ids (generated ids up to and including the first EOS)."""
        return scorer.score([[int(t) for t in ids] for ids in completion_ids], answer)["total"]

    args = trl_args(cfg, Path(cfg.run.output_dir) / "trl")
    marks: dict = {"t0": None, "end": None, "hit": None, "hit_step": None, "threads": None}

    def clock() -> float:
        return time.perf_counter() - marks["t0"] - timed.seconds

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["threads"] = torch.get_num_threads()  # what TRL / accelerate left it at
            timed.seconds = 0.0
            marks["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = marks["end"] = clock()
            step = state.global_step
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.trainer.total_steps:
                if timed()["eval/accuracy"] >= target and marks["hit"] is None:
                    marks["hit"], marks["hit_step"] = now, step

    start_accuracy = timed()["eval/accuracy"]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    final = timed()["eval/accuracy"]
    scorer.close()
    evaluator.close()
    samples = cfg.trainer.total_steps * cfg.batch_size
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    return {
        "samples_per_s": samples / marks["end"],
        "time_to_target_s": marks["hit"],
        "steps_to_target": marks["hit_step"],
        "final_accuracy": final,
        "start_accuracy": start_accuracy,
        "wall_s": marks["end"],
        "steps": cfg.trainer.total_steps,
        "mean_reward_logged": rewards[-1] if rewards else None,
        "torch_threads_in_training": marks["threads"],
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }


def child(args) -> None:
    if args.pin:
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, allowed[: args.threads[0]])
    cfg = arm_config(
        args.child,
        args.threads[0],
        args.steps,
        args.eval_every,
        Path(args.out),
        Path(args.policy),
        args.seeds[0],
        args.set if args.child != "trl" else (),
    )
    if args.child == "trl":
        fig = run_trl(cfg, args.target)
    else:
        import logging

        import torch
        import transformers

        logging.disable(logging.WARNING)
        fig = run_ours(cfg, args.child, args.target)
        fig["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    fig["torch_threads"] = cfg.cluster.torch_threads
    print(RESULT + json.dumps(fig), flush=True)


# ---------------------------------------------------------------------------------------- the harness (parent)
def build_policy(out: Path) -> Path:
    """The tiny policy every arm loads: OUR builder (configs/tiny.yaml's model section, seed trainer.seed)."""
    from rlhf_core.config import load_config
    from rlhf_core.model.policy import ensure_policy

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run.output_dir={out}"])
    return Path(ensure_policy(cfg.model, cfg.data.task, out, seed=cfg.trainer.seed)).resolve()


def launch(args, arm: str, threads: int, out: Path, policy: Path, seed: int = 0) -> dict:
    python = args.trl_python if arm == "trl" else args.ours_python
    cmd = [python, str(Path(__file__).resolve()), "--child", arm, "--threads", str(threads), "--seeds", str(seed)]
    cmd += ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--target", str(args.target)]
    cmd += ["--out", str(out), "--policy", str(policy)] + (["--pin"] if args.pin else [])
    cmd += [x for kv in args.set for x in ("--set", kv)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = str(threads)  # what torch.set_num_threads sets too; also any BLAS pool it starts
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stderr.log", "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (out / "stderr.log").read_text()[-3000:]
        raise RuntimeError(f"arm {arm} at {threads} thread(s) failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT) :])


def median_of(runs: list[dict]) -> dict:
    """Medians over the runs: of each figure over the runs that have it (steps_to_target: over the runs that reached
    the target), and steps_to_target_all over every run, one that did not reach it counted as beyond its last step
    (None when the median run did not reach it)."""
    out = {}
    for key in KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["reached"] = f"{sum(r.get('time_to_target_s') is not None for r in runs)}/{len(runs)}"
    steps = [math.inf if r.get("steps_to_target") is None else r["steps_to_target"] for r in runs]
    middle = statistics.median(steps) if steps else math.inf
    out["steps_to_target_all"] = None if math.isinf(middle) or math.isnan(middle) else middle
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="sampling seeds (trainer.seed, data.seed)")
    parser.add_argument("--steps", type=int, default=400, help="trainer steps per run (configs/tiny.yaml: 400)")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps")
    parser.add_argument("--target", type=float, default=0.9, help="held-out greedy accuracy target")
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of our arms (repeatable)"
    )
    parser.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON"), help="the TRL venv's python")
    parser.add_argument("--ours-python", default=sys.executable, help="the interpreter of our arms")
    parser.add_argument("--pin", action="store_true", help="pin each arm's process to its first --threads CPUs")
    parser.add_argument("--workdir", default=None, help="keep the runs' directories and logs here")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if "trl" in args.arms and not args.trl_python:
        parser.error("the trl arm needs --trl-python (or TRL_PYTHON): the python of the venv trl is installed in")

    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    began = time.perf_counter()
    runs: dict = {n: {a: [] for a in args.arms} for n in args.threads}
    with tempfile.TemporaryDirectory(prefix="trl_side_by_side_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        policy = build_policy(work)
        for rep, seed in enumerate(s for _ in range(args.reps) for s in args.seeds):
            for n in args.threads:
                order = args.arms[rep % len(args.arms) :] + args.arms[: rep % len(args.arms)]
                for arm in order:
                    load_before = os.getloadavg()[0]
                    fig = launch(args, arm, n, work / f"r{rep}" / f"t{n}" / arm, policy, seed)
                    fig.update({"load_before": load_before, "load_after": os.getloadavg()[0], "rep": rep})
                    fig["seed"] = seed
                    runs[n][arm].append(fig)
                    hit = fig["time_to_target_s"]
                    say(
                        f"threads {n} {arm:12s} seed {seed} rep {rep}: {fig['samples_per_s']:7.1f} samples/s, to "
                        f"{args.target}: {'-' if hit is None else f'{hit:.1f} s'} (step {fig['steps_to_target']}), "
                        f"final acc {fig['final_accuracy']:.3f}, wall {fig['wall_s']:.1f} s, "
                        f"load {load_before:.1f}->{fig['load_after']:.1f}"
                    )
    out: dict = {"target": args.target, "steps": args.steps, "reps": args.reps, "seeds": args.seeds}
    out["cpus"] = os.cpu_count()
    out.update({"eval_every": args.eval_every, "pin": args.pin, "wall_s_total": time.perf_counter() - began})
    out["versions"] = {arm: runs[args.threads[0]][arm][0]["versions"] for arm in args.arms}
    out["threads"] = {}
    for n in args.threads:
        med = {a: median_of(runs[n][a]) for a in args.arms}
        base = med.get("ours", {}).get("samples_per_s")
        ratio = {a: med[a]["samples_per_s"] / base for a in args.arms if base}
        out["threads"][str(n)] = {"median": med, "samples_per_s_vs_ours": ratio, "runs": runs[n]}
    if args.json:
        print(json.dumps(out))
        return
    for n, res in out["threads"].items():
        print(
            f"\n{n} torch thread(s), median of {args.reps * len(args.seeds)}\n{'arm':14s}"
            + "".join(f"{k:>18s}" for k in KEYS)
        )
        for arm, fig in res["median"].items():
            cells = "".join(f"{fig[k]:18.3f}" if fig[k] is not None else f"{'-':>18s}" for k in KEYS)
            ratio = res["samples_per_s_vs_ours"].get(arm)
            every = fig["steps_to_target_all"]
            every = f"> {args.steps}" if every is None else f"{every:g}"
            line = f"{arm:14s}{cells}  reached {fig['reached']}, median steps of all {every}"
            print(line + (f"  x ours {ratio:.2f}" if ratio else ""))
    print(f"versions: {json.dumps(out['versions'])}")


if __name__ == "__main__":
    main()
