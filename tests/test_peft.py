"""LoRA through peft: the adapter each task gets, what trains, what a checkpoint holds, resuming,
the batch finder's key, and the checks a config gets before the first trial."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hpo.config.loader import parse_config
from hpo.errors import ConfigError
from hpo.trainer.batch_finder import BatchFinder, batch_key
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import DataConfig, ModelConfig, PeftSettings, TrainingConfig, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.errors import ModelError
from hpo.trainer.loop import Trainer
from hpo.trainer.model import build_model, check_model_config, load_tokenizer
from hpo.trainer.peft_adapters import (
    auto_target_modules,
    check_targets,
    is_adapted,
    parameter_counts,
    peft_task_type,
    wrap_model,
)
from hpo.trainer.step import make_optimizer
from hpo.trainer.tasks import TASKS, auto_model_class, prepare_data
from tests.conftest import (
    MINILM_TOKENIZER,
    TINY_BERT,
    hold_env,
    holding_metrics,
    start_hpo,
    tiny_config,
    wait_until_held,
    wait_until_training,
    write_config,
)

TINY_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 128,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 64,
}


@pytest.fixture(scope="module")
def tiny_pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT saved as a pretrained model folder: LoRA adapts saved weights."""
    from transformers import AutoConfig, AutoModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    settings = dict(TINY_BERT)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    return folder


def lora_job(folder: Path, train: Path, evaluation: Path, **peft: Any) -> TrainJob:
    training = TrainingConfig(
        physical_batch_size=4,
        effective_batch_size=8,
        learning_rate=3e-3,
        epochs=2,
        evals_per_epoch=2,
        device="cpu",
    )
    return TrainJob(
        data=DataConfig(train_file=str(train), eval_file=str(evaluation), max_length=32),
        model=ModelConfig(
            name_or_path=str(folder), tokenizer=MINILM_TOKENIZER, peft=PeftSettings(**peft)
        ),
        training=training,
    )


@pytest.fixture
def prepared(tiny_pretrained: Path, easy_data: tuple[Path, Path]) -> tuple[TrainJob, PreparedData]:
    job = lora_job(tiny_pretrained, *easy_data, r=4)
    return job, prepare_data(job.data, load_tokenizer(job.model))


def _model_for(task: str, settings: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    settings = dict(settings)
    config = AutoConfig.for_model(settings.pop("model_type"), num_labels=3, **settings)
    return auto_model_class(task).from_config(config)


# -- the adapter each task and family gets ---------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "task_type", "head"),
    [
        ("sequence_classification", "SEQ_CLS", "classifier"),
        ("multi_label_classification", "SEQ_CLS", "classifier"),
        ("regression", "SEQ_CLS", "classifier"),
        ("token_classification", "TOKEN_CLS", "classifier"),
        ("causal_lm", "CAUSAL_LM", None),
    ],
)
def test_every_task_trains_the_adapter_and_its_head_and_nothing_else(
    task: str, task_type: str, head: str | None
) -> None:
    assert set(TASKS) >= {task} and peft_task_type(task) == task_type
    base = _model_for(task, TINY_GPT2 if task == "causal_lm" else TINY_BERT)
    model = wrap_model(base, PeftSettings(r=4), task)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    heads = [n for n in trainable if "lora_" not in n]
    if head is None:  # a language model's head is its (tied, frozen) embeddings
        assert heads == []
    else:  # the new head trains fully, as peft's modules_to_save copy
        assert heads and all(f"{head}.modules_to_save.default." in n for n in heads), heads
    # The optimizer sees exactly the trainable tensors.
    optimizer, _ = make_optimizer(model, TrainingConfig())
    in_optimizer = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    trainable_count, total = parameter_counts(model)
    assert in_optimizer == trainable_count < total / 10


def test_auto_targets_the_attention_projections_peft_knows_per_family() -> None:
    assert auto_target_modules("bert") == ["query", "value"]
    assert auto_target_modules("gpt2") == ["c_attn"]
    with pytest.raises(ModelError, match="set model.peft.target_modules") as caught:
        auto_target_modules("distilbert")
    assert "'distilbert'" in str(caught.value) and "\n" not in str(caught.value)


def test_target_modules_are_checked_against_the_models_layers() -> None:
    model = _model_for("sequence_classification", TINY_BERT)
    good = PeftSettings(target_modules=["query", "key", "attention.output.dense"])
    check_targets(good, model, "sequence_classification")
    model = _model_for("sequence_classification", TINY_BERT)  # the check put an adapter on it
    with pytest.raises(ModelError) as caught:
        check_targets(
            PeftSettings(target_modules=["query", "q_proj"]), model, "sequence_classification"
        )
    message = str(caught.value)
    assert "'q_proj' names no layer of the model (bert)" in message and "'query'" not in message
    assert "its linear layers: classifier, dense, key, query, value" in message


def _meta_model(task: str, settings: dict[str, Any]) -> Any:
    with torch.device("meta"):  # as hpo checks a config: no weights
        return _model_for(task, settings)


@pytest.mark.parametrize(
    ("family", "targets", "expected"),
    [
        (
            TINY_BERT,
            ["query", "LayerNorm"],
            "'LayerNorm' names LayerNorm layers, which LoRA cannot "
            "adapt (only linear, embedding and convolution layers); name layers LoRA adapts; "
            "in this "
            "model (bert): dense, key, position_embeddings, query, token_type_embeddings, value, "
            "word_embeddings",
        ),
        (TINY_BERT, ["attention"], "'attention' names BertAttention layers, which LoRA cannot"),
        (TINY_GPT2, ["ln_1"], "'ln_1' names LayerNorm layers, which LoRA cannot adapt"),
        (
            TINY_BERT,
            ["classifier"],
            "got ['classifier']; peft refuses the adapter (No modules were "
            "targeted for adaptation); name layers LoRA adapts; in this model (bert): dense, key,",
        ),
    ],
    ids=["LayerNorm", "a whole block", "gpt2", "the head"],
)
def test_a_target_lora_cannot_adapt_is_refused_naming_the_layers_it_can(
    family: dict[str, Any], targets: list[str], expected: str
) -> None:
    model = _meta_model("sequence_classification", family)
    with pytest.raises(ModelError) as caught:
        check_targets(PeftSettings(target_modules=targets), model, "sequence_classification")
    message = str(caught.value)
    assert message.startswith("model.peft.target_modules: ") and "\n" not in message
    assert expected in message, message


def test_targets_peft_accepts_pass_the_check_on_the_meta_device() -> None:
    for family, targets in ((TINY_BERT, ["query", "word_embeddings"]), (TINY_GPT2, ["c_attn"])):
        model = _meta_model("sequence_classification", family)
        check_targets(PeftSettings(target_modules=targets), model, "sequence_classification")


def test_auto_on_a_family_peft_does_not_know_names_its_layers() -> None:
    from transformers import DistilBertConfig

    config = DistilBertConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    model = auto_model_class("sequence_classification").from_config(config)
    with pytest.raises(ModelError, match=r"its linear layers: .*q_lin.*v_lin"):
        check_targets(PeftSettings(), model, "sequence_classification")


def test_check_model_config_refuses_unknown_targets_before_any_trial(tiny_pretrained: Path) -> None:
    good = ModelConfig(name_or_path=str(tiny_pretrained), peft=PeftSettings())
    check_model_config(good, 32)
    bad = dataclasses.replace(good, peft=PeftSettings(target_modules=["qkv"]))
    with pytest.raises(ModelError, match="'qkv' names no layer"):
        check_model_config(bad, 32)


def test_gradient_checkpointing_still_reaches_the_adapter(tiny_pretrained: Path) -> None:
    config = ModelConfig(
        name_or_path=str(tiny_pretrained), gradient_checkpointing=True, peft=PeftSettings(r=4)
    )
    model = build_model(config, ["a", "b"], seed=0).train()
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
    # lora_B starts at zero (so lora_A's first gradient is zero too): B's shows the path.
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


# -- training, checkpoints and resuming ------------------------------------------------------------


def _trained(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_to_the_same_weights(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    reference = Trainer(*prepared)
    expected = reference.fit()
    assert is_adapted(reference.model)
    assert 0 < expected.trainable_params < expected.total_params / 10
    steps: list[int] = []
    stopper = Trainer(*prepared)
    store = CheckpointStore(tmp_path / "t")
    stopped = stopper.fit(
        checkpoints=store,
        should_stop=lambda: len(steps) >= 1,
        on_evaluation=lambda e: steps.append(e.optimizer_step) or None,
    )
    assert stopped.status == "interrupted"
    # The state holds the adapter, the head and their AdamW moments: not the 2M frozen weights.
    full_model_bytes = 4 * expected.total_params
    assert store.state_path.stat().st_size < full_model_bytes / 10
    best = sorted(p.name for p in store.best_model_path.iterdir())
    assert best == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "config.json",
    ], best
    assert (store.best_model_path / "adapter_model.safetensors").stat().st_size < (
        full_model_bytes / 10
    )

    resumed = Trainer(*prepared)  # a fresh base model, as on another host
    result = resumed.fit(checkpoints=CheckpointStore(tmp_path / "t", resume=True))
    assert result.resumed_at_step == stopped.optimizer_steps and result.status == "completed"
    want, got = _trained(reference), _trained(resumed)
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert result.curve == expected.curve


def test_the_saved_adapter_loads_through_peft_and_merges_to_a_plain_model(
    prepared: tuple[TrainJob, PreparedData], tiny_pretrained: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification

    trainer = Trainer(*prepared)
    store = CheckpointStore(tmp_path / "t")
    trainer.fit(checkpoints=store)
    folder = store.best_model_path
    base = AutoModelForSequenceClassification.from_pretrained(
        tiny_pretrained, config=AutoConfig.from_pretrained(folder)
    )
    loaded = PeftModel.from_pretrained(base, folder).eval()
    ids = torch.tensor([[101, 2204, 102]])
    with torch.no_grad():
        adapted = loaded(input_ids=ids).logits
        merged = loaded.merge_and_unload()(input_ids=ids).logits
    assert loaded.config.id2label == {0: "neg", 1: "pos"}
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)


# -- the batch finder ------------------------------------------------------------------------------


def test_the_batch_finder_keys_and_probes_the_adapted_model(
    prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared
    full = dataclasses.replace(job, model=dataclasses.replace(job.model, peft=None))
    cpu = torch.device("cpu")
    lora_key, full_key = batch_key(job, cpu, "fp32"), batch_key(full, cpu, "fp32")
    assert lora_key["peft"]["r"] == 4 and "peft" not in full_key
    wider = dataclasses.replace(job.model, peft=PeftSettings(r=16))
    assert batch_key(dataclasses.replace(job, model=wider), cpu, "fp32") != lora_key
    rescaled = dataclasses.replace(job.model, peft=PeftSettings(r=4, alpha=64, dropout=0.2))
    assert batch_key(dataclasses.replace(job, model=rescaled), cpu, "fp32") == lora_key
    finder = BatchFinder(job, data.label_names, cpu)
    assert is_adapted(finder.base_model)


# -- the config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peft", "message"),
    [
        ({"r": 0}, "model.peft.r: got 0; must be an integer in [1, 4096]"),
        ({"alpha": 0}, "model.peft.alpha: got 0.0; must be > 0"),
        ({"dropout": 1.0}, "model.peft.dropout: got 1.0; must be in [0, 1)"),
        ({"method": "ia3"}, "model.peft.method: got 'ia3'; must be one of lora, none"),
        ({"target_modules": []}, "model.peft.target_modules: got []; must be auto or a list"),
        ({"dropuot": 0.1}, "model.peft.dropuot: unknown key (did you mean 'dropout'?)"),
    ],
)
def test_bad_peft_settings_are_one_line_each(
    easy_data: tuple[Path, Path], tiny_pretrained: Path, peft: dict[str, Any], message: str
) -> None:
    raw = tiny_config(*easy_data, model={"name_or_path": str(tiny_pretrained), "peft": peft})
    del raw["model"]["config"]
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, Path("."))
    assert [p for p in caught.value.problems if message in p], caught.value.problems


def test_lora_on_a_model_built_from_config_is_refused(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data, model={"peft": {"r": 8}})
    with pytest.raises(ConfigError, match="model.peft: got 'lora'; needs a pretrained model"):
        parse_config(raw, Path("."))


def test_a_config_without_peft_fine_tunes_every_weight(
    easy_data: tuple[Path, Path], tiny_pretrained: Path
) -> None:
    config = parse_config(tiny_config(*easy_data), Path("."))
    assert config.model.peft is None
    lora = {"name_or_path": str(tiny_pretrained), "peft": {"r": 16, "alpha": 32}}
    raw = tiny_config(*easy_data, model=lora)
    del raw["model"]["config"]
    peft = parse_config(raw, Path(".")).model.peft
    assert peft == PeftSettings(r=16, alpha=32.0)


# -- through hpo run -------------------------------------------------------------------------------


def lora_config(
    folder: Path, train: Path, evaluation: Path, **sections: dict[str, Any]
) -> dict[str, Any]:
    raw = tiny_config(train, evaluation, **sections)
    raw["model"] = {
        "name_or_path": str(folder),
        "tokenizer": MINILM_TOKENIZER,
        "peft": {"r": 8, "alpha": 16},
    }
    return raw


@pytest.mark.parametrize(
    ("peft", "message"),
    [
        ({"r": -1}, "model.peft.r: got -1; must be an integer in [1, 4096]"),
        ({"target_modules": ["query", "qkv"]}, "'qkv' names no layer of the model (bert)"),
        (
            {"target_modules": ["LayerNorm"]},
            "model.peft.target_modules: 'LayerNorm' names LayerNorm "
            "layers, which LoRA cannot adapt",
        ),
    ],
)
def test_bad_lora_input_through_hpo_run_exits_2_and_writes_nothing(
    tmp_path: Path,
    tiny_pretrained: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    peft: dict[str, Any],
    message: str,
) -> None:
    raw = lora_config(tiny_pretrained, *easy_data)
    raw["model"]["peft"].update(peft)
    config = write_config(tmp_path / "bad.yaml", raw)
    database = tmp_path / "must-not-exist.db"
    capsys.readouterr()
    code = hpo_main(
        ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not database.exists()


def test_a_lora_study_resumes_from_the_store_and_downloads_an_adapter_or_a_merged_model(
    tmp_path: Path,
    tiny_pretrained: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through `hpo run`: a LoRA trial stopped by SIGTERM after its first evaluation resumes, in
    the next worker, from the adapter state in the artifact store (its own folder gone, as on
    another host); `hpo best --download` gives an adapter that peft loads on the base model,
    and `--merge` a plain model that gives the same predictions."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    store = tmp_path / "store"
    store.mkdir()
    url = f"sqlite:///{tmp_path / 'study.db'}"
    raw = lora_config(
        tiny_pretrained,
        *easy_data,
        study={
            "n_trials": 2,
            "artifact_store": f"file://{store}",
            "checkpoint_dir": str(tmp_path / "host-a"),
        },
        # 64 steps, an evaluation every 16: the first evaluation holds until the stop arrives
        training={"learning_rate": 2e-2},
    )
    raw["search_space"]["learning_rate"] = {"type": "categorical", "choices": [2e-2]}
    # (a trial of 64 tiny steps had finished training before the signal in 1 run of 10)
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "lora.yaml", raw)
    args = ("run", "--study", "lora", "--config", str(config), "--storage", url)

    held = tmp_path / "held"
    first = start_hpo(*args, cwd=tmp_path, env=hold_env(held, release="stop"), own_group=True)
    study = wait_until_training(url, "lora", [first])
    wait_until_held(held, [first])
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr[-3000:]
    shutil.rmtree(tmp_path / "host-a")  # the next worker runs on another host
    monkeypatch.chdir(tmp_path)
    assert hpo_main(list(args)) == 0

    trials = {t.number: t for t in study.get_trials()}
    assert {n: t.state for n, t in trials.items()} == {
        0: TrialState.FAIL,
        1: TrialState.COMPLETE,
        2: TrialState.COMPLETE,
    }
    retry = next(t for t in trials.values() if t.system_attrs.get("failed_trial") == 0)
    assert retry.user_attrs["resumed_from"].startswith("file://")
    assert retry.user_attrs["resumed_at_step"] >= 16
    assert sorted(retry.intermediate_values) == [1, 2, 3, 4]  # the curve continues
    assert all(t.value is not None and t.value > 0.6 for t in (trials[1], retry))  # chance: 0.5
    for trial in (trials[1], retry):
        trainable, total = trial.user_attrs["trainable_params"], trial.user_attrs["total_params"]
        assert 0 < trainable < total / 100, (trainable, total)
    # What went to the store is the adapter: no file holds the 2M frozen weights.
    stored = [p for p in store.rglob("*") if p.is_file()]
    assert stored and max(p.stat().st_size for p in stored) < 1_000_000

    capsys.readouterr()
    assert hpo_main(["best", "--study", "lora", "--storage", url]) == 0
    assert "a LoRA adapter" in capsys.readouterr().out
    assert hpo_main(["best", "--study", "lora", "--storage", url, "--download", "adapter"]) == 0
    said = capsys.readouterr().out
    assert "PeftModel.from_pretrained" in said and str(tiny_pretrained) in said, said
    adapter = tmp_path / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        str(tiny_pretrained)
    )
    base = AutoModelForSequenceClassification.from_pretrained(
        tiny_pretrained, config=AutoConfig.from_pretrained(adapter)
    )
    loaded = PeftModel.from_pretrained(base, adapter).eval()
    args_merge = ["best", "--study", "lora", "--storage", url, "--download", "merged", "--merge"]
    assert hpo_main(args_merge) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert merged.config.id2label == {0: "neg", 1: "pos"}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    encoded = tokenizer(
        ["the meal was superb", "our room felt awful"], return_tensors="pt", padding=True
    )
    with torch.no_grad():
        want, got = loaded(**encoded).logits, merged(**encoded).logits
    torch.testing.assert_close(want, got, rtol=1e-4, atol=1e-5)
    assert got.argmax(-1).tolist() == [1, 0]  # pos, neg


def test_the_report_and_hpo_best_say_how_an_adapter_loads() -> None:
    from hpo.reports.text import best_text
    from hpo.study.join import ADAPTER_ATTR, TASK_ATTR, model_loader

    plain = {TASK_ATTR: "token_classification"}
    assert model_loader(plain) == "AutoModelForTokenClassification.from_pretrained"
    adapter = {**plain, ADAPTER_ATTR: {"method": "lora", "base_model": "pkg://m/model"}}
    assert model_loader(adapter) == (
        "a LoRA adapter on pkg://m/model: PeftModel.from_pretrained(AutoModelForTokenClassification"
        ".from_pretrained(BASE, config=AutoConfig.from_pretrained(DIR)), DIR)"
    )
    # Each trial's own record wins: a search that turns LoRA on and off has both kinds.
    full_trial = {ADAPTER_ATTR: None}
    assert model_loader(adapter, full_trial) == "AutoModelForTokenClassification.from_pretrained"
    lora_trial = {ADAPTER_ATTR: adapter[ADAPTER_ATTR]}
    assert model_loader(plain, lora_trial) == model_loader(adapter)
    assert model_loader(adapter, {}) == model_loader(adapter)  # trials recorded before
    best = {
        "number": 3,
        "study": "s",
        "value": 0.9,
        "params": {},
        "adapter": adapter[ADAPTER_ATTR],
        "user_attrs": {"best_model_uri": "file:///store/s/trial-3/best-model"},
    }
    assert "a LoRA adapter (hpo best --download DIR fetches it, loadable with peft; --merge" in (
        best_text(best)
    )


def test_the_retrain_card_of_a_lora_study_names_the_adapter_and_its_base(
    easy_data: tuple[Path, Path], tiny_pretrained: Path
) -> None:
    from hpo.reports.model_card import card_loader

    raw = tiny_config(*easy_data, model={"name_or_path": str(tiny_pretrained), "peft": {"r": 4}})
    del raw["model"]["config"]
    config = parse_config(raw, Path("."))
    assert card_loader(config).startswith(f"a LoRA adapter on {tiny_pretrained}: PeftModel")
    config.model.peft = None
    assert (
        card_loader(config) == "AutoModelForSequenceClassification.from_pretrained(<this folder>)"
    )


def test_method_none_fine_tunes_every_weight_so_a_search_can_turn_lora_off(
    prepared: tuple[TrainJob, PreparedData],
) -> None:
    job, data = prepared
    off = dataclasses.replace(job.model, peft=PeftSettings(method="none", r=4))
    assert off.adapter is None and job.model.adapter is not None
    model = build_model(off, data.label_names, seed=0)
    assert not is_adapted(model) and all(p.requires_grad for p in model.parameters())
    assert "peft" not in batch_key(dataclasses.replace(job, model=off), torch.device("cpu"), "fp32")
    inline = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER, peft=off.peft)
    assert inline.problems() == []  # LoRA off: a model built from config is fine


def test_merge_of_a_model_trained_fully_is_one_line(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hpo.errors import HPOError
    from hpo.services import API_DOWNLOAD, DownloadNames, _finish_adapter

    study = SimpleNamespace(user_attrs={})
    plain, merged, out = tmp_path / "plain", tmp_path / "merged", tmp_path / "out"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert _finish_adapter(study, None, plain, None, out, DownloadNames()) == ""
    with pytest.raises(HPOError, match="^--merge: the best trial fine-tuned every weight"):
        _finish_adapter(study, None, plain, merged, out, DownloadNames())
    with pytest.raises(HPOError, match="^merge=True: the best trial fine-tuned every weight"):
        _finish_adapter(study, None, plain, merged, out, API_DOWNLOAD)


def test_hpo_retrain_of_a_lora_study_saves_an_adapter_that_peft_loads(
    tmp_path: Path,
    tiny_pretrained: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`hpo retrain` of a LoRA study trains the winner's adapter again with new seeds and
    saves the best run as an adapter folder: peft loads it on the base model its card names,
    and it predicts as the trained model did (its head included)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from hpo.study.retrain import CARD_JSON

    monkeypatch.chdir(tmp_path)
    raw = lora_config(
        tiny_pretrained,
        *easy_data,
        study={"n_trials": 1},
        training={"epochs": 1, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "lora.yaml", raw)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert hpo_main(["run", "--study", "lora", "--config", str(config), "--storage", url]) == 0
    (searched,) = optuna.load_study(study_name="lora", storage=url).trials
    assert searched.user_attrs["adapter"] == {"method": "lora", "base_model": str(tiny_pretrained)}
    retrain = [
        "retrain",
        "--study",
        "lora",
        "--config",
        str(config),
        "--storage",
        url,
        "--top",
        "1",
        "--seeds",
        "2",
        "--out",
        "final",
    ]
    assert hpo_main(retrain) == 0
    out = capsys.readouterr().out
    assert "final model: final" in out, out
    final = tmp_path / "final"
    assert (final / "adapter_config.json").exists() and not (final / "model.safetensors").exists()
    card = json.loads((final / CARD_JSON).read_text(encoding="utf-8"))
    assert card["adapter"]["method"] == "lora" and card["adapter"]["r"] == 8
    assert "PeftModel.from_pretrained" in (final / "README.md").read_text(encoding="utf-8")
    ids = torch.tensor([[101, 2204, 102], [101, 2919, 102]])
    logits = []
    for seed in (0, 1):  # the base model's new head starts differently each time...
        torch.manual_seed(seed)
        base = AutoModelForSequenceClassification.from_pretrained(
            tiny_pretrained, config=AutoConfig.from_pretrained(final)
        )
        loaded = PeftModel.from_pretrained(base, final).eval()
        with torch.no_grad():
            logits.append(loaded(input_ids=ids).logits)
    assert loaded.config.id2label == {0: "neg", 1: "pos"}
    # ...and the adapter folder replaces it with the trained one, with the trained LoRA layers.
    torch.testing.assert_close(logits[0], logits[1])
    assert any("lora_" in name for name, _ in loaded.named_parameters())


def test_a_compiled_lora_model_trains_the_adapter_as_the_eager_one_does(
    prepared: tuple[TrainJob, PreparedData], monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.compile with LoRA: the compiled graph trains the adapter (and the head) and
    nothing else, to the same weights as eager training (aot_eager on the CPU: the same
    kernels)."""
    from hpo.trainer import compiled

    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch.compiler.reset()
    job, data = prepared
    # No dropout anywhere: compiled code draws its random numbers in another order.
    assert job.model.peft is not None
    peft = dataclasses.replace(job.model.peft, dropout=0.0)
    model = dataclasses.replace(job.model, dropout=0.0, peft=peft)
    training = dataclasses.replace(job.training, max_steps=4)
    job = dataclasses.replace(job, model=model, training=training)
    weights = []
    for compile_it in (False, True):
        run = dataclasses.replace(job, model=dataclasses.replace(job.model, compile=compile_it))
        trainer = Trainer(run, data)
        before = compiled.compile_stats()
        result = trainer.fit()
        assert result.status == "completed" and result.optimizer_steps == 4
        assert ((compiled.compile_stats() - before).graphs > 0) == compile_it
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    eager, graph = weights
    assert eager.keys() == graph.keys()
    for name in eager:
        torch.testing.assert_close(graph[name], eager[name], rtol=1e-4, atol=1e-5)
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or "classifier" in n for n in trained)
    torch.compiler.reset()
