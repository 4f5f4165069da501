"""The study config: its schema (schema.py: typed sections, one description per field; space.py:
the search space's dimensions), the YAML loader that checks a file and reports every problem at
once (loader.py, with its checks beside it), the one place a trial's values become a TrainJob
(search_paths.with_params), and the JSON Schema editors read (json_schema.py, `hpo config
schema`).
"""

from hpo.config.loader import load_config, parse_config
from hpo.config.schema import Config, PrunerConfig, SamplerConfig, StudyConfig
from hpo.config.search_paths import with_params
from hpo.config.space import ParamSpec

__all__ = [
    "Config",
    "ParamSpec",
    "PrunerConfig",
    "SamplerConfig",
    "StudyConfig",
    "load_config",
    "parse_config",
    "with_params",
]
