"""Which folders the wheel installs, under which import names; everything else about the package
(its name, version, dependencies, extras) is in pyproject.toml.

One top-level package, `hpo`: the repository's trainer/ and storage/ folders (beside hpo/, the
project's layout) are installed as `hpo.trainer` and `hpo.storage`, names that collide with no
other package's. In a checkout, hpo/trainer and hpo/storage are links to those folders, so the
same names import there (PYTHONPATH=., mypy, lint-imports, an editable install).

The demo (configs/demo.yaml and its data, data/demo/) is package data of hpo, `hpo/_demo/` in the
wheel, laid out as in the repository so the config's relative data paths hold in both: `hpo run
--study demo` runs it in any folder. The repository keeps the one copy of those files.
"""

from setuptools import find_packages, setup

DEMO = {"hpo._demo.configs": "configs", "hpo._demo.data.demo": "data/demo"}
# Not through the links: the sdist holds the folders once, and a wheel built from it has no links.
INNER = ("trainer", "storage")
INNER_PACKAGES = [
    f"hpo.{name}" for name in find_packages(include=[p for i in INNER for p in (i, f"{i}.*")])
]

setup(
    packages=[
        *find_packages(include=["hpo", "hpo.*"], exclude=[f"hpo.{i}*" for i in INNER]),
        *INNER_PACKAGES,
        *DEMO,
    ],
    package_dir={**{f"hpo.{i}": i for i in INNER}, **DEMO},
    package_data={"hpo._demo.configs": ["demo.yaml"], "hpo._demo.data.demo": ["*.csv"]},
)
