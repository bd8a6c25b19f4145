"""Models of installed plugins: the entry-point group `fedcli.models` read once per process, without
importing the plugins (docs/bring-your-own.md, "Plugins"); a plugin's model is recorded by its
`module:factory` reference (datasets/yours/model.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType

from fedcli.datasets.yours.model import is_reference

log = logging.getLogger(__name__)


def model_plugins() -> Mapping[str, tuple[str, str]]:
    """Models of installed plugins: name -> (reference `module:factory`, package), read from the
    entry-point group ``fedcli.models`` without importing them (docs/bring-your-own.md, "Plugins").
    A name that is not a `module:attr` reference is left out with a warning."""
    global _PLUGINS
    if _PLUGINS is None:
        from importlib.metadata import entry_points

        found: dict[str, tuple[str, str]] = {}
        for ep in entry_points(group="fedcli.models"):
            package = ep.dist.name if ep.dist is not None else "?"
            if not is_reference(ep.value) or ep.name in found:
                log.warning(
                    "model plugin %r of %s is left out: %r is not a unique 'module:factory'",
                    ep.name,
                    package,
                    ep.value,
                )
                continue
            found[ep.name] = (ep.value.replace(" ", ""), package)
        _PLUGINS = MappingProxyType(dict(sorted(found.items())))
    return _PLUGINS


_PLUGINS: Mapping[str, tuple[str, str]] | None = None
