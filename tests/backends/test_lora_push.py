"""Adapter pushes from the trainer into a real engine server (a subprocess on a tiny Qwen3, fp32 on the CPU): only
the adapter's tensors travel (by handle, broadcast over the weight-update group, or as a PEFT folder on disk), every
engine checksum is compared with the trainer's, the engine then generates with the trainer's log-probs under `policy@<version>`, and versions older than
the previous one are unloaded. A checksum that differs, or a tensor missing or extra, fails naming it."""

import httpx
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.backends.lora_adapter import is_lora_name
from slime.backends.lora_push import AdapterPushError, compare_checksums
from slime.backends.packing import pack_samples
from slime.backends.weight_sender import destroy_weight_group
from slime.utils.misc import find_free_port
from tests.helpers.fsdp_helpers import make_args, make_trainer
from tests.helpers.lora_helpers import LORA_FLAGS, random_adapter, wide_tiny_checkpoint

PROMPT = list(range(10, 30))
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_push")
    wide_tiny_checkpoint(root / "model")
    (root / "push").mkdir()
    return root


@pytest.fixture(scope="module")
def engine(root, tmp_path_factory):
    from slime.engine.server.launch import launch_server

    process = launch_server(root / "model", extra_args=["--device", "cpu", "--enable-lora", "--max-lora-rank", "8",
                                                        "--max-loras-per-batch", "3"],
                            log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield process
    process.stop()


@torch.no_grad()
def _randomise_adapter(trainer, seed: int) -> None:
    shapes = {name.removeprefix("hf_model."): tuple(p.shape) for name, p in trainer.model.named_parameters()
              if is_lora_name(name)}
    adapter = random_adapter(shapes, seed=seed)
    for name, param in trainer.model.named_parameters():
        if name.removeprefix("hf_model.") in adapter:
            (param.to_local() if isinstance(param, DTensor) else param).copy_(adapter[name.removeprefix("hf_model.")])


def _generate(url: str, lora_path):
    return httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                                               "lora_path": lora_path}, timeout=120, trust_env=False)


def _loaded(url: str) -> set[str]:
    response = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "not-loaded"}, timeout=60, trust_env=False)
    return set(response.json()["loaded_adapters"])


@pytest.mark.parametrize("transport", ["tensor", "disk", "distributed"])
def test_pushed_adapter_is_verified_served_with_the_trainers_log_probs_and_old_versions_unloaded(
        root, engine, transport):
    args = make_args(root / "model", *LORA_FLAGS, "--update-weight-disk-dir", root / "push")
    trainer = make_trainer(args)
    try:
        base_bytes = sum(p.numel() * 4 for name, p in trainer.model.named_parameters() if not is_lora_name(name))
        for version in (1, 2, 3):
            _randomise_adapter(trainer, seed=version)
            result = trainer.update_weights([engine.url], weight_version=str(version), mode=transport)
            adapter_bytes = sum(p.numel() * 4 for name, p in trainer.model.named_parameters() if is_lora_name(name))
            assert result.bytes == adapter_bytes < base_bytes / 5  # the adapter alone travels
            response = _generate(engine.url, f"policy@{version}")
            assert response.status_code == 200, response.text
            output = response.json()
            tokens = PROMPT + output["output_ids"]
            packed = pack_samples([tokens], [len(output["output_ids"])], [0])
            expected, _ = trainer.backend.forward_only([packed])[0]
            got = torch.tensor([entry[0] for entry in output["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(got, expected.float(), rtol=0, atol=1e-4)
        assert {"policy@2", "policy@3"} <= _loaded(engine.url) and "policy@1" not in _loaded(engine.url)
        assert _generate(engine.url, "policy@1").status_code == 400
        assert not list((root / "push").iterdir())  # the disk versions are removed once loaded
    finally:
        for name in _loaded(engine.url):
            httpx.post(engine.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=60, trust_env=False)
        if trainer.weight_updater.group is not None:  # the engine leaves the broadcast group too
            destroy_weight_group(trainer.weight_updater.group, [engine.url])
        dist.destroy_process_group()


def test_a_restarted_engine_gets_the_current_version_and_every_engine_drops_old_ones(root, engine, tmp_path):
    """Fault tolerance: engine 1 restarts (a fresh server) after version 2 and gets it alone, as the engine watch
    pushes it; at version 3 both engines end at {policy@2, policy@3}, the running one's policy@1 unloaded although the
    pusher reconnected in between. An engine that cannot be reached is skipped and reported."""
    from slime.engine.server.launch import launch_server

    args = make_args(root / "model", *LORA_FLAGS)
    trainer = make_trainer(args)
    restarted = launch_server(root / "model", extra_args=["--device", "cpu", "--enable-lora", "--max-lora-rank", "8",
                                                          "--max-loras-per-batch", "3"],
                              log_path=tmp_path / "restarted.log")
    dead = f"http://127.0.0.1:{find_free_port()}"
    try:
        for version in (1, 2):
            _randomise_adapter(trainer, seed=version)
            trainer.update_weights({0: engine.url}, weight_version=str(version), mode="tensor")
        trainer.update_weights({1: restarted.url}, weight_version="2", mode="tensor")  # the watch's push
        assert _loaded(restarted.url) == {"policy@2"}
        _randomise_adapter(trainer, seed=3)
        result = trainer.update_weights({0: engine.url, 1: restarted.url, 2: dead}, weight_version="3", mode="tensor")
        assert result.unreachable_engines == [dead]
        for url in (engine.url, restarted.url):
            assert _loaded(url) == {"policy@2", "policy@3"}
        assert _generate(engine.url, "policy@3").json()["meta_info"]["output_token_logprobs"] == \
            _generate(restarted.url, "policy@3").json()["meta_info"]["output_token_logprobs"]
    finally:
        for name in _loaded(engine.url):
            httpx.post(engine.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=60, trust_env=False)
        restarted.stop()
        dist.destroy_process_group()


def test_checksum_mismatch_names_the_tensor():
    expected = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 1.5,
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": -0.25}
    compare_checksums("http://e", "policy@1", expected, dict(expected))
    with pytest.raises(AdapterPushError, match=r"tensor .*q_proj.lora_B.weight has checksum -0.2500001"):
        compare_checksums("http://e", "policy@1", expected, {**expected, next(reversed(expected)): -0.2500001})
    with pytest.raises(AdapterPushError, match="reports no checksum for .*lora_A"):
        compare_checksums("http://e", "policy@1", expected, {next(reversed(expected)): -0.25})
    with pytest.raises(AdapterPushError, match="holds extra.weight, which was not sent"):
        compare_checksums("http://e", "policy@1", expected, {**expected, "extra.weight": 0.0})
