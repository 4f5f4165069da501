# hpo worker and dashboard image. PyPI's torch wheel for Linux x86_64 ships with CUDA.
#   PYTHON_IMAGE     the base (default python:3.11-slim)
#   PIP_FIND_LINKS,  pip's own settings, for a build without PyPI: a wheelhouse built with
#   PIP_NO_INDEX     `pip wheel` and mounted, e.g. `podman build -v $PWD/wheels:/wheels:ro
#                    --build-arg PIP_FIND_LINKS=/wheels --build-arg PIP_NO_INDEX=1 .`
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
# An init as PID 1: it reaps the worker's orphaned grandchildren (DataLoader workers of a killed
# trial process), which Kubernetes leaves to the container's first process. `-s`: a subreaper
# too, where something else is PID 1 (compose's `init: true`). Signals go to hpo, as before.
RUN apt-get update && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# The dependencies first, from pyproject.toml alone: a layer that a change of hpo's code keeps.
COPY pyproject.toml ./
# With the extras a deployment uses: s3 (an artifact store in S3) and ensemble (hpo ensemble).
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['s3'] \
+ p['optional-dependencies']['ensemble']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir "torch>=2.4,<3" \
    && pip install --no-cache-dir -r /tmp/requirements.txt "setuptools>=77" \
    && rm /tmp/requirements.txt
COPY README.md LICENSE setup.py ./
# configs/ and data/ before the install: the demo's config and data are package data (setup.py).
COPY configs ./configs
COPY data ./data
COPY hpo ./hpo
COPY trainer ./trainer
COPY storage ./storage
RUN pip install --no-cache-dir --no-deps --no-build-isolation . && rm -rf build *.egg-info
ENTRYPOINT ["tini", "-s", "--", "hpo"]
