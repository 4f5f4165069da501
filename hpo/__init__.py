"""hpo: hyperparameter optimisation for fine-tuning transformer models.

Kept import-light: the CLI reports a bad config before torch, transformers or Optuna load.
"""

__version__ = "0.1.0"
