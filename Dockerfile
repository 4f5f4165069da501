# hpo worker and dashboard image. PyPI's torch wheel for Linux x86_64 ships with CUDA.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY hpo ./hpo
COPY trainer ./trainer
COPY storage ./storage
RUN pip install --no-cache-dir "torch>=2.4,<3" && pip install --no-cache-dir .
COPY configs ./configs
COPY data ./data
ENTRYPOINT ["hpo"]
