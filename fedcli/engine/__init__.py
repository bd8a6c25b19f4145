"""The simulation engine: set-up, the round loop, back ends, checkpoints, a run's lifecycle (docs/architecture.md §1)."""
