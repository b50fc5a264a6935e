"""Adapter pushes over the weight-update group (transport "distributed": the engines on devices of their own), into
real engine servers (subprocesses on a tiny Qwen3, fp32 on the CPU, gloo): the same adapter pushed by handle and by
broadcast gives the same tokens and log-probs; a broadcast that drops a tensor or carries a changed one is caught by
the checksums, naming the tensor, and the group keeps working; a two-rank engine (both ranks in the broadcast) in
the same group as a one-rank engine serves the adapter with the one-rank engine's log-probs; an engine without LoRA
takes the whole broadcast, then refuses naming enable_lora."""

import httpx
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.backends.lora_adapter import is_lora_name
from slime.backends.lora_push import AdapterPushError, checksums, compare_checksums
from slime.backends.weight_sender import destroy_weight_group
from tests.helpers.fsdp_helpers import make_args, make_trainer
from tests.helpers.lora_helpers import LORA_FLAGS, random_adapter, wide_tiny_checkpoint

PROMPT = list(range(10, 30))
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
LORA_SERVER = ["--device", "cpu", "--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "3"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return wide_tiny_checkpoint(tmp_path_factory.mktemp("lora_push_distributed") / "model")


def _launch(model, tmp_path_factory, *extra):
    from slime.engine.server.launch import launch_server

    return launch_server(model, extra_args=[*LORA_SERVER, *extra], log_path=tmp_path_factory.mktemp("log") / "s.log")


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    process = _launch(model, tmp_path_factory)
    yield process
    process.stop()


@pytest.fixture
def trainer(model):
    trainer = make_trainer(make_args(model, *LORA_FLAGS))
    yield trainer
    pusher = trainer.weight_updater
    if pusher.group is not None:  # every engine leaves the broadcast group, so the next test can form its own
        destroy_weight_group(pusher.group, pusher.engine_urls)
    for url in pusher.engine_urls:
        try:
            for name in _loaded(url):
                httpx.post(url + "/unload_lora_adapter", json={"lora_name": name}, timeout=60, trust_env=False)
        except httpx.TransportError:
            pass  # a server the test stopped
    dist.destroy_process_group()


@torch.no_grad()
def _randomise_adapter(trainer, seed: int) -> None:
    shapes = {name.removeprefix("hf_model."): tuple(p.shape) for name, p in trainer.model.named_parameters()
              if is_lora_name(name)}
    adapter = random_adapter(shapes, seed=seed)
    for name, param in trainer.model.named_parameters():
        if name.removeprefix("hf_model.") in adapter:
            (param.to_local() if isinstance(param, DTensor) else param).copy_(adapter[name.removeprefix("hf_model.")])


def _generate(url: str, lora_path: str) -> dict:
    response = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                   "return_logprob": True, "lora_path": lora_path},
                          timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    output = response.json()
    return {"ids": output["output_ids"],
            "log_probs": torch.tensor([entry[0] for entry in output["meta_info"]["output_token_logprobs"]])}


def _loaded(url: str) -> set[str]:
    response = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "not-loaded"}, timeout=60, trust_env=False)
    return set(response.json()["loaded_adapters"])


def test_broadcast_push_serves_what_the_tensor_push_serves_and_a_partial_or_changed_one_is_caught(trainer, engine):
    _randomise_adapter(trainer, seed=7)
    assert "perf/lora_push_broadcast_gb" not in trainer.update_weights([engine.url], weight_version="1",
                                                                      mode="tensor").log_metrics()
    by_handle = _generate(engine.url, "policy@1")
    result = trainer.update_weights([engine.url], weight_version="2", mode="distributed")
    pusher = trainer.weight_updater
    assert pusher.transport == "distributed" and pusher.group is not None
    assert result.bytes == sum(p.numel() * 4 for name, p in trainer.model.named_parameters() if is_lora_name(name))
    assert result.log_metrics()["perf/lora_push_broadcast_gb"] == result.bytes / 1e9  # the route, as a run logs it
    by_broadcast = _generate(engine.url, "policy@2")
    base = _generate(engine.url, None)
    assert by_broadcast["ids"] == by_handle["ids"]
    assert torch.equal(by_broadcast["log_probs"], by_handle["log_probs"])  # the same fp32 values, the same engine
    assert not torch.allclose(by_broadcast["log_probs"], base["log_probs"], atol=1e-3)  # the adapter acts

    # A broadcast that leaves one tensor out, or carries one changed value: the engine's checksums give it away.
    sent = pusher._to_send(trainer.backend.adapter_weights())
    expected = checksums(sent)
    config = pusher.config_of(trainer.backend.adapter_weights())
    module = sorted(sent)[0].rsplit(".lora_", 1)[0]  # one adapted layer's A and B both left out
    dropped = sorted(name for name in sent if name.startswith(module + ".lora_"))
    assert len(dropped) == 2
    partial = {name: t for name, t in sent.items() if name not in dropped}
    replies = pusher._broadcast("partial@3", partial, "3", config)
    with pytest.raises(AdapterPushError, match=f"no checksum for {dropped[0]}"):
        compare_checksums(engine.url, "partial@3", expected, replies[engine.url].get("checksums"))
    httpx.post(engine.url + "/unload_lora_adapter", json={"lora_name": "partial@3"}, timeout=60, trust_env=False)
    changed_name = sorted(sent)[-1]
    changed = dict(sent, **{changed_name: sent[changed_name].clone()})
    changed[changed_name].view(-1)[0] += 1e-3
    replies = pusher._broadcast("changed@3", changed, "3", config)
    with pytest.raises(AdapterPushError, match=f"tensor {changed_name} has checksum"):
        compare_checksums(engine.url, "changed@3", expected, replies[engine.url].get("checksums"))
    httpx.post(engine.url + "/unload_lora_adapter", json={"lora_name": "changed@3"}, timeout=60, trust_env=False)

    # The group still works after those pushes: the next version loads, verified, and the old ones go.
    _randomise_adapter(trainer, seed=8)
    trainer.update_weights([engine.url], weight_version="4", mode="distributed")
    assert {"policy@2", "policy@4"} <= _loaded(engine.url) and "policy@1" not in _loaded(engine.url)


def test_a_two_rank_engine_takes_the_broadcast_on_every_rank_beside_a_one_rank_engine(
        trainer, engine, model, tmp_path_factory):
    sharded = _launch(model, tmp_path_factory, "--tp-size", "2", "--kvcache-block-size", "4",
                      "--num-kvcache-blocks", "64")
    try:
        for version, seed in (("1", 11), ("2", 12)):  # the second push reuses the group formed by the first
            _randomise_adapter(trainer, seed=seed)
            trainer.update_weights({0: engine.url, 1: sharded.url}, weight_version=version, mode="distributed")
            single, two_ranks = _generate(engine.url, f"policy@{version}"), _generate(sharded.url, f"policy@{version}")
            assert two_ranks["ids"] == single["ids"]
            torch.testing.assert_close(two_ranks["log_probs"], single["log_probs"], rtol=0, atol=1e-5)
        assert not torch.allclose(single["log_probs"], _generate(engine.url, None)["log_probs"], atol=1e-3)
        info = httpx.get(sharded.url + "/get_server_info", timeout=60, trust_env=False).json()
        assert info["tp_size"] == 2
    finally:
        destroy_weight_group(trainer.weight_updater.group, trainer.weight_updater.engine_urls)
        trainer.weight_updater.group = None
        sharded.stop()


def test_an_engine_without_lora_takes_the_whole_broadcast_then_refuses_by_name(trainer, model, tmp_path_factory):
    """The engine receives every tensor before refusing (a refusal mid-broadcast would leave the trainer hanging),
    and the group still carries the next push."""
    from slime.engine.server.launch import launch_server

    plain = launch_server(model, extra_args=["--device", "cpu"], log_path=tmp_path_factory.mktemp("log") / "p.log")
    try:
        _randomise_adapter(trainer, seed=5)
        for version in ("1", "2"):
            with pytest.raises(RuntimeError, match="enable_lora"):
                trainer.update_weights({0: plain.url}, weight_version=version, mode="distributed")
    finally:
        destroy_weight_group(trainer.weight_updater.group, trainer.weight_updater.engine_urls)
        trainer.weight_updater.group = None
        plain.stop()
