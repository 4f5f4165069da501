"""hpo: hyperparameter optimisation for fine-tuning transformer models.

Kept import-light: `trainer/` and `storage/` import `hpo.errors` without pulling in Optuna.
"""

__version__ = "0.1.0"
