"""Config loading: every shipped YAML loads; every problem in a bad one is reported at once."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from hpo.config.convert import MAX_SHOWN_CHARS, show
from hpo.config.loader import load_config, parse_config
from hpo.config.schema import DEFAULT_BATCH_CHOICES
from hpo.errors import ConfigError
from hpo.trial.search_space import sample
from tests.conftest import REPO, tiny_config, write_config

SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted(
    (REPO / "bench" / "configs").glob("*.yaml")
)


def test_configs_folder_is_not_empty() -> None:
    names = {p.name for p in SHIPPED}
    assert {"demo.yaml", "nli-minilm.yaml", "bert-base-nli.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert {"effective_batch_size", "learning_rate"} <= set(config.search_space)
    assert Path(config.data.train_file).is_file()
    assert Path(config.data.eval_file).is_file()


def test_a_file_and_its_mapping_make_the_same_config() -> None:
    # One parse path: load_config reads the file, then parses its mapping as code's would be.
    path = REPO / "configs" / "demo.yaml"
    raw = yaml.safe_load(path.read_text())
    assert load_config(path) == parse_config(raw, base_dir=path.parent, source=str(path))


def test_defaults_fill_the_search_space(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    del raw["search_space"]
    config = parse_config(raw, base_dir=Path("."))
    batch = config.search_space["effective_batch_size"]
    lr = config.search_space["learning_rate"]
    assert batch.type == "categorical" and batch.choices == DEFAULT_BATCH_CHOICES
    assert (lr.low, lr.high, lr.log) == (1e-6, 1e-3, True)
    assert config.study.pruner.type == "median"
    assert config.study.resolved_direction == "maximize"


def test_yaml_exponent_without_dot_is_a_number(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # YAML 1.1 reads 1e-6 as the string "1e-6"; users write it that way all the time.
    text = write_config(tmp_path / "c.yaml", tiny_config(*easy_data)).read_text()
    assert "low: 0.001" in text
    text = text.replace("low: 0.001", "low: 1e-6")
    path = tmp_path / "c2.yaml"
    path.write_text(text)
    assert load_config(path).search_space["learning_rate"].low == 1e-6


def test_all_problems_reported_at_once(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(
        *easy_data,
        study={"metrc": "accuracy", "n_trials": "many"},
        training={"physical_batch_size": 0, "epochs": 1.5},
    )
    raw["search_space"] = {
        "learning_rate": {"type": "float", "low": 0, "high": 1e-3, "log": True},
        "weight_decay": {"type": "float", "low": 0.3, "high": 0.1},
        "effective_batch_size": {"type": "categorical", "choices": []},
        "lerning_rate": {"type": "float", "low": 1e-5, "high": 1e-4},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=Path("."))
    text = "\n".join(caught.value.problems)
    expected = [
        "study.metrc: unknown key (did you mean 'metric'?)",
        "study.n_trials: got 'many'; must be an integer or null",
        "training.physical_batch_size: got 0; must be a positive integer",
        "training.epochs: got 1.5; must be an integer",
        "search_space.learning_rate.low: got 0.0; must be > 0 for a log-scale parameter",
        "search_space.weight_decay.low: got 0.3; must be <= high (0.1)",
        "search_space.effective_batch_size.choices: got []; a categorical parameter needs",
        "search_space.lerning_rate: unknown parameter (did you mean 'learning_rate'?)",
    ]
    for line in expected:
        assert line in text
    assert len(caught.value.problems) == len(expected)


def test_search_space_values_must_be_valid_settings(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    raw["search_space"]["effective_batch_size"] = {"type": "categorical", "choices": [32, -4]}
    raw["search_space"]["learning_rate"] = {"type": "float", "low": -1e-3, "high": 1e-3}
    raw["search_space"]["epochs"] = {"type": "float", "low": 1, "high": 3}
    raw["search_space"]["warmup_ratio"] = {"type": "categorical", "choices": [0.1, "lots"]}
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=Path("."))
    text = "\n".join(caught.value.problems)
    assert "search_space.epochs: got type float; epochs is a whole number" in text
    assert "search_space.warmup_ratio: value 'lots' must be a number" in text
    assert "search_space.effective_batch_size: value -4 must be a positive integer" in text
    assert "search_space.learning_rate: value -0.001 must be > 0" in text


def test_missing_data_file_and_wrong_direction(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data, study={"metric": "eval_loss", "direction": "maximize"})
    raw["data"]["train_file"] = "nowhere/train.csv"
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=tmp_path)
    text = "\n".join(caught.value.problems)
    assert "data.train_file: 'nowhere/train.csv' not found" in text
    assert "metric eval_loss must be minimized" in text


def test_relative_paths_resolve_against_the_config_folder(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    train, evaluation = easy_data
    raw = tiny_config(Path("data/train.csv"), Path("data/eval.csv"))
    config = parse_config(raw, base_dir=train.parent.parent)
    assert Path(config.data.train_file) == train
    assert Path(config.data.eval_file) == evaluation


@pytest.mark.parametrize(
    ("storage", "expected"),
    [
        ("sqlite:///rel.db", "conf/rel.db"),
        ("sqlite:///sub/rel.db", "conf/sub/rel.db"),
        ("sqlite+pysqlite:///rel.db", "conf/rel.db"),
        ("sqlite:///../rel.db", "rel.db"),
        ("sqlite:///{tmp}/abs.db", "abs.db"),
    ],
)
def test_a_relative_sqlite_file_in_the_config_is_relative_to_the_config(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    easy_data: tuple[Path, Path],
    storage: str,
    expected: str,
) -> None:
    """As data paths are: workers started from two folders share one database, one budget."""
    from hpo.storage.url import resolve_storage_url

    conf, elsewhere = tmp_path / "conf", tmp_path / "run" / "deeper"
    (conf / "sub").mkdir(parents=True)
    elsewhere.mkdir(parents=True)
    raw = tiny_config(*easy_data, study={"storage": storage.format(tmp=tmp_path)})
    write_config(conf / "c.yaml", raw)
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("../../conf/c.yaml"))
    described = resolve_storage_url(None, config.study.storage).describe()
    assert described == f"SQLite file {tmp_path / expected} (from config)"


@pytest.mark.slow
def test_workers_started_from_two_folders_share_the_config_s_database(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    raw = tiny_config(*easy_data, study={"storage": "sqlite:///rel.db", "n_trials": 1})
    config = write_config(conf / "c.yaml", raw)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        assert hpo_main(["run", "--study", "s", "--config", str(config), "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.rglob("*.db")) == ["rel.db"]
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{conf / 'rel.db'}")
    assert len(study.trials) == 1  # the second worker found the budget spent


@pytest.mark.parametrize("storage", ["postgresql+psycopg2://u:pw@h/db", "sqlite:///:memory:"])
def test_a_config_storage_that_is_no_relative_file_is_kept_as_written(
    easy_data: tuple[Path, Path], storage: str
) -> None:
    raw = tiny_config(*easy_data, study={"storage": storage})
    assert parse_config(raw, base_dir=Path("/elsewhere")).study.storage == storage


def test_a_relative_sqlite_file_from_the_command_line_is_relative_to_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.storage.url import resolve_storage_url

    monkeypatch.chdir(tmp_path)
    for cli, env in (("sqlite:///rel.db", None), (None, "sqlite:///rel.db")):
        if env is not None:
            monkeypatch.setenv("HPO_STORAGE", env)
        chosen = resolve_storage_url(cli, "sqlite:////elsewhere/config.db")
        assert chosen.describe().startswith(f"SQLite file {tmp_path / 'rel.db'} (from ")


def test_model_needs_exactly_one_source(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    raw["model"]["name_or_path"] = "org/model"
    with pytest.raises(ConfigError, match="give exactly one of name_or_path or config"):
        parse_config(raw, base_dir=Path("."))


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("study: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="a folder, not a file; pass --config with a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="the config path is empty; pass --config"):
        load_config("")  # --config '': not the working folder


def test_a_missing_config_suggests_a_demo_config_that_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the repository root, `configs/demo.yaml` names nothing: the hint must."""
    import hpo.config.loader

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config("absent.yaml")
    suggested = str(caught.value).rpartition("such as ")[2]
    assert Path(suggested).is_file(), str(caught.value)
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=r"such as configs/demo\.yaml$"):
        load_config("absent.yaml")
    # Installed without its repository (a wheel): no path that is not there.
    monkeypatch.setattr(hpo.config.loader, "DEMO_CONFIG", tmp_path / "no" / "demo.yaml")
    with pytest.raises(ConfigError) as caught:
        load_config("absent.yaml")
    assert "such as" not in str(caught.value)
    assert "configs/demo.yaml in hpo's sources" in str(caught.value)


def test_one_problem_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "absent.yaml")
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"config: {tmp_path / 'absent.yaml'}: no such file; ")
    with pytest.raises(ConfigError) as caught:
        parse_config({"study": {"metrc": "x", "n_trials": 0}}, base_dir=Path("."))
    lines = str(caught.value).splitlines()  # several: a count, then a line each
    assert lines[0] == f"config: {len(lines) - 1} problems; fix them and run again:"
    assert lines[1].startswith("  - study.metrc: unknown key (did you mean 'metric'?)")


def test_search_space_misspelt_at_the_top_gets_a_did_you_mean() -> None:
    problems = _problems({"search_spaces": {}})
    assert any(
        "search_spaces: unknown key (did you mean 'search_space'?); known: study, "
        "search_space, model" in p
        for p in problems
    ), problems


def _problems(raw: Any, base_dir: Path = Path(".")) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=base_dir)
    return caught.value.problems


def _bomb_yaml(key: str, depth: int = 9) -> str:
    """A "billion laughs" value: 9 aliases of 9 aliases ... expand to 9**depth strings."""
    lines = [f"{key}:", "  - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


def test_absent_sections_are_validated_like_present_ones() -> None:
    # An empty file used to reach the model loader and fail there with an AssertionError.
    problems = _problems({})
    assert problems == [
        "model.name_or_path: give exactly one of name_or_path or config "
        "(the model: section is missing or empty)",
        "data.train_file: is required: a path to the data (the data: section is missing or empty)",
        "data.eval_file: is required: a path to held-out rows each trial is scored on, in "
        "train_file's formats; with one file, move about a tenth of its rows into another and "
        "name that here (the data: section is missing or empty)",
    ]


@pytest.mark.parametrize("section", ["model", "data"])
def test_a_missing_section_names_its_required_keys(
    easy_data: tuple[Path, Path], section: str
) -> None:
    raw = tiny_config(*easy_data)
    del raw[section]
    text = "\n".join(_problems(raw))
    expected = {"model": ["model.name_or_path"], "data": ["data.train_file", "data.eval_file"]}
    for key in expected[section]:
        assert f"{key}: " in text and "section is missing" in text
    assert "save_to_disk" not in text


def test_an_alias_bomb_is_reported_in_a_short_line_at_once(tmp_path: Path) -> None:
    for key in ("study", "search_space"):
        path = tmp_path / f"{key}.yaml"
        path.write_text(_bomb_yaml(key))
        started = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert time.monotonic() - started < 2
        text = "\n".join(caught.value.problems)
        assert f"{key}: got a list [['lol', 'lol', 'lol', 'lol', ...], [[...], [...]" in text
        assert max(len(p) for p in caught.value.problems) < 300


def test_every_user_value_in_a_message_is_short() -> None:
    huge = {
        "study": {"n_trials": "x" * 1_000_000, "metric": list(range(10**5))},
        "training": {"seed": 10**5000, "learning_rate": 10**5000, "x" * 10_000: 1},
        "data": {"train_file": "t" * 100_000, "eval_file": "e"},
        "search_space": {"learning_rate": {"type": "categorical", "choices": [[[[1]]]]}},
    }
    problems = _problems(huge)
    assert len(problems) >= 5
    # The longest is the list of training's known keys (about 440 characters, growing with the
    # section): the user's 10 000-character key is cut to 80.
    assert max(len(p) for p in problems) < 700, max(problems, key=len)
    assert "training.seed: got an integer of about 5001 digits; must be in [0, 2**64)" in problems
    assert "training.learning_rate: got an integer of about 5001 digits; must be a number" in (
        problems
    )


def test_show_is_bounded_and_speaks_yaml() -> None:
    assert show(None) == "null" and show(True) == "true"
    assert show(1e-4) == "0.0001" and show("a") == "'a'"
    assert len(show("x" * 10**6)) <= MAX_SHOWN_CHARS
    nested: list[Any] = [1]
    for _ in range(50):
        nested = [nested] * 9
    assert len(show(nested)) <= MAX_SHOWN_CHARS  # 9**50 leaves: not expanded


def test_categorical_numbers_become_the_settings_type(tmp_path: Path) -> None:
    # YAML 1.1 reads 1e-4 as the string '1e-4': the range check compared it with 0 (TypeError)
    # and the trial would have received a string.
    path = tmp_path / "c.yaml"
    raw = tiny_config(tmp_path / "t.csv", tmp_path / "e.csv")
    raw["search_space"] = {
        "learning_rate": {"type": "categorical", "choices": ["LR1", 3.0e-4]},
        "effective_batch_size": {"type": "categorical", "choices": [16.0, 32]},
        "max_grad_norm": {"type": "categorical", "choices": [None, 1]},
    }
    for name in ("t.csv", "e.csv"):
        (tmp_path / name).write_text("text,label\na,b\n")
    write_config(path, raw)
    path.write_text(path.read_text().replace("LR1", "1e-4"))
    assert "- 1e-4\n" in path.read_text()
    space = load_config(path).search_space
    assert space["learning_rate"].choices == [1e-4, 3e-4]
    assert space["effective_batch_size"].choices == [16, 32]
    assert [type(c) for c in space["effective_batch_size"].choices] == [int, int]
    assert space["max_grad_norm"].choices == [None, 1.0]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    params = sample(study.ask(), space)
    assert isinstance(params["learning_rate"], float)
    assert isinstance(params["effective_batch_size"], int)


def test_categorical_choices_are_range_checked(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data)
    raw["search_space"]["learning_rate"] = {"type": "categorical", "choices": ["1e-4", -1e-4]}
    raw["search_space"]["weight_decay"] = {"type": "categorical", "choices": [0.1, "1e-1"]}
    raw["search_space"]["epochs"] = {"type": "categorical", "choices": [1, "two"]}
    text = "\n".join(_problems(raw))
    assert "search_space.learning_rate: value -0.0001 must be > 0" in text
    assert "search_space.weight_decay.choices: 0.1 is listed twice" in text
    assert "search_space.epochs: value 'two' must be an integer" in text


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"type": "int", "low": 1, "high": 4, "step": 0}, "step: got 0.0; must be a positive"),
        ({"type": "int", "low": 1, "high": 4, "step": -1}, "step: got -1.0; must be a positive"),
        ({"type": "int", "low": 1, "high": 4, "step": 1.5}, "step: got 1.5; must be a positive"),
        ({"type": "float", "low": 0, "high": 0.2, "step": 0}, "step: got 0.0; must be > 0"),
        ({"type": "float", "low": 0, "high": 0.2, "step": -0.1}, "step: got -0.1; must be > 0"),
        ({"type": "float", "low": 0, "high": 0.2, "step": 0.5}, "must be <= high - low (0.2)"),
        ({"type": "float", "low": 0, "high": 0.2, "step": ".nan"}, "step: got '.nan'; must be a"),
        ({"type": "float", "low": 0.01, "high": 0.2, "step": 0.1, "log": True}, "cannot be comb"),
        ({"type": "categorical", "choices": [0.1], "low": 0}, "low: got 0.0; only for type: float"),
        ({"type": "float", "low": 0, "high": 0.2, "choices": [0.1]}, "choices: got [0.1]; only"),
        ({"type": "float", "low": -math.inf, "high": 0.2}, "low: got -inf; must be a finite"),
        ({"type": "floaty", "low": 0, "high": 0.2}, "type: got 'floaty'; must be one of"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, str) else None,
)
def test_a_search_dimension_optuna_cannot_sample_is_refused(
    easy_data: tuple[Path, Path], spec: dict[str, Any], expected: str
) -> None:
    raw = tiny_config(*easy_data)
    name = "epochs" if spec["type"] == "int" else "warmup_ratio"
    raw["search_space"][name] = spec
    problems = _problems(raw)
    assert len(problems) == 1 and problems[0].startswith(f"search_space.{name}."), problems
    assert expected in problems[0], problems


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "int", "low": 1, "high": 5, "step": 2},
        {"type": "int", "low": 1, "high": 1, "step": 3},
        {"type": "float", "low": 0.0, "high": 0.2, "step": 0.05},
        {"type": "float", "low": 0.0, "high": 0.2, "step": 0.2},
    ],
)
def test_every_step_that_passes_can_be_sampled(
    easy_data: tuple[Path, Path], spec: dict[str, Any]
) -> None:
    raw = tiny_config(*easy_data)
    name = "epochs" if spec["type"] == "int" else "warmup_ratio"
    raw["search_space"] = {name: spec}
    space = parse_config(raw, base_dir=Path(".")).search_space
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        value = sample(study.ask(), space)[name]
        assert spec["low"] <= value <= spec["high"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "- a\n- b\n",
            "must hold a mapping of sections (study:, search_space:, model:, data:, "
            "training:), got a list ['a', 'b']",
        ),
        ("42\n", "got the number 42"),
        ("study: 5\n", "study: got the number 5; must be a mapping of keys"),
        (
            "study: {n_trials: 1}\nstudy: {n_trials: 2}\n",
            "key 'study' appears twice in one mapping; keep one (line 2, column 1)",
        ),
        ("study: {n_trials: -3}\n", "study.n_trials: got -3; must be a positive integer or null"),
        ("study: {n_trials: 1e3}\n", None),  # YAML 1.1 reads 1e3 as a string: a whole number
        ("study: {timeout: 1.0e+300}\n", "study.timeout: got 1e+300; must be at most 1e+09"),
        ("study: {sampler: {seed: -1}}\n", "study.sampler.seed: got -1; must be in [0, 2**32)"),
        ("training: {learning_rate: 1e400}\n", "learning_rate: got '1e400'; must be a finite"),
        ("training: {learning_rate: .nan}\n", "training.learning_rate: got nan; must be a finite"),
        ("training: {weight_decay: .inf}\n", "training.weight_decay: got inf; must be a finite"),
        ("training: {seed: 1" + "0" * 30 + "}\n", "training.seed: got 1000000000"),
        ("training: {lérning_rate: 1}\n", "training.lérning_rate: unknown key"),
        ("training: {1: 2}\n", "training.1: unknown key; known: physical_batch_size"),
        ("search_space: {learning_rate: null}\n", "search_space.learning_rate: is empty; give"),
        ("search_space: {null: {type: float}}\n", "search_space.null: unknown parameter"),
        ("search_space: [learning_rate]\n", "search_space: got a list ['learning_rate']; must"),
        (
            "search_space:\n  weight_decay: {type: categorical, choices: [0.1, abc, [1]]}\n",
            "search_space.weight_decay: value 'abc' must be a number",
        ),
        (
            "model: {config: {model_type: [bert], 1: x}, tokenizer: t}\n",
            "model.config: key 1 is not text; quote it",
        ),
        (
            "model: {config: {model_type: [bert]}, tokenizer: t}\n",
            "model.config.model_type: got ['bert']; must be a name, e.g. bert",
        ),
        (
            "model: {tokenizer: t, config: {model_type: bert, a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"
            + "".join(f", {k}: &{k} [{', '.join([f'*{p}'] * 10)}]" for p, k in ("ab", "bc", "cd"))
            + "}}\n",
            "model.config: holds more than 10000 values (a YAML alias repeated?)",
        ),
        (
            'data: {train_file: "a\\0b", eval_file: ~nosuchuser/e.csv}\n',
            "data.train_file: 'a\\x00b' not found",
        ),
        ("study: {n_trials: 1" + "0" * 5000 + "}\n", "a value cannot be read (Exceeds the limit"),
        ("study: {when: 2024-13-45}\n", "a value cannot be read (month must be in 1..12)"),
        ("study: " + "[" * 3000 + "]" * 3000 + "\n", "lists or mappings nested hundreds deep"),
        ("study: !!python/object:os.system {}\n", "not valid YAML: could not determine a "),
        ("study: {n_trials: 1}\n\t\n", "not valid YAML: found character '\\t'"),
    ],
)
def test_strange_yaml_is_a_config_error(
    tmp_path: Path, easy_data: tuple[Path, Path], text: str, expected: str | None
) -> None:
    path = tmp_path / "c.yaml"
    complete = yaml.safe_dump(
        {k: v for k, v in tiny_config(*easy_data).items() if f"{k}:" not in text}
    )
    path.write_text(text + ("" if text.startswith(("-", "42")) else complete), encoding="utf-8")
    if expected is None:
        assert load_config(path).study.n_trials == 1000
        return
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert any(expected in p for p in caught.value.problems), caught.value.problems


def test_merge_keys_may_override_without_counting_as_duplicates(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data)
    del raw["training"]
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(raw) + "training:\n  <<: {epochs: 1, device: cpu}\n  epochs: 3\n"
    )
    training = load_config(path).training
    assert (training.epochs, training.device) == (3, "cpu")


def test_an_unreadable_or_non_utf8_config_is_one_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("study: {metric: accuracy}  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_config(latin)
    assert caught.value.problems == ["not UTF-8 text (byte 0xe9 at offset 32); save it as UTF-8"]

    def refuse(*args: Any, **kwargs: Any) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError) as caught:
        load_config(latin)
    assert caught.value.problems == ["cannot read the file (Permission denied)"]


def test_a_password_in_a_value_of_the_wrong_kind_is_never_shown(tmp_path: Path) -> None:
    """`storage: [url]` or `storage: {url: ...}`: the error shows the value back, masked."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "study:\n  storage: ['postgresql://u:CfgSecret3@127.0.0.1/x']\n"
        "  artifact_store: {url: 's3://AKIA:DictSecret@bucket/p'}\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert "study.storage: got ['postgresql://u:***@127.0.0.1/x']" in str(raised.value)
    assert "Secret" not in str(raised.value) and "Secret" not in repr(raised.value.problems)
