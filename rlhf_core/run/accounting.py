"""Accounting across a run's roles: every group a rollout worker generated is trained, evicted, dropped, filtered,
buffered or in flight, counted at each end independently (`reconcile`), and so is every sample and response token
(`token_ledger`, logged as ledger/*)."""

from __future__ import annotations

from rlhf_core.supervision.audit_config import LEDGER_ACCOUNTS  # the accounts the audit reads back


def _pushed_unrevoked(stats: dict, revoked: set) -> int:
    """A live worker's own count of groups pushed, but under lease names since revoked (a loop declared lost
    in a process that lived on: the buffer counted what it accepted from them in revoked_groups)."""
    by_holder = stats.get("pushed_by_holder")
    if not by_holder:
        return int(stats.get("groups_pushed", 0))
    return sum(int(n) for holder, n in by_holder.items() if holder not in revoked)


def reconcile(poll: dict) -> dict:
    """Conservation of prompt groups, from counts kept independently at each end, in groups:

        generated (rollout workers' own count of pushes the buffer accepted)
          = trained (the trainer's own count) + evicted + dropped + filtered + buffered + in_flight

    where in_flight = taken from the buffer but not trained yet (0 once the loops have stopped: a
    prefetched batch goes back). `unaccounted` is generated minus the right-hand side: a group lost between
    a worker and the buffer makes it non-zero; a group trained twice (or taken and never trained) makes
    in_flight non-zero once the loops have stopped. A rollout worker lost or retired is counted by what the
    buffer accepted from it (`revoked_groups`: its own count died with it); a live worker's pushes under a
    lease name since revoked (a loop declared lost whose process lived on) are counted there, not twice.
    filtered: groups algorithm.filter_groups kept out (all rewards equal), counted as consumed. With the token
    ledger's accounts (`token_ledger`: samples and tokens) when the buffer measures them."""
    b = poll["buffer"]
    # the workers' own counts, and for workers lost or retired (revoked) the buffer's count of what it accepted
    revoked = set(b.get("revoked_holders", ()))
    generated = b.get("revoked_groups", 0) + sum(
        _pushed_unrevoked(s, revoked) for s in poll["rollout"] if s.get("alive")
    )
    trained = int(poll["trainer"].get("groups_trained", 0))
    in_flight = b["sampled"] - trained
    filtered = int(b.get("filtered_groups", 0))
    accounted = trained + b["evicted_stale"] + b["dropped_overflow"] + filtered + b["size"] + in_flight
    return {
        "generated": generated,
        "pushed": b["pushed"],
        "trained": trained,
        "consumed": b["sampled"],
        "evicted": b["evicted_stale"],
        "dropped": b["dropped_overflow"],
        "filtered": filtered,
        "buffered": b["size"],
        "in_flight": in_flight,
        "unaccounted": generated - accounted,
        **token_ledger(b, poll["trainer"]),
    }


def token_ledger(buffer: dict, trainer: dict) -> dict:
    """Every sample and response token the buffer accepted, in exactly one account, in both units (rows =
    samples, tokens = the response tokens trained on or not: response_mask summed):

        pushed = trained + evicted + dropped + filtered + buffered + in_flight + carried   (+ revoked, apart)

    counted where each happens: pushed, filtered and taken by the run's ExperienceBuffer as groups arrive and
    leave, evicted (stale), dropped (overflow) and buffered by the buffer that held them, trained by the trainer
    from the groups it trained on; in_flight = taken - trained (a prefetched batch, 0 once the loops stopped and
    gave it back). revoked: what a lost worker pushed after its lease was revoked (refused; its prompts were
    generated again). Across a resume (`trainer["ledger_carried"]`: the ledger the checkpoint recorded) the
    accounts go on from the checkpoint's, and what was buffered or in flight then is `carried`: generated before
    the checkpoint, lost with the process that held it, its prompts generated again by the resumed run. Keys
    <account>_samples / <account>_tokens and unaccounted_samples / unaccounted_tokens; {} when the buffer does
    not measure (a buffer built without group_length)."""
    if "pushed_tokens" not in buffer or "buffered_tokens" not in buffer:
        return {}
    before = trainer.get("ledger_carried") or {}  # the ledger at the checkpoint this run resumed from
    out = {}
    for unit, suffix in (("samples", "rows"), ("tokens", "tokens")):
        trained = int(trainer.get(f"trained_{suffix}", 0))
        row = {
            "pushed": int(buffer[f"pushed_{suffix}"]),
            "trained": trained,
            "evicted": int(buffer.get(f"evicted_{suffix}", 0)),
            "dropped": int(buffer.get(f"dropped_{suffix}", 0)),
            "filtered": int(buffer.get(f"filtered_{suffix}", 0)),
            "buffered": int(buffer.get(f"buffered_{suffix}", 0)),
            "in_flight": int(buffer.get(f"taken_{suffix}", 0)) - trained,
            "revoked": int(buffer.get(f"refused_{suffix}", 0)),
            "carried": 0,
        }
        for k in ("pushed", "trained", "evicted", "dropped", "filtered", "revoked"):  # closed accounts go on
            row[k] += int(before.get(f"{k}_{unit}", 0))
        # what was buffered or in flight at that checkpoint died with the process that held it: carried
        row["carried"] = sum(int(before.get(f"{k}_{unit}", 0)) for k in ("buffered", "in_flight", "carried"))
        row["unaccounted"] = row["pushed"] - sum(row[k] for k in LEDGER_ACCOUNTS)
        out.update({f"{k}_{unit}": v for k, v in row.items()})
    return out


def group_rows(group) -> int:
    """Completions in a group, packed (`rlhf_core.distributed.transport.pack_groups`) or not."""
    if isinstance(group, dict):
        return int(group["batch"]["response_ids"][1].shape[0])
    return len(group)


def group_length(group) -> tuple[int, int]:
    """(response tokens, rows) of a group, packed or not: its response_mask summed, and its rows."""
    if isinstance(group, dict):
        mask = group["batch"]["response_mask"][1]
        return int(mask.sum()), int(mask.shape[0])
    mask = group.batch.response_mask
    return int(mask.sum()), int(mask.shape[0])
