"""What a run is, host by host: each role's cycle written once (`roles`), the control objects every host shares
(`control`: the experience buffer that owns the staleness bound, the weight store, the conservation of groups),
the in-process lockstep host (`local`: both cycles in one thread) and the in-process async host (`threaded`: each
role's loop on its own thread; `hosts.make_runtime` picks it or the Ray host, `rlhf_core.distributed`, by
cluster.host). No Ray here.
"""
