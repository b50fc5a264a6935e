#!/bin/bash
# The small-model equivalent of scripts/run-qwen3-4B.sh, on a CPU: the same flag groups and, where they apply, the
# same values, with the quickstart's tiny Qwen3 (4 layers, hidden 128, built locally, nothing downloaded) and its
# arithmetic task in place of Qwen3-4B and DAPO-Math-17k. What differs from the 4B recipe, and why:
#   MODEL_ARGS: the tiny model's shape (train.py checks it against its config.json), not a scripts/models preset;
#   CKPT_ARGS: the tiny model and a save folder under TASK_DIR;
#   ROLLOUT_ARGS / EVAL_ARGS: batch 4 prompts x 4 samples, 12 new tokens (the task's answers are a few tokens);
#   PERF_ARGS: --train-backend fsdp (megatron-core does not run on a CPU), so no TP / SP / recompute flags;
#   OPTIMIZER_ARGS: --lr 5e-4 (the quickstart's: 1e-6 would not move a random tiny model);
#   NUM_GPUS: trainer processes (and, with --colocate, engine ranks), default 2;
#   GPUS_PER_ENGINE: the 4B recipe's 2 (one engine of two ranks over the two processes), 1 when NUM_GPUS is 1.
# Usage: TASK_DIR=/tmp/tiny NUM_ROLLOUT=20 bash scripts/run-tiny-cpu.sh   (the task is built there when missing)

set -ex

export PYTHONUNBUFFERED=1

TASK_DIR=${TASK_DIR:-/tmp/slime-tiny-cpu}
SAVE_DIR=${SAVE_DIR:-${TASK_DIR}/ckpt}
NUM_ROLLOUT=${NUM_ROLLOUT:-20}
NUM_GPUS=${NUM_GPUS:-2}
if [ "$NUM_GPUS" -ge 2 ]; then DEFAULT_GPUS_PER_ENGINE=2; else DEFAULT_GPUS_PER_ENGINE=1; fi
GPUS_PER_ENGINE=${GPUS_PER_ENGINE:-${DEFAULT_GPUS_PER_ENGINE}}
echo "NUM_GPUS: $NUM_GPUS GPUS_PER_ENGINE: $GPUS_PER_ENGINE"

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
if [ ! -f "${TASK_DIR}/model/config.json" ]; then
   (cd "${SCRIPT_DIR}/.." && python3 -m examples.quickstart.task --out-dir "${TASK_DIR}")
fi

MODEL_ARGS=(
   --swiglu
   --num-layers 4
   --hidden-size 128
   --ffn-hidden-size 384
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 10000
   --vocab-size 300
   --kv-channels 32
   --qk-layernorm
)

CKPT_ARGS=(
   --hf-checkpoint ${TASK_DIR}/model
   --ref-load ${TASK_DIR}/model
   --load ${SAVE_DIR}/
   --save ${SAVE_DIR}/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data ${TASK_DIR}/train.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout ${NUM_ROLLOUT}
   --rollout-batch-size 4
   --n-samples-per-prompt 4
   --rollout-max-response-len 12
   --rollout-temperature 1

   --global-batch-size 16
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data arith ${TASK_DIR}/eval.jsonl
   --n-samples-per-eval-prompt 1
   --eval-max-response-len 12
   --eval-top-p 1
)

PERF_ARGS=(
   --train-backend fsdp

   # --micro-batch-size 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 5e-4
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project slime-dev
   # --wandb-group tiny-cpu
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine ${GPUS_PER_ENGINE}
   --sglang-mem-fraction-static 0.7
)

MISC_ARGS=(
   # default dropout in megatron is 0.1
   --attention-dropout 0.0
   --hidden-dropout 0.0
   # should be good for model performance
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   # need to comment this when using model with MLA
   --attention-backend flash
)

python3 "${SCRIPT_DIR}/../train.py" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node ${NUM_GPUS} \
   --colocate \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${WANDB_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${SGLANG_ARGS[@]} \
   ${MISC_ARGS[@]} \
   "$@"
