"""Where an environment class (or a tool function) lives: checked by reading the source at config time,
imported in the environment pool's processes. No torch, no transformers.

An environment is loaded like a reward function: `env.path` (a .py file or an importable module; empty for
the built-ins) and `env.name` (the class), instantiated as `cls(**env.kwargs)` once per trajectory.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Optional

from rlhf_core.reward.functions.spec import import_path, module_source

BUILTIN_ENVS = {
    "ToolEnv": "rlhf_core.env.tools",
    "GymAdapter": "rlhf_core.env.adapters",
    "OpenEnvAdapter": "rlhf_core.env.adapters",
}
"""Environments given by name alone (path empty): name -> the module that defines it."""


def _read_tree(path: str, where: str) -> tuple[ast.Module, Path]:
    source = module_source(path)
    if source is None:
        raise ValueError(
            f"{where}: {path!r} is neither an existing .py file nor an importable module (relative paths are "
            "read from the working directory)"
        )
    try:
        return ast.parse(source.read_text(encoding="utf-8"), filename=str(source)), source
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot read {source}: {exc}") from None


def _bound_otherwise(node, name: str) -> bool:
    """Whether `node` binds `name` by an assignment or an import (checked for real when imported)."""
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((n.asname or n.name).split(".")[0] == name for n in node.names)
    return False


def check_env_source(path: str, name: str, where: str = "env") -> None:
    """Config-time check by reading the source only: the file or module exists and defines class `name`
    with `reset` and `step` methods (or binds the name otherwise). Raises ValueError naming `where`."""
    if not path:
        if name not in BUILTIN_ENVS:
            raise ValueError(
                f"{where}.path is empty and {where}.name {name!r} is not a built-in environment (built-ins: "
                f"{sorted(BUILTIN_ENVS)}); give {where}.path: a .py file or an importable module"
            )
        return
    tree, source = _read_tree(path, f"{where}.path")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            missing = [m for m in ("reset", "step") if m not in methods]
            if missing and not node.bases:
                raise ValueError(
                    f"{where}.name: class {name} in {source} has no {' or '.join(missing)} method; an environment "
                    "defines reset(row) and step(action) (docs/environments.md)"
                )
            return
        if _bound_otherwise(node, name):
            return
    raise ValueError(f"{where}.name: {source} defines no class named {name!r}")


def check_tool_source(path: str, name: str, where: str) -> None:
    """Config-time check of a tool: the file or module exists and defines function `name`."""
    tree, source = _read_tree(path, f"{where}.path")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return
        if _bound_otherwise(node, name):
            return
    raise ValueError(f"{where}.name: {source} defines no function named {name!r}")


def check_factory_source(factory: str, where: str = "env.factory") -> None:
    """Config-time check of an adapter's factory 'module:callable' (or 'file.py:callable'), by reading the
    source: the module or file exists and defines or imports `callable` (a function, a class or a name)."""
    path, _, name = factory.rpartition(":")
    if not path or not name:
        raise ValueError(f"{where}: {factory!r} is not 'module:callable' (or 'file.py:callable')")
    tree, source = _read_tree(path, where)
    top = name.split(".")[0]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == top:
            return
        if _bound_otherwise(node, top):
            return
    raise ValueError(f"{where}: {source} defines no {top!r}")


def load_attr(path: str, name: str, where: str, builtins: Optional[dict] = None):
    """Import `name` from a .py file (loaded as a module of its own) or an importable module."""
    if not path and builtins:
        path = builtins.get(name, "")
    if not path:
        raise ValueError(f"{where}: path is empty and {name!r} is not a built-in")
    module = import_path(path, where)
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{where}: {path} defines no {name!r}")
    return obj


def load_env_class(path: str, name: str, where: str = "env"):
    """The environment class, checked to have callable reset and step."""
    cls = load_attr(path, name, where, BUILTIN_ENVS)
    if not inspect.isclass(cls):
        raise ValueError(f"{where}: {name} in {path or 'built-ins'} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"{where}: class {name} has no {' or '.join(missing)} method; an environment defines reset(row) and "
            "step(action) (docs/environments.md)"
        )
    return cls


def load_tools(tools: list[tuple[str, str]], where: str = "env.tools") -> dict:
    """{name: function} for [(path, name), ...]."""
    out = {}
    for i, (path, name) in enumerate(tools):
        fn = load_attr(path, name, f"{where}[{i}]")
        if not callable(fn):
            raise ValueError(f"{where}[{i}]: {name} in {path} is not a function")
        out[name] = fn
    return out
