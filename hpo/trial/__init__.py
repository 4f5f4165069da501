"""One trial's life: its task and parameters, the objective, the trial process, its checkpoint
folders and uploads."""
