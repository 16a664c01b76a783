"""What a run is, host by host: each role's cycle written once (`roles`), the control objects every host shares
(`control`: the experience buffer that owns the staleness bound, the weight store, the conservation of groups),
and the in-process host (`local`: both cycles in one process, no Ray). The Ray host is `rlhf_core.distributed`.
"""
