"""The user's own data and model (docs/bring-your-own.md, docs/your-data.md).

`files` turns a .npz/.csv/.parquet file into a task (`--data FILE`), `data` a Python data object
or data function (a torch Dataset, a Hugging Face Dataset, a flwr-datasets partition, `pkg.mod:fn`),
`model` a model reference (`--model pkg.mod:factory` / `file.py:factory`), and `trust` decides which
user code named by a file, a store row or a study a command may import.
"""
