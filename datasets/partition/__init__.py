"""Partitioners: a data set's examples split into federated clients, and partition files.

`make` dispatches a `PartitionSpec` to its partitioner (`make_partition`; its docstring lists the
schemes and their deviations from the reference code), `spec` holds `PartitionSpec` and its checks,
`schemes` the partitioners and the label helpers, `summary` the statistics and the figure, `files`
the partition files (`fedcli partition ... --out`). None of them imports `make`.
"""
