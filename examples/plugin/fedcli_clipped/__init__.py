"""Example fedcli plugin: `fedavg-clipped` (see `fedcli_clipped.fedavg_clipped`).

Importing the package does not import the algorithm module: fedcli's registry loads it
through the `fedcli.algorithms` entry point.
"""
