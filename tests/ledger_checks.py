"""The token ledger's check for end-to-end tests: every group, sample and response token a run generated ends in
exactly one account (rlhf_core.run.accounting: reconcile and token_ledger)."""

from __future__ import annotations


def assert_ledger_balances(rec: dict, stopped: bool = True) -> None:
    """`rec`: a run's reconcile(final poll). Balanced in groups, samples and tokens; with `stopped` (the loops
    stopped and gave a prefetched batch back) nothing is in flight either."""
    assert "unaccounted_tokens" in rec, f"the run's buffer kept no token ledger: {rec}"
    for unit in ("", "_samples", "_tokens"):
        assert rec[f"unaccounted{unit}"] == 0, (unit or "groups", rec)
        if stopped:
            assert rec[f"in_flight{unit}"] == 0, (unit or "groups", rec)
    assert rec["trained_tokens"] > 0 and rec["pushed_tokens"] >= rec["trained_tokens"], rec
