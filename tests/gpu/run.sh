#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (one H200, 16 cores, no internet), under
# 11 minutes. Everything is built from configs: no model or data downloads.
#
#   bash tests/gpu/run.sh                # from the repository root (a copy of the working tree)
#
# Parts (each under its own timeout, so one failure never hides the others):
#   sglang-parity  SGLang vs the torch backend on a Qwen2-0.5B-shaped model (random weights)
#   vllm-parity    vLLM vs the torch backend, same model
#   nccl           bucketed NCCL weight broadcast (2 GPUs) + CUDA IPC sync (1 GPU), checksummed
#   megatron-step  one `rl360 train` step with --set trainer.backend=megatron on the GPU
#   sglang-bench   tokens/s through the session server vs SGLang's own API ({"bench": ...})
#   vllm-bench     the same for vLLM
#   fsdp-train     3 steps of `rl360 train` on one GPU: SGLang engine, FSDP trainer, NCCL (CUDA
#                  IPC, colocated) weight sync, the Qwen2-0.5B-shaped model (phase C)
# Setup: two venvs (--system-site-packages, so what the machine already has is used): one with
# sglang + megatron-core, one with vllm (they pin different torch builds). pip honours
# PIP_INDEX_URL / PIP_FIND_LINKS for a local mirror or wheelhouse; without one the installs
# fail fast, which is reported, and each part then says what it could not import.
# Logs: $OUT/gpu-check/ when OUT is set, else ./gpu-check-logs/; summary.json at the end.
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
LOGS="${OUT:+$OUT/gpu-check}"
LOGS="${LOGS:-$REPO/gpu-check-logs}"
mkdir -p "$LOGS"
WORK="${WORK:-$(mktemp -d /tmp/rl360-gpu.XXXXXX)}"
PY="${PYTHON:-python3}"
T_INSTALL="${T_INSTALL:-90}"   # seconds; every timeout below can be overridden the same way
T_MODEL="${T_MODEL:-40}"
T_PHASE="${T_PHASE:-165}"
START=$(date +%s)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

declare -A STATUS
note() { echo "[run.sh $(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOGS/run.log"; }

# ---------------------------------------------------------------- setup
note "repo $REPO, logs $LOGS, work $WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$LOGS/gpu.txt" 2>&1 \
  || note "nvidia-smi failed: no GPU visible?"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  note "FATAL: $PY is $("$PY" -V 2>&1); rl360 needs Python >= 3.11 (set PYTHON=...)"
  exit 2
fi
DEPS="$("$PY" - <<'EOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if not d.startswith("torch")), "httpx>=0.27")
EOF
)"
pins() {  # the exact pins of pyproject extras (the one place GPU versions live)
  "$PY" -c 'import sys, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(" ".join(x for e in sys.argv[1:] for x in extras[e]))' "$@"
}
SGLANG_PINS="$(pins sglang megatron)"
VLLM_PINS="$(pins vllm)"

make_venv() {  # name, packages...
  local name="$1"; shift
  local venv="$WORK/venv-$name"
  "$PY" -m venv --system-site-packages "$venv" >"$LOGS/install-$name.log" 2>&1 || return 1
  # shellcheck disable=SC2086
  timeout "$T_INSTALL" "$venv/bin/pip" install --disable-pip-version-check -q \
    "$@" $DEPS >>"$LOGS/install-$name.log" 2>&1
}
note "installing: $SGLANG_PINS venv, $VLLM_PINS venv (in parallel, ${T_INSTALL}s each)"
# shellcheck disable=SC2086
make_venv sglang $SGLANG_PINS & P1=$!
# shellcheck disable=SC2086
make_venv vllm $VLLM_PINS & P2=$!
wait $P1; RC1=$?; wait $P2; RC2=$?
for pair in "sglang:$RC1" "vllm:$RC2"; do
  n="${pair%%:*}"; rc="${pair##*:}"
  if [ "$rc" -ne 0 ]; then
    note "INSTALL FAILED for the $n venv (rc=$rc; 124 = timed out, often: no network and no"
    note "  PIP_INDEX_URL/PIP_FIND_LINKS). Last lines of $LOGS/install-$n.log:"
    tail -n 5 "$LOGS/install-$n.log" | sed 's/^/    /' | tee -a "$LOGS/run.log"
    note "  continuing with what the system site-packages provide"
  else
    note "install ok: $n venv"
  fi
done
SPY="$WORK/venv-sglang/bin/python"; VPY="$WORK/venv-vllm/bin/python"
[ -x "$SPY" ] || SPY="$PY"
[ -x "$VPY" ] || VPY="$PY"
for pair in "sglang:$SPY:sglang" "vllm:$VPY:vllm" "megatron:$SPY:megatron.core" \
            "ray:$SPY:ray" "torch-cuda:$SPY:torch"; do
  IFS=: read -r label py mod <<<"$pair"
  if "$py" -c "import $mod; import torch; assert torch.cuda.is_available() or '$label' != 'torch-cuda'" \
       >>"$LOGS/imports.log" 2>&1; then
    note "import ok: $label"
  else
    note "import FAILED: $label (see $LOGS/imports.log)"
  fi
done

# ---------------------------------------------------------------- parts
PIDS=()
run_part() {  # name, timeout, python, needed-modules, args...  (background; status -> file)
  local name="$1" t="$2" py="$3" needs="$4"; shift 4
  if ! "$py" -c "import ${needs//,/, }" >"$LOGS/$name.log" 2>&1; then
    echo "skip:$needs" >"$LOGS/$name.rc"
    return
  fi
  (
    timeout --kill-after=15 "$t" "$py" "$@" >"$LOGS/$name.log" 2>&1 </dev/null
    echo $? >"$LOGS/$name.rc"
  ) &
  PIDS+=($!)
}
part_status() {
  local name="$1" rc
  rc="$(cat "$LOGS/$name.rc" 2>/dev/null || echo missing)"
  case "$rc" in
    0) STATUS[$name]=PASS ;;
    124|137) STATUS[$name]="TIMEOUT" ;;
    missing) STATUS[$name]="NO RESULT" ;;
    skip:*) STATUS[$name]="SKIP (cannot import ${rc#skip:})" ;;
    *) STATUS[$name]="FAIL (rc=$rc)" ;;
  esac
  note "$name: ${STATUS[$name]}   (log: $LOGS/$name.log)"
  if [ "$rc" != 0 ]; then tail -n 8 "$LOGS/$name.log" | sed 's/^/    /' | tee -a "$LOGS/run.log"; fi
}

MODEL="$WORK/qwen2-0.5b-shape"
note "building the model from its config"
timeout "$T_MODEL" "$SPY" tests/gpu/gpu_check.py build-model "$MODEL" >"$LOGS/build-model.log" 2>&1 \
  || note "model build FAILED (see $LOGS/build-model.log); parity and bench parts will fail"

MEG_SETS=(--set "run.name=gpu-meg" --set "run.out_dir=\"$WORK/runs\"" --set "model.path='tiny'"
  --set "train.init=''" --set "ray.dashboard=false" --set "env.actors=1" --set "engine.num_cpus=1"
  --set "trainer.num_cpus=2" --set "trainer.num_gpus=1" --set "trainer.backend='megatron'"
  --set "trainer.micro_batch_size=4" --set "train.steps=1" --set "train.group_size=2"
  --set "train.groups_per_batch=2" --set "train.task_limit=2"
  --set "train.tasks=['examples/tasks/code.jsonl']" --set "train.sampling.max_tokens=16"
  --set "train.checkpoints.every=1" --set "train.wandb='offline'")

note "phase A (${T_PHASE}s): sglang-parity, vllm-bench, nccl, megatron-step"
PIDS=()
run_part sglang-parity "$T_PHASE" "$SPY" sglang tests/gpu/gpu_check.py parity --engine sglang \
  --model "$MODEL" --out "$LOGS/sglang-parity.json"
run_part vllm-bench "$T_PHASE" "$VPY" vllm,ray tests/gpu/gpu_check.py bench --engine vllm --model "$MODEL"
run_part nccl 120 "$SPY" torch,msgspec tests/gpu/gpu_check.py nccl --out "$LOGS/nccl.json"
RAY_ADDRESS=local run_part megatron-step "$T_PHASE" "$SPY" megatron.core,ray -m rl360 train recipes/cpu-demo.toml \
  "${MEG_SETS[@]}"
wait "${PIDS[@]}"
for p in sglang-parity vllm-bench nccl megatron-step; do part_status "$p"; done

note "phase B (${T_PHASE}s): vllm-parity, sglang-bench"
PIDS=()
run_part vllm-parity "$T_PHASE" "$VPY" vllm tests/gpu/gpu_check.py parity --engine vllm \
  --model "$MODEL" --out "$LOGS/vllm-parity.json"
run_part sglang-bench "$T_PHASE" "$SPY" sglang,ray tests/gpu/gpu_check.py bench --engine sglang --model "$MODEL"
wait "${PIDS[@]}"
for p in vllm-parity sglang-bench; do part_status "$p"; done

# the real loop on one GPU: engine and trainer share it (half each), weights by CUDA IPC
TRAIN_SETS=(--set "run.name=gpu-train" --set "run.out_dir=\"$WORK/runs\"" --set "model.path='$MODEL'"
  --set "model.family='qwen2'" --set "model.dtype='bfloat16'" --set "train.init=''"
  --set "ray.dashboard=false" --set "env.actors=1" --set "env.episodes_per_actor=16"
  --set "engine.backend='sglang'" --set "engine.num_gpus=0.5" --set "engine.num_cpus=2"
  --set "engine.options={mem_fraction_static=0.35}"
  --set "trainer.backend='fsdp'" --set "trainer.num_gpus=0.5" --set "trainer.num_cpus=2"
  --set "trainer.dtype='bfloat16'" --set "trainer.micro_batch_size=4"
  --set "train.weight_sync={transport='collective', backend='nccl'}"
  --set "train.steps=3" --set "train.group_size=2" --set "train.groups_per_batch=4"
  --set "train.task_limit=4" --set "train.tasks=['examples/tasks/code.jsonl']"
  --set "train.sampling.max_tokens=32" --set "train.checkpoints.every=0"
  --set "train.wandb='disabled'")
note "phase C (${T_PHASE}s): fsdp-train"
PIDS=()
RAY_ADDRESS=local run_part fsdp-train "$T_PHASE" "$SPY" sglang,ray -m rl360 train recipes/cpu-demo.toml \
  "${TRAIN_SETS[@]}"
wait "${PIDS[@]}"
part_status fsdp-train
grep -E "^step " "$LOGS/fsdp-train.log" 2>/dev/null | tee -a "$LOGS/run.log"

# ---------------------------------------------------------------- summary
note "summary (total $(( $(date +%s) - START ))s):"
for p in sglang-parity vllm-parity nccl megatron-step sglang-bench vllm-bench fsdp-train; do
  printf '  %-14s %s\n' "$p" "${STATUS[$p]:-NOT RUN}" | tee -a "$LOGS/run.log"
done
for p in sglang-bench vllm-bench; do  # their last line is the bench JSON
  line="$(tail -n 1 "$LOGS/$p.log" 2>/dev/null)"
  case "$line" in '{"bench"'*) echo "$line" | tee -a "$LOGS/run.log" ;; esac
done
{
  echo "{"
  first=1
  for p in sglang-parity vllm-parity nccl megatron-step sglang-bench vllm-bench fsdp-train; do
    [ $first -eq 1 ] || echo ","
    first=0
    printf '  "%s": "%s"' "$p" "${STATUS[$p]:-NOT RUN}"
  done
  echo; echo "}"
} >"$LOGS/summary.json"
fails=0
for p in "${!STATUS[@]}"; do
  case "${STATUS[$p]}" in PASS|SKIP*) ;; *) fails=$((fails + 1)) ;; esac
done
passed=0
for p in "${!STATUS[@]}"; do [ "${STATUS[$p]}" = PASS ] && passed=$((passed + 1)); done
[ "$passed" -gt 0 ] || { note "nothing passed: exit 2"; exit 2; }
exit $(( fails > 0 ? 1 : 0 ))
