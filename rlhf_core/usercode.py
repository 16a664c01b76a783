"""The one loader of user Python files: reward functions, environment classes and tools (no torch, no
transformers; nothing is executed at config time).

Config time reads the source (`check_source`, `check_env_source`, `check_tool_source`: the name exists, with a
signature that fits); the processes that run user code import it (`load_function`, `load_env_class`,
`load_tools`, `load_attr`), a `.py` path or an importable module alike (`import_path`).

Reward functions have one of two signatures, told apart by their parameter names:
  TRL   f(prompts, completions, completion_ids, **columns) -> list[float | None]   (plain or async)
  verl  compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
An environment is loaded like a reward function: `env.path` (a .py file or an importable module; empty for
the built-ins) and `env.name` (the class), instantiated as `cls(**env.kwargs)` once per trajectory.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import threading
from pathlib import Path
from typing import Literal, Optional

Kind = Literal["trl", "verl"]

BUILTIN_FUNCTIONS = {"math_verify": "rlhf_core.reward.functions.math_verify"}
"""Functions given by name alone (path empty): name -> the module that defines it."""

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")
SIGNATURES = (
    "TRL's f(prompts, completions, completion_ids, **columns) (a parameter named 'completions') or verl's "
    "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
)


def classify(params: list[str], has_var_kw: bool) -> Optional[Kind]:
    """'verl' when the first parameters are verl's, 'trl' when one is named 'completions', else None."""
    if tuple(params[:3]) == VERL_PARAMS:
        return "verl"
    if "completions" in params:
        return "trl"
    return None


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


def check_source(path: str, name: str, where: str) -> Kind:
    """Config-time check, by reading the source only: the file or module exists, defines `name` as a
    function, and its signature is TRL's or verl's. Raises ValueError naming `where`."""
    if not path:
        if name not in BUILTIN_FUNCTIONS:
            raise ValueError(
                f"{where}: path is empty and {name!r} is not a built-in function (built-ins: "
                f"{sorted(BUILTIN_FUNCTIONS)}); give path: a .py file or an importable module"
            )
        path = BUILTIN_FUNCTIONS[name]
    tree, source = _read_tree(path, where)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            a = node.args
            params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            kind = classify(params, a.kwarg is not None)
            if kind is None:
                raise ValueError(f"{where}: {name}({', '.join(params)}) in {source} is not {SIGNATURES}")
            return kind
        if _bound_otherwise(node, name):
            return "trl"  # bound another way (assigned, imported): the pool checks the real signature
    raise ValueError(f"{where}: {source} defines no function named {name!r}")


# Environments run many episodes in one process, on threads, and each opening loads its tools: without this lock
# a second thread found the module registered but not yet executed ("defines no 'add'", a flaky test).
_IMPORT_LOCK = threading.Lock()
USER_MODULE_PREFIX = "atrlhf_user_"
"""The sys.modules name of each .py file `import_path` loaded: the Ray host ships these by value (an object of a
class they define, such as a user loss's options in the config, then unpickles in an actor's process)."""


def import_path(path: str, where: str, what: str = "file"):
    """The module of a `path` entry: a .py file loaded as a module of its own (once per process, registered in
    sys.modules, where pickling and dataclasses look modules up), or an importable module. Shared by reward
    functions and environments (rlhf_core.usercode)."""
    if not is_file_path(path):
        return importlib.import_module(path)
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"{where}: {what} {file} does not exist")
    module_name = f"{USER_MODULE_PREFIX}{abs(hash(str(file)))}"
    with _IMPORT_LOCK:
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]  # a file that fails to import is not left half-loaded for the next caller
                raise
    return module


def load_function(path: str, name: str, where: str):
    """Import the function (a .py file is loaded as a module of its own) and return (function, kind)."""
    if not path:
        path = BUILTIN_FUNCTIONS.get(name, "")
    module = import_path(path, where, "reward function file")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where}: {path} has no function named {name!r}")
    sig = inspect.signature(fn)
    params = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    kind = classify(params, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()))
    if kind is None:
        raise ValueError(f"{where}: {name}{sig} in {path} is not {SIGNATURES}")
    return fn, kind


BUILTIN_ENVS = {
    "ToolEnv": "rlhf_core.env.tools",
    "GymAdapter": "rlhf_core.env.adapters",
    "OpenEnvAdapter": "rlhf_core.env.adapters",
    "TextArenaAdapter": "rlhf_core.env.adapters",
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


def check_factory_source(factory: str, where: str = "env.path/env.name") -> None:
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
