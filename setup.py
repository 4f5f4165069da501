"""Which folders the wheel installs, under which import names; everything else about the package
(its name, version, dependencies, extras) is in pyproject.toml.

The demo (configs/demo.yaml and its data, data/demo/) is package data of hpo, `hpo/_demo/` in the
wheel, laid out as in the repository so the config's relative data paths hold in both: `hpo run
--study demo` runs it in any folder. The repository keeps the one copy of those files.
"""

from setuptools import find_packages, setup

DEMO = {"hpo._demo.configs": "configs", "hpo._demo.data.demo": "data/demo"}

setup(
    packages=[
        *find_packages(include=["hpo", "hpo.*", "trainer", "trainer.*", "storage", "storage.*"]),
        *DEMO,
    ],
    package_dir=DEMO,
    package_data={"hpo._demo.configs": ["demo.yaml"], "hpo._demo.data.demo": ["*.csv"]},
)
