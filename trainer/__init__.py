"""trainer: fine-tune a sequence classifier from a plain config; knows nothing of Optuna.

`train(job, data, on_evaluation)` in `hpo.trainer.loop` returns a `TrainResult`
(`hpo.trainer.result`).
The loop's parts: `step` (one optimizer step), `loaders`, `evaluation`, `batch_finder` (the
physical batch), `memory` (out-of-memory handling), `checkpoint` and `resume` (what a checkpoint
holds), `progress`; its inputs: `config`, `data` (the tokenized splits: files read by `readers`,
labels checked by `labels`, tokenized and cached by `token_cache`, cut into steps and padded
by `batching`), `model`, `device`; its errors: `errors`.
"""
