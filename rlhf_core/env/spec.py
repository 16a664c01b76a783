"""Moved to `rlhf_core.usercode`, the one loader of user Python files; these names stay importable here."""

from rlhf_core.usercode import (  # noqa: F401
    BUILTIN_ENVS,
    check_env_source,
    check_factory_source,
    check_tool_source,
    load_attr,
    load_env_class,
    load_tools,
)
