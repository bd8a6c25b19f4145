"""Issue 33, item 4: the JSON Schemas of a run config and a sweep spec (docs/schema/, docs/guide.md).

They are generated from the declarations fedcli validates with (fedcli/config/sections.py,
fedcli/config/schema.py): the committed files must be what `python -m fedcli.config.schema` writes
now, the packaged configs and recipes must satisfy them, and what they refuse fedcli refuses too.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from fedcli.cli.hpdoc import field_descriptions
from fedcli.config.build import build_config
from fedcli.config.schema import RUN_CONFIG, SWEEP_SPEC, run_config_schema, sweep_spec_schema
from fedcli.config.sections import SECTIONS, RunConfig, TrainConfig
from fedcli.errors import ConfigError
from fedcli.sweep.spec_keys import (
    PRUNERS,
    REPORT_KEYS,
    SEARCH_KEYS,
    SPEC_KEYS,
    PrunerBlock,
    ReportBlock,
    SearchBlock,
    SweepSpec,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "docs" / "schema"
CONFIGS = sorted((REPO / "fedcli" / "configs").glob("*.yaml")) + [
    REPO / "examples" / "fedpa-femnist-demo.yaml"
]
SPECS = sorted((REPO / "fedcli" / "recipes").glob("*.yaml")) + [REPO / "examples" / "search-pruning.yaml"]


def errors(schema_file: str, doc: Any) -> list[str]:
    """The messages of every way `doc` fails the committed schema (jsonschema where installed, else
    pydantic on the declaration the schema is generated from)."""
    try:
        import jsonschema
    except ImportError:
        cls = RunConfig if schema_file == RUN_CONFIG else SweepSpec
        try:
            pydantic.TypeAdapter(cls).validate_python(doc)
        except pydantic.ValidationError as exc:
            return [e["msg"] for e in exc.errors()]
        return []
    schema = json.loads((SCHEMAS / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def test_committed_schemas_are_what_the_module_writes_now(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedcli.config.schema", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for name in (RUN_CONFIG, SWEEP_SPEC):
        fresh, committed = (tmp_path / name).read_text(), (SCHEMAS / name).read_text()
        assert fresh == committed, f"docs/schema/{name} is stale: run python -m fedcli.config.schema"


def test_run_config_schema_carries_help_defaults_choices_and_bounds() -> None:
    schema = run_config_schema()
    train = schema["$defs"]["TrainConfig"]["properties"]
    assert train["rounds"] == {
        "default": TrainConfig.rounds,
        "description": "R; communication rounds",
        "minimum": 1,
        "title": "Rounds",
        "type": "integer",
    }
    assert train["executor"]["enum"] == ["auto", "loop", "vmap", "fused", "process", "distributed"]
    assert train["workers"]["anyOf"][0]["maximum"] == 1024
    assert schema["$defs"]["TrainConfig"]["additionalProperties"] is False
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(RunConfig)}
    for name, cls in SECTIONS.items():  # every option has its help text, also in hpdoc's reading
        props = schema["$defs"][cls.__name__]["properties"]
        described = field_descriptions(cls)
        for item in dataclasses.fields(cls):
            assert props[item.name]["description"] == described[item.name] != "", f"{name}.{item.name}"


def test_sweep_schema_declares_exactly_the_keys_a_spec_may_hold() -> None:
    assert [f.name for f in dataclasses.fields(SweepSpec)] == list(SPEC_KEYS)
    assert [f.name for f in dataclasses.fields(ReportBlock)] == list(REPORT_KEYS)
    assert [f.name for f in dataclasses.fields(SearchBlock)] == list(SEARCH_KEYS)
    options = {k for keys in PRUNERS.values() for k in keys}
    assert {f.name for f in dataclasses.fields(PrunerBlock)} == {"type", *options}
    schema = sweep_spec_schema()
    assert schema["required"] == ["experiment"]
    assert schema["$defs"]["PrunerBlock"]["properties"]["type"]["enum"] == list(PRUNERS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_packaged_configs_satisfy_the_run_config_schema(path: Path) -> None:
    assert errors(RUN_CONFIG, yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_recipes_satisfy_the_sweep_spec_schema(path: Path) -> None:
    assert errors(SWEEP_SPEC, yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize(
    ("doc", "schema_says", "fedcli_says"),
    [
        ({"train": {"rundos": 3}}, "'rundos' was unexpected", "unknown config key 'train.rundos'"),
        ({"train": {"rounds": 0}}, "0 is less than the minimum of 1", "train.rounds must be >= 1; got 0."),
        (
            {"train": {"workers": 5000}},
            "5000 is not valid under any of the given schemas",
            "train.workers must be <= 1024",
        ),
        ({"train": {"executor": "gpu"}}, "'gpu' is not one of", "train.executor must be one of auto, loop"),
        (
            {"partition": {"scheme": "zipf"}},
            "'zipf' is not one of",
            "partition.scheme must be one of natural",
        ),
        (
            {"data": {"download": "yes"}},
            "'yes' is not of type 'boolean'",
            "data.download must be bool; got 'yes'.",
        ),
        (
            {"train": {"batch_size": 2.5}},
            "2.5 is not of type 'integer'",
            "train.batch_size must be int; got 2.5.",
        ),
    ],
)
def test_the_schema_refuses_what_fedcli_refuses(
    doc: dict[str, Any], schema_says: str, fedcli_says: str, tmp_path: Path
) -> None:
    pytest.importorskip("jsonschema")  # the messages below are jsonschema's
    found = errors(RUN_CONFIG, doc)
    assert any(schema_says in m for m in found), found
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"data": {"task": "lsq"}, **doc} if "data" not in doc else doc))
    with pytest.raises(ConfigError) as caught:
        build_config(file=path)
    assert fedcli_says in str(caught.value)


def test_a_bad_spec_fails_the_sweep_schema() -> None:
    pytest.importorskip("jsonschema")  # uniqueItems and enums are checked by a JSON Schema validator
    found = errors(
        SWEEP_SPEC,
        {"experiment": "x", "seeds": [0, 0], "search": {"sampler": "cmaes", "space": {}}, "grdi": {}},
    )
    assert len(found) == 3, found  # the unknown key, the repeated seed, the sampler
    assert errors(SWEEP_SPEC, {"grid": {"algo": ["fedavg"]}}) != []  # experiment is required
