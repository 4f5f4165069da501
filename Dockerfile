# hpo worker and dashboard image. PyPI's torch wheel for Linux x86_64 ships with CUDA.
FROM python:3.11-slim
# An init as PID 1: it reaps the worker's orphaned grandchildren (DataLoader workers of a killed
# trial process), which Kubernetes leaves to the container's first process. `-s`: a subreaper
# too, where something else is PID 1 (compose's `init: true`). Signals go to hpo, as before.
RUN apt-get update && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY hpo ./hpo
COPY trainer ./trainer
COPY storage ./storage
RUN pip install --no-cache-dir "torch>=2.4,<3" && pip install --no-cache-dir .
COPY configs ./configs
COPY data ./data
ENTRYPOINT ["tini", "-s", "--", "hpo"]
