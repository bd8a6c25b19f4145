"""Hyperparameter descriptions read from the comments of an algorithm's config dataclass.

docs/style.md rule 5 has every hyperparameter field commented in its source (symbol, meaning,
source of the default), and the algorithm modules may import only torch and a few stdlib
modules (tests/test_layering.py), so the text is read here, from the source, not declared
there a second time:

    rho: float = 0.1  # shrinkage rho >= 0; Table 6, EMNIST-62      -> "shrinkage rho >= 0; Table 6, EMNIST-62"
    burn_in_epochs: int = 1  # epochs ...; TFF code
    #                          (client_mixin_epochs_per_round = 1 ...)   continues the field above it
    # mu >= 0, the proximal weight (Eq. 2) ...                          a comment block above a field
    mu: float                                                           with no comment of its own

Fields inherited from a base config class take the base class's comments. A class whose
source cannot be read (a plugin shipped without sources) gets no descriptions, not an error.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from collections import ChainMap
from dataclasses import MISSING, fields
from typing import Any


def field_descriptions(config_cls: type) -> dict[str, str]:
    """{field name: its description} of a config dataclass and its bases ("" where none): the field's
    metadata `description` where it declares one (the run config's sections, fedcli/config/sections.py
    `opt`), else its comment."""
    # the class's own comments first, then its bases' (method resolution order)
    comments = ChainMap(*(_class_comments(cls) for cls in config_cls.__mro__ if cls is not object))
    return {f.name: f.metadata.get("description") or comments.get(f.name, "") for f in fields(config_cls)}


def hyperparameter_rows(config_cls: type) -> list[dict[str, Any]]:
    """One row per hyperparameter: name, type (as written), default ('required' if none), description."""
    described = field_descriptions(config_cls)
    rows = []
    for f in fields(config_cls):
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = "required"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append({"name": f.name, "type": kind, "default": default, "description": described[f.name]})
    return rows


def _class_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source file (built dynamically, or shipped as bytecode)
        return {}
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    comments = _comments_by_line(source)
    whole = {n: text for n, (alone, text) in comments.items() if alone}
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        end = stmt.end_lineno or stmt.lineno
        own = [
            comments[n][1].strip()
            for n in range(stmt.lineno, end + 1)
            if n in comments and not comments[n][0]
        ]
        if own:  # its trailing comment, and the indented comment-only lines right under it
            text = own + [whole[n].strip() for n in _run(whole, end + 1, 1, indented=True)]
        else:  # the block of comment-only lines right above it
            text = [whole[n].strip() for n in reversed(_run(whole, stmt.lineno - 1, -1, indented=False))]
        out[stmt.target.id] = " ".join(t for t in text if t)
    return out


def _run(whole: dict[int, str], start: int, step: int, indented: bool) -> list[int]:
    """Line numbers of the unbroken run of comment-only lines from `start` on, going by `step`,
    whose text is (or is not) indented under the comment above (`#     more text`)."""
    lines = []
    while start in whole and whole[start].startswith(" ") == indented:
        lines.append(start)
        start += step
    return lines


def _comments_by_line(source: str) -> dict[int, tuple[bool, str]]:
    """Line number -> (whether the comment is the whole line, its text after '# ', indentation kept)."""
    out: dict[int, tuple[bool, str]] = {}
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            text = token.string[1:]
            out[row] = (not lines[row - 1][:col].strip(), text[1:] if text.startswith(" ") else text)
    return out


def algo_rows(**_: Any) -> list[dict[str, Any]]:
    """Registered algorithms with their paper and hyperparameter defaults."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.algorithms.base import hyperparameter_defaults

    def executors(a: Any) -> str:  # process runs whichever of these fits, in each worker
        names = ["loop", "vmap", "process"] if a.supports_vmap else ["loop", "process"]
        if a.supports_vmap and a.local is not None:  # Algorithm.local: the declared local SGD
            names.insert(2, "fused (dense classifiers)")
        return ", ".join(names)

    return [
        {
            "id": a.name,
            "name": a.name,
            "paper": a.paper,
            "hyperparameters": hyperparameter_defaults(a.config_cls),
            "executors": executors(a),
            "description": a.description,
        }
        for a in ALGORITHMS.values()
    ]


def algo_detail_rows(name: str) -> list[dict[str, Any]]:
    """`fedcli list algos NAME`: the algorithm's row of `fedcli list algos --json`, with
    `hyperparameter_details` (name, type, default, description per field) added.

    Raises:
        ConfigError: `name` is not a registered algorithm.
    """
    from fedcli.algorithms import ALGORITHMS
    from fedcli.config.checks import suggest
    from fedcli.errors import ConfigError

    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm must be one of `fedcli list algos`; got {name!r}{suggest(name, list(ALGORITHMS))}."
        )
    row = next(r for r in algo_rows() if r["name"] == name)
    record = ALGORITHMS[name]
    return [
        {
            **row,
            "hyperparameter_details": hyperparameter_rows(record.config_cls),
            "recommended": recommended_rows(record),
            "caveats": record.caveats,
        }
    ]


EXAMPLE_RUN: dict[str, Any] = {  # RunFacts' fields (fedcli/algorithms/base.py), passed as keywords
    "task": "femnist",
    "kind": "classification",
    "model": "mlp",
    "rounds": 50,
    "clients_per_round": 10,
}


def recommended_rows(record: Any) -> list[dict[str, Any]]:
    """The settings the algorithm recommends (Algorithm.recommend), each with its rule and the value it
    takes on the default run (femnist, 50 rounds, 10 clients per round); [] when it recommends none."""
    from fedcli.algorithms.base import RunFacts

    if record.recommend is None:
        return []
    return [
        {"key": key, "default_run": a.value, "why": a.why}
        for key, a in sorted(record.recommend(RunFacts(**EXAMPLE_RUN)).items())
    ]


def algo_detail(row: dict[str, Any]) -> Any:
    """A rich renderable of one algorithm: paper, description, executors, its hyperparameters table."""
    from rich.console import Group
    from rich.table import Column, Table
    from rich.text import Text

    head = Text.assemble(
        (row["name"], "bold"),
        f"  {row['paper']}\n",
        row["description"] or "",
        f"\nexecutors: {row['executors']}",
    )
    details = row["hyperparameter_details"]
    if not details:
        return Group(head, Text("\nno hyperparameters of its own (the shared train.* options apply)"))
    table = Table(
        Column("name", no_wrap=True),
        Column("default", no_wrap=True),
        Column("type", no_wrap=True),
        Column("meaning; source of the default", overflow="fold"),
        title=f"{row['name']} hyperparameters (--hp KEY=VALUE)",
        title_justify="left",
    )
    for hp in details:
        table.add_row(hp["name"], str(hp["default"]), hp["type"], hp["description"] or "—")
    parts: list[Any] = [head, Text(""), table]
    if row.get("recommended"):
        advice = Table(
            Column("key", no_wrap=True),
            Column("default run", no_wrap=True),
            Column("rule; source", overflow="fold"),
            title="recommended for a run that does not set them (applied, recorded as fedcli.recommended)",
            title_justify="left",
        )
        for item in row["recommended"]:
            advice.add_row(item["key"], str(item["default_run"]), item["why"])
        parts += [Text(""), advice, Text("default run: femnist, 50 rounds, 10 clients per round")]
    if row.get("caveats"):
        parts += [Text(""), Text.assemble(("out of the box: ", "bold"), row["caveats"])]
    return Group(*parts)
