"""Weight push from the FSDP trainer into a running engine server (tensor handles and gloo broadcast): after
training changes the weights, the engine's log-probs of its own sampled tokens equal the trainer's. Dense Qwen3 and
Qwen3-MoE (stacked expert tensors leave the trainer under the checkpoint's per-expert names)."""

import subprocess
import sys
import time

import httpx
import pytest
import torch
import torch.distributed as dist

from slime.backends.packing import pack_samples
from slime.utils.misc import find_free_port
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer


@pytest.fixture(params=[("qwen3", []), ("qwen3_moe", [])], ids=["fp32", "moe_fp32"])
def engine(tmp_path, request):
    arch, extra_args = request.param
    checkpoint = build_tiny_model(tmp_path / "tiny", arch=arch, seed=6)
    port = find_free_port()
    process = subprocess.Popen([sys.executable, "-m", "slime.engine.server", "--model-path", str(checkpoint),
                                "--port", str(port), *extra_args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"engine server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail("engine server did not become healthy in 120 s")
    yield checkpoint, url
    process.kill()
    process.wait()
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine_sample(url, prompt):
    response = httpx.post(url + "/generate", timeout=60, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3},
    }).json()
    meta = response["meta_info"]
    return response["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta.get("weight_version")


def _trainer_log_probs(trainer, prompt, output_ids):
    packed = pack_samples([prompt + output_ids], [len(output_ids)], [0])
    with torch.no_grad():
        log_probs, _ = trainer.model.forward_micro_batch(packed)
    return log_probs


def test_pushed_weights_reproduce_trainer_log_probs(engine):
    checkpoint, url = engine
    trainer = make_trainer(make_args(checkpoint, "--lr", "3e-2", "--micro-batch-size", "4",
                                     "--update-weight-buffer-size", "20000"))
    prompt = [5, 17, 33, 42]
    output_ids, before, _ = _engine_sample(url, prompt)
    torch.testing.assert_close(torch.tensor(before), _trainer_log_probs(trainer, prompt, output_ids),
                               rtol=0, atol=1e-4)

    for mode, version in (("tensor", "1"), ("distributed", "2")):
        trainer.train(int(version), make_train_data(8, vocab_size=300, seed=int(version)))
        timings = trainer.update_weights([url], weight_version=version, mode=mode)
        assert timings.num_buckets > 1 and timings.bytes > 0
        output_ids, after, engine_version = _engine_sample(url, prompt)
        expected = _trainer_log_probs(trainer, prompt, output_ids)
        assert engine_version == version
        torch.testing.assert_close(torch.tensor(after), expected, rtol=0, atol=1e-4)
    # Training moved the weights far enough that the stale engine would have disagreed.
    stale_output, stale, _ = _engine_sample(url, prompt)
    assert (torch.tensor(stale) - torch.tensor(before)).abs().max() > 1e-3 or stale_output != output_ids


@pytest.mark.parametrize("engine", [("qwen3", [])], ids=["fp32"], indirect=True)
def test_an_engine_lost_during_a_push_is_skipped_and_the_others_get_it_all(engine):
    checkpoint, url = engine
    trainer = make_trainer(make_args(checkpoint, "--lr", "3e-2", "--micro-batch-size", "4",
                                     "--update-weight-buffer-size", "20000"))
    trainer.train(1, make_train_data(8, vocab_size=300, seed=1))
    lost = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there: a dead engine
    timings = trainer.update_weights([lost, url], weight_version="1", mode="tensor")
    assert timings.unreachable_engines == [lost] and timings.num_buckets > 1
    prompt = [5, 17, 33, 42]
    output_ids, log_probs, engine_version = _engine_sample(url, prompt)
    assert engine_version == "1"
    torch.testing.assert_close(torch.tensor(log_probs), _trainer_log_probs(trainer, prompt, output_ids),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("engine", [("qwen3", ["--dtype", "bfloat16"])], ids=["bf16"], indirect=True)
def test_weights_travel_in_the_engines_dtype(engine):
    """A bf16 engine gets bf16 tensors (half the bytes of the fp32 master weights), rounded exactly as the engine
    rounds fp32 tensors itself: the same log-probs, to the bit, as after an fp32 push of the same weights."""
    checkpoint, url = engine
    trainer = make_trainer(make_args(checkpoint, "--lr", "3e-2", "--micro-batch-size", "4"))
    trainer.train(1, make_train_data(8, vocab_size=300, seed=1))
    num_param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    prompt = [5, 17, 33, 42]
    results = {}
    for mode in ("tensor", "distributed"):
        for forced in (torch.float32, None):
            trainer.weight_updater.dtype = forced
            timings = trainer.update_weights([url], weight_version=f"{mode}-{forced}", mode=mode)
            assert trainer.weight_updater.push_dtype == (forced or torch.bfloat16)
            assert timings.bytes == num_param_bytes // (1 if forced else 2)
            results[mode, forced] = _engine_sample(url, prompt)[:2]
    assert len({repr(result) for result in results.values()}) == 1, results
