"""slime's own example generate functions, copied unchanged into tests/data/slime_examples/ (THUDM/slime 624b824a),
run one rollout against the built-in engine through this package's default rollout, with the local services
they need started here (a BM25 retrieval server on loopback for search-r1; for tau-bench a second engine server as its
LLM user simulator, plus the tau_bench package and SGLang's parser names it imports, which are not installed here)."""

import json
import sys
import threading
from pathlib import Path

import pytest

from examples.search_r1.retrieval_server import BM25Index, make_server
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.http_utils import run
from tests.helpers import args_helpers

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "slime_examples"
CORPUS = ['"Zorvia"\nZorvia is a small island nation; its capital is Quellport.',
          '"Brindle"\nBrindle is a river town known for its glass bridges.']


@pytest.fixture(scope="module")
def retrieval_url():
    server = make_server(BM25Index(CORPUS), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()
    server.server_close()


def rollout_args(tmp_path, server, tiny_qwen3, rows, **overrides):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    host, port = server.url.removeprefix("http://").split(":")
    defaults = {"label_key": "label", "hf_checkpoint": str(tiny_qwen3), "rollout_max_response_len": 12,
                "sglang_router_ip": host, "sglang_router_port": int(port), "sglang_server_concurrency": 8,
                "rm_type": None}
    return args_helpers.make_args("--prompt-data", path, "--n-samples-per-prompt", 2, **{**defaults, **overrides})


def check_trajectory(sample):
    """tokens = prompt + response; log-probs only (and all) where the policy sampled; observations masked out."""
    assert len(sample.tokens) == sample.prompt_length + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
    for mask, log_prob in zip(sample.loss_mask, sample.rollout_log_probs):
        assert (log_prob == 0.0) if mask == 0 else (log_prob < 0.0 or log_prob == pytest.approx(0.0, abs=1e-3))
    assert sample.status in (sample.Status.COMPLETED, sample.Status.TRUNCATED)


def test_search_r1_generate_and_reward_unchanged(tmp_path, server, tiny_qwen3, retrieval_url, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "search-r1"))
    import generate_with_search

    # The example's configuration block, set as its README says (the local retriever's URL).
    monkeypatch.setitem(generate_with_search.SEARCH_R1_CONFIGS["local"], "search_url", retrieval_url)
    observation, done = run(generate_with_search.execute_predictions("<search>capital of Zorvia</search>"))
    assert not done and observation.startswith("\n\n<information>Doc 1(Title: \"Zorvia\")")
    assert "Quellport" in observation.split("Doc 2")[0]  # the matching fact ranks first

    args = rollout_args(tmp_path, server, tiny_qwen3,
                        [{"input": "Question: what is the capital of Zorvia?\n", "label": {"ground_truth":
                                                                                         {"target": ["Quellport"]}}}],
                        custom_generate_function_path="generate_with_search.generate",
                        custom_rm_path="generate_with_search.reward_func",
                        # every token stops a turn: each of the example's two turns samples one token
                        rollout_stop_token_ids=list(range(vocab_size(tiny_qwen3))))
    (group,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    assert len(group) == 2
    for sample in group:
        check_trajectory(sample)
        assert sample.reward in (0, 0.2, 1)  # format score, or EM
        # the random tiny model writes no valid action: the example appends its "invalid action" observation
        # (loss mask 0) after each of its two sampled turns
        assert sample.loss_mask[0] == 1 and sample.loss_mask.count(1) == 2 and sample.loss_mask[-1] == 0
        assert "My previous action is invalid" in sample.response


def vocab_size(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def test_retool_generate_and_reward_unchanged(tmp_path, server, tiny_qwen3, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "retool"))
    import generate_with_retool

    observation, done = run(generate_with_retool.execute_predictions("<code>print(6 * 7)</code>"))
    assert not done and observation == "\n\n<interpreter>\nOutput:\n42\n</interpreter>\n\n"  # its sandbox ran it

    args = rollout_args(tmp_path, server, tiny_qwen3, [{"input": "What is 6 times 7?", "label": "42"}],
                        custom_generate_function_path="generate_with_retool.generate",
                        custom_rm_path="generate_with_retool.reward_func", reward_key="score",
                        rollout_max_context_len=1024, rollout_stop_token_ids=list(range(vocab_size(tiny_qwen3))))
    monkeypatch.setitem(generate_with_retool.TOOL_CONFIGS, "max_turns", 3)  # its config block, set by the user
    (group,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    for sample in group:
        check_trajectory(sample)
        assert 1 <= sample.loss_mask.count(1) <= 3 and sample.loss_mask[0] == 1  # one-token turns (max_turns 3)
        assert sample.reward["score"] <= -0.6 and sample.reward["acc"] is False  # dapo strict box + tool shaping
        assert sample.tool_call_count == 0 and sample.payload_has_system


def test_multi_agent_generate_unchanged(tmp_path, server, tiny_qwen3, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from multi_agent import rollout_with_multi_agents

    # Its config block names its agent system by its place in slime's tree; here the copy's place.
    monkeypatch.setitem(rollout_with_multi_agents.MULTI_AGENT_CONFIGS, "custom_multi_agent_function_path",
                        "multi_agent.agent_system.run_agent_system")
    monkeypatch.setitem(rollout_with_multi_agents.MULTI_AGENT_CONFIGS, "num_parallel", 2)
    args = rollout_args(tmp_path, server, tiny_qwen3, [{"input": "What is 6 times 7?", "label": "42"}],
                        custom_generate_function_path="multi_agent.rollout_with_multi_agents."
                                                      "generate_with_multi_agents",
                        rm_type="math", custom_rm_path=None, rollout_max_context_len=1024)
    (group,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    # each of the 2 prompt samples became its solver agents' samples (no "</think>" from the tiny model, so no
    # rewriter round), siblings of one rollout, each scored by --rm-type math and weighted for a wrong answer
    assert len(group) == 4
    assert len({s.rollout_id for s in group}) == 2
    for sample in group:
        check_trajectory(sample)
        assert sample.loss_mask == [1] * sample.response_length
        assert sample.reward == 0.0 * rollout_with_multi_agents.MULTI_AGENT_CONFIGS["incorrect_reward_weight"]


# ---- tau-bench ---------------------------------------------------------------------------------------------------
# tau_bench is not on PyPI: tests/data/tau_bench_local has its public API (see its README); SGLang, whose function-call
# parser the example imports, is not a dependency: tests/data/sglang_function_call_shim has those names over this
# project's parser. Both are importable during these tests only.
TAU_PATHS = [EXAMPLES / "tau-bench", EXAMPLES.parent / "tau_bench_local", EXAMPLES.parent / "sglang_function_call_shim"]
STOP = "###STOP###"


def build_stop_saying_model(out_dir: Path, seed: int = 1) -> Path:
    """A real checkpoint whose every chat reply is "###STOP###": the user simulator that ends each conversation after
    the agent's first turn. Its layers add nothing to the residual stream (zero output projections), so the next
    token depends on the current one only: any token -> the added token "###STOP###" -> end of turn."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from slime.utils.tiny_model import build_tiny_model

    build_tiny_model(out_dir, arch="qwen3", seed=seed, embedding_size=520)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens([STOP])
    tokenizer.save_pretrained(out_dir)
    stop_id, eos_id = tokenizer.convert_tokens_to_ids(STOP), tokenizer.eos_token_id
    weights = load_file(out_dir / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed = weights["model.embed_tokens.weight"]
    embed.zero_()
    embed[:, 0] = 1.0
    embed[stop_id] = 0.0
    embed[stop_id, 1] = 1.0
    weights["model.norm.weight"].fill_(1.0)
    lm_head = torch.zeros_like(embed)
    lm_head[stop_id, 0] = lm_head[eos_id, 1] = 10.0  # logit margins of 80 after the norm: sampling is deterministic
    weights["lm_head.weight"] = lm_head
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out_dir


@pytest.fixture(scope="module")
def user_simulator(tmp_path_factory):
    from slime.engine.server.launch import launch_server

    model = build_stop_saying_model(tmp_path_factory.mktemp("stop_user"))
    process = launch_server(model, log_path=tmp_path_factory.mktemp("log") / "user_simulator.log")
    yield process
    process.stop()


@pytest.fixture
def tau_imports(monkeypatch, user_simulator):
    monkeypatch.setenv("USER_MODEL_API_BASE", f"{user_simulator.url}/v1")
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)  # the example sets it on import: restored afterwards
    for path in TAU_PATHS:
        monkeypatch.syspath_prepend(str(path))
    yield
    for name, module in list(sys.modules.items()):  # none of them may outlive the test (the shim is not SGLang)
        if any(str(getattr(module, "__file__", None) or "").startswith(str(path)) for path in TAU_PATHS):
            del sys.modules[name]


def test_tau_bench_generate_unchanged(tmp_path, server, tiny_qwen3, tau_imports):
    import generate_with_tau
    from transformers import AutoTokenizer

    rows = [{"index": 1, "metadata": {"split": "train"}}]  # the rows slime's tau1_mock.py writes: a task index
    args = rollout_args(tmp_path, server, tiny_qwen3, rows, input_key="index", label_key=None,
                        custom_generate_function_path="generate_with_tau.generate", custom_rm_path=None)
    (group,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    assert len(group) == 2
    for sample in group:
        # the user simulator said STOP after the agent's one reply: a finished conversation, scored by tau-bench
        assert sample.status == sample.Status.COMPLETED and sample.index == 1
        assert sample.metadata["task"]["outputs"] == ["processed"] and sample.metadata["source"] == "user"
        assert sample.reward == 0.0 and sample.metadata["reward_info"]["info"]["outputs"] == {"processed": False}
        # tokens: the templated prompt (wiki, tools, the user's first message), then the agent's turn (trained on)
        # and the user's answer (not trained on)
        assert len(sample.tokens) == sample.prompt_length + sample.response_length
        assert len(sample.loss_mask) == sample.response_length
        prompt_text = tokenizer.decode(sample.tokens[:sample.prompt_length])
        assert prompt_text == sample.prompt and generate_with_tau.tau_config.env in prompt_text.lower()
        assert prompt_text.endswith(f"<|im_start|>user\n{STOP}<|im_end|>\n<|im_start|>assistant\n")
        num_trained = sample.loss_mask.count(1)
        assert sample.loss_mask == [1] * num_trained + [0] * (sample.response_length - num_trained)
        agent_turn = tokenizer.decode(sample.tokens[sample.prompt_length:][:num_trained])
        assert agent_turn == sample.response + "<|im_end|>\n"
        user_turn = tokenizer.decode(sample.tokens[sample.prompt_length + num_trained:])
        assert user_turn == f"<|im_start|>user\n{STOP}<|im_end|>\n"


def test_local_tau_bench_scores_as_tau_bench_does(tau_imports):
    """The local tau_bench's reward is tau-bench's: the database the agent leaves against the task's ground truth
    (or the expected outputs in its replies), computed when the user simulator ends the conversation."""
    from tau_bench.envs import get_env
    from tau_bench.types import Action

    def episode(task_index, actions):
        env = get_env("retail", user_strategy="llm", user_model="sim", task_split="train", user_provider="openai",
                      task_index=task_index)
        assert env.reset(task_index=task_index).observation == STOP  # the simulator's every line
        for action in actions:
            response = env.step(action)
            assert not response.done and response.reward == 0
        final = env.step(Action(name="respond", kwargs={"content": "Done. Your order #W0004 is processed, sir"}))
        assert final.done and final.info.source == "user"
        return final.reward

    find = Action(name="find_user_id_by_email", kwargs={"email": "mia.li3818@example.com"})
    cancel = Action(name="cancel_pending_order", kwargs={"order_id": "#W0001", "reason": "no longer needed"})
    assert episode(0, [find, cancel]) == 1.0
    delivered = Action(name="cancel_pending_order", kwargs={"order_id": "#W0002", "reason": "no longer needed"})
    assert episode(0, [find, delivered]) == 0.0  # the tool refuses (not pending): the database is not the goal's
    assert episode(0, [find]) == 0.0  # nothing changed: not the ground truth's database
    assert episode(1, []) == 1.0  # task 1 wants "processed" said to the user, which the reply above does
