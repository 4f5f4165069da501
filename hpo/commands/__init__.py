"""What each `hpo` command does: the one place that wires config, storage and trainer together."""
