# llama3.1-8B-Instruct model shape: slime's preset (THUDM/slime@624b824 scripts/models/llama3.1-8B-Instruct.sh) in Megatron's flag names.
# train.py checks the values against --hf-checkpoint's config.json; both backends build the model from that file.
# Usage: source scripts/models/llama3.1-8B-Instruct.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --swiglu
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --max-position-embeddings 131072
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 500000
   --vocab-size 128256
   --kv-channels 128
   --use-rope-scaling
   --rotary-scaling-factor 8.0
   --untie-embeddings-and-output-weights
)
