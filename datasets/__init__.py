"""Data sources, partitioners, the on-device federated container and tasks."""
