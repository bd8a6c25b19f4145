"""No module-level mutable state but what ALLOWED lists (docs/style.md rule 9), checked by parsing the source.

Every module under fedcli/, algorithms/, datasets/ and tracking/ is parsed with `ast`; a module-level
name is *state* when

- it is bound to a mutable container (a dict/list/set literal or comprehension, or a call of dict,
  list, set, defaultdict, OrderedDict, Counter, deque, WeakKeyDictionary, WeakValueDictionary,
  WeakSet, ChainMap or bytearray) and is not an ALL_CAPS constant, or is an ALL_CAPS one that is
  mutated (`.append/.add/.update/.pop/.clear/.setdefault/...`, `NAME[...] = `, `del NAME[...]`,
  `NAME += ...`) anywhere: in its module or in a module that imports it (`from m import NAME`,
  `m.NAME.add(...)`);
- or, whatever its value, it is rebound after import: `global NAME` in a function of its module,
  or `m.NAME = ...` in another module.

`__all__` is not state; functools caches (`@functools.cache`) are not module-level names and are
allowed. ALLOWED holds the ones that stay, each with why; a new one fails the test.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "fedcli": ROOT / "fedcli",
    "fedcli.algorithms": ROOT / "algorithms",
    "fedcli.datasets": ROOT / "datasets",
    "fedcli.tracking": ROOT / "tracking",
}  # as installed (pyproject)

MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "bytearray",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "ChainMap",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
MUTATORS = {
    "append",
    "extend",
    "insert",
    "update",
    "pop",
    "popitem",
    "clear",
    "setdefault",
    "add",
    "discard",
    "remove",
    "appendleft",
    "extendleft",
    "sort",
    "reverse",
    "move_to_end",
    "__setitem__",
    "__delitem__",
}

# module -> {name: why it stays}. Keep each reason honest: what the state is, and why no caller-owned
# object or argument replaces it (or what would).
ALLOWED: dict[str, dict[str, str]] = {
    "fedcli.datasets.yours.data": {
        "_REGISTRY": "objects registered with `fedcli.register_data` for `--data-object` (being split by "
        "another change: datasets/yours/ is not edited here)",
        "_LOADED": "the objects loaded from --data files this process (datasets/yours/, as above)",
    },
    "fedcli.datasets.yours.model": {
        "_VMAP_OBSTACLES": "a weak per-module memo of why a user model cannot run under vmap; weak keys: "
        "it never keeps a model alive (datasets/yours/, as above)",
    },
    "fedcli.datasets.yours.user_code": {
        "IMPORTED": "module -> sha256 of the user code this process imported, filled by yours/model.py: "
        "Python's module cache cannot import a changed file twice (datasets/yours/, as above)",
        "IMPORTED_CODE": "the (reference, sha256) of every user code file this process imported: a fact "
        "about the process (Python's own import cache), read by yours/trust.py (datasets/yours/, as above)",
    },
    "fedcli.datasets.yours.plugins": {
        "_PLUGINS": "the installed model plugins' entry points, read once per process (a read-only "
        "mapping once set; datasets/yours/, as above)",
    },
    "fedcli.children": {
        "_EARLY": "kind -> the child a command spawns first thing, before it parsed its input, so that its "
        "imports overlap the command's: the sweep's first worker (fedcli/sweep/process.py, adopted by the "
        "WorkerScheduler) and the run's MLflow mirror (tracking/mlflow/handle.py, adopted by "
        "MirrorHandle.spawn or ended by discard_early/atexit). One process per kind handed off, emptied on "
        "adoption; an argument would go through the CLI, the run layer and open_tracker",
    },
}


@dataclass(frozen=True)
class Binding:
    line: int
    mutable: bool  # bound to a mutable container


def is_caps(name: str) -> bool:
    return name.strip("_").replace("_", "").isupper()


def module_names(packages: dict[str, Path]) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The module's statements, those inside top-level if/try/with blocks included (not defs, classes)."""
    found: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.If, ast.With)):
            found += _top_level(stmt.body) + _top_level(getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            found += _top_level(stmt.body) + _top_level(stmt.orelse) + _top_level(stmt.finalbody)
            for handler in stmt.handlers:
                found += _top_level(handler.body)
        else:
            found.append(stmt)
    return found


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in MUTABLE_CALLS
    return False


def import_time(tree: ast.Module) -> set[int]:
    """ids of the nodes that run when the module is imported (not inside a def or lambda)."""
    seen: set[int] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        seen.add(id(node))
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += ast.iter_child_nodes(node)
    return seen


def bindings(tree: ast.Module) -> dict[str, Binding]:
    """Module-level names bound by assignment -> where, and whether to a mutable container."""
    found: dict[str, Binding] = {}
    for stmt in _top_level(tree.body):
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [stmt.target], stmt.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id not in found:
                found[target.id] = Binding(stmt.lineno, _is_mutable(value))
    return found


def _aliases(module: str, path: Path, tree: ast.Module, modules: dict[str, Path]) -> dict[str, str]:
    """Local name -> the dotted name it stands for (a module, or `module.NAME`), from every import."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`a.b.c` with its first name resolved through the module's imports (or as a local name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _owner(dotted: str, modules: dict[str, Path]) -> tuple[str, str] | None:
    """`pkg.mod.NAME[.more]` -> (pkg.mod, NAME) when pkg.mod is a module here."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:cut]) in modules:
            return ".".join(parts[:cut]), parts[cut]
    return None


def changes(
    module: str, path: Path, tree: ast.Module, bound: dict[str, dict[str, Binding]], modules: dict[str, Path]
) -> list[tuple[str, str, str]]:
    """(owner module, name, how) for each change `module` makes, after it is imported, to a module-level
    name (its own or another module's): a mutation, an item or attribute set, a `global` rebinding."""
    aliases = _aliases(module, path, tree, modules)
    building = import_time(tree)
    found: list[tuple[str, str, str]] = []

    def target(node: ast.expr) -> tuple[str, str] | None:
        while isinstance(node, ast.Subscript):  # TABLE[k].append(...) changes TABLE
            node = node.value
        if isinstance(node, ast.Name) and node.id in bound[module] and node.id not in aliases:
            return module, node.id
        dotted = _dotted(node, aliases)
        return _owner(dotted, modules) if dotted and "." in dotted else None

    def note(owner: tuple[str, str] | None, how: str, node: ast.AST) -> None:
        if owner is None or (owner[0] == module and id(node) in building):
            return  # the module builds its own table as it is imported: construction, not state
        if owner[1] in bound.get(owner[0], {}) or how.startswith(("rebound", "set from")):
            found.append((*owner, how))

    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                note((module, name), "rebound (global)", node)
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
        ):
            note(target(node.func.value), f"mutated (.{node.func.attr}) in {module}", node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            note(target(node.value), f"item set in {module}", node)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            note(target(node.target), f"augmented in {module}", node)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for each in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(each, ast.Attribute) and (dotted := _dotted(each, aliases)):
                    owner = _owner(dotted, modules)
                    if owner is not None and owner[0] != module and dotted == ".".join(owner):
                        note(owner, f"set from {module}", node)
                    else:
                        note(target(each.value), f"attribute set in {module}", node)
    return found


def module_state(packages: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module -> {name: what makes it state} for every module-level mutable state under `packages`."""
    modules = module_names(packages)
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    bound = {name: bindings(tree) for name, tree in trees.items()}
    mutated: dict[tuple[str, str], str] = {}  # (module, name) -> how, the first seen
    for module, tree in trees.items():
        for owner, name, how in changes(module, modules[module], tree, bound, modules):
            mutated.setdefault((owner, name), how)

    found: dict[str, dict[str, str]] = {}
    for module, names in bound.items():
        for name, binding in names.items():
            how = mutated.get((module, name))
            if name == "__all__" or (how is None and not (binding.mutable and not is_caps(name))):
                continue
            found.setdefault(module, {})[name] = how or "a mutable container"
    for (module, name), how in mutated.items():
        if how.startswith(("rebound", "set from")) and name not in found.get(module, {}):
            found.setdefault(module, {})[name] = how
    return found


def test_module_level_mutable_state_is_on_the_allow_list() -> None:
    """Every module-level mutable container or rebound name is one ALLOWED lists (with why), and every
    entry of ALLOWED still exists: remove it from the list when its state goes."""
    found = module_state(PACKAGES)
    new = {m: sorted(set(names) - set(ALLOWED.get(m, {}))) for m, names in found.items()}
    new = {m: names for m, names in new.items() if names}
    assert new == {}, (
        "module-level mutable state not on ALLOWED (pass an argument or an object the caller owns): "
        + "; ".join(f"{m}.{n} ({found[m][n]})" for m, names in sorted(new.items()) for n in names)
    )
    gone = sorted(f"{m}.{n}" for m, names in ALLOWED.items() for n in names if n not in found.get(m, {}))
    assert gone == [], f"ALLOWED lists state that no longer exists: {gone}"


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    return {"pkg": tmp_path / "pkg"}


def test_the_check_finds_registries_rebinding_and_outside_mutation(tmp_path: Path) -> None:
    """The check can fail: a lower-case registry, a constant mutated from a function or from another
    module, a name rebound with `global` or set from another module are found; constants never
    mutated, tuples, frozensets, `__all__` and functools caches are not."""
    packages = _package(
        tmp_path,
        {
            "a.py": (
                "import functools\nfrom collections import defaultdict\n"
                "__all__ = ['f']\nTABLE = {'x': 1}\nNAMES = ('a', 'b')\nFROZEN = frozenset({1})\n"
                "_registry = {}\nGROUPS = defaultdict(list)\nSEEN = set()\n_CURRENT = None\n"
                "CACHE = None\nEXTERNAL = []\nclass State:\n    run = None\n_state = State()\n"
                "@functools.cache\ndef f():\n    return 1\n"
                "def g(x):\n    GROUPS[x].append(1)\n    global _CURRENT\n    _CURRENT = x\n    _state.run = x\n"
            ),
            "b.py": (
                "from pkg.a import SEEN\nfrom pkg import a as alias\nimport pkg.a\n"
                "def h():\n    SEEN.add(1)\n    alias.CACHE = {}\n    pkg.a.EXTERNAL.append(2)\n"
            ),
        },
    )
    assert module_state(packages) == {
        "pkg.a": {
            "_registry": "a mutable container",
            "GROUPS": "mutated (.append) in pkg.a",
            "SEEN": "mutated (.add) in pkg.b",
            "_CURRENT": "rebound (global)",
            "_state": "attribute set in pkg.a",
            "CACHE": "set from pkg.b",
            "EXTERNAL": "mutated (.append) in pkg.b",
        }
    }


def test_the_check_finds_state_nested_in_top_level_blocks(tmp_path: Path) -> None:
    """A registry bound under a top-level `try`/`if` is module-level too; a table the module fills as it
    is imported (a top-level loop or item assignment) is a constant until a function changes it; a local
    in a function is not state."""
    packages = _package(
        tmp_path,
        {
            "c.py": (
                "try:\n    _hooks = []\nexcept ImportError:\n    _hooks = None\n"
                "if True:\n    LIMITS = {}\n    LIMITS['x'] = 1\n"
                "TABLE = [0] * 4\nfor i in range(4):\n    TABLE[i] = i\n"
                "ORDER = []\n"
                "def k():\n    local = {}\n    local['y'] = 2\n    ORDER[:] = [2]\n"
            )
        },
    )
    assert module_state(packages) == {
        "pkg.c": {"_hooks": "a mutable container", "ORDER": "item set in pkg.c"}
    }
