#!/usr/bin/env bash
# slime's checks on one H200, in one device call: `bash benchmarks/gpu_run.sh STEP...` with steps from the case
# below (default: all). Needs the bundle of scripts/gpu_wheels.sh carried (`.gpubundle`): the Python packages the
# image lacks (ray, sglang-router, fastapi, ...), pre-installed and xz-compressed. Each step's log goes to
# $OUT/<step>.log; a summary table prints last.
set -u
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run_out}; mkdir -p $OUT /tmp/site
[ -e /tmp/site/ray ] || tar xJf .gpubundle/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
grpo() {  # PLACEMENT [smoke flags]: a GRPO run; metrics and curves come back as $OUT/grpo_<placement>...{jsonl,png}
  local tag; tag=$(printf 'grpo_%s' "$*" | tr -c 'a-zA-Z0-9_' '_')
  python3 benchmarks/gpu_grpo_smoke.py /tmp/$tag --placement "$@"; local rc=$?
  cp /tmp/$tag/run/metrics.jsonl $OUT/$tag.jsonl; cp /tmp/$tag/run/curves.png $OUT/$tag.png; return $rc
}
loop_bench() {  # TAG [smoke flags]: bench_loop.py; its metrics come back as $OUT/TAG_metrics.jsonl
  local tag=$1; shift
  python3 benchmarks/bench_loop.py /tmp/$tag "$@"; local rc=$?
  cp /tmp/$tag/loop/metrics.jsonl $OUT/${tag}_metrics.jsonl
  cat /tmp/$tag/loop/engine_*.log 2>/dev/null | grep -i "captured\|engine busy" | tail -12; return $rc
}
run_step() {
  case $1 in
    gpu_tests) python3 -m pytest -q -m gpu tests ;;
    profile_engine) python3 benchmarks/profile_engine.py ;;
    profile_w1_prefill) python3 benchmarks/profile_engine.py --prefill ;;
    engine_w1_steps) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1 --skip-hf --print-steps ;;
    engine_w1w5_new) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --print-steps ;;
    # Decode attention in the engine vs alone: aligned / unaligned contexts, a cache spread over most of the device,
    # and W1 with a KV cache sized to its need (9,000 blocks, 16 GB) instead of 90% of the device.
    attention_spread) python3 benchmarks/bench_paged_attention.py --cases decode_256x300,decode_256x320,decode_256x321,decode_256x384 &&
                      python3 benchmarks/bench_paged_attention.py --cases decode_256x300,decode_256x321,decode_256x384 --spread-gb 50 ;;
    attention_sweep_unaligned) python3 benchmarks/bench_paged_attention.py --sweep --iters 50 \
                                 --cases decode_256x300,decode_256x321,decode_256x352,decode_256x480 ;;
    # A/B in the engine: W1 on the decode attention config before 866b2fa (64-key tiles, 4 warps), file restored after.
    engine_w1_old_attention) f=slime/engine/layers/triton_paged_attention.py; cp $f /tmp/attention.py.bak
                             sed -i 's/^DOT_DECODE_CONFIG = .*/DOT_DECODE_CONFIG = KernelConfig(block_m=16, block_n=64, use_dot=True, num_warps=4, num_stages=3)/' $f
                             grep -n "^DOT_DECODE_CONFIG" $f
                             python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --print-steps; rc=$?
                             cp /tmp/attention.py.bak $f; return $rc ;;
    engine_w1_16k) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --print-steps --max-num-batched-tokens 16384 ;;
    # The fp8 KV cache: its kernels (store, attention, self-checks) compiled, then W1 / W5 in bf16 and fp8 KV.
    fp8_kv_gpu_tests) python3 -m pytest -q tests/engine/test_triton_kernels.py tests/engine/layers/test_paged_attention.py \
                        tests/engine/test_kv_cache.py tests/engine/test_engine_cuda.py -k "fp8 or kv_cache or cuda" ;;
    # An fp8 cache's tiles in fp16 (FP8_KV_IN_FP16) vs bf16: the kernel alone (configs swept at W1's mean and W5's
    # step), then the fp8 tests on the GPU.
    attention_fp8) python3 benchmarks/bench_paged_attention.py --kv-cache-dtype fp8_e4m3 --iters 50 \
                     --cases decode_256x300,decode_256x480,prefill_32x256 &&
                   python3 benchmarks/bench_paged_attention.py --kv-cache-dtype fp8_e4m3 --iters 50 --sweep \
                     --cases decode_256x384 | grep -v "splits  2" ;;
    # fp8 decode configs at the contexts a W1 decode run passes through (aligned and not), fp16 tiles only.
    attention_fp8_sweep) python3 benchmarks/bench_paged_attention.py --kv-cache-dtype fp8_e4m3 --fp8-tiles fp16 \
                           --iters 50 --sweep --sweep-decode-configs 16x1x4,32x1x4,32x1x3,64x1x3,64x2x3,64x2x4,32x2x4,128x4x2 \
                           --cases decode_256x300,decode_256x321,decode_256x384,decode_256x480,w5_decode_512x384 | grep "best\|kernel" ;;
    engine_fp8_kv_16k) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --kv-cache-dtype fp8_e4m3 --max-num-batched-tokens 16384 ;;
    engine_fp8_kv) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --kv-cache-dtype fp8_e4m3 ;;
    # Rollout/trainer log-prob mismatch with the fp8 KV cache against the bf16 one, same task (dense: 0.0073-0.0074).
    grpo_fp8_kv) grpo colocated --num-rollout 3 --task-dir /tmp/fp8_task "--train-args=--get-mismatch-metrics --sglang-kv-cache-dtype fp8_e4m3" ;;
    grpo_bf16_kv) grpo colocated --num-rollout 3 --task-dir /tmp/fp8_task --train-args=--get-mismatch-metrics ;;
    attention_gpu_tests) python3 -m pytest -q tests/engine/layers/test_paged_attention.py ;;
    engine_w1_small_kv) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1 --skip-hf --print-steps --num-kvcache-blocks 9000 ;;
    decode_gemm) python3 benchmarks/bench_decode_gemm.py --quick ;;  # decode matmuls: cuBLAS vs Triton tiles / split-K
    # Piecewise prefill graphs (prefill_graphs.py): their tests on CUDA (against the eager forward, whole generations,
    # the engine's CUDA and release tests with them on), then W1 / W5 with them and without them, same call.
    prefill_graphs_gpu_tests) python3 -m pytest -q -s tests/engine/test_prefill_graphs.py tests/engine/test_engine_cuda.py tests/engine/test_parked_graphs.py \
                                tests/backends/test_handover_gpu.py tests/engine/models/test_moe_cuda.py tests/engine/test_kv_cache.py -k "cuda or graph or arena or stable or engine" ;;
    engine_prefill_graphs_ab) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --print-steps &&
                              python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf --print-steps --no-prefill-cuda-graphs ;;
    # The prefill graphs' tests, then the device memory their pool holds for Qwen3-0.6B at 8192 / 16384 tokens (the log).
    prefill_graphs_final) python3 -m pytest -q tests/engine/test_prefill_graphs.py &&
                          for tokens in 8192 16384; do python3 -c "
import logging, sys, tempfile, torch; from pathlib import Path; sys.path.insert(0, '.')
logging.basicConfig(level=logging.INFO, format='%(message)s')
from benchmarks.engine_checkpoints import QWEN3_06B_SHAPE, build_checkpoint
from slime.engine.engine import Engine
path = build_checkpoint(Path(tempfile.mkdtemp()), QWEN3_06B_SHAPE, torch.bfloat16, 'cuda', seed=0)
Engine(str(path), device='cuda', dtype='bfloat16', max_num_seqs=256, max_model_len=1024, max_num_batched_tokens=$tokens)
" 2>&1 | grep "piecewise"; done ;;
    # The fused sampler's tests compiled (noise keys in the kernel, the merge kernel), then W1 / W5.
    sampler_gpu_tests) python3 -m pytest -q tests/engine/test_triton_kernels.py tests/engine/test_sampler.py -k "sample or draws or fused or sampling" ;;
    # The decode graph with the batch's halves on two streams (out of phase or not) against one stream.
    decode_streams) python3 benchmarks/bench_decode_streams.py ;;
    profile_engine_w5) python3 benchmarks/profile_engine.py --shape smollm-135m --num-prompts 512 ;;  # W5: host- or GPU-bound?
    bench_engine) python3 benchmarks/bench_engine.py --preset qwen3-0.6b ;;
    agent_adapter) python3 benchmarks/bench_agent_adapter.py --shape qwen3-0.6b --device cuda ;;
    engine_all) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload all ;;
    # Engine tensor / expert parallelism (needs 2 GPUs: --kind nvidia-h100-x2 or nvidia-h200-x2). The sharded model on
    # NCCL against one GPU, then W1 (0.6B) and W4 (Qwen3-8B shape) at TP=1 beside TP=2, then Qwen3-30B-A3B's layer
    # shape (8 of its 48 layers) at TP=2 and TP=2 x EP=2, then a shape one H100 cannot hold: Qwen3-30B-A3B's layers
    # x 64 (~81 GB of bf16 weights) at TP=2 (TP=1's start-up error names --rollout-num-gpus-per-engine).
    tp_gpu_tests) python3 -m pytest -q -m gpu tests/engine/parallel ;;
    engine_tp2) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w4 --skip-hf --tp-size 2 ;;
    engine_tp2_moe) python3 -c "from pathlib import Path; import torch; from benchmarks.engine_checkpoints import SHAPES, build_checkpoint; build_checkpoint(Path('/tmp/moe8l'), SHAPES['qwen3-30b-a3b-8l'], torch.bfloat16, 'cuda', 0)" &&
                    python3 benchmarks/bench_engine.py --preset qwen3-0.6b --model-path /tmp/moe8l --skip-hf --tp-size 2 &&
                    python3 benchmarks/bench_engine.py --preset qwen3-0.6b --model-path /tmp/moe8l --skip-hf --tp-size 2 --ep-size 2 ;;
    engine_tp2_no_fit) python3 -c "from pathlib import Path; import torch; from benchmarks.engine_checkpoints import SHAPES, build_checkpoint; build_checkpoint(Path('/tmp/moe64l'), dict(SHAPES['qwen3-30b-a3b-8l'], num_hidden_layers=64), torch.bfloat16, 'cuda', 0)" &&
                       python3 benchmarks/bench_engine.py --preset qwen3-0.6b --model-path /tmp/moe64l --skip-hf --tp-size 2 --num-prompts 64 ;;
    engine_trace) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --skip-hf --trace-steps 3 ;;
    engine_w1_plain) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --skip-hf --no-overlap-schedule ;;
    engine_w1_overlap) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --overlap-schedule ;;
    bench_train) python3 benchmarks/bench_train.py ;;
    bench_train_profile) python3 benchmarks/bench_train.py --profile --skip-baseline --num-iters 2 ;;
    train_4b_profile) python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --profile --skip-baseline --num-iters 1 ;;
    trainer_gpu_tests) python3 -m pytest -q tests/backends/fsdp_utils/test_backend_gpu.py ;;
    # async optimizer-state moves, flat onloads, device ref copies, the engine's discarding release and uninitialized KV
    # Weights and KV cache at fixed addresses (device_arena.py): the arena itself, the engine's graphs kept across
    # colocated releases (against fresh engines), the engine's CUDA tests (memory given back on release).
    arena_gpu_tests) python3 -m pytest -q -s tests/engine/test_device_arena.py tests/engine/test_parked_graphs.py tests/engine/test_engine_cuda.py \
                       tests/backends/test_handover_gpu.py -k "arena or stable or graph or engine or cuda" ;;
    # The engine alone generating a GRPO rollout's shape fresh vs right after a colocated release cycle.
    generate_after_release) python3 benchmarks/bench_generate_after_release.py /tmp/after_release ;;
    arena_quick_gpu_tests) python3 -m pytest -q -s tests/engine/test_device_arena.py tests/engine/test_parked_graphs.py tests/engine/models/test_moe_cuda.py \
                             tests/backends/test_handover_gpu.py -k "arena or stable or graph or routing or released_without" ;;
    handover_gpu_tests) python3 -m pytest -q tests/backends/test_handover_gpu.py tests/backends/fsdp_utils/test_backend_gpu.py tests/engine/test_engine_cuda.py tests/engine/test_triton_kernels.py ;;
    offload_gpu_tests) python3 -m pytest -q -s tests/backends/test_handover_gpu.py tests/backends/fsdp_utils/test_backend_gpu.py tests/backends/test_host_storage_copies.py \
                         tests/backends/megatron_utils/test_offload.py ;;  # the trainers' offload by storage (host_storage_copies.py)
    trainer_handover) python3 benchmarks/bench_trainer_handover.py --model-shape qwen3-0.6b ;;
    trainer_flags_gpu_tests) python3 -m pytest -q tests/backends/test_train_flow_flags_gpu.py ;;  # slime's trainer-side flags
    engine_quick_tests) python3 -m pytest -q -m gpu tests/engine/test_engine_cuda.py tests/engine/test_overlap.py tests/engine/server/test_app_gpu.py ;;
    memory_gpu_tests) python3 -m pytest -q tests/backends/fsdp_utils/test_backend_gpu.py tests/engine/test_engine_cuda.py ;;
    train_06b) python3 benchmarks/bench_train.py --model-shape qwen3-0.6b --micro-batch-size 4 ;;
    train_06b_compile) python3 benchmarks/bench_train.py --model-shape qwen3-0.6b --compile-model --skip-baseline ;;
    train_06b_32k) python3 benchmarks/bench_train.py --model-shape qwen3-0.6b --max-tokens-per-gpu 32768 --skip-baseline ;;
    train_06b_recompute) python3 benchmarks/bench_train.py --model-shape qwen3-0.6b --recompute-activations --skip-baseline ;;
    train_17b) python3 benchmarks/bench_train.py --model-shape qwen3-1.7b --micro-batch-size 2 ;;
    train_17b_compile) python3 benchmarks/bench_train.py --model-shape qwen3-1.7b --compile-model --skip-baseline ;;
    train_4b) python3 benchmarks/bench_train.py --model-shape qwen3-4b --micro-batch-size 2 ;;
    kernel_tests) python3 -m pytest -q tests/backends/fsdp_utils/test_backend_gpu.py tests/backends/test_triton_log_probs.py tests/backends/test_log_probs.py tests/engine/layers/test_paged_attention.py tests/engine/test_triton_kernels.py ;;
    bench_attention) python3 benchmarks/bench_paged_attention.py --sweep ;;
    # The DeepSeek-V3 family: the MLA kernel and the engine on it (bf16, CUDA graphs), FSDP's packed flash path.
    mla_gpu_tests) python3 -m pytest -q tests/engine/layers/test_triton_mla_decode.py tests/engine/models/test_deepseek_v3_cuda.py \
                     tests/backends/fsdp_utils/test_deepseek_v3.py ;;
    bench_mla_decode) python3 benchmarks/bench_mla_decode.py && python3 benchmarks/bench_mla_decode.py --sweep --iters 30 ;;
    # Moonlight's layers cut to 4 (benchmarks/gpu_grpo_smoke.py's moonlight-4l): the engine against transformers generate
    engine_moonlight) python3 -c "from benchmarks.gpu_grpo_smoke import SHAPES; from slime.utils.tiny_model import build_tiny_model; \
s = dict(SHAPES['moonlight-4l']); build_tiny_model('/tmp/moonlight4l', arch=s.pop('arch'), **s)" &&
                      python3 benchmarks/bench_engine.py --model-path /tmp/moonlight4l --workload w1 --device cuda --dtype bfloat16 ;;
    grpo_moonlight_r3) grpo colocated --shape moonlight-4l --train-args='--use-rollout-routing-replay --get-mismatch-metrics' ;;
    bench_log_probs) python3 benchmarks/bench_log_probs.py ;;
    bench_varlen) python3 benchmarks/bench_varlen_attention.py --model-shape qwen3-4b ;;
    train_06b_c) python3 benchmarks/bench_train.py --model-shape qwen3-0.6b --compile-model --micro-batch-size 4 ;;
    train_17b_c) python3 benchmarks/bench_train.py --model-shape qwen3-1.7b --compile-model --micro-batch-size 2 ;;
    train_4b_c) python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --micro-batch-size 2 ;;
    train_4b_c_keep) python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --micro-batch-size 2 --no-reshard-after-forward ;;
    train_4b_c_keep_skip) python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --no-reshard-after-forward --skip-baseline ;;
    train_4b_keep_profile) python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --no-reshard-after-forward --profile --skip-baseline --num-iters 1 ;;
    train_4b_c_skip) python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --skip-baseline ;;
    train_4b_c_es) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --micro-batch-size 2 ;;
    train_4b_c_8k) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/bench_train.py --model-shape qwen3-4b --compile-model --micro-batch-size 2 --max-tokens-per-gpu 8192 ;;
    overlap_tests) python3 -m pytest -q -m gpu tests/engine/test_overlap.py tests/engine/test_host_staging.py tests/engine/test_engine_cuda.py ;;
    engine_gpu_tests) python3 -m pytest -q tests/engine/test_triton_kernels.py tests/engine/test_overlap.py tests/engine/test_host_staging.py tests/engine/test_engine_cuda.py tests/engine/server/test_app_gpu.py ;;
    train_06b_32k_rc) python3 benchmarks/bench_train.py --model-shape qwen3-0.6b --max-tokens-per-gpu 32768 --recompute-activations --compile-model --skip-baseline ;;
    ft_colocated) SLIME_RUN_SLOW=1 python3 -m pytest -q tests/e2e/test_fault_tolerance.py -k colocated ;;  # engine killed mid-rollout
    grpo_smoke) grpo colocated ;;
    # The RL-speed issue: host work per decode step (CPU, device faked) on this host, W1 and the 135M shape at
    # batch 512 (W5) with HF's ratio, and the GRPO loop against its standalone floors.
    engine_speed) python3 benchmarks/bench_engine.py --workload host &&
                  python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --hf-workloads w1,w5 ;;
    # The prefill phase under the profiler (W1's model, then W5's), and W1 / W5 at larger prefill chunks.
    profile_engine_prefill) python3 benchmarks/profile_engine.py --prefill &&
                            python3 benchmarks/profile_engine.py --prefill --shape smollm-135m --num-prompts 512 ;;
    engine_chunks) for tokens in 8192 32768 16384; do
                     python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf \
                       --max-num-batched-tokens $tokens || exit; done ;;
    # Overlapped prefill on and off (W1, W5), its CUDA-graph test, and the attention kernel's configs on W1's and
    # W5's decode shapes and W1's prefill chunk.
    engine_overlap_prefill) for flag in --overlap-prefill --no-overlap-prefill; do
                              python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf $flag ||
                              exit; done ;;
    overlap_gpu_tests) python3 -m pytest -q -m gpu tests/engine/test_overlap.py ;;
    engine_kernel_gpu_tests) python3 -m pytest -q tests/engine/layers/test_paged_attention.py tests/engine/test_triton_kernels.py \
                               tests/engine/test_engine_cuda.py && python3 -m pytest -q -m gpu tests/engine/test_overlap.py ;;
    engine_w1w5) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --hf-workloads w1,w5 ;;
    engine_w1w5_16k) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf \
                       --max-num-batched-tokens 16384 ;;
    engine_w1w5_no_overlap_prefill) python3 benchmarks/bench_engine.py --preset qwen3-0.6b --workload w1,w5 --skip-hf \
                                      --no-overlap-prefill ;;
    attention_sweep) python3 benchmarks/bench_paged_attention.py --sweep \
                       --cases decode_256x384,decode_256x512,w5_decode_512x384,prefill_32x256 ;;
    engine_host) python3 benchmarks/bench_engine.py --workload host ;;  # host work per decode step, device faked
    rollout_io) python3 benchmarks/bench_rollout_io.py ;;  # the rollout's per-sample JSON / Sample work, host CPU only
    # The trainer's layers compiled (its steady speed); rollouts 0-1 are warm-up, dynamo's recompiles are logged.
    loop_bench) TORCH_LOGS=recompiles loop_bench loop_bench --train-args=--compile-model --num-rollout 7 --warmup-rollouts 2 ;;
    loop_bench_eager) loop_bench loop_bench_eager ;;
    # The same with the engine's KV cache sized near the rollout's need (~40 GB for its 14.7 GB of KV) instead of 90%
    # of the device: the colocated hand-over frees and allocates it every rollout (120 GB: 409 ms alone).
    loop_bench_kv_sized) TORCH_LOGS=recompiles loop_bench loop_bench_kv_sized \
                           "--train-args=--compile-model --sglang-mem-fraction-static 0.3" --num-rollout 7 --warmup-rollouts 2 ;;
    # The same with the engine's prefill and mixed steps eager (Config.prefill_cuda_graphs off; file restored after).
    loop_bench_kv_sized_eager_prefill) f=slime/engine/config.py; cp $f /tmp/config.py.bak
                           sed -i 's/^    prefill_cuda_graphs: bool = True/    prefill_cuda_graphs: bool = False/' $f; grep -n "prefill_cuda_graphs: bool" $f
                           TORCH_LOGS=recompiles loop_bench loop_bench_kv_sized_eager_prefill \
                             "--train-args=--compile-model --sglang-mem-fraction-static 0.3" --num-rollout 7 --warmup-rollouts 2; rc=$?
                           cp /tmp/config.py.bak $f; return $rc ;;
    # And with the trainer staying on the GPU (slime's "no offload in colocate"): only the engine releases and resumes.
    loop_bench_resident) TORCH_LOGS=recompiles loop_bench loop_bench_resident \
                           "--train-args=--compile-model --sglang-mem-fraction-static 0.3 --no-offload-train" \
                           --num-rollout 7 --warmup-rollouts 2 ;;
    # Neither side offloads (slime's --no-offload-train --no-offload-rollout under --colocate): the hand-over is the
    # weight push alone, and the engine keeps its CUDA graphs (weights and KV cache stay where they are).
    loop_bench_no_offload) TORCH_LOGS=recompiles loop_bench loop_bench_no_offload \
                           "--train-args=--compile-model --sglang-mem-fraction-static 0.3 --no-offload-train --no-offload-rollout" \
                           --num-rollout 7 --warmup-rollouts 2 ;;
    # The colocated hand-over's parts (release, resumes, per-bucket push: per-tensor vs packed handles, WeightSender)
    # against a real engine server, Qwen3-0.6B shape in bf16; then the CUDA IPC push into the real engine.
    # Then the device operations they are made of, alone (allocation, pinned / pageable copies, KV zero fill), and
    # the FSDP trainer's offload / onload alone (bytes, bandwidth).
    handover) python3 benchmarks/bench_handover.py /tmp/handover &&
              python3 benchmarks/handover_primitives.py --shape qwen3-0.6b &&
              python3 benchmarks/bench_trainer_handover.py --model-shape qwen3-0.6b &&
              python3 -m pytest -q tests/backends/test_weight_sender.py -k cuda ;;
    rollout_postprocess) python3 benchmarks/bench_rollout_postprocess.py ;;  # the manager's work after the samples are back, host CPU only
    # MoE (issue 16): Qwen3-30B-A3B's layer shapes, 8 layers, 64 experts, top-8 (3.2B params, 0.9B active).
    moe_gpu_tests) python3 -m pytest -q tests/engine/models/test_moe_cuda.py tests/engine/models/test_moe.py ;;
    # Vision-language: the VL engine's GPU tests (decode CUDA graphs vs generate, the Qwen2.5-VL-3B shape), then the
    # engine against transformers generate with images.
    vl_gpu_tests) python3 -m pytest -q tests/engine/models/test_vl_engine_cuda.py tests/engine/models/test_vl_engine.py ;;
    bench_vl_engine) python3 benchmarks/bench_vl_engine.py ;;
    vl_train_gpu_tests) python3 -m pytest -q tests/backends/fsdp_utils/test_vision_language_gpu.py tests/backends/fsdp_utils/test_vision_language.py ;;
    moe_engine) python3 benchmarks/engine_checkpoints.py qwen3-30b-a3b-8l /tmp/moe_ckpt && python3 benchmarks/bench_engine.py --preset qwen3-0.6b --model-path /tmp/moe_ckpt ;;
    moe_train) python3 benchmarks/bench_train.py --model-shape qwen3-30b-a3b-8l --micro-batch-size 2 ;;
    moe_train_c) python3 benchmarks/bench_train.py --model-shape qwen3-30b-a3b-8l --micro-batch-size 2 --compile-model ;;
    moe_grpo_r3) grpo colocated --shape qwen3-30b-a3b-8l --num-rollout 3 --task-dir /tmp/moe_task "--train-args=--use-rollout-routing-replay --get-mismatch-metrics" ;;
    moe_grpo_free) grpo colocated --shape qwen3-30b-a3b-8l --num-rollout 3 --task-dir /tmp/moe_task --train-args=--get-mismatch-metrics ;;
    grpo_compiled) grpo colocated --train-args=--compile-model ;;
    # --train-backend megatron (TP=1) beside the FSDP backend and the transformers baseline, then a colocated GRPO run.
    megatron_gpu_tests) python3 -m pytest -q tests/backends/megatron_utils/test_model.py tests/backends/megatron_utils/test_backend.py -k "not tp2" ;;
    train_06b_megatron) python3 benchmarks/bench_train.py --backend megatron --model-shape qwen3-0.6b --micro-batch-size 4 ;;
    train_17b_megatron) python3 benchmarks/bench_train.py --backend megatron --model-shape qwen3-1.7b --micro-batch-size 2 ;;
    # 4B: 8k-token micro-batches (at 16k the Megatron step's activations do not fit beside its fp32 grad buffer)
    train_4b_megatron) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/bench_train.py --backend megatron --model-shape qwen3-4b --micro-batch-size 2 --max-tokens-per-gpu 8192 ;;
    megatron_offload_gpu_tests) python3 -m pytest -q -m gpu tests/backends/megatron_utils/test_offload.py ;;  # colocated offload, fp32 and bf16
    grpo_megatron) grpo colocated --train-args=--train-backend=megatron ;;
    # PPO with the Megatron critic, colocated (the critic's device memory offloaded outside its values and update).
    megatron_critic_gpu_tests) python3 -m pytest -q -m gpu tests/backends/megatron_utils/test_critic.py ;;  # the critic's offload, bf16
    ppo_megatron) grpo colocated --num-rollout 3 "--train-args=--train-backend=megatron --advantage-estimator=ppo --num-critic-only-steps=1" ;;
    # MoE on --train-backend megatron (issues 15/16): the 8-layer Qwen3-30B-A3B shape with R3, then routing freely.
    moe_grpo_megatron_r3) grpo colocated --shape qwen3-30b-a3b-8l --num-rollout 3 --task-dir /tmp/moe_task "--train-args=--train-backend=megatron --use-rollout-routing-replay --get-mismatch-metrics" ;;
    moe_grpo_megatron_free) grpo colocated --shape qwen3-30b-a3b-8l --num-rollout 3 --task-dir /tmp/moe_task "--train-args=--train-backend=megatron --get-mismatch-metrics" ;;
    # The same with grouped experts (--moe-grouped-gemm, as slime's MoE presets pass it).
    moe_grpo_megatron_grouped_r3) grpo colocated --shape qwen3-30b-a3b-8l --num-rollout 3 --task-dir /tmp/moe_task "--train-args=--train-backend=megatron --moe-grouped-gemm --use-rollout-routing-replay --get-mismatch-metrics" ;;
    moe_grpo_megatron_grouped_free) grpo colocated --shape qwen3-30b-a3b-8l --num-rollout 3 --task-dir /tmp/moe_task "--train-args=--train-backend=megatron --moe-grouped-gemm --get-mismatch-metrics" ;;
    # Megatron MoE experts: grouped (--moe-grouped-gemm, torch grouped_mm) beside FSDP and transformers, then
    # megatron-core's SequentialMLP loop on the same shape; the grouped path's GPU test.
    moe_train_megatron) python3 benchmarks/bench_train.py --backend megatron --model-shape qwen3-30b-a3b-8l --micro-batch-size 2 --moe-grouped-gemm ;;
    moe_train_megatron_sequential) python3 benchmarks/bench_train.py --backend megatron --model-shape qwen3-30b-a3b-8l --skip-baseline ;;
    moe_megatron_gpu_tests) python3 -m pytest -q tests/backends/megatron_utils/test_grouped_experts_gpu.py ;;
    # Two GPUs (nvidia-h200-x2): the multi-GPU issue's runs.
    multi_gpu_tests) python3 -m pytest -q tests/backends/fsdp_utils/test_multi_gpu.py tests/backends/test_weight_sender.py ;;
    weight_sync_gpu_tests) python3 -m pytest -q tests/backends/test_weight_disk.py tests/engine/server/test_local_checkpoint.py ;;  # disk / delta sync from a CUDA trainer (needs a bundle with xxhash, zstandard)
    grpo_disagg) grpo disaggregated ;;
    grpo_colocated2) grpo colocated-2 ;;
    grpo_async) grpo disaggregated --async ;;
    megatron_vpp_gpu_tests) python3 -m pytest -q tests/backends/megatron_utils/test_multi_gpu.py -k vpp ;;  # PP=2 x VPP=2 over NCCL vs PP=1
    megatron_cp_gpu_tests) python3 -m pytest -q tests/backends/megatron_utils/test_multi_gpu.py -k cp2 ;;  # CP=2 over NCCL (2 GPUs) vs CP=1
    *) echo "unknown step $1"; return 2 ;;
  esac
}
if [ "${1:-}" = --one ]; then run_step $2; exit $?; fi  # one step, in its own process so a timeout can end it
steps=${*:-gpu_tests bench_engine bench_train grpo_smoke}
for name in $steps; do
  start=$(date +%s); timeout ${STEP_TIMEOUT:-600} bash "$0" --one $name > $OUT/$name.log 2>&1; rc=$?
  [ $rc = 0 ] || ray stop --force > /dev/null 2>&1  # a step cut off by its timeout leaves its Ray cluster behind
  # a GRPO run cut off by its timeout still returns its rollouts' rows (only this step's: $OUT holds 8 files)
  for f in $(find /tmp -maxdepth 3 -path '/tmp/grpo_*/run/metrics.jsonl' -newermt "@$start"); do
    cp "$f" "$OUT/$(basename "$(dirname "$(dirname "$f")")").jsonl"
  done
  echo "$name rc=$rc $(( $(date +%s) - start ))s" >> $OUT/summary.txt
done
for name in $steps; do echo "== $name"; tail -n ${TAIL:-30} $OUT/$name.log; done
cat $OUT/summary.txt
