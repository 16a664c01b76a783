"""Import layers: no circle among the project's modules, and the light modules stay light.

The module-level imports of every module under rlhf_core/, flows/ and tasks/ (read from the source, not run;
imports under `if TYPE_CHECKING:` and inside functions are not executed at import time and are left out)
form a graph in which importing a module also imports the packages above it. A cycle in that graph is an
import circle (build <-> data <-> reward was one): it works or fails depending on which module is imported
first. Fresh interpreters check the modules that must import without torch. Above the modules, the folders form
layers (LAYER_ORDER): every import, those inside functions included, points down to a folder listed before its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_core", "flows", "tasks", "tracking")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.Module, hidden: bool = False) -> list[tuple[str, list[str]]]:
    """(module, names) of every import executed when the module is imported; with `hidden`, those inside
    functions too."""
    out = []
    if hidden:  # every import statement but those under `if TYPE_CHECKING:` (never executed)
        skipped = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and _is_type_checking(node)
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                out.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((node.module, [a.name for a in node.names]))
        return out

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.With)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(hidden: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names in _imported(ast.parse(path.read_text(encoding="utf-8")), hidden):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            for target in targets:
                if target not in modules:
                    continue
                own = set(_ancestors(name)) | {name}
                graph[name] |= {m for m in [*_ancestors(target), target] if m in modules and m not in own}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_finder_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    graph = import_graph()
    assert "rlhf_core.run.build" in graph["rlhf_core.scoring"]  # scoring sits above build
    assert "rlhf_core.reward.answer_forms" in graph["rlhf_core.data.answers"]  # data uses the reward's answer forms
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


LAYERS = ("rlhf_core.run.build", "rlhf_core.scoring", "rlhf_core.data", "rlhf_core.reward")


def test_build_data_and_reward_form_no_circle_even_through_imports_inside_functions():
    """The circle the structure issue named (reward/scoring.py built a run and sat below build.py; data/answers.py
    imported the reward package inside its functions): between these layers imports point one way, hidden
    ones included."""

    def layer(module: str) -> str | None:
        return next((u for u in LAYERS if module == u or module.startswith(u + ".")), None)

    units: dict[str, set[str]] = {u: set() for u in LAYERS}
    for name, targets in import_graph(hidden=True).items():
        if layer(name):
            units[layer(name)] |= {layer(t) for t in targets if layer(t) and layer(t) != layer(name)}
    cycle = find_cycle(units)
    assert cycle is None, "import circle (imports inside functions included): " + " -> ".join(cycle)


# ------------------------------------------------------------------------------------------------- layers
# The folders, bottom first: a module imports from its own folder and the folders before it, never from one after
# it, at import time or inside a function (not under `if TYPE_CHECKING:`, which never runs). Each sub-package of
# rlhf_core is a folder, each top-level module of rlhf_core one of its own (rlhf_core/__init__.py is empty), and
# tracking/, tasks/ and flows/ sit above rlhf_core (docs/architecture.md, "Layers"). A new folder or top-level
# module fails test_every_module_has_a_layer until it is placed here.
LAYER_ORDER = (
    "rlhf_core.types",  # the data that crosses every boundary (RolloutBatch, Experience)
    "rlhf_core.usercode",  # the one loader of user Python files
    "rlhf_core.lazy",  # the packages' lazy exports
    "rlhf_core.algorithms",
    "rlhf_core.env",
    "rlhf_core.config",  # validates with the algorithms' registry and the environment's source checks
    "rlhf_core.autopilot",
    "rlhf_core.autoscale",
    "rlhf_core.model",
    "rlhf_core.reward",
    "rlhf_core.data",  # the data layer uses the reward's answer forms
    "rlhf_core.rollout",
    "rlhf_core.agent",  # drives a rollout engine
    "rlhf_core.buffer",
    "rlhf_core.trainer",
    "rlhf_core.supervision",
    "rlhf_core.models",  # the public names of model/policy.py (docs/api.md)
    "rlhf_core.run",  # a run assembled and hosted in-process
    "rlhf_core.distributed",  # the Ray actors of run/'s roles
    "rlhf_core.hosts",  # where a run's roles run (in this thread, on threads, on Ray actors): above what each uses
    "rlhf_core.loop",
    "rlhf_core.policy_eval",
    "rlhf_core.scoring",  # builds a run's reward
    "rlhf_core.staleness",
    "rlhf_core.sweep_grid",
    "tracking",
    "tasks",
    "flows",
)
# Imports that may point up, by (module, the folder it may import): none. The host factory (rlhf_core.hosts) sits
# above the hosts it picks; rlhf_core.distributed's lazy exports of DistributedRun and run_distributed (where
# docs/api.md lists them) name modules of rlhf_core.hosts as strings, loaded on first use.
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def layer_of(module: str) -> str | None:
    """The folder of LAYER_ORDER that holds `module` (None for the empty root package rlhf_core)."""
    return next((f for f in LAYER_ORDER if module == f or module.startswith(f + ".")), None)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph between folders: folder -> the folders its modules import."""
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if (src := layer_of(name)) is not None:
            out.setdefault(src, set()).update(t for t in map(layer_of, targets) if t is not None and t != src)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'module -> imported module' for every import from a folder into one above it, but UPWARD_ALLOWED's."""
    rank = {folder: i for i, folder in enumerate(LAYER_ORDER)}
    found = []
    for name, targets in sorted(graph.items()):
        src = layer_of(name)
        for target in sorted(targets):
            dst = layer_of(target)
            if src and dst and rank[dst] > rank[src] and (name, dst) not in UPWARD_ALLOWED:
                found.append(f"{name} -> {target}")
    return found


def test_every_module_has_a_layer():
    unplaced = [name for name in _modules() if name != "rlhf_core" and layer_of(name) is None]
    assert not unplaced, f"place these in LAYER_ORDER (bottom first): {unplaced}"
    assert not _imported(ast.parse((ROOT / "rlhf_core" / "__init__.py").read_text()), hidden=True)


def test_the_layer_check_sees_an_upward_import():
    """An import planted inside a function of the reward model, up into run/, is found; one under TYPE_CHECKING
    is not (it never runs); and one from run/ up into the hosts is found too (no exception is left)."""
    planted = (
        "def check(path):\n    from rlhf_core.run.preflight import check_paths\n\n"
        "if TYPE_CHECKING:\n    from flows.train import train\n"
    )
    graph = import_graph(hidden=True)
    graph["rlhf_core.reward.model"] = {module for module, _ in _imported(ast.parse(planted), hidden=True)}
    assert upward_imports(graph) == ["rlhf_core.reward.model -> rlhf_core.run.preflight"]
    graph["rlhf_core.run.build"] = {"rlhf_core.hosts.ray_cluster"}
    assert upward_imports(graph) == [
        "rlhf_core.reward.model -> rlhf_core.run.preflight",
        "rlhf_core.run.build -> rlhf_core.hosts.ray_cluster",
    ]


def test_imports_point_down_the_layers_even_inside_functions():
    graph = import_graph(hidden=True)
    assert "rlhf_core.hosts.ray_cluster" in graph["rlhf_core.hosts"]  # the factory picks the Ray host from above
    upward = upward_imports(graph)
    folders = "\n".join(f"  {f} -> {sorted(t)}" for f, t in sorted(folder_graph(graph).items()))
    assert not upward, (
        f"imports from a folder into one above it (LAYER_ORDER): {upward}\nMove the shared code down to the "
        f"folder that owns it, or pass it in from above. The folder graph now:\n{folders}"
    )


def ray_importers() -> list[str]:
    """'module imports ray...' for every module outside rlhf_core/distributed/ with an import of Ray, inside
    functions included."""
    found = []
    for name, path in _modules().items():
        if name == "rlhf_core.distributed" or name.startswith("rlhf_core.distributed."):
            continue
        for module, _ in _imported(ast.parse(path.read_text(encoding="utf-8")), hidden=True):
            if module == "ray" or module.startswith("ray."):
                found.append(f"{name} imports {module}")
    return found


def test_only_rlhf_core_distributed_imports_ray():
    """ARCHITECTURE.md: only rlhf_core/distributed/ imports ray. The Ray host (rlhf_core.hosts.ray_cluster) and the
    console's routing of Ray's worker output (flows/terminal.py) reach Ray through its functions (calls.py,
    cluster.py, console.py)."""
    assert not ray_importers(), ray_importers()
    source = (ROOT / "rlhf_core" / "hosts" / "ray_cluster.py").read_text(encoding="utf-8")
    assert "get_or_fail" in source and "import ray" not in source  # the host still waits on Ray, through calls.py


@pytest.mark.parametrize(
    "module",
    [
        "rlhf_core.config",
        "rlhf_core.algorithms",
        "rlhf_core.data",
        "rlhf_core.reward.answer_forms",
        "rlhf_core.reward.functions.pool",
        "rlhf_core.reward.functions.math_verify",
    ],
)
def test_light_modules_import_no_torch(module):
    """The config (loaded by every CLI call), the algorithms' registry and options (the config validates with them;
    the tensor functions load on first use), the data layer (the prompt queue's process) and the reward-function
    pool's side (what its processes import)."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_no_import_circle_even_through_imports_inside_functions():
    """An import inside a function is still an import: the circles it hid (lora <-> sharding through the trainer
    package, rollout <-> env through the multi-turn runner, trainer <-> checkpoint) are gone, and stay gone."""
    cycle = find_cycle(import_graph(hidden=True))
    assert cycle is None, "import circle (imports inside functions included): " + " -> ".join(cycle)


MAX_LINES = 450  # structure round three: a module past this holds two ideas; split it (as rlhf_core/supervision/)
HOSTS = {"rlhf_core.distributed.trainer_actor": 200, "rlhf_core.distributed.rollout_actor": 120}  # hosting only


def test_every_module_is_at_most_450_lines_and_the_ray_actors_only_host():
    lines = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()}
    assert len(lines) > 100  # the finder sees the tree
    too_long = {name: n for name, n in lines.items() if n > HOSTS.get(name, MAX_LINES)}
    assert not too_long, f"modules over their limit ({MAX_LINES} lines; the actors {HOSTS}): {too_long}"


def test_both_hosts_implement_the_one_control_interface_with_its_signatures():
    """rlhf_core.hosts.base.RunHost is the control interface the supervision, the flow and run_distributed call:
    every host (Ray actors, threads, the in-process lockstep host of run_sync) implements every method of it with
    its parameters, over HostBase's shared sequences."""
    import inspect

    from rlhf_core.hosts.base import HostBase, RunHost
    from rlhf_core.hosts.in_process import InProcessRun
    from rlhf_core.hosts.ray_cluster import DistributedRun
    from rlhf_core.hosts.threads import ThreadedRun

    methods = [n for n, f in vars(RunHost).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert len(methods) >= 19, methods
    for host in (ThreadedRun, DistributedRun, InProcessRun):
        assert issubclass(host, HostBase), host
        for name in methods:
            want = [p for p in inspect.signature(getattr(RunHost, name)).parameters if p != "self"]
            got = [p for p in inspect.signature(getattr(host, name)).parameters if p != "self"]
            assert got[: len(want)] == want, (host.__name__, name, got, want)
