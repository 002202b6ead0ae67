#!/usr/bin/env bash
# GPU benchmark of AR and Lopti against TRL's GRPOTrainer (the `cost` experiment of benchmarks/experiments.py, size
# `gpu`).
#
# Runs on a single CUDA GPU with nothing downloadable: the model is a randomly initialised Qwen2.5-1.5B-shaped Qwen2
# built from a config, bf16 autocast, plain `transformers` generation (no vLLM). Writes bench_gpu.json and
# bench_gpu.md under $OUT (default: benchmarks/results), the JSON after every variant, so a run cut short still
# returns what it measured. Variants (default): GRPO, AR, Lopti, AR + Lopti on TRL's GRPOTrainer, then RLOO, Lopti and
# AR + Lopti on TRL's RLOOTrainer. Budget: variants not started within 3m30s are skipped (and listed as skipped), and
# the benchmark is stopped at 5 minutes; with the two rehearsals below the whole run fits one 10-minute device call.
#
# Python packages: the benchmark needs trl==1.16.0, transformers>=5.24 and datasets. Where the machine lacks
# them, carry wheels in a folder (default .whl, see benchmarks/fetch_gpu_wheels.sh) and this script installs them
# with pip --no-index into /tmp/site first.
#
# Then, inside the same budget, the launch of the 3B AR + Lopti preset and of its RLOO twin under the shipped fsdp2.yaml
# is rehearsed on one CUDA process each (`trl-lopti grpo --rehearse`: tiny model, one Lopti cycle, a checkpoint and a
# resume, on CUDA with NCCL and bf16 mixed precision instead of the CPU tests' gloo); their output goes to
# $OUT/gpu_rehearsal.txt. A failure of either leaves the benchmark's files in place.
#
# Last, where vLLM is installed (its GPU build is too large to carry as wheels), one short vLLM cycle on the GPU in
# colocate mode (server mode needs a second GPU: NCCL takes one rank per device): the vLLM preset on the rehearsal's tiny
# model for two generation batches, with TRL's importance-sampling correction on, so that TRL logs how far vLLM's
# sampling log-probabilities lie from the trainer's after each weight load ($OUT/gpu_vllm_cycle.txt). It has not run
# on a GPU yet.
#
# Usage (repository root):  bash benchmarks/run_gpu.sh [arguments of `experiments.py cost`, e.g. --variants grpo lopti]
set -euo pipefail

OUT_DIR="${OUT:-benchmarks/results}"
WHEELS="${BENCH_WHEELS:-.whl}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The package itself, from the working tree (no install needed).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "$PYTHON" -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT_DIR/gpu_env.txt"

[ $# -gt 0 ] || set -- --variants grpo ar lopti ar+lopti rloo rloo-lopti rloo-ar+lopti
timeout 300 "$PYTHON" benchmarks/experiments.py cost --size gpu --time_budget_s 210 --output-dir "$OUT_DIR" "$@" \
    2>&1 | grep -v -i -E "warn|Loading weights|Writing model" | tee "$OUT_DIR/gpu_log.txt" || true

for run in grpo:qwen2.5-3b-instruct_ar_lopti rloo:qwen2.5-3b-instruct_rloo_ar_lopti; do  # command:preset
    preset=${run#*:}
    timeout 100 "$PYTHON" -m accelerate.commands.launch --config_file configs/accelerate/fsdp2.yaml --num_processes 1 \
        -m trl_lopti "${run%%:*}" --config "kk/$preset" --rehearse --output_dir "/tmp/rehearsal/$preset" 2>&1 \
        | grep -E "^rehearse|Error|error" | tee -a "$OUT_DIR/gpu_rehearsal.txt" \
        || echo "rehearsal of $preset failed (exit ${PIPESTATUS[0]})" | tee -a "$OUT_DIR/gpu_rehearsal.txt"
done

if "$PYTHON" -c "import vllm" 2>/dev/null; then
    "$PYTHON" -c "from trl_lopti.models import PEAKED_TINY_MODEL, build_tiny_model as build
build('/tmp/vllm-tiny', **PEAKED_TINY_MODEL)"
    timeout 300 "$PYTHON" -m trl_lopti grpo --config vllm/qwen2.5-3b-instruct_ar_lopti_server \
        --model_name_or_path /tmp/vllm-tiny --vllm_mode colocate --vllm_gpu_memory_utilization 0.2 \
        --vllm_max_model_length 2048 --vllm_importance_sampling_correction true --kk_source generated \
        --kk_num_samples 64 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --steps_per_generation 4 \
        --max_steps 8 --max_completion_length 64 --eval_strategy no --save_strategy no --report_to none \
        --logging_steps 1 --output_dir /tmp/vllm-gpu-cycle 2>&1 \
        | grep -E "sampling_logp_difference|lopti/|Error|error" | tee "$OUT_DIR/gpu_vllm_cycle.txt" \
        || echo "vLLM cycle failed (exit ${PIPESTATUS[0]})" | tee -a "$OUT_DIR/gpu_vllm_cycle.txt"
else
    echo "vLLM is not installed here: no vLLM cycle" | tee "$OUT_DIR/gpu_vllm_cycle.txt"
fi
