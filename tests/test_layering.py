"""Import rules of docs/style.md rules 1, 8 and 10, checked by parsing the source.

- algorithms/ imports only torch, the stdlib modules dataclasses/math/types/typing/
  collections.abc/__future__ and fedcli.algorithms (never tracking, the CLI, I/O, logging, time);
- algorithms/ and datasets/ never call the global RNGs (torch.rand*, np.random.<draw>, random.*);
- datasets/ never imports fedcli.algorithms, fedcli.engine or the CLI; tracking/ never imports the engine;
- no module imports itself back through others: the package's import graph (every import statement,
  lazy ones and TYPE_CHECKING ones included) has no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_IN_ALGORITHMS = {
    "torch",
    "dataclasses",
    "math",
    "types",
    "typing",
    "collections",
    "__future__",
    "fedcli",
}
FORBIDDEN_IN_ALGORITHMS = {
    "mlflow",
    "sqlalchemy",
    "typer",
    "click",
    "logging",
    "os",
    "pathlib",
    "random",
    "time",
    "numpy",
    "pandas",
}


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "algorithms").glob("*.py")), ids=lambda p: p.name)
def test_algorithms_import_only_torch_stdlib_math_and_base(path: Path) -> None:
    for name in imports(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN_IN_ALGORITHMS, f"{path.name} imports {name}"
        assert top in ALLOWED_IN_ALGORITHMS or path.name == "__init__.py", f"{path.name} imports {name}"
        if top == "fedcli":
            assert name.startswith("fedcli.algorithms"), f"{path.name} imports {name}"


GLOBAL_RNG = re.compile(
    r"\btorch\.(rand|randn|randint|randperm|normal|bernoulli|multinomial)\(|"
    r"\bnp\.random\.(rand|randn|randint|choice|permutation|shuffle|normal|uniform|seed)\(|"
    r"^\s*import random\b|\brandom\.(random|randint|choice|shuffle)\(",
    re.M,
)


@pytest.mark.parametrize(
    "path",
    sorted([*(ROOT / "algorithms").glob("*.py"), *(ROOT / "datasets").rglob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_global_rng_in_algorithms_or_datasets(path: Path) -> None:
    text = path.read_text()
    for match in GLOBAL_RNG.finditer(text):
        line = text[: match.start()].count("\n") + 1
        context = text.splitlines()[line - 1]
        assert "generator=" in context, (
            f"{path.relative_to(ROOT)}:{line} draws from a global RNG: {context.strip()}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("folder", "banned"),
    [
        ("datasets", ("fedcli.algorithms", "fedcli.engine", "fedcli.cli")),
        ("tracking", ("fedcli.engine", "fedcli.cli", "fedcli.algorithms")),
    ],
)
def test_lower_layers_do_not_import_upper_layers(folder: str, banned: tuple[str, ...]) -> None:
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imports(path):
            assert not name.startswith(banned), f"{path.relative_to(ROOT)} imports {name}"


# ----------------------------------------------------------------------------- no import circles

PACKAGES = {
    "fedcli": ROOT / "fedcli",
    "fedcli.algorithms": ROOT / "algorithms",
    "fedcli.datasets": ROOT / "datasets",
    "fedcli.tracking": ROOT / "tracking",
}  # as installed (pyproject)


def module_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports, from every `import` statement of its source.

    Every statement counts wherever it stands: at module level, inside a function (a lazy
    import is still a dependency, only a later one), under `if TYPE_CHECKING:` (a type the
    module's signatures name). `from a.b import c` depends on module a.b.c when that is a
    module, else on a.b; relative imports are resolved. Implicit imports of parent packages
    (importing a.b.c runs a/__init__.py and a/b/__init__.py first) are not edges: they are
    cycles only where a package's __init__ imports its own submodules, which would show as
    an edge from the __init__ module itself.
    """
    modules: dict[str, Path] = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path

    def known(name: str) -> str | None:  # the longest prefix of `name` that is a module here
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 packages
                    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                deps.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base)
                    for alias in node.names
                )
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


@pytest.mark.slow
def test_the_package_has_no_import_cycles() -> None:
    """No module of fedcli (fedcli/, algorithms/, datasets/, tracking/) imports, even lazily, a module
    that imports it back, directly or through others (docs/architecture.md §1, "Dependency direction")."""
    graph = module_graph(PACKAGES)
    assert "fedcli.engine.rounds" in graph and "fedcli.engine.setup" in graph["fedcli.engine.rounds"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_lazy_and_type_only_cycles(tmp_path: Path) -> None:
    """The check can fail: a package whose modules import each other inside a function and under
    TYPE_CHECKING (what engine/train.py and engine/workers.py did before issue 25)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    )
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    assert find_cycle(module_graph({"pkg": tmp_path / "pkg"})) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (tmp_path / "pkg" / "c.py").write_text("import os\n")
    assert find_cycle(module_graph({"pkg": tmp_path / "pkg"})) is None


# ----------------------------------------------------------------------------- tracking below the run layer

TRACKING_BANNED = ("fedcli.sweep", "fedcli.cli", "fedcli.api", "fedcli.runs", "fedcli.engine")  # prefixes


def banned_imports(folder: Path, banned: tuple[str, ...]) -> list[str]:
    """`path: module` for every import under `folder` (recursively) of a module starting with `banned`
    (`from fedcli import cli` counts as `fedcli.cli`)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else (
                    [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    else []
                )
            )
            found += [
                f"{path.relative_to(folder.parent)}: {name}" for name in names if name.startswith(banned)
            ][:1]
    return found


def test_tracking_imports_no_sweep_cli_api_or_engine() -> None:
    """Nothing under tracking/ (its subpackages included) imports the sweep layer, the CLI, the Python API,
    the run layer or the engine: the sweep hands its mirror what it needs (`fedcli.sweep.rows.parent_tags`)."""
    assert (ROOT / "tracking" / "mlflow" / "sweep_mirror.py").exists()
    assert banned_imports(ROOT / "tracking", TRACKING_BANNED) == []


def test_the_tracking_rule_finds_a_nested_lazy_import(tmp_path: Path) -> None:
    """The rule can fail: a lazy `from fedcli.sweep.rows import ...` two folders down is found."""
    (tmp_path / "tracking" / "mlflow").mkdir(parents=True)
    (tmp_path / "tracking" / "mlflow" / "x.py").write_text(
        "def f():\n    from fedcli.sweep.rows import parent_tags\n"
    )
    (tmp_path / "tracking" / "y.py").write_text(
        "import fedcli.runs.run\nimport fedcli.tracking.keys\nfrom fedcli import cli\n"
    )
    assert banned_imports(tmp_path / "tracking", TRACKING_BANNED) == [
        "tracking/mlflow/x.py: fedcli.sweep.rows",
        "tracking/y.py: fedcli.runs.run",
        "tracking/y.py: fedcli.cli",
    ]


# ----------------------------------------------------------------------------- nothing below the CLI imports it


def cli_importers(root: Path) -> list[str]:
    """`path: module` for every import of fedcli.cli (lazy ones too) outside fedcli/cli/ and fedcli/__main__.py,
    in the package's folders under `root` (fedcli/, algorithms/, datasets/, tracking/)."""
    found = []
    for folder in ("fedcli", "algorithms", "datasets", "tracking"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("fedcli", "cli") or rel == Path("fedcli/__main__.py"):
                continue
            found += [
                f"{rel}: {name}"
                for name in imports(path)
                if name == "fedcli.cli" or name.startswith("fedcli.cli.")
            ]
    return found


@pytest.mark.slow
def test_only_the_cli_imports_the_cli() -> None:
    """The Python API, the run layer (fedcli/runs/), the sweep, the engine and the lower layers never import
    fedcli.cli: what both front ends need lives in fedcli/runs/ (docs/architecture.md §1)."""
    assert (ROOT / "fedcli" / "api.py").exists() and (ROOT / "fedcli" / "runs" / "stores.py").exists()
    assert cli_importers(ROOT) == []


def test_the_cli_rule_finds_a_lazy_import(tmp_path: Path) -> None:
    """The rule can fail: a lazy `from fedcli.cli.common import ...` in the API is found; the CLI's own
    modules and fedcli/__main__.py are not counted."""
    for folder in ("fedcli/cli", "algorithms", "datasets", "tracking"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "fedcli" / "api.py").write_text("def f():\n    from fedcli.cli.common import open_store\n")
    (tmp_path / "fedcli" / "__main__.py").write_text("from fedcli.cli.main import main\n")
    (tmp_path / "fedcli" / "cli" / "train.py").write_text("from fedcli.cli.common import Panel\n")
    (tmp_path / "tracking" / "x.py").write_text("import fedcli.clients\n")
    assert cli_importers(tmp_path) == ["fedcli/api.py: fedcli.cli.common"]


# ----------------------------------------------------------------------------- datasets/ inside

# datasets/ subpackage -> the other subpackages it may import (each may import the core modules
# of datasets/: tasks, registry's records, federated, sources, models, metrics, ...)
DATASETS_SUBPACKAGES = {"bundled": {"formats"}, "formats": set(), "partition": set(), "yours": set()}


# the old path of yours/trust.py, kept for MLflow models logged before the move (datasets/code_trust.py)
LEGACY_DATASETS_ALIAS = "fedcli.datasets.code_trust"


def datasets_rule_breaks(folder: Path) -> list[str]:
    """`module -> module` for each import inside datasets/ (`folder`) that goes up or sideways: a core
    module other than registry importing a subpackage, or a subpackage one not in DATASETS_SUBPACKAGES."""
    graph = module_graph({"fedcli.datasets": folder})

    def subpackage(module: str) -> str | None:  # fedcli.datasets.<sub>.<module> -> <sub>; core modules: None
        parts = module.split(".")
        return parts[2] if len(parts) > 3 else None

    breaks = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            here, there = subpackage(module), subpackage(dep)
            if there is None or there == here:
                continue
            if (
                (module not in ("fedcli.datasets.registry", LEGACY_DATASETS_ALIAS))
                if here is None
                else (there not in DATASETS_SUBPACKAGES[here])
            ):
                breaks.append(f"{module} -> {dep}")
    return breaks


def test_datasets_subpackages_import_down_only() -> None:
    """Inside datasets/ (docs/architecture.md §1): the core modules import no subpackage but registry
    (it gathers bundled/ and yours/ tasks); bundled/ reads formats/; formats/, partition/ and yours/
    import only the core. The rules above (no upper layers, no global RNG) read the subpackages too."""
    assert {p.parent.name for p in (ROOT / "datasets").rglob("*.py")} >= {*DATASETS_SUBPACKAGES, "datasets"}
    assert datasets_rule_breaks(ROOT / "datasets") == []


def test_the_datasets_rule_finds_a_sideways_import(tmp_path: Path) -> None:
    """The rule can fail: formats/ importing bundled/ lazily, and a core module importing yours/, are found."""
    for sub in ("formats", "bundled", "yours"):
        (tmp_path / "datasets" / sub).mkdir(parents=True)
        (tmp_path / "datasets" / sub / "__init__.py").write_text("")
    (tmp_path / "datasets" / "bundled" / "femnist.py").write_text(
        "from fedcli.datasets.formats import leaf\n"
    )
    (tmp_path / "datasets" / "formats" / "leaf.py").write_text(
        "def f():\n    from fedcli.datasets.bundled import femnist\n"
    )
    (tmp_path / "datasets" / "yours" / "model.py").write_text("")
    (tmp_path / "datasets" / "tasks.py").write_text("from fedcli.datasets.yours.model import x\n")
    (tmp_path / "datasets" / "registry.py").write_text("from fedcli.datasets.yours.model import x\n")
    assert datasets_rule_breaks(tmp_path / "datasets") == [
        "fedcli.datasets.formats.leaf -> fedcli.datasets.bundled.femnist",
        "fedcli.datasets.tasks -> fedcli.datasets.yours.model",
    ]


# ----------------------------------------------------------------------------- the engine and its store

ENGINE_STORE_BANNED = (
    "fedcli.tracking.store.sql_store",
    "fedcli.tracking.store.session",
    "fedcli.tracking.store.writes",
    "fedcli.tracking.store.queries",
    "sqlalchemy",
)  # prefixes


def test_the_engine_reaches_the_store_through_its_protocol() -> None:
    """fedcli/engine/ imports neither the SQL store (`fedcli.tracking.store.sql_store`) nor SQLAlchemy: it
    writes a run through `RunStore` (tracking/store/protocol.py), what a run's process needs of the store."""
    assert (ROOT / "tracking" / "store" / "protocol.py").exists()
    assert banned_imports(ROOT / "fedcli" / "engine", ENGINE_STORE_BANNED) == []


def test_the_engine_store_rule_finds_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """The rule can fail: a lazy SqlStore import, `from fedcli.tracking.store import sql_store` and a
    SQLAlchemy import under TYPE_CHECKING are found; the protocol and the store's other modules are not."""
    (tmp_path / "engine" / "backends").mkdir(parents=True)
    (tmp_path / "engine" / "train.py").write_text(
        "from fedcli.tracking.store.protocol import RunStore\n"
        "from fedcli.tracking.store.common import RunTakenOver\n"
        "def f():\n    from fedcli.tracking.store.sql_store import SqlStore\n"
    )
    (tmp_path / "engine" / "backends" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sqlalchemy.orm import Session\n"
    )
    (tmp_path / "engine" / "y.py").write_text("from fedcli.tracking.store import sql_store\n")
    assert banned_imports(tmp_path / "engine", ENGINE_STORE_BANNED) == [
        "engine/backends/x.py: sqlalchemy.orm",
        "engine/train.py: fedcli.tracking.store.sql_store",
        "engine/y.py: fedcli.tracking.store.sql_store",
    ]


def protocol_mismatches(protocol: type, implementation: type) -> list[str]:
    """Each member of `protocol` that `implementation` lacks or defines with another signature (names,
    kinds, defaults and annotations of the parameters, the return annotation), and each annotated
    attribute of `protocol` that `implementation` does not declare with the same annotation."""
    import inspect

    found = []
    for name, member in vars(protocol).items():
        if name.startswith("_") or not callable(member):
            continue
        theirs = getattr(implementation, name, None)
        if theirs is None:
            found.append(f"{name}: missing")
        elif inspect.signature(member) != inspect.signature(theirs):  # follows functools.wraps
            found.append(f"{name}: {inspect.signature(theirs)} is not {inspect.signature(member)}")
    declared: dict[str, object] = {}
    for cls in reversed(implementation.__mro__):
        declared.update(getattr(cls, "__annotations__", {}))
    for name, annotation in getattr(protocol, "__annotations__", {}).items():
        if declared.get(name) != annotation:
            found.append(f"{name}: declared {declared.get(name)!r}, not {annotation!r}")
    return found


def test_the_sql_store_is_a_run_store_with_the_same_signatures() -> None:
    """RunStore's methods are copies of SqlStore's (and its mixins'), so the engine's calls mean the same
    thing whatever the annotation says; mypy checks the rest (`SqlStore` passed where a `RunStore` is
    expected, tracking/store/protocol.py)."""
    from fedcli.tracking.store.protocol import RunStore
    from fedcli.tracking.store.sql_store import SqlStore

    assert {"start_run", "log_round", "end_run", "heartbeat", "checkpoints"} <= set(vars(RunStore))
    assert protocol_mismatches(RunStore, SqlStore) == []


def runner_mismatches(protocol: type, implementation: type) -> list[str]:
    """`protocol_mismatches`, plus each read-only property of `protocol` (an attribute the sweep's driver
    reads) that `implementation` does not declare at class level (its MRO's annotations)."""
    declared: set[str] = set()
    for cls in implementation.__mro__:
        declared |= set(getattr(cls, "__annotations__", {}))
    return protocol_mismatches(protocol, implementation) + [
        f"{name}: not declared"
        for name, member in vars(protocol).items()
        if isinstance(member, property) and name not in declared
    ]


def test_both_trial_runners_have_the_protocols_signatures() -> None:
    """`fedcli sweep`'s driver (fedcli/cli/sweep_run.py, annotated `TrialRunner`) gets the same calls from the
    local worker scheduler and the Ray one: the methods it calls with the same signatures, the attributes
    it reads declared; mypy checks their types."""
    from fedcli.sweep.ray_runner import RayScheduler
    from fedcli.sweep.scheduler import TrialRunner
    from fedcli.sweep.worker_pool import WorkerScheduler

    assert {"run", "cleanup", "plans", "processes", "signum"} <= set(vars(TrialRunner))
    assert runner_mismatches(TrialRunner, WorkerScheduler) == []
    assert runner_mismatches(TrialRunner, RayScheduler) == []


def test_the_trial_runner_check_finds_another_signature_and_an_undeclared_attribute() -> None:
    """The check above can fail: a runner whose `run` takes another default, one without `cleanup`, one
    that does not declare `signum`."""
    from collections.abc import Callable

    from fedcli.sweep.scheduler import TrialRunner

    class Slow:
        plans: list[object]
        processes: list[object]

        def run(self, tick: Callable[..., None], tick_s: float = 5.0) -> int | None:
            return None

    assert runner_mismatches(TrialRunner, Slow) == [
        "run: (self, tick: 'Callable[..., None]', tick_s: 'float' = 5.0) -> 'int | None' is not "
        "(self, tick: 'Callable[[list[TrialProcess]], None]', tick_s: 'float' = 1.0) -> 'int | None'",
        "cleanup: missing",
        "signum: not declared",
    ]


def test_the_signature_check_finds_a_changed_default_and_a_missing_method() -> None:
    """The check can fail: another default, a renamed parameter, a missing method or attribute."""
    from typing import Protocol

    class Wanted(Protocol):
        retry_s: float

        def a(self, run_id: str, n: int = 1) -> None: ...
        def b(self, ref: str) -> str: ...
        def c(self) -> None: ...

    class Given:
        def a(self, run_id: str, n: int = 2) -> None: ...
        def b(self, name: str) -> str: ...

    assert protocol_mismatches(Wanted, Given) == [
        "a: (self, run_id: 'str', n: 'int' = 2) -> 'None' is not (self, run_id: 'str', n: 'int' = 1) -> 'None'",
        "b: (self, name: 'str') -> 'str' is not (self, ref: 'str') -> 'str'",
        "c: missing",
        "retry_s: declared None, not 'float'",
    ]
