"""Where an environment class (or a tool function) lives: checked by reading the source at config time,
imported in the environment pool's processes. No torch, no transformers.

An environment is loaded like a reward function: `env.path` (a .py file or an importable module; empty for
the built-ins) and `env.name` (the class), instantiated as `cls(**env.kwargs)` once per trajectory.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Optional

BUILTIN_ENVS = {"ToolEnv": "rlhf_core.env.tools"}
"""Environments given by name alone (path empty): name -> the module that defines it."""


def is_file_path(path: str) -> bool:
    return path.endswith(".py") or "/" in path


def module_source(path: str) -> Optional[Path]:
    """The source file of a `path` entry (a .py file, or an importable module), or None if there is none."""
    if is_file_path(path):
        return Path(path) if Path(path).is_file() else None
    try:
        found = importlib.util.find_spec(path)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and origin.endswith(".py") else None


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


def load_attr(path: str, name: str, where: str, builtins: Optional[dict] = None):
    """Import `name` from a .py file (loaded as a module of its own) or an importable module."""
    if not path and builtins:
        path = builtins.get(name, "")
    if not path:
        raise ValueError(f"{where}: path is empty and {name!r} is not a built-in")
    if is_file_path(path):
        file = Path(path).resolve()
        if not file.is_file():
            raise ValueError(f"{where}: file {file} does not exist")
        module_name = f"atrlhf_env_{abs(hash(str(file)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # pickling and dataclasses look modules up here
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
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
