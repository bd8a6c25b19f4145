"""The tasks fedcli ships: one module per data set, each exporting `TASKS: tuple[Task, ...]`.

fedcli.datasets.registry imports every module listed in its `_TASK_MODULES`; a new bundled task is a
module here plus its name there. The readers of the publishers' file formats live in
fedcli.datasets.formats, the data-location and download plumbing in fedcli.datasets.sources.
"""
