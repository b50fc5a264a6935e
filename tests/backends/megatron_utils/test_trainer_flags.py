"""slime's Megatron-actor flags on the Megatron backend (one gloo process): parameter freezing by megatron-core
names with --reset-optimizer-states, --custom-model-provider-path (slime's provider signature) and
--megatron-config-path's actor overrides with --use-stateless-adam."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.helpers.fsdp_helpers import make_train_data, make_trainer, run_distributed
from tests.helpers.megatron_helpers import make_megatron_args

pytest.importorskip("megatron.core")

PROVIDED = []


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_megatron_flags"), arch="qwen3", seed=3, vocab_size=300)


def tiny_provider(pre_process: bool, post_process: bool):
    """A --custom-model-provider-path function: the default GPTModel of the test's checkpoint, recorded."""
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_gpt_model

    args = copy.copy(PROVIDED[0])
    args.custom_model_provider_path = None
    model = build_gpt_model(args, AutoConfig.from_pretrained(args.hf_checkpoint), torch.device("cpu"))
    PROVIDED.append((pre_process, post_process, model))
    return model


def _named(trainer) -> dict[str, torch.Tensor]:
    from slime.backends.megatron_utils.names import named_global_parameters

    return {name: param.detach().clone() for name, param in named_global_parameters(trainer.backend.model_chunks)}


def _freeze_provider_and_role_config(rank, world_size, port, checkpoint, config):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    data = make_train_data(4, vocab_size=300, seed=2)
    frozen_trainer = make_trainer(make_megatron_args(checkpoint, "--lr", "1e-2", "--freeze-params-name-list",
                                                     "embedding", r"decoder\.layers\.0\.", "--reset-optimizer-states"),
                                  port=port)
    before = _named(frozen_trainer)
    frozen_trainer.train(0, data)
    after = _named(frozen_trainer)
    frozen_trainer.train(1, data)  # the reset zeroes AdamW's steps first: one step again, not two
    distributed_optimizer = frozen_trainer.backend.optimizer.chained_optimizers[0]  # megatron's, over torch AdamW
    steps = {float(state["step"]) for state in distributed_optimizer.optimizer.state.values()}
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    with_state = {id(param) for param in distributed_optimizer.model_param_group_index_map}  # model params
    frozen = {name for name, param in frozen_trainer.backend.model.named_parameters()
              if id(param) not in with_state}
    pushed = set(dict(frozen_trainer.backend.hf_weights(None)))
    dist.destroy_process_group()
    destroy_model_parallel()

    args = make_megatron_args(checkpoint, "--custom-model-provider-path", f"{__name__}.tiny_provider",
                              "--megatron-config-path", config, "--use-stateless-adam", "--no-save-optim")
    PROVIDED.append(args)
    trainer = make_trainer(args, port=port + 1)
    metrics = trainer.train(0, data)
    inner = trainer.backend.optimizer.optimizer  # the torch optimizer inside megatron's distributed one
    stateless = type(inner).__name__, len(inner.state)
    provided = [(pre, post, model is trainer.backend.model) for pre, post, model in PROVIDED[1:]]
    destroy_model_parallel()
    return (set(before), changed, frozen, pushed, steps, provided, metrics["train/lr"], trainer.args.lr, args.lr,
            stateless)


def test_freezing_provider_and_role_config(tiny_checkpoint, tmp_path):
    config = tmp_path / "megatron.yaml"
    config.write_text("megatron:\n  - name: default\n    role: actor\n    overrides: {lr: 3e-3}\n")
    names, changed, frozen, pushed, steps, provided, lr, trainer_lr, driver_lr, stateless = run_distributed(
        _freeze_provider_and_role_config, 1, tiny_checkpoint, config)[0]
    expected_frozen = {name for name in names if name.startswith("embedding.") or ".layers.0." in name}
    assert expected_frozen and changed == set(names) - expected_frozen
    assert frozen == expected_frozen  # no optimizer state for them
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"} <= pushed  # still synced
    assert steps == {1.0}  # --reset-optimizer-states
    assert stateless == ("StatelessAdam", 0)
    assert provided == [(True, True, True)]
    assert lr == trainer_lr == pytest.approx(3e-3) and driver_lr == pytest.approx(1e-6)
