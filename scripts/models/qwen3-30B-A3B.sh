# qwen3-30B-A3B model shape (48 layers, 128 experts, top-8), slime's Megatron-style flags; train.py checks the shape
# and MoE flags against --hf-checkpoint's config.json. The kernel flags (--moe-grouped-gemm, dispatcher, fusion)
# select Megatron kernels; the FSDP backend always runs grouped GEMM experts.
# Usage: source scripts/models/qwen3-30B-A3B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --vocab-size 151936
   --rotary-base 1000000
   --norm-epsilon 1e-6
   --normalization RMSNorm
   --swiglu
   --disable-bias-linear
   --use-rotary-position-embeddings
   --qk-layernorm
   --untie-embeddings-and-output-weights
   --num-experts 128
   --moe-router-topk 8
   --moe-ffn-hidden-size 768
   --moe-layer-freq ([1]*48)
   --moe-router-score-function softmax
   --moe-router-dtype fp32
   --moe-grouped-gemm
   --moe-token-dispatcher-type alltoall
   --moe-permute-fusion
   --moe-aux-loss-coeff 0
)
