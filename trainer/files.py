"""The names of what a run keeps in its checkpoint folder, without torch: hpo's worker loop,
which never imports torch, drops a finished trial's resume state by its name."""

STATE_FILE = "checkpoint.pt"  # the resume state: model, optimizer, schedule, RNG, progress
BEST_MODEL_DIR = "best-model"  # the best evaluation's model (a symlink to its newest version)
