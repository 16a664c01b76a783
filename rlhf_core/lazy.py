"""One lazy-export helper for the packages whose __init__ imports nothing (or nothing heavy): a public name loads
its module on first access, so importing the package stays light (no torch, no Ray) for the processes that only
need part of it.

    _LAZY = {"ToolEnv": "rlhf_core.env.tools", ...}  # public name -> the module that defines it
    __all__, __getattr__, __dir__ = lazy_exports(globals(), _LAZY)

The value is cached in the package's namespace, so the module's own object is returned and `__getattr__` runs
once a name. A name not in the table (a submodule not yet imported included) raises AttributeError as usual.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(namespace: dict[str, Any], where: Mapping[str, str]) -> tuple[list[str], Callable, Callable]:
    """(__all__, __getattr__, __dir__) for the package whose globals() are `namespace`; `where`: public name ->
    the module (full dotted path) that defines it. __all__: those names, sorted."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return sorted(where), __getattr__, __dir__
