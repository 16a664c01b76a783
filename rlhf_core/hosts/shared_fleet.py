"""A shared fleet: the points of a LoRA sweep trained together on one base model, one rollout engine and one
trainer process (`atrlhf sweep --shared-fleet`).

    the base model, loaded once: its weights in memory once, under module trees of their own
        (`shares_weights`): each point's trainer model (its adapter, as a run of its own has it) and the
        engine's (every point's adapter beside the others; a sync copies one point's adapter in)
    each point: a `SharedPointHost`, the threads host with its own buffer, prompt queue, weight store, trainer
        role (its own Trainer and optimizer over its adapter) and rollout roles, whose engine is an
        `AdapterEngine`: the fleet's engine for its adapter, at its own version
    the points' generate() calls -> `FleetBatcher` -> one mixed-adapter batch (peft's `adapter_names`, one per
        row) -> each point its rows, tagged with its adapter's version

Everywhere else each point is a run of its own: the sweep's child flow run of atrlhf-train drives its host
through supervise() (its MLflow child run, checkpoints, evaluations, export, audit); its staleness bound and
accounting are its own; its failure ends its host only, whose workers then leave the batcher, so that the
batches are shared by the points still running. The hosts are found by `fleet_host` (the host factory asks it
for a config registered here, by its run.output_dir).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.config import TrainConfig, apply_overrides, validate_config
from rlhf_core.data.prompts import PromptBatch
from rlhf_core.hosts.threads import ThreadedRun
from rlhf_core.model.lora import apply_lora
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.run import build
from rlhf_core.run.fleet_config import check_shareable, fleet_base
from rlhf_core.types import RolloutBatch

BATCH_WINDOW_S = 0.05  # how long a generate() call waits for the other points' calls to join its batch


@dataclass
class _Request:
    adapter: str
    version: int
    prompts: PromptBatch
    samples: int
    sampling: SamplingParams
    since: float = field(default_factory=time.monotonic)
    done: bool = False
    result: Optional[RolloutBatch] = None
    error: Optional[BaseException] = None


class FleetBatcher:
    """Every point's generate() calls as batches of the one engine. A call waits until every member's call is in
    (or BATCH_WINDOW_S after the oldest waiting one), then one caller generates for all the waiting calls of the
    same sampling settings, under the engine's lock, and hands each its rows: with `mixed`, in one forward per
    token (peft's `adapter_names`, one per row: an accelerator's batch); without, one call after another, each
    with its adapter active (a CPU's: there peft's mixed forward costs more than it saves)."""

    def __init__(self, engine, lock: threading.Lock, window_s: float = BATCH_WINDOW_S, mixed: bool = True):
        self.engine, self.lock, self.mixed = engine, lock, mixed
        self.window_s = window_s if mixed else 0.0  # calls in turn: nothing to gain by waiting for the others
        self.cv = threading.Condition()
        self.pending: list[_Request] = []
        self.members = 0
        self.busy = False
        self.batches = 0
        self.rows = 0

    def join(self) -> None:
        with self.cv:
            self.members += 1

    def leave(self) -> None:
        with self.cv:
            self.members -= 1
            self.cv.notify_all()

    def generate(self, adapter: str, version: int, prompts: PromptBatch, samples: int, sampling) -> RolloutBatch:
        req = _Request(adapter, version, prompts, samples, sampling)
        with self.cv:
            self.pending.append(req)
            self.cv.notify_all()
        while True:
            with self.cv:
                batch = self._next_batch(req)
            if batch is None:
                break
            try:
                self._run(batch)
            except BaseException as exc:  # the engine failed: every call of this batch fails with it
                for r in batch:
                    r.error, r.done = exc, True
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()
        if req.error is not None:
            raise req.error
        return req.result

    def _next_batch(self, req: _Request) -> Optional[list[_Request]]:
        """Under the condition: None once `req` is answered, else the batch this caller leads (waits meanwhile)."""
        while not req.done:
            if self.busy or not self.pending:
                self.cv.wait(0.5)
                continue
            head = self.pending[0]
            waited = time.monotonic() - head.since
            if len(self.pending) < self.members and waited < self.window_s:
                self.cv.wait(self.window_s - waited)
                continue
            batch = [r for r in self.pending if r.samples == head.samples and r.sampling == head.sampling]
            self.pending = [r for r in self.pending if not any(r is b for b in batch)]
            self.busy = True
            return batch
        return None

    def _run(self, batch: list[_Request]) -> None:
        engine, G = self.engine, batch[0].samples
        with self.lock:
            if self.mixed:
                try:
                    outs = [engine.generate(self._merged(batch), G, batch[0].sampling)]
                finally:
                    engine.adapter_names = None
            else:  # in turn, each with its adapter active
                outs = []
                for r in batch:
                    engine.set_adapter(r.adapter)
                    outs.append(engine.generate(r.prompts, G, r.sampling))
        row = group = 0
        for i, r in enumerate(batch):
            n, width = len(r.prompts), r.prompts.prompt_ids.shape[1]
            if self.mixed:
                r.result = _rows(outs[0], row, n * G, group, width, r.version)
            else:
                r.result = _rows(outs[i], 0, n * G, 0, width, r.version)
            r.done = True
            row, group = row + n * G, group + n
        self.batches += 1
        self.rows += row

    def _merged(self, batch: list[_Request]) -> PromptBatch:
        """The calls' prompts as one batch (left-padded to the widest), the engine told each row's adapter."""
        width = max(r.prompts.prompt_ids.shape[1] for r in batch)

        def left_pad(t: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

        G = batch[0].samples
        self.engine.adapter_names = [r.adapter for r in batch for _ in range(len(r.prompts) * G)]
        return PromptBatch(
            torch.cat([left_pad(r.prompts.prompt_ids, self.engine.pad_token_id) for r in batch]),
            torch.cat([left_pad(r.prompts.prompt_mask, False) for r in batch]),
            None,
            torch.cat([r.prompts.uids for r in batch]),
        )


def _rows(out: RolloutBatch, start: int, rows: int, group: int, width: int, version: int) -> RolloutBatch:
    """Rows [start, start + rows) of a fleet batch as the batch a point's own engine would have returned: its
    prompt width, responses cut to its longest, group ids from 0, every token of its adapter's version."""
    sl = slice(start, start + rows)
    lengths = out.response_lengths[sl]
    steps = max(1, int(lengths.max())) if rows else 0
    P = out.prompt_ids.shape[1]
    response_ids = out.response_ids[sl, :steps].contiguous()
    return RolloutBatch(
        prompt_ids=out.prompt_ids[sl, P - width :].contiguous(),
        prompt_mask=out.prompt_mask[sl, P - width :].contiguous(),
        response_ids=response_ids,
        response_mask=out.response_mask[sl, :steps].contiguous(),
        behavior_logprobs=out.behavior_logprobs[sl, :steps].contiguous(),
        response_lengths=lengths.contiguous(),
        group_ids=out.group_ids[sl] - group,
        policy_version=torch.full_like(lengths, version),
        prompt_uids=out.prompt_uids[sl].contiguous(),
        token_versions=torch.full_like(response_ids, version),
    )


class AdapterEngine:
    """One point's rollout engine: the fleet's engine generating with the point's adapter, at the version this
    view loaded last. Everything else (stop ids, dtype, device, the sampling generator) is the fleet engine's."""

    def __init__(self, fleet: SharedFleet, adapter: str):
        self.fleet, self.adapter = fleet, adapter
        self.version = 0
        self.closed = False
        fleet.batcher.join()

    def generate(
        self, prompts: PromptBatch, samples_per_prompt: int, sampling: SamplingParams, between_steps=None
    ) -> RolloutBatch:
        """between_steps: ignored (a fleet's batch serves every point: a point's weights land between batches)."""
        return self.fleet.batcher.generate(self.adapter, self.version, prompts, samples_per_prompt, sampling)

    def load_weights(self, state_dict: Optional[dict[str, torch.Tensor]], version: int) -> None:
        if state_dict is not None:
            with self.fleet.engine_lock:
                self.fleet.engine.load_adapter(self.adapter, state_dict)
        self.version = int(version)

    def probe_sample(self, *args, **kwargs):
        return self._with_adapter("probe_sample", *args, **kwargs)

    def top_logprobs(self, *args, **kwargs):
        return self._with_adapter("top_logprobs", *args, **kwargs)

    def _with_adapter(self, method: str, *args, **kwargs):
        """The engine's `method` with this view's adapter active (between the fleet's batches)."""
        with self.fleet.engine_lock:
            self.fleet.engine.set_adapter(self.adapter)
            return getattr(self.fleet.engine, method)(*args, **kwargs)

    def close(self) -> None:
        """Leave the batcher (its batches stop waiting for this view's calls)."""
        if not self.closed:
            self.closed = True
            self.fleet.batcher.leave()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.fleet.engine, name)


class SharedPointHost(ThreadedRun):
    """One point of a shared fleet: the threads host, with the fleet's model and engine in place of its own."""

    def __init__(self, cfg: TrainConfig, fleet: SharedFleet, adapter: str):
        super().__init__(cfg)
        self.fleet, self.adapter = fleet, adapter

    def _build(self) -> None:
        with self.fleet.building:  # one point at a time: its trainer's seed evidence is torch's seed as it set it
            super()._build()

    def _policy(self, policy_dir: Path):
        return self.fleet.models[self.adapter], self.fleet.tokenizer

    def _rollout_worker(self, index: int, policy_dir: Path):
        engine = AdapterEngine(self.fleet, self.adapter)
        return build.build_rollout_worker(self.cfg, None, self.fleet.tokenizer, policy_dir, 0, engine=engine)

    def teardown(self, failed: bool = False) -> None:
        engines = [r.worker.engine for r in self.rollout_roles]
        try:
            super().teardown(failed)
        finally:
            for engine in engines:
                engine.close()


def fleet_config(base: TrainConfig) -> TrainConfig:
    """The base config of a shared fleet's points: the threads host (`fleet_base`) and model.path the one base
    model they share (the tiny default built once under the sweep's run.output_dir, not one per point's
    directory and seed)."""
    cfg = fleet_base(base)
    if cfg.model.path:
        return cfg
    data = cfg.model_dump(mode="json")
    apply_overrides(data, [f"model.path={json.dumps(str(build.resolve_policy_dir(cfg)))}"])
    return validate_config(data)


def shares_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A module tree of its own over the same parameter and buffer tensors as `model` (no weight copied): a point's
    trainer model, or the engine's, is one with its adapters, so that the frozen base weights are in memory once
    and every point trains its adapter on its own tree (no adapter switching, no lock between points)."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


_HOSTS: dict[str, tuple[SharedFleet, str]] = {}
_HOSTS_LOCK = threading.Lock()


def _key(cfg: TrainConfig) -> str:
    return str(Path(cfg.run.output_dir).expanduser().resolve())


def fleet_host(cfg: TrainConfig) -> Optional[SharedPointHost]:
    """The host of a point registered by an open `SharedFleet` (by its run.output_dir), else None."""
    with _HOSTS_LOCK:
        found = _HOSTS.get(_key(cfg))
    return None if found is None else SharedPointHost(cfg, *found)


class SharedFleet:
    """The base model (its weights once), each point's trainer model over it with the point's adapter, the engine's
    model over it with every point's adapter, the HF engine and its batcher. A context manager: while open, the
    points' configs (by run.output_dir) get their hosts from `fleet_host`."""

    def __init__(self, points: dict[str, TrainConfig], window_s: float = BATCH_WINDOW_S, mixed: Optional[bool] = None):
        check_shareable(points)
        first = next(iter(points.values()))
        build.setup_process(first, first.trainer.seed)
        self.policy_dir = build.resolve_policy_dir(first)
        self.base, self.tokenizer = build.build_policy(first, self.policy_dir, adapters=False)
        self.configs = {f"point{i}": cfg for i, cfg in enumerate(points.values())}  # by adapter name
        # the engine's batches mixed (every point's rows in one batch) with vLLM (its multi-LoRA batching) and on an
        # accelerator (peft's mixed-adapter forward); in turn on a CPU with the HF engine, where peft's mixed forward
        # costs more than it saves (docs/benchmarks.md, "Sweeps on one fleet")
        if mixed is None:
            mixed = first.rollout.engine == "vllm" or self.base.device.type != "cpu"
        self.mixed = mixed
        # one adapter made, or one point's parts built, at a time: the global RNG is seeded for it
        self.building = threading.Lock()
        self.models = {adapter: self.adapted(adapter) for adapter in self.configs}  # each point's trainer model
        engine_model = shares_weights(self.base)
        for adapter, cfg in self.configs.items():
            torch.manual_seed(cfg.trainer.seed)  # as `adapted` initialises the point's trainer model
            engine_model = apply_lora(engine_model, cfg.model.lora, adapter)
        stop_ids = build.build_stop_ids(first, self.tokenizer, self.policy_dir)
        adapters = {adapter: cfg.model.lora for adapter, cfg in self.configs.items()}
        self.engine = build.build_engine(  # HF (its model carries the adapters) or vLLM (told them)
            first, engine_model, self.tokenizer, model_path=str(self.policy_dir), seed=first.trainer.seed,
            stop_token_ids=stop_ids, adapters=adapters,
        )  # fmt: skip
        self.engine_lock = threading.Lock()  # the engine's model: one batch (or one point's sync) at a time
        self.batcher = FleetBatcher(self.engine, self.engine_lock, window_s, self.mixed)

    def adapted(self, adapter: str) -> torch.nn.Module:
        """A module tree over the base weights with `adapter`'s point's LoRA adapter, initialised from its seed."""
        cfg = self.configs[adapter]
        with self.building:
            torch.manual_seed(cfg.trainer.seed)
            return apply_lora(shares_weights(self.base), cfg.model.lora)

    def __enter__(self) -> SharedFleet:
        with _HOSTS_LOCK:
            for adapter, cfg in self.configs.items():
                _HOSTS[_key(cfg)] = (self, adapter)
        return self

    def __exit__(self, *exc) -> None:
        with _HOSTS_LOCK:
            for cfg in self.configs.values():
                if _HOSTS.get(_key(cfg), (None,))[0] is self:
                    del _HOSTS[_key(cfg)]

    def stats(self) -> dict:
        """The engine's batches, rows, and rows per batch."""
        b = self.batcher
        return {"batches": b.batches, "rows": b.rows, "rows_per_batch": b.rows / max(1, b.batches)}
