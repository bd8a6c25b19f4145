"""The back ends that run a cohort inside one process, in auto's order of preference.

`process` workers and `distributed` ranks each run one of these on their share of the cohort
(engine/select.py picks which, by the same rules as for the whole cohort).
"""

from __future__ import annotations

from types import MappingProxyType

from fedcli.engine.backends import fused, loop, vmap

IN_PROCESS = MappingProxyType({info.name: info for info in (fused.INFO, loop.INFO, vmap.INFO)})
