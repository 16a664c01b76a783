"""Algorithms by registration: policy losses and advantage estimators by name, each with its options class.

    @register_policy_loss("my_pg", options=MyPGOptions)          # MyPGOptions: a subclass of AlgorithmOptions
    def my_pg(inputs: LossInputs, options: MyPGOptions) -> tuple[loss, stats]: ...

    @register_advantage("my_baseline", grouped=True)
    def my_baseline(inputs: AdvantageInputs, options: AlgorithmOptions) -> advantages: ...

A config then names it (`algorithm.loss: my_pg`, its options under `algorithm.loss_options`), and the trainer
calls it; no table is edited. The one signature of each kind, and the inputs objects, are described at
`rlhf_core.algorithms.dispatch.LossInputs` and `rlhf_core.algorithms.advantages.AdvantageInputs`.

This module does not import torch: the config (`rlhf_core.config.AlgorithmConfig`) validates names and options
against these registries when a config is validated, so a name registered by user code (a module imported
before the config is loaded) is accepted like a built-in one, and loading a config stays light. The built-ins
are registered by `rlhf_core.algorithms.builtin`, which `rlhf_core.algorithms` imports first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Set
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, SerializeAsAny, ValidationError, WithJsonSchema


class AlgorithmOptions(BaseModel):
    """Base of every algorithm's options class, and the options of an algorithm that takes none.

    A key the class does not declare is refused (extra="forbid": an option that does not apply cannot be
    written); assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


OptionsField = Annotated[
    SerializeAsAny[AlgorithmOptions], WithJsonSchema({"type": "object", "additionalProperties": True})
]
"""The type of a config field holding an algorithm's options: any AlgorithmOptions subclass, dumped whole; its JSON
schema a free-form object (the class is only known once the algorithm's name is)."""


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss: fn(inputs: LossInputs, options) -> (loss [], stats).

    step_mask: None, or fn(inputs: LossInputs, options) -> BoolTensor [N, L], the loss's token mask computed over
    the whole step's batch (M2PO's): the trainer computes it once per step and passes each micro-batch its rows
    as inputs.keep_mask (with inputs.kept_norm, the normalisers of keep·mask)."""

    name: str
    fn: Callable[..., Any]
    options: type[AlgorithmOptions]
    step_mask: Optional[Callable[..., Any]] = None
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """A registered advantage estimator: fn(inputs: AdvantageInputs, options) -> advantages [N] (or [N, T]);
    with critic=True -> (advantages [N, T], returns [N, T]).

    grouped: it compares the completions of one prompt (rollout.samples_per_prompt must be 2 or more).
    critic: it needs a learned critic's values (the run builds one, configured under critic:)."""

    name: str
    fn: Callable[..., Any]
    options: type[AlgorithmOptions]
    grouped: bool = False
    critic: bool = False
    aliases: tuple[str, ...] = ()


Spec = Union[PolicyLossSpec, AdvantageSpec]


class Registry:
    """Specs by name; aliases resolve to the spec they name. `kind` is the config field ("loss", "advantage")."""

    def __init__(self, kind: str, what: str, decorator: str):
        self.kind, self.what, self.decorator = kind, what, decorator
        self._specs: dict[str, Spec] = {}
        self._names: dict[str, str] = {}  # name or alias -> name

    def add(self, spec: Spec) -> None:
        for name in (spec.name, *spec.aliases):
            if not isinstance(name, str) or not name:
                raise ValueError(f"a {self.what} needs a non-empty string name, got {name!r}")
            if name not in self._names:
                continue
            owner = self._specs[self._names[name]]
            if owner.name != spec.name or not _same(owner.fn, spec.fn):
                raise ValueError(f"{self.what} {name!r} is already registered (by {_where(owner.fn)})")
        old = self._specs.pop(spec.name, None)  # the same function again: its module was imported anew
        for alias in old.aliases if old else ():
            self._names.pop(alias, None)
        self._specs[spec.name] = spec
        self._names.update({name: spec.name for name in (spec.name, *spec.aliases)})

    def get(self, name: str) -> Spec:
        """The spec of `name` (a name or an alias, or '<file.py or module>:<name>': the user's module is imported in
        this process first, which registers it); ValueError naming the registered ones when there is none."""
        if isinstance(name, str) and name not in self._names and ":" in name:
            self._import_user(name)
        try:
            return self._specs[self._names[name]]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}. Register one with "
                f"rlhf_core.algorithms.{self.decorator} in a module imported before the config is loaded "
                "(in every process that trains)"
            ) from None

    def _import_user(self, spelled: str) -> None:
        """'<path>:<name>': import `path` (a .py file or an importable module, rlhf_core.usercode: once per process,
        in whichever process asks first: the driver validating the config, a Ray trainer building its loss), whose
        decorator registers `name`; the whole spelling then names that spec too."""
        from rlhf_core.usercode import import_path

        path, _, name = spelled.rpartition(":")
        where = f"algorithm.{self.kind} {spelled!r}"
        try:
            import_path(path, where, what="file")
        except Exception as exc:  # the user's file: its error, named with the key that loads it
            raise ValueError(f"{where}: importing {path} failed: {type(exc).__name__}: {exc}") from None
        if name not in self._names:
            raise ValueError(
                f"{where}: {path} registers no {self.what} {name!r} (decorate it with "
                f"rlhf_core.algorithms.{self.decorator}({name!r}))"
            )
        self._names[spelled] = self._names[name]

    def names(self) -> list[str]:
        """Every name and alias, sorted (a '<path>:<name>' spelling is its name's)."""
        return sorted(n for n in self._names if ":" not in n)

    def specs(self) -> list[Spec]:
        return list(self._specs.values())

    def view(self, value: Callable[[Spec], Any]) -> Mapping[str, Any]:
        """A live read-only mapping: every name and alias -> value(its spec)."""
        return _View(self, value)

    def names_where(self, test: Callable[[Spec], bool]) -> Set[str]:
        """A live read-only set of the names and aliases whose spec passes `test`."""
        return _Names(self, test)


class _View(Mapping):
    def __init__(self, registry: Registry, value: Callable[[Spec], Any]):
        self._registry, self._value = registry, value

    def __getitem__(self, name: str) -> Any:
        if name not in self._registry._names:
            raise KeyError(name)
        return self._value(self._registry.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __len__(self) -> int:
        return len(self._registry._names)

    def __repr__(self) -> str:
        return repr(dict(self))


class _Names(Set):
    def __init__(self, registry: Registry, test: Callable[[Spec], bool]):
        self._registry, self._test = registry, test

    def _current(self) -> list[str]:
        return [n for n in self._registry.names() if self._test(self._registry.get(n))]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._registry._names and self._test(self._registry.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __repr__(self) -> str:
        return repr(tuple(self._current()))


POLICY_LOSS_REGISTRY = Registry("loss", "policy loss", "register_policy_loss")
ADVANTAGE_REGISTRY = Registry("advantage", "advantage estimator", "register_advantage")
REGISTRIES = {r.kind: r for r in (POLICY_LOSS_REGISTRY, ADVANTAGE_REGISTRY)}


def _same(a: Callable, b: Callable) -> bool:
    return a is b or _where(a) == _where(b)


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _options_class(options: Optional[type], name: str) -> type[AlgorithmOptions]:
    if options is None:
        return AlgorithmOptions
    if not (isinstance(options, type) and issubclass(options, AlgorithmOptions)):
        raise TypeError(
            f"{name!r}: options must be a subclass of rlhf_core.algorithms.AlgorithmOptions, got {options!r}"
        )
    if options.model_config.get("extra") != "forbid":
        raise TypeError(f"{name!r}: {options.__name__} must refuse unknown keys (model_config extra='forbid')")
    return options


def register_policy_loss(
    name: str,
    *,
    options: Optional[type[AlgorithmOptions]] = None,
    step_mask: Union[bool, Callable[..., Any]] = False,
    aliases: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Decorator registering fn(inputs: LossInputs, options) -> (loss [], stats) as the policy loss `name`.

    options: its options class (a subclass of AlgorithmOptions), validated from `algorithm.loss_options`; None: it
    takes none. step_mask: False, or fn(inputs: LossInputs, options) -> BoolTensor [N, L] when the loss's token
    mask is a statistic of the whole step (see PolicyLossSpec). aliases: further names of the same loss.
    Returns the function unchanged."""
    if step_mask is True or (step_mask is not False and not callable(step_mask)):
        raise TypeError(f"{name!r}: step_mask is False or the function computing the step's token mask")

    options_class = _options_class(options, name)

    def decorate(fn: Callable) -> Callable:
        POLICY_LOSS_REGISTRY.add(PolicyLossSpec(name, fn, options_class, step_mask or None, tuple(aliases)))
        return fn

    return decorate


def register_advantage(
    name: str,
    *,
    options: Optional[type[AlgorithmOptions]] = None,
    grouped: bool = False,
    critic: bool = False,
    aliases: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Decorator registering fn(inputs: AdvantageInputs, options) as the advantage estimator `name`: it returns
    advantages [N] (one per sequence) or [N, T] (per token); with critic=True (advantages [N, T], returns [N, T]).

    options: its options class, validated from `algorithm.advantage_options`; None: it takes none. grouped: it
    compares the completions of one prompt (the config then asks for 2 or more per prompt). critic: it needs a
    learned critic's values (inputs.values, inputs.token_rewards); the run builds and trains the critic on the
    returns. Returns the function unchanged."""

    options_class = _options_class(options, name)

    def decorate(fn: Callable) -> Callable:
        ADVANTAGE_REGISTRY.add(AdvantageSpec(name, fn, options_class, bool(grouped), bool(critic), tuple(aliases)))
        return fn

    return decorate


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The registered policy loss `name` (or alias); ValueError naming the registered ones."""
    return POLICY_LOSS_REGISTRY.get(name)  # type: ignore[return-value]


def advantage_spec(name: str) -> AdvantageSpec:
    """The registered advantage estimator `name` (or alias); ValueError naming the registered ones."""
    return ADVANTAGE_REGISTRY.get(name)  # type: ignore[return-value]


def _is_a_default(registry: Registry, option: str, value: Any) -> bool:
    """`value` is the default of `option` in some registered options class (a whole config dumped for one
    algorithm lists its options at their defaults; they must not stop it from being switched to another)."""
    for spec in registry.specs():
        field = spec.options.model_fields.get(option)
        if field is None or field.is_required() or field.default_factory is not None:
            continue
        if field.default == value and isinstance(field.default, bool) == isinstance(value, bool):
            return True
    return False


def options_for(kind: str, name: str, given: Any, flat: Optional[Mapping[str, str]] = None) -> AlgorithmOptions:
    """The options of the algorithm `name` of `kind` ("loss", "advantage"): an instance of its registered class.

    given: a mapping (from a config), an options instance, or None (the defaults). A key the class does not
    declare is refused with a ValueError naming the field and the algorithm, unless its value is the default of
    that option in another registered algorithm's class: a config dumped whole for one algorithm (a checkpoint's,
    a sweep's base) can then be switched to another. flat: {option: the old flat key of AlgorithmConfig it was
    written as}, so that messages name what was written."""
    registry = REGISTRIES[kind]
    spec = registry.get(name)
    cls = spec.options
    if type(given) is cls:
        return given
    if given is None:
        data: dict[str, Any] = {}
    elif isinstance(given, BaseModel):
        data = given.model_dump()
    elif isinstance(given, Mapping):
        data = dict(given)
    else:
        raise ValueError(f"algorithm.{kind}_options must be a mapping of option: value, got {given!r}")
    flat = flat or {}

    def written(option: str) -> str:
        return f"algorithm.{flat[option]}" if option in flat else f"algorithm.{kind}_options.{option}"

    for option in list(data):
        if option in cls.model_fields:
            continue
        if _is_a_default(registry, option, data[option]):
            del data[option]
            continue
        takes = ", ".join(cls.model_fields) or "no options"
        owners = sorted({s.name for s in registry.specs() if option in s.options.model_fields})
        where = f"; it is an option of algorithm.{kind} {' or '.join(map(repr, owners))}" if owners else ""
        raise ValueError(f"{written(option)} has no effect with algorithm.{kind} {name!r}, which takes {takes}{where}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        if not any(e["loc"] and e["loc"][0] in flat for e in err.errors()):
            raise  # pydantic places these errors at algorithm.<kind>_options.<option>
        raise ValueError(
            "; ".join(
                f"{written(str(e['loc'][0])) if e['loc'] else f'algorithm.{kind}_options'}: {e['msg']} "
                f"(got {e.get('input')!r})"
                for e in err.errors()
            )
        ) from None
