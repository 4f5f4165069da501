"""One trial's life: its task and parameters, the objective, the trial process (started by
fork_start, watched by process_watch), its checkpoint folders and uploads. The user's code it
runs is hpo.plugins'."""
