"""What a run is, whichever host runs it: each role's cycle written once (`roles`), the control objects every host
shares (`control`: the experience buffer that owns the staleness bound, the weight store, the conservation of
groups), the in-process run's parts and its lockstep step (`local`), the one supervision loop (`supervise`), the
builders, checkpoints, evaluation and preflight checks. The hosts themselves are `rlhf_core.hosts`. No Ray here.
"""
