"""Study names that print alike (issue 42, 8): `café` typed with a combined é or with e and a
combining accent is one study, a look-alike of a study in the database is refused, and the names
that do not show what they are print escaped."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

import hpo
from hpo.config.schema import Config, ParamSpec, StudyConfig
from hpo.errors import HPOError
from hpo.reports.text import studies_table
from hpo.storage.engine import open_storage
from hpo.storage.url import StorageURL
from hpo.study.join import open_study
from hpo.study.names import check_no_lookalike, checked_study_name, shown_study_name

COMPOSED = unicodedata.normalize("NFC", "café")  # é as one character
DECOMPOSED = unicodedata.normalize("NFD", "café")  # e and a combining accent


def test_a_name_in_any_unicode_form_becomes_its_composed_form() -> None:
    assert COMPOSED != DECOMPOSED
    assert checked_study_name(DECOMPOSED) == COMPOSED
    assert checked_study_name(COMPOSED) == COMPOSED


@pytest.mark.parametrize(
    "new",
    ["Café", "CAFÉ", DECOMPOSED, "ca\u200bfé", "café\u00ad"],
    ids=["capital", "upper case", "decomposed", "zero-width space", "soft hyphen"],
)
def test_a_new_name_that_looks_like_a_stored_one_is_refused_naming_it(new: str) -> None:
    with pytest.raises(HPOError) as refused:
        check_no_lookalike(new, ["other", COMPOSED])
    message = str(refused.value)
    assert "\n" not in message and "already holds study 'café'" in message
    assert "pass that name exactly to join it" in message


def test_the_same_name_or_a_different_one_is_no_lookalike() -> None:
    check_no_lookalike(COMPOSED, [COMPOSED, DECOMPOSED])  # joins the study of that very name
    check_no_lookalike("cafe", [COMPOSED])  # an e without accent reads differently


def test_names_that_do_not_show_what_they_are_print_escaped() -> None:
    assert shown_study_name(COMPOSED) == "café"
    assert shown_study_name(DECOMPOSED) == "'cafe\\u0301'"
    assert shown_study_name("a\u200bb") == "'a\\u200bb'"
    assert shown_study_name("tab\there") == "'tab\\there'"
    rows = [
        {
            "name": name,
            "direction": "maximize",
            "directions": ["maximize"],
            "n_trials": 1,
            "best_value": None,
        }
        for name in (COMPOSED, DECOMPOSED)
    ]
    table = studies_table(rows).splitlines()  # `hpo studies`: the two rows read differently
    assert table[1].startswith("café ") and table[2].startswith("'cafe\\u0301' ")


def _config() -> Config:
    return Config(
        study=StudyConfig(n_trials=1), search_space={"x": ParamSpec(type="float", low=0, high=1)}
    )


def test_a_study_that_looks_like_a_stored_one_is_refused_and_nothing_is_created(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'names.db'}"
    # Made by plain Optuna, or by an hpo that kept names as typed.
    optuna.create_study(study_name=DECOMPOSED, storage=url, direction="maximize")
    storage = open_storage(StorageURL(url, "--storage"))
    try:
        with pytest.raises(HPOError, match=r"already holds study 'cafe\\u0301'"):
            open_study(storage, COMPOSED, _config())
        assert [s.study_name for s in storage.get_all_studies()] == [DECOMPOSED]
        assert open_study(storage, DECOMPOSED, _config()).study_name == DECOMPOSED  # joined
    finally:
        storage.engine.dispose()


def test_hpo_run_and_its_readers_take_a_decomposed_name_as_the_composed_study(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_fn.py").write_text("def train(ctx):\n    return {'loss': 1.0}\n")
    config = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {"metric": "loss", "direction": "minimize", "n_trials": 1},
        "search_space": {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}},
    }
    url = f"sqlite:///{tmp_path / 'names.db'}"
    result = hpo.run(config, study=DECOMPOSED, storage=url)
    assert result.study == COMPOSED and result.trials == {"complete": 1}
    assert [s.study_name for s in optuna.get_all_study_summaries(url)] == [COMPOSED]
    with hpo.open_study(DECOMPOSED, url) as study:  # found as typed either way
        assert len(study.trials()) == 1
    assert hpo_main(["status", "--study", DECOMPOSED, "--storage", url]) == 0
    assert "study 'café': 1 complete" in capsys.readouterr().out
