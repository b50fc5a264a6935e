"""Every weight route of the trainer into engines of two ranks, disaggregated (one FSDP trainer process, tiny Qwen3,
real engine servers at --tp-size 2 on 127.0.0.1):
- tensor: rank 0 sends each engine one handle per engine rank;
- distributed: one gloo group of the trainer and every engine rank, engine i's ranks at 1 + the ranks before it
  (world size 5 for two engines of two);
- disk: each engine's ranks read the written version.
After each push both engines' log-probs of their own sample equal the trainer's weights through transformers (1e-4),
and every rank's report is at the pushed version (the sender checks it; a check that fails raises). The engines start
from another seed's checkpoint, so a push that missed them would show.
"""

import httpx
import pytest
import torch
import torch.distributed as dist

from slime.backends import weight_sender
from slime.backends.engine_ranks import EngineRankError, check_rank_reports
from slime.engine.server.launch import launch_server
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer

PROMPT = list(range(3, 35))
SAMPLING = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("push_ranks")
    engine_checkpoint = build_tiny_model(root / "engine", arch="qwen3", seed=9)
    trainer_checkpoint = build_tiny_model(root / "trainer", arch="qwen3", seed=8)
    servers = [launch_server(engine_checkpoint, log_path=root / f"engine_{i}.log", env={"OMP_NUM_THREADS": "1"},
                             extra_args=["--device", "cpu", "--tp-size", "2", "--weights-dir-allowlist", str(root)])
               for i in range(2)]
    yield root, trainer_checkpoint, {i: server.url for i, server in enumerate(servers)}
    for server in servers:
        server.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def _generate(url):
    response = httpx.post(url + "/generate", timeout=120, trust_env=False, json={
        "input_ids": PROMPT, "return_logprob": True, "sampling_params": SAMPLING})
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]], meta


def _reference_log_probs(checkpoint, params, tokens, response_length):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.func.functional_call(model, params, (torch.tensor([tokens]),)).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return torch.stack([log_probs[p - 1, tokens[p]] for p in range(len(tokens) - response_length, len(tokens))])


def test_every_route_reaches_every_rank_of_every_engine(setup, monkeypatch):
    root, trainer_checkpoint, engines = setup
    trainer = make_trainer(make_args(
        trainer_checkpoint, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--lr", "3e-2",
        "--micro-batch-size", "4", "--update-weight-buffer-size", "20000", "--update-weight-transport", "disk",
        "--update-weight-disk-dir", str(root / "pushes")))
    assert trainer.weight_updater.ranks_per_engine == 2 and not trainer.weight_updater.colocated
    sent, real_post = [], weight_sender._post

    def recording_post(url, path, payload, headers=None):
        answer = real_post(url, path, payload, headers)
        sent.append((url, path, payload, answer))
        return answer

    monkeypatch.setattr(weight_sender, "_post", recording_post)
    for step, mode in enumerate(("tensor", "distributed", "disk"), start=1):
        trainer.train(step, make_train_data(8, vocab_size=300, seed=step))
        sent.clear()
        version = str(step)
        result = trainer.update_weights(engines, weight_version=version, mode=mode)
        assert result.unreachable_engines == [] and result.num_buckets > 1
        if mode == "tensor":
            pushes = [payload for _, path, payload, _ in sent if path == "/update_weights_from_tensor"]
            assert len(pushes) == 2 * result.num_buckets
            assert {len(payload["serialized_named_tensors"]) for payload in pushes} == {2}
        if mode == "distributed":
            groups = {url: payload for url, path, payload, _ in sent if path == "/init_weights_update_group"}
            assert {url: (p["rank_offset"], p["world_size"]) for url, p in groups.items()} == {
                engines[0]: (1, 5), engines[1]: (3, 5)}
        final = [(url, answer) for url, path, payload, answer in sent
                 if path.startswith("/update_weights_from") and payload.get("weight_version") == version]
        assert sorted(url for url, _ in final) == sorted(engines.values())
        for _, answer in final:  # the reports the sender checked: both ranks at the version
            assert [(r["rank"], r["weight_version"]) for r in answer["ranks"]] == [(0, version), (1, version)]
        params = {name.removeprefix("hf_model."): value for name, value in full_params(trainer).items()}
        for url in engines.values():
            output_ids, log_probs, meta = _generate(url)
            assert meta["weight_version"] == version
            expected = _reference_log_probs(trainer_checkpoint, params, PROMPT + output_ids, len(output_ids))
            torch.testing.assert_close(torch.tensor(log_probs), expected, rtol=0, atol=1e-4)
    # The same reports, one rank short, are what the sender refuses.
    _, answer = final[0]
    with pytest.raises(EngineRankError, match="rank 1 did not report"):
        check_rank_reports(final[0][0], {"ranks": answer["ranks"][:1]}, 2, version, required=True)
