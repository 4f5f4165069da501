"""Ensembles of a study's models, built on arrays of the members' predictions: greedy selection,
stacking with scikit-learn meta-learners, honest scores, saving with skops, soups, a feature cache.

What a command calls: `evaluate_ensemble` (every candidate scored, the best stack fitted),
`save_ensemble` / `load_ensemble`, `uniform_soup` / `greedy_soup` / `adapter_soup`,
`FeatureCache`, `average_token_probabilities`; `evaluate_cached` reads a fitted ensemble
back from its `ReportCache` instead of fitting it again.
"""

from hpo.ensemble.cache import FeatureCache, default_cache_folder
from hpo.ensemble.errors import EnsembleError
from hpo.ensemble.honest import ChosenBy, EnsembleReport, Split, evaluate_ensemble
from hpo.ensemble.learners import Learner, available_learners, default_learner
from hpo.ensemble.report_cache import ReportCache, evaluate_cached
from hpo.ensemble.saving import SavedEnsemble, load_ensemble, save_ensemble, weights_sha256
from hpo.ensemble.scoring import average, average_token_probabilities, check_stackable
from hpo.ensemble.selection import Selection, greedy_selection
from hpo.ensemble.soups import GreedySoup, adapter_soup, greedy_soup, uniform_soup
from hpo.ensemble.stacking import FeatureSettings, StackedModel, fit_stacked, stack_features

__all__ = [
    "ChosenBy",
    "EnsembleError",
    "EnsembleReport",
    "FeatureCache",
    "FeatureSettings",
    "GreedySoup",
    "Learner",
    "ReportCache",
    "SavedEnsemble",
    "Selection",
    "Split",
    "StackedModel",
    "adapter_soup",
    "available_learners",
    "average",
    "average_token_probabilities",
    "check_stackable",
    "default_cache_folder",
    "default_learner",
    "evaluate_cached",
    "evaluate_ensemble",
    "fit_stacked",
    "greedy_selection",
    "greedy_soup",
    "load_ensemble",
    "save_ensemble",
    "stack_features",
    "uniform_soup",
    "weights_sha256",
]
