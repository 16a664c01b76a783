"""Moved to `rlhf_core.usercode`, the one loader of user Python files; these names stay importable here."""

from rlhf_core.usercode import (  # noqa: F401
    BUILTIN_FUNCTIONS,
    SIGNATURES,
    VERL_PARAMS,
    Kind,
    check_source,
    classify,
    import_path,
    is_file_path,
    load_function,
    module_source,
)
