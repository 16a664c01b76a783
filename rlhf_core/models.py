"""The public names of the policy model (docs/api.md), now in `rlhf_core.model.policy` (and its neighbours in
`rlhf_core.model`): importable from here as before."""

from rlhf_core.model.directory import *  # noqa: F403
from rlhf_core.model.policy import *  # noqa: F403
from rlhf_core.model.policy import build_tiny_policy, disable_dropout, load_policy, stop_token_ids  # noqa: F401
