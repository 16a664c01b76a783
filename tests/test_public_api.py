"""The public API is a list (docs/api.md) and this test: every row of the list imports from its package with
the signature written there.

The table is read from docs/api.md itself, so the document and the test cannot drift: a name removed from
its package, a parameter renamed, reordered, made keyword-only or given another default, fails here until
the document says the same; a row that is not in the table format fails the parse. A fresh interpreter
checks that the packages that re-export names lazily (rlhf_core.reward, rlhf_core.env) still import no torch
where the reward-function and environment pools' processes import them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"
KINDS = ("function", "class", "protocol", "exception", "constant")
SECTION = re.compile(r"^## `(?P<package>[A-Za-z_][\w.]*)`\s*$")
ROW = re.compile(r"^\| `(?P<name>\w+)` \| (?P<kind>\w+) \| `(?P<signature>[^`]+)` \| (?P<text>[^|]+?) \|\s*$")

# Names the list must hold whatever else it holds (the API users were told about).
REQUIRED = {
    "rlhf_core.reward": {"tensor_native_reward", "score_responses"},
    "rlhf_core.algorithms": {
        "compute_ppo_loss",
        "compute_m2po_loss",
        "compute_grpo_loss",
        "compute_grpo_advantages",
        "compute_rloo_advantages",
        "compute_gae_advantages",
        "kl_penalty",
    },
    "rlhf_core.buffer": {"BoundedReplayBuffer", "VersionedReplayBuffer", "GroupAwareReplayBuffer"},
    "rlhf_core.config": {"load_config", "TrainConfig"},
    "rlhf_core.loop": {"run_sync"},
    "rlhf_core.distributed": {"run_distributed"},
    "rlhf_core.env": {"Environment", "ToolEnv"},
    "rlhf_core.scoring": {"score_responses"},
}

# Packages that re-export lazily: every name they export is in the list, and is the defining module's object.
LAZY_PACKAGES = ("rlhf_core.reward", "rlhf_core.env")

# What the reward-function pool's and the environment pool's processes import: no torch, no transformers.
LIGHT_MODULES = (
    "rlhf_core.reward",
    "rlhf_core.reward.functions",
    "rlhf_core.usercode",
    "rlhf_core.reward.functions.pool",
    "rlhf_core.reward.functions.math_verify",
    "rlhf_core.env",
    "rlhf_core.usercode",
    "rlhf_core.env.pool",
    "rlhf_core.env.protocol",
    "rlhf_core.env.tools",
)


@dataclass(frozen=True)
class Entry:
    line: int
    package: str
    name: str
    kind: str
    signature: str

    @property
    def id(self) -> str:
        return f"{self.package}.{self.name}"


def parse_api(text: str) -> list[Entry]:
    """The rows of docs/api.md: under each '## `package`' heading, '| `name` | kind | `signature` | text |'."""
    entries, package = [], None
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            m = SECTION.match(line)
            package = m["package"] if m else None
            continue
        if not line.startswith("| `"):
            continue
        m = ROW.match(line)
        if m is None or m["kind"] not in KINDS:
            raise ValueError(f"docs/api.md:{lineno}: not a row of the table format (kinds: {KINDS}): {line[:100]}")
        if package is None:
            raise ValueError(f"docs/api.md:{lineno}: a row outside a '## `package`' section")
        entries.append(Entry(lineno, package, m["name"], m["kind"], m["signature"].strip()))
    return entries


ENTRIES = parse_api(API_DOC.read_text(encoding="utf-8"))

# --------------------------------------------------------------------------------------------- signatures
NO_DEFAULT = object()  # the parameter has no default
SOME_DEFAULT = object()  # written `...`: a default exists, its value is not spelled out


@dataclass(frozen=True)
class Param:
    name: str
    kind: inspect._ParameterKind
    default: Any

    def __str__(self) -> str:
        default = "" if self.default is NO_DEFAULT else "=..." if self.default is SOME_DEFAULT else f"={self.default!r}"
        return f"{self.name}{default} ({self.kind.description})"


def documented(part: str) -> tuple[str, list[Param]]:
    """(name, parameters) of one documented signature 'name(a, b=1, *, c=None, **kw)'."""
    fn = ast.parse(f"def {part}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args

    def default(node) -> Any:
        if node is None:
            return NO_DEFAULT
        if isinstance(node, ast.Constant) and node.value is Ellipsis:
            return SOME_DEFAULT
        return ast.literal_eval(node)

    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [
        Param(
            a.arg,
            inspect.Parameter.POSITIONAL_ONLY if i < len(args.posonlyargs) else inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default(d),
        )
        for i, (a, d) in enumerate(zip(positional, defaults))
    ]
    if args.vararg:
        params.append(Param(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, NO_DEFAULT))
    keyword = inspect.Parameter.KEYWORD_ONLY
    params += [Param(a.arg, keyword, default(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(Param(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, NO_DEFAULT))
    return fn.name, params


def actual(obj) -> list[Param]:
    return [
        Param(p.name, p.kind, NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(obj).parameters.values()
    ]


def _same_value(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a default whose == is not a bool (a tensor) is not the documented literal
        return False


def signature_problems(part: str, obj) -> list[str]:
    """How `obj`'s signature differs from the documented `part` ([] when it does not)."""
    name, want = documented(part)
    try:
        got = actual(obj)
    except (TypeError, ValueError) as exc:
        return [f"{name}: no signature to compare ({exc})"]
    if [p.name for p in want] != [p.name for p in got]:
        names = ", ".join(p.name for p in got), ", ".join(p.name for p in want)
        return [f"{name}: parameters ({names[0]}), documented ({names[1]})"]
    problems = []
    for w, g in zip(want, got):
        if w.kind != g.kind:
            problems.append(f"{name}: {g.name} is {g.kind.description}, documented {w.kind.description}")
        if w.default is NO_DEFAULT and g.default is not NO_DEFAULT:
            problems.append(f"{name}: {g.name} has a default ({g.default!r}), documented without one")
        elif w.default is not NO_DEFAULT and g.default is NO_DEFAULT:
            problems.append(f"{name}: {g.name} has no default, documented {w}")
        elif w.default not in (NO_DEFAULT, SOME_DEFAULT) and not _same_value(w.default, g.default):
            problems.append(f"{name}: {g.name} defaults to {g.default!r}, documented {w.default!r}")
    return problems


# ------------------------------------------------------------------------------------------------ entries
def entry_problems(entry: Entry) -> list[str]:
    """What is wrong with one row of the list: the name does not import from its package, is of another kind,
    or has another signature than the row's ([] when the row holds)."""
    try:
        obj = getattr(importlib.import_module(entry.package), entry.name)
    except (ImportError, AttributeError) as exc:
        return [f"from {entry.package} import {entry.name} fails: {type(exc).__name__}: {exc}"]
    parts = [p.strip() for p in entry.signature.split(";")]
    problems = []
    if entry.kind == "constant":
        m = re.fullmatch(rf"{entry.name}: (\w+)", entry.signature)
        if m is None:
            return [f"a constant's signature is '{entry.name}: type', not {entry.signature!r}"]
        if type(obj).__name__ != m[1]:
            problems.append(f"{entry.name} is a {type(obj).__name__}, documented {m[1]}")
        return problems
    if entry.kind == "function":
        if len(parts) != 1 or inspect.isclass(obj) or not callable(obj):
            return [f"{entry.name} is documented as one function signature; it is {obj!r}"]
        name, _ = documented(parts[0])
        if name != entry.name:
            return [f"the signature names {name}, the row {entry.name}"]
        return signature_problems(parts[0], obj)
    if not inspect.isclass(obj):
        return [f"{entry.name} is documented as a {entry.kind}; it is {obj!r}"]
    if entry.kind == "exception":
        if not issubclass(obj, BaseException):
            problems.append(f"{entry.name} is not an exception class")
        if parts != [entry.name]:
            problems.append(f"an exception's signature is its bare name, not {entry.signature!r}")
        return problems
    is_protocol = bool(getattr(obj, "_is_protocol", False))
    if (entry.kind == "protocol") != is_protocol:
        what = "a typing.Protocol" if is_protocol else "not a typing.Protocol"
        problems.append(f"{entry.name} is {what}, documented as a {entry.kind}")
    methods = []
    for i, part in enumerate(parts):
        if part == entry.name and i == 0 and entry.kind == "class":
            continue  # a class whose constructor is not documented
        name, _ = documented(part)
        if name == entry.name and i == 0 and entry.kind == "class":
            problems += signature_problems(part, obj)  # the constructor
            continue
        methods.append(name)
        if not callable(getattr(obj, name, None)):
            problems.append(f"{entry.name} has no method {name}")
            continue
        problems += [f"{entry.name}.{p}" for p in signature_problems(part, getattr(obj, name))]
    if entry.kind == "protocol":
        required = {n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")}
        if required != set(methods):
            problems.append(f"{entry.name} requires {sorted(required)}, documented {methods}")
    return problems


def test_the_list_parses_and_holds_the_required_names():
    assert len(ENTRIES) >= sum(len(v) for v in REQUIRED.values())
    listed: dict[str, set[str]] = {}
    for e in ENTRIES:
        assert e.name not in listed.setdefault(e.package, set()), f"docs/api.md:{e.line}: {e.id} listed twice"
        listed[e.package].add(e.name)
    for package, names in REQUIRED.items():
        missing = names - listed.get(package, set())
        assert not missing, f"docs/api.md lists no {sorted(missing)} under `{package}`"


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_public_name(entry: Entry):
    problems = entry_problems(entry)
    assert not problems, f"docs/api.md:{entry.line} ({entry.id}): " + "; ".join(problems)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_reexports_are_listed_and_are_the_implementations(package):
    module = importlib.import_module(package)
    listed = {e.name for e in ENTRIES if e.package == package}
    exported = set(module.__all__)
    assert exported == listed, f"{package}.__all__ and docs/api.md differ: {sorted(exported ^ listed)}"
    for name, source in module._LAZY.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), f"{package}.{name}"
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_the_check_fails_on_a_changed_api():
    """The comparison is not vacuous: a renamed, reordered, re-kinded or re-defaulted parameter, a missing
    name, a wrong kind and a malformed row are all caught."""

    def f(a, b=1, *, c=None, **kw): ...

    assert signature_problems("f(a, b=1, *, c=None, **kw)", f) == []
    assert signature_problems("f(a, b=..., *, c=..., **kw)", f) == []
    assert signature_problems("f(a, bb=1, *, c=None, **kw)", f)  # renamed
    assert signature_problems("f(b=1, a=None, *, c=None, **kw)", f)  # reordered
    assert signature_problems("f(a, *, b=1, c=None, **kw)", f)  # keyword-only
    assert signature_problems("f(a, b=2, *, c=None, **kw)", f)  # another default
    assert signature_problems("f(a, b=True, *, c=None, **kw)", f)  # same ==, another type
    assert signature_problems("f(a, b, *, c=None, **kw)", f)  # default gone
    assert signature_problems("f(a, b=1, *, c=None, d=None, **kw)", f)  # a parameter missing
    assert signature_problems("f(a, b=1, *, c=None)", f)  # **kw not documented

    gone = Entry(0, "rlhf_core.reward", "no_such_reward", "function", "no_such_reward(x)")
    assert "fails" in entry_problems(gone)[0]
    buffer = ("rlhf_core.buffer", "BoundedReplayBuffer")
    assert entry_problems(Entry(0, *buffer, "function", "BoundedReplayBuffer(max_size)"))  # a class
    assert entry_problems(Entry(0, *buffer, "class", "BoundedReplayBuffer(size)"))  # its parameter is max_size
    assert entry_problems(Entry(0, *buffer, "class", "BoundedReplayBuffer(max_size); pop(self)"))  # no pop
    assert entry_problems(Entry(0, "rlhf_core.env", "Environment", "protocol", "reset(self, row)"))  # step left out
    with pytest.raises(ValueError, match="table format"):
        parse_api("## `rlhf_core.loop`\n\n| `run_sync` | functon | `run_sync(cfg)` | Trains. |\n")
    with pytest.raises(ValueError, match="outside"):
        parse_api("| `run_sync` | function | `run_sync(cfg)` | Trains. |\n")


def test_the_pools_imports_stay_free_of_torch():
    """What the reward-function pool's processes import (its initializer is pickled by reference to
    rlhf_core.reward.functions.pool) and the environment pool's, with the lazy re-exports of rlhf_core.reward
    and rlhf_core.env in place: no torch, no transformers until a re-exported name is used."""
    code = "\n".join(
        [
            "import importlib, pickle, sys",
            f"for m in {LIGHT_MODULES!r}: importlib.import_module(m)",
            "import rlhf_core.reward as reward",
            "from rlhf_core.reward.functions import pool",
            "pickle.loads(pickle.dumps(pool._load))",
            "from rlhf_core.reward import functions",
            "from rlhf_core.env import Environment, ToolEnv",
            "assert 'tensor_native_reward' in dir(reward) and 'score_responses' in reward.__all__",
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))",
            "from rlhf_core.reward import tensor_native_reward",  # the re-export loads its module (and torch)
            "print('torch' in sys.modules)",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
