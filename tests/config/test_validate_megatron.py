"""Megatron's flag combinations: invalid layouts are parse-time errors naming the flag; the derived layout (data-parallel
size, virtual stages, backend defaults); inert flags reported once; what the Megatron backend does not run is refused
at start-up."""

import logging

import pytest

from slime.config import validate_megatron as validate_megatron_args
from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.config.flags_megatron import INERT
from slime.config.validate_megatron import require_train_backend
from tests.helpers.megatron_arg_helpers import base, data  # noqa: F401 (data: a fixture)


@pytest.mark.parametrize("extra, message", [
    (["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "3"], "not divisible by --tensor-model"),
    (["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2", "--context-parallel-size", "4"],
     r"\(2 x 1 x 4\)"),
    (["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"], "needs an MoE model"),
    (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--train-backend", "fsdp"],
     "--tensor-model-parallel-size 2 needs --train-backend megatron"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--train-backend", "fsdp"],
     "--pipeline-model-parallel-size 2 needs --train-backend megatron"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--train-backend", "megatron"],
     "virtual pipeline stages.*--pipeline-model-parallel-size > 1"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "5"], "14 layers per pipeline stage are not divisible"),
    (["--actor-num-gpus-per-node", "3", "--pipeline-model-parallel-size", "3", "--global-batch-size", "16"],
     "28 layers are not divisible by --pipeline-model-parallel-size 3"),
    (["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "3", "--global-batch-size", "16"],
     "16 attention heads are not divisible"),
    (["--decoder-last-pipeline-num-layers", "4"], "need --pipeline-model-parallel-size > 1"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
      "2", "--micro-batch-size", "16"], r"--num-virtual-stages-per-pipeline-rank \(virtual pipeline stages\): "
     r"--global-batch-size 16 / \(--micro-batch-size 16 x 1 data-parallel ranks\) = 1 micro-batches per step, not a "
     "multiple of --pipeline-model-parallel-size 2"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "7", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--global-batch-size", "1"],
     "with --use-dynamic-batch-size: --global-batch-size 1 over 1 data-parallel ranks is 1 samples per rank and step, "
     "not a multiple of --pipeline-model-parallel-size 2"),
    (["--train-backend", "megatron", "--micro-batch-size", "3"], "Megatron's rule"),
    (["--recompute-granularity", "selective"], "FSDP trainer recomputes whole decoder layers"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     "FSDP trainer recomputes whole decoder layers"),
    (["--recompute-method", "uniform"], "need --recompute-granularity full"),
    (["--train-backend", "megatron", "--recompute-granularity", "full"], "needs --recompute-method"),
    (["--train-backend", "megatron", "--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "selective takes no --recompute-method"),
    (["--train-backend", "megatron", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "29"], "more than the 28 layers"),
    (["--train-backend", "megatron", "--recompute-activations", "--recompute-granularity", "full"], "contradicts"),
    (["--fp16"], "--fp16 is not supported"),
    (["--train-backend", "megatron", "--compile-model"], "--compile-model compiles the FSDP trainer"),
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "--lr-warmup-fraction and --lr-warmup-iters"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction"),
    (["--norm-epsilon", "1e-5"], "--norm-epsilon 1e-05 does not match rms_norm_eps"),
    (["--rotary-percent", "0.5"], "partial_rotary_factor=1.0"),
    (["--normalization", "LayerNorm"], "RMSNorm"),
    (["--untie-embeddings-and-output-weights"], "tie_word_embeddings=True"),
    (["--use-rope-scaling", "--rotary-scaling-factor", "8"], "rope_scaling"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0: must be >= 1"),
])
def test_bad_megatron_combinations_name_the_flag(tmp_path, data, extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(base(tmp_path, data, *extra))


def test_moe_expert_parallel_rules(tmp_path, data):
    moe = ["--actor-num-gpus-per-node", "8", "--global-batch-size", "16"]
    args = parse_args(base(tmp_path, data, *moe, "--expert-model-parallel-size", "8", model="qwen3-30B-A3B"))
    assert args.train_backend == "megatron" and args.data_parallel_size == 8 and args.expert_tensor_parallel_size == 1
    with pytest.raises(ArgumentError, match="128 experts are not divisible by --expert-model-parallel-size 3"):
        parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "3", "--global-batch-size", "16",
                        "--expert-model-parallel-size", "3", model="qwen3-30B-A3B"))
    with pytest.raises(ArgumentError, match=r"--pipeline-model-parallel-size \(2 x 8 x 1\)"):
        parse_args(base(tmp_path, data, *moe, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "8",
                        model="qwen3-30B-A3B"))
    with pytest.raises(ArgumentError, match="--tensor-model-parallel-size 2 on an MoE model needs --sequence-parallel"):
        parse_args(base(tmp_path, data, *moe, "--tensor-model-parallel-size", "2", model="qwen3-30B-A3B"))
    with pytest.raises(ArgumentError, match="seq_aux_loss with --sequence-parallel"):
        parse_args(base(tmp_path, data, *moe, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
                        model="qwen3-30B-A3B"))


def test_derived_layout_and_backend_defaults(tmp_path, data):
    fsdp = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2"))
    assert (fsdp.train_backend, fsdp.data_parallel_size, fsdp.virtual_pipeline_model_parallel_size) == ("fsdp", 2, None)
    assert (fsdp.adam_beta2, fsdp.weight_decay, fsdp.lr_decay_style) == (0.98, 0.0, "constant")
    assert fsdp.untie_embeddings_and_output_weights is False and fsdp.attention_dropout == 0.0
    assert fsdp.bf16 == (fsdp.device == "cuda") and not fsdp.use_distributed_optimizer

    megatron = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "8", "--global-batch-size", "8",
                               "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                               "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "2"))
    assert megatron.train_backend == "megatron" and megatron.data_parallel_size == 2
    assert megatron.virtual_pipeline_model_parallel_size == 2 and megatron.expert_tensor_parallel_size == 2
    assert (megatron.adam_beta2, megatron.weight_decay, megatron.lr_decay_style) == (0.999, 0.01, "linear")
    assert megatron.use_distributed_optimizer and megatron.global_batch_size % (2 * 2) == 0

    per_stage = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size",
                                "2", "--num-layers-per-virtual-pipeline-stage", "7"))
    assert per_stage.virtual_pipeline_model_parallel_size == 2  # 28 layers / 2 stages / 7 per virtual stage

    selective = parse_args(base(tmp_path, data, "--train-backend", "megatron", "--recompute-activations"))
    assert selective.recompute_granularity == "selective"  # Megatron's meaning of --recompute-activations
    full = parse_args(base(tmp_path, data, "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"))
    assert full.train_backend == "fsdp" and full.recompute_activations  # FSDP: checkpoint every decoder layer

    warmup = parse_args(base(tmp_path, data, "--lr-warmup-fraction", "0.25", "--num-steps-per-rollout", "4"))
    assert warmup.lr_warmup_iters == 2  # 0.25 x 2 rollouts x 4 steps


def test_data_parallel_size_decides_the_global_batch_rule(tmp_path, data):
    # 2 processes at TP 2 are one data-parallel rank: any global batch divides over it
    args = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
                           "--global-batch-size", "1"))
    assert args.data_parallel_size == 1 and args.num_steps_per_rollout == 16
    with pytest.raises(ArgumentError, match="over 2 data-parallel ranks"):
        parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--global-batch-size", "1"))


def test_inert_flags_are_reported_once(tmp_path, data, caplog):
    with caplog.at_level(logging.WARNING):
        parse_args(base(tmp_path, data, "--attention-backend", "flash", "--no-rope-fusion", "--optimizer-cpu-offload",
                        "--moe-token-drop-policy", "probs", "--accumulate-allreduce-grads-in-fp32", "--qk-layernorm"))
    notices = sorted(r.getMessage() for r in caplog.records if "no effect here" in r.getMessage())
    assert [n.split(": no effect here")[0] for n in notices] == [
        "--accumulate-allreduce-grads-in-fp32", "--attention-backend, --no-rope-fusion", "--optimizer-cpu-offload",
        "--qk-layernorm"]  # --moe-token-drop-policy probs is its default
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_args(base(tmp_path, data))
    assert "no effect" not in caplog.text
    assert all(flag.inert_because for flag in INERT)


def test_megatron_backend_must_import_at_start(tmp_path, data, monkeypatch):
    args = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"))
    monkeypatch.setattr(validate_megatron_args, "MEGATRON_BACKEND_MODULE", "slime.backends.megatron_utils.no_such")
    with pytest.raises(ArgumentError, match="no Megatron training backend.*--train-backend fsdp without "
                                            "--tensor-model-parallel-size 2$"):
        require_train_backend(args)
    monkeypatch.setattr(validate_megatron_args, "MEGATRON_BACKEND_MODULE", "slime.config.flags_megatron")
    require_train_backend(args)
    require_train_backend(parse_args(base(tmp_path, data)))  # fsdp: nothing to check
    require_train_backend(parse_args(base(tmp_path, data, "--device", "cpu", "--actor-num-gpus-per-node", "2",
                                          "--pipeline-model-parallel-size", "2",
                                          "--num-virtual-stages-per-pipeline-rank", "2")))  # virtual stages run


@pytest.mark.parametrize("extra, message", [
    (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "--sequence-parallel runs on GPUs only.*drop it for a CPU run"),
])
def test_what_the_megatron_backend_does_not_run_is_refused_at_start(tmp_path, data, extra, message):
    args = parse_args(base(tmp_path, data, "--device", "cpu", *extra))  # Megatron's rules: the flags parse
    with pytest.raises(ArgumentError, match=message):
        require_train_backend(args)
    args.device = "cuda"
    if "--sequence-parallel" in extra:
        require_train_backend(args)  # on GPUs sequence parallelism runs


def test_context_parallelism_runs_on_dense_models_without_routing_replay(tmp_path, data):
    cp2 = ["--device", "cpu", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"]
    dense = parse_args(base(tmp_path, data, *cp2))
    assert dense.train_backend == "megatron" and dense.data_parallel_size == 1
    require_train_backend(dense)  # dense models run context parallel, on the CPU too
    moe = parse_args(base(tmp_path, data, *cp2, model="qwen3-30B-A3B"))  # slime's recipes parse
    with pytest.raises(ArgumentError, match="--context-parallel-size 2 on an MoE model.*--context-parallel-size 1"):
        require_train_backend(moe)
    for flag in ("--use-routing-replay", "--use-rollout-routing-replay"):
        with pytest.raises(ArgumentError, match=f"{flag} with --context-parallel-size 2.*--context-parallel-size 1"):
            parse_args(base(tmp_path, data, *cp2, flag, model="qwen3-30B-A3B"))
