# llama3-8B (Meta-Llama-3-8B) model shape in Megatron's flag names: slime ships llama3.1-8B-Instruct.sh; this is it
# without the rope scaling. train.py checks the values against --hf-checkpoint's config.json.
# Usage: source scripts/models/llama3-8B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --vocab-size 128256
   --rotary-base 500000
   --norm-epsilon 1e-5
   --normalization RMSNorm
   --swiglu
   --disable-bias-linear
   --use-rotary-position-embeddings
   --untie-embeddings-and-output-weights
)
