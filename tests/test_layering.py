"""Import rules of docs/style.md rules 1, 8 and 10, checked by parsing the source.

- algorithms/ imports only torch, the stdlib modules dataclasses/math/types/typing/
  collections.abc/__future__ and fedcli.algorithms (never tracking, the CLI, I/O, logging, time);
- algorithms/ and datasets/ never call the global RNGs (torch.rand*, np.random.<draw>, random.*);
- datasets/ never imports fedcli.algorithms, fedcli.engine or the CLI; tracking/ never imports the engine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_IN_ALGORITHMS = {"torch", "dataclasses", "math", "types", "typing", "collections", "__future__", "fedcli"}
FORBIDDEN_IN_ALGORITHMS = {"mlflow", "sqlalchemy", "typer", "click", "logging", "os", "pathlib", "random", "time",
                           "numpy", "pandas"}


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


GLOBAL_RNG = re.compile(r"\btorch\.(rand|randn|randint|randperm|normal|bernoulli|multinomial)\(|"
                        r"\bnp\.random\.(rand|randn|randint|choice|permutation|shuffle|normal|uniform|seed)\(|"
                        r"^\s*import random\b|\brandom\.(random|randint|choice|shuffle)\(", re.M)


@pytest.mark.parametrize("path", sorted([*(ROOT / "algorithms").glob("*.py"), *(ROOT / "datasets").glob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_global_rng_in_algorithms_or_datasets(path: Path) -> None:
    text = path.read_text()
    for match in GLOBAL_RNG.finditer(text):
        line = text[: match.start()].count("\n") + 1
        context = text.splitlines()[line - 1]
        assert "generator=" in context, f"{path.name}:{line} draws from a global RNG: {context.strip()}"


@pytest.mark.parametrize(("folder", "banned"), [("datasets", ("fedcli.algorithms", "fedcli.engine", "fedcli.cli")),
                                                ("tracking", ("fedcli.engine", "fedcli.cli", "fedcli.algorithms"))])
def test_lower_layers_do_not_import_upper_layers(folder: str, banned: tuple[str, ...]) -> None:
    for path in sorted((ROOT / folder).glob("*.py")):
        for name in imports(path):
            assert not name.startswith(banned), f"{folder}/{path.name} imports {name}"
