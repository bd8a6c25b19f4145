"""On-disk formats of the published federations, fedcli's disk store and a generator of both.

`leaf` reads LEAF JSON (FEMNIST, Shakespeare, Sent140), `tff_h5` TensorFlow Federated h5 files
(EMNIST, CIFAR-100, StackOverflow), `diskstore` keeps a task's examples as memory-mapped arrays
for paper-scale runs, and `generate` makes paper-sized synthetic federations (`python -m
fedcli.datasets.formats.generate`, docs/scaling.md) that `writers` writes in the publishers' formats.
"""
