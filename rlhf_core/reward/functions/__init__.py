"""User Python reward functions (`reward.functions`, TRL and verl signatures), their process pool, and the
rollout worker's external reward that calls them.

The pool side imports no torch: its processes import `spec`, `pool`, `math_verify` and the user's functions
only (this package's `__init__` and `rlhf_core.reward`'s import nothing), so they start in a fraction of a
second and stay small.

`spec`: find a function (a .py file or an importable module) and tell its signature apart, by reading the
source (config time, nothing executed) or by inspecting the imported function (in the pool).
`pool`: `FunctionPool`, long-lived spawned processes (a `pebble` process pool), one task per TRL call (a
chunk of rows) or per verl row, each with its own deadline; a process that misses one is killed and replaced.
`math_verify`: the built-in `math_verify` function (the `math-verify` package, extra `math`).
`external`: `PythonFunctionRewards` (torch): decode the responses, call the pool, hand tensors back to the
rollout worker.
"""
