"""model.compile: graphs compiled once per process and reused by a fresh model of the next trial;
the batch dimension dynamic; what a trial compiled is recorded. aot_eager stands in for inductor
(which takes minutes on this CPU); the counting, the reuse and the shapes are the same."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch

from tests.conftest import MINILM_TOKENIZER, TINY_BERT, run_study, tiny_config, write_config
from trainer import compiled
from trainer.config import ModelConfig
from trainer.model import build_model


def test_the_private_torch_names_hpo_compiles_with_still_exist() -> None:
    # If this fails after a torch upgrade, mend trainer/compiled.py (the only place using them).
    from torch._dynamo import lookup_backend, maybe_mark_dynamic

    assert callable(lookup_backend("inductor")) and callable(lookup_backend("aot_eager"))
    assert callable(maybe_mark_dynamic)


def _forward(model: torch.nn.Module, batch: int, width: int) -> None:
    ids = torch.randint(0, 1000, (batch, width))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_a_fresh_model_reuses_the_graphs_of_the_last_and_batch_sizes_share_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch.compiler.reset()
    config = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
    shapes = [(4, 32), (5, 32), (3, 32), (8, 32), (4, 48), (7, 48)]
    before = compiled.compile_stats()
    first = compiled.compile_model(build_model(config, ["a", "b"], seed=0))
    with torch.no_grad():
        for batch, width in shapes:
            _forward(first, batch, width)
    used = compiled.compile_stats() - before
    # One graph per width: the batch sizes (3 to 8) do not each compile a graph of their own.
    assert 1 <= used.graphs <= 2 and used.seconds > 0
    before = compiled.compile_stats()
    second = compiled.compile_model(build_model(config, ["a", "b"], seed=1))  # the next trial
    with torch.no_grad():
        for batch, width in shapes:
            _forward(second, batch, width)
    assert (compiled.compile_stats() - before).graphs == 0
    torch.compiler.reset()


def test_a_worker_compiles_for_its_first_trial_only(
    tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = tiny_config(*easy_data, study={"n_trials": 2, "pruner": {"type": "none"}},
                      model={"compile": True}, training={"max_steps": 3})  # fmt: skip
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    result = run_study(config, url, tmp_path, env={compiled.BACKEND_ENV: "aot_eager"})
    assert result.returncode == 0, result.stderr[-3000:]
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    graphs = [t.user_attrs["compile_graphs"] for t in sorted(trials, key=lambda t: t.number)]
    assert graphs[0] > 0 and graphs[1] == 0, graphs
    assert trials[0].user_attrs["compile_s"] > 0
