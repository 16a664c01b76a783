"""Which sweep points may share one fleet (`atrlhf sweep --shared-fleet`, rlhf_core.hosts.shared_fleet), on their
configs alone: plain Python, no model, no torch."""

from __future__ import annotations

from rlhf_core.config import ConfigError, TrainConfig, apply_overrides, flatten_config, validate_config

# what the points of one shared fleet (`--shared-fleet`) may set differently: what an adapter run may differ in;
# the rest is the base model, tokenizer, data and rollout engine they share
SHAREABLE = (
    "model.lora.",
    "trainer.",
    "algorithm.",
    "reward.",
    "runtime.max_staleness",
    "runtime.autopilot.",
    "eval.",
    "checkpoint.",
    "supervision.",
    "run.",
    "tracking.",
    "data.seed",
)


def fleet_base(base: TrainConfig) -> TrainConfig:
    """The base config of a shared fleet's points: the threads host (the fleet's hosts are threads of the sweep's
    process, on its one base model and engine)."""
    data = base.model_dump(mode="json")
    apply_overrides(data, ['cluster.host="threads"'])
    return validate_config(data)


def check_shareable(points: dict[str, TrainConfig]) -> None:
    """ConfigError, naming the key, where the points cannot share one fleet: a key outside `SHAREABLE` that
    differs between two points (another base model, tokenizer, data or rollout setting), a point without
    model.lora (full fine-tuning changes the base the others share), an engine other than HF or vLLM, partial
    rollouts, or an environment or agent rollout (a fleet batches single-turn generation)."""
    names = list(points)
    if not names:
        raise ConfigError("shared fleet: no points to run")
    first = flatten_config(points[names[0]])
    for name in names:
        cfg = points[name]
        if cfg.model.lora is None:
            raise ConfigError(
                f"shared fleet: point {name!r} has no model.lora: the points share one base model, which full "
                "fine-tuning would change; set model.lora or run the sweep without --shared-fleet"
            )
        if cfg.rollout.engine not in ("hf", "vllm"):
            raise ConfigError(
                f"shared fleet: rollout.engine is {cfg.rollout.engine!r}; a shared fleet generates with the HF "
                "engine's mixed-adapter batches or vLLM's multi-LoRA ones (set rollout.engine: hf or vllm, or run "
                "the sweep without --shared-fleet)"
            )
        if cfg.rollout.partial_rollout:
            raise ConfigError(
                "shared fleet: rollout.partial_rollout is on; a fleet's batch serves every point, so a point's new "
                "weights land between batches, not mid-generation (set rollout.partial_rollout: false, or run the "
                "sweep without --shared-fleet)"
            )
        if cfg.env.enabled or cfg.agent.enabled:
            raise ConfigError(
                f"shared fleet: point {name!r} rolls out through {'env' if cfg.env.enabled else 'agent'}:; a "
                "shared fleet batches single-turn generation (run the sweep without --shared-fleet)"
            )
        leaves = flatten_config(cfg)
        for key in sorted(set(first) | set(leaves)):
            if first.get(key) != leaves.get(key) and not key.startswith(SHAREABLE):
                raise ConfigError(
                    f"shared fleet: points {names[0]!r} and {name!r} differ in {key} ({first.get(key)!r} against "
                    f"{leaves.get(key)!r}); the points of one fleet share the base model, tokenizer, data and "
                    "rollout engine, and may differ only in what an adapter run may (model.lora, trainer, algorithm, "
                    "reward, runtime.max_staleness, eval, checkpoint); run this grid without --shared-fleet"
                )
