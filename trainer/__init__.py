"""trainer: fine-tune a sequence classifier from a plain config; knows nothing of Optuna.

`train(config, on_evaluation)` returns a `TrainResult`; see `trainer.loop`.
"""
