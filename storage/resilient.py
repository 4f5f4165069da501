"""An Optuna storage that rides out a database outage: it holds another storage and forwards
every call, retrying those that fail for lack of a connection (see outage.py), the way Optuna's
own `_CachedStorage` holds a backend rather than patching it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.storage.outage import retrying

if TYPE_CHECKING:  # Optuna names no public home for it; only a type here
    from optuna.study._frozen import FrozenStudy

T = TypeVar("T")


class ResilientStorage(BaseStorage):
    """Forwards to `backend`; with `patience_s`, a call that loses its connection is retried
    with backoff for up to that long before it raises StorageError."""

    def __init__(
        self,
        backend: BaseStorage,
        patience_s: float | None = None,
        database: str = "the study database",
    ) -> None:
        self.backend = backend
        self.patience_s = patience_s
        self.database = database  # how messages name it: its URL, password masked
        self.wrote = False  # a write went through: a refusal after it is news, not the start

    def _call(self, what: str, call: Callable[[], T]) -> T:
        if self.patience_s is None:
            return call()
        result = retrying(
            call, what, self.patience_s, wrote_before=self.wrote, database=self.database
        )
        if what.startswith(("create_", "set_", "delete_")):
            self.wrote = True
        return result

    # -- studies -----------------------------------------------------------------------------

    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        return self._call(
            "create_new_study", partial(self.backend.create_new_study, directions, study_name)
        )

    def delete_study(self, study_id: int) -> None:
        self._call("delete_study", partial(self.backend.delete_study, study_id))

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(
            "set_study_user_attr", partial(self.backend.set_study_user_attr, study_id, key, value)
        )

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(
            "set_study_system_attr",
            partial(self.backend.set_study_system_attr, study_id, key, value),
        )

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call(
            "get_study_id_from_name", partial(self.backend.get_study_id_from_name, study_name)
        )

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call(
            "get_study_name_from_id", partial(self.backend.get_study_name_from_id, study_id)
        )

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call(
            "get_study_directions", partial(self.backend.get_study_directions, study_id)
        )

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call(
            "get_study_user_attrs", partial(self.backend.get_study_user_attrs, study_id)
        )

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call(
            "get_study_system_attrs", partial(self.backend.get_study_system_attrs, study_id)
        )

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._call("get_all_studies", self.backend.get_all_studies)

    # -- trials ------------------------------------------------------------------------------

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._call(
            "create_new_trial", partial(self.backend.create_new_trial, study_id, template_trial)
        )

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        self._call(
            "set_trial_param",
            partial(
                self.backend.set_trial_param,
                trial_id,
                param_name,
                param_value_internal,
                distribution,
            ),
        )

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._call(
            "get_trial_id",
            partial(self.backend.get_trial_id_from_study_id_trial_number, study_id, trial_number),
        )

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._call(
            "get_trial_number", partial(self.backend.get_trial_number_from_id, trial_id)
        )

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._call(
            "get_trial_param", partial(self.backend.get_trial_param, trial_id, param_name)
        )

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        attempts = [0]

        def call() -> bool:
            attempts[0] += 1
            try:
                return self.backend.set_trial_state_values(trial_id, state, values)
            except optuna.exceptions.UpdateFinishedTrialError:
                # A retry after a commit whose answer the outage lost: it is already done.
                if attempts[0] > 1 and self.backend.get_trial(trial_id).state == state:
                    return True
                raise

        return self._call("set_trial_state_values", call)

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        self._call(
            "set_trial_intermediate_value",
            partial(self.backend.set_trial_intermediate_value, trial_id, step, intermediate_value),
        )

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(
            "set_trial_user_attr", partial(self.backend.set_trial_user_attr, trial_id, key, value)
        )

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(
            "set_trial_system_attr",
            partial(self.backend.set_trial_system_attr, trial_id, key, value),
        )

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._call("get_trial", partial(self.backend.get_trial, trial_id))

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        return self._call(
            "get_all_trials",
            partial(self.backend.get_all_trials, study_id, deepcopy=deepcopy, states=states),
        )

    def get_n_trials(
        self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None
    ) -> int:
        return self._call("get_n_trials", partial(self.backend.get_n_trials, study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call("get_best_trial", partial(self.backend.get_best_trial, study_id))

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_params", partial(self.backend.get_trial_params, trial_id))

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call(
            "get_trial_user_attrs", partial(self.backend.get_trial_user_attrs, trial_id)
        )

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call(
            "get_trial_system_attrs", partial(self.backend.get_trial_system_attrs, trial_id)
        )

    def remove_session(self) -> None:
        self.backend.remove_session()
