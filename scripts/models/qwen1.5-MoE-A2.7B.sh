# Qwen1.5-MoE-A2.7B model shape (Qwen2-MoE: 24 layers, 60 experts, top-4, a shared expert with a sigmoid gate),
# slime's Megatron-style flags; train.py checks the shape and MoE flags against --hf-checkpoint's config.json.
# Usage: source scripts/models/qwen1.5-MoE-A2.7B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 24
   --hidden-size 2048
   --ffn-hidden-size 5632
   --num-attention-heads 16
   --kv-channels 128
   --vocab-size 151936
   --rotary-base 1000000
   --norm-epsilon 1e-6
   --normalization RMSNorm
   --swiglu
   --add-qkv-bias
   --use-rotary-position-embeddings
   --untie-embeddings-and-output-weights
   --num-experts 60
   --moe-router-topk 4
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 5632
   --moe-layer-freq 1
   --moe-router-score-function softmax
   --moe-grouped-gemm
   --moe-aux-loss-coeff 0
)
