"""The shipped NLI config fine-tunes the real pretrained MiniLM on sentence pairs."""

from __future__ import annotations

from pathlib import Path

from hpo.config.loader import load_config
from hpo.trainer.config import TrainJob
from hpo.trainer.loop import train
from hpo.trainer.model import load_tokenizer
from hpo.trainer.tasks import prepare_data
from tests.conftest import REPO


def test_nli_minilm_config_trains_a_few_steps(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "nli-minilm.yaml")
    # The shipped evaluation split, cut to 60 rows: the pretrained model is slow on a CPU.
    lines = Path(config.data.eval_file).read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "eval.csv").write_text("".join(lines[:61]), encoding="utf-8")
    config.data.eval_file = str(tmp_path / "eval.csv")
    data = prepare_data(config.data, load_tokenizer(config.model))
    assert data.label_names == ["contradiction", "entailment", "neutral"]
    assert data.train.type_ids is not None and data.train.type_ids.max() == 1
    config.training.max_steps = 2
    config.training.effective_batch_size = 16
    config.training.physical_batch_size = 8
    config.training.device = "cpu"
    result = train(TrainJob(config.data, config.model, config.training), data, metric="macro_f1")
    assert result.status == "completed" and result.optimizer_steps == 2
    assert result.grad_accum_steps == 2 and len(result.evaluations) == 1
