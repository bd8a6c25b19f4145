"""The simulation engine: round loop, cohort sampling, executors, checkpoints."""
