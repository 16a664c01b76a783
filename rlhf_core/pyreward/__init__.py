"""User Python reward functions (TRL and verl signatures) and the process pool that runs them.

Kept outside `rlhf_core.reward` on purpose: the pool's processes import this package and the user's
functions only, never torch, so they start in a fraction of a second and stay small. The torch side (decode
the responses, call the pool, hand tensors back to the rollout worker) is `rlhf_core.reward.functions`.

`spec`: find a function (a .py file or an importable module) and tell its signature apart, by reading the
source (config time, nothing executed) or by inspecting the imported function (in the pool).
`pool`: `FunctionPool`, long-lived spawned processes, one call per chunk of rows, per-call timeouts.
`math_verify`: the built-in `math_verify` function (the `math-verify` package, extra `math`).
"""
