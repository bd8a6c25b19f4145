"""State pytrees as plain containers, and back: how checkpoints and `model.pt` hold an algorithm's states.

Files never run code (docs/operations.md, "Security"): an algorithm's NamedTuple (or dataclass)
states are written as `{TYPE_KEY: "module.QualName", "fields": {...}}` (`to_plain`) and rebuilt on
load from the types of the run's own freshly built state (`from_plain`), never from a name in the
file; `check_like` refuses a loaded tree whose structure or shapes differ from the run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fedcli.errors import CheckpointError

TYPE_KEY = "__fedcli_type__"  # to_plain's marker of a NamedTuple or dataclass node


def to_plain(tree: Any) -> Any:
    """A state pytree as tensors in dicts, lists and tuples: what `torch.load(weights_only=True)` reads.

    A NamedTuple or dataclass node becomes `{TYPE_KEY: "module.QualName", "fields": {name: value}}`.

    Raises:
        TypeError: the state holds another kind of object (docs/style.md rule 6: states are
            NamedTuples of tensors and Params).
    """
    if tree is None or isinstance(tree, (torch.Tensor, bool, int, float, str)):
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        fields = zip(tree._fields, tree, strict=True)  # type: ignore[attr-defined]  # a NamedTuple
        return {TYPE_KEY: _type_name(type(tree)), "fields": {k: to_plain(v) for k, v in fields}}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return {
            TYPE_KEY: _type_name(type(tree)),
            "fields": {f.name: to_plain(getattr(tree, f.name)) for f in dataclasses.fields(tree) if f.init},
        }
    if isinstance(tree, dict):
        return {k: to_plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_plain(v) for v in tree)
    raise TypeError(
        f"a checkpointed state holds a {type(tree).__name__}; states must be tensors in NamedTuples, "
        "dataclasses, dicts, lists and tuples (docs/style.md rule 6)"
    )


def from_plain(plain: Any, template: Any, what: str) -> Any:
    """Rebuild a state `to_plain` wrote, with the node types of `template` (the run's own fresh state).

    The result must have the template's structure and its tensors the template's shapes and
    dtypes: a file of another algorithm, model or data set is refused, not half-used.

    Raises:
        CheckpointError: a type the template does not have, or another structure or shape.
    """
    types = _node_types(template)

    def build(node: Any) -> Any:
        if isinstance(node, dict) and TYPE_KEY in node:
            cls = types.get(str(node[TYPE_KEY]))
            if cls is None or not isinstance(node.get("fields"), dict):
                raise CheckpointError(
                    f"{what} holds a state of type {node[TYPE_KEY]!r}, which this run's algorithm "
                    "does not have; it is another algorithm's file"
                )
            try:
                return cls(**{k: build(v) for k, v in node["fields"].items()})
            except TypeError as err:
                raise CheckpointError(f"{what} does not fit this run's state ({err})") from None
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(build(v) for v in node)
        return node

    tree = build(plain)
    check_like(tree, template, what)
    return tree


def check_like(tree: Any, template: Any, what: str) -> None:
    """Raise CheckpointError unless `tree` has the structure of `template` and tensors of its shapes and dtypes."""
    leaves, spec = pytree.tree_flatten(tree)
    expected, expected_spec = pytree.tree_flatten(template)
    if spec != expected_spec:
        raise CheckpointError(
            f"{what} does not fit this run's state (another structure: another algorithm, "
            "model or fedcli version)"
        )
    for leaf, want in zip(leaves, expected, strict=True):
        if isinstance(want, torch.Tensor) and (
            not isinstance(leaf, torch.Tensor) or leaf.shape != want.shape or leaf.dtype != want.dtype
        ):
            got = (
                f"{tuple(leaf.shape)} {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            )
            raise CheckpointError(
                f"{what} does not fit this run's state (a tensor of {got} where the run has "
                f"{tuple(want.shape)} {want.dtype})"
            )


def named_tuple_types(*templates: Any) -> tuple[type, ...]:
    """The NamedTuple types in the given state pytrees (what a format-1 file of the run may hold)."""
    found: dict[str, type] = {}
    for template in templates:
        found.update({k: v for k, v in _node_types(template).items() if issubclass(v, tuple)})
    return tuple(found.values())


def _node_types(tree: Any) -> dict[str, type]:
    """module.QualName -> type of every NamedTuple and dataclass node in a state pytree."""
    found: dict[str, type] = {}

    def visit(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            found[_type_name(type(node))] = type(node)
            for value in node:
                visit(value)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            found[_type_name(type(node))] = type(node)
            for f in dataclasses.fields(node):
                visit(getattr(node, f.name))
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(tree)
    return found


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
