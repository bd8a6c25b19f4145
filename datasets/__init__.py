"""fedcli's data layer, installed as `fedcli.datasets` (its map: docs/architecture.md §1, "Layout").

Core modules here: `tasks` and `registry` (Task records), `federated` (FederatedData), `sources`
(where data lives, downloads), `models`, `metrics`, `augment`, `stock_layers` / `stock_random`.
Packages: `partition/` (partitioners and partition files), `bundled/` (the tasks fedcli ships),
`formats/` (the publishers' on-disk formats, the disk store, the generator), `yours/` (the user's
own data and model).

The folder is also found under the top-level name `datasets` (the Hugging Face library's) when a
script runs from the checkout's root, whose folder Python puts first on sys.path. Imported under
that name, this module hands the name to the next `datasets` on sys.path, so the script gets the
library it asked for (docs/architecture.md, "The datasets folder and the `datasets` name").
"""


def _hand_over(name: str) -> None:
    """Load the `name` package found on sys.path outside this checkout in place of this folder."""
    import os
    import sys
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout]
    spec = PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} outside fedcli's checkout {checkout} (its {name}/ "
            f"folder is fedcli.{name}); install it (pip install {name}).",
            name=name,
        )
    module = module_from_spec(spec)
    sys.modules[name] = module  # the import statement returns what sys.modules holds after this runs
    spec.loader.exec_module(module)


if __name__ == "datasets":  # imported as the top-level `datasets`, not as fedcli.datasets
    _hand_over(__name__)
