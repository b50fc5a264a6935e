"""Multi-turn rollouts against the REAL built-in engine behind the REAL sglang-router (tiny Qwen3, CPU).

A tiny random model never writes a well-formed tool call, so the tests make the conversation deterministic from
outside: every token id is a stop token (each turn samples exactly one token and ends with finish "stop") and a
parser given by dotted path reads every turn as a call. What is checked is the trajectory the loop builds: tokens
are exactly the prompt, the sampled ids and the rendered between-turn text; the loss mask is 1 exactly on the sampled
ids; the rollout's log-probs equal a transformers forward over the final tokens; tool failures become messages.
"""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from slime.engine.server.launch import launch_server
from slime.ray.router import RouterProcess, register_worker
from slime.ray.train_data import multi_turn_metrics
from slime.rollout import multi_turn
from slime.rollout.dataset import load_tokenizer
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm
from slime.utils.http_utils import run
from slime.utils.tool_parsers import ParsedTurn, ToolCall
from slime.utils.types import Sample
from tests.helpers import args_helpers

PROMPT = [{"role": "user", "content": "What is the value of key a?"}]


# ---------------------------------------------------------------- hooks loaded by dotted path
def lookup(key: str) -> str:
    return f"value-{key}"


def explode(key: str) -> str:
    raise RuntimeError("tool bug")


def hang(key: str) -> str:
    time.sleep(60)
    return key


def every_turn_calls(tool: str):
    def parse(text, tools):
        return ParsedTurn(text, [ToolCall(tool, {"key": "a"}, text)])

    return parse


calls_lookup = every_turn_calls("lookup")
calls_explode = every_turn_calls("explode")
calls_hang = every_turn_calls("hang")


def calls_malformed(text, tools):
    return ParsedTurn(text, [ToolCall("", {}, text, "tool call is not valid JSON")])


def inline_lookup(text, tools):
    return ParsedTurn(text, [ToolCall("lookup", {"key": "z"}, text)])


inline_lookup.inline_response = True


class CountdownEnv:
    """Two steps: each answer earns 0.25 and gets an observation; the second ends the episode."""

    def __init__(self, args):
        self.steps = 0

    def reset(self, sample):
        return None

    async def step(self, text):
        self.steps += 1
        return f"step {self.steps} seen", 0.25, self.steps >= 2, {}


def make_env(args):
    return CountdownEnv(args)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("multi_turn")
    model_dir = str(build_tiny_model(root / "tiny", arch="qwen3"))
    server = launch_server(model_dir, log_path=root / "engine.log", env={"OMP_NUM_THREADS": "1"})
    router = RouterProcess(policy="round_robin")
    try:
        register_worker(router.url, server.url)
        yield SimpleNamespace(model_dir=model_dir, router=router)
    finally:
        router.shutdown()
        server.stop()


def make_args(stack, **overrides):
    vocab_size = load_tokenizer(stack.model_dir).vocab_size
    args = args_helpers.make_args(**{
        "hf_checkpoint": stack.model_dir, "sglang_router_ip": stack.router.host, "sglang_router_port": stack.router.port,
        "max_turns": 3, "tool_functions_path": [f"{__name__}.lookup", f"{__name__}.explode", f"{__name__}.hang"],
        "tool_call_parser": f"{__name__}.calls_lookup", "tool_timeout": 0.5, "max_tool_response_chars": 4096,
        "rm_type": None, "sglang_server_concurrency": 4, **overrides})
    params = {"temperature": 1.0, "max_new_tokens": 200, "no_stop_trim": True,
              "stop_token_ids": list(range(vocab_size))}  # every token ends its turn: one token per turn
    return args, params


def spans(sample):
    """[(mask, token ids)] runs of equal loss mask over the response."""
    response = sample.tokens[sample.prompt_length:]
    runs = []
    for token, mask in zip(response, sample.loss_mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


def between_text(tokenizer, history_len, tool_text):
    history = PROMPT + [{"role": "assistant", "content": "x"}] * history_len
    return multi_turn.render_between_turns(tokenizer, history, [{"role": "tool", "name": "lookup",
                                                                  "content": tool_text}], [])


# ---------------------------------------------------------------- tests
def test_turns_are_token_exact_and_masked_on_sampled_ids_only(stack):
    args, params = make_args(stack)
    tokenizer = load_tokenizer(stack.model_dir)
    sample = run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))
    state = sample.metadata["multi_turn"]
    assert (state["turns"], state["tool_calls"], state["tool_errors"]) == (3, 2, 0)
    assert state["turn_lengths"] == [1, 1, 1]
    runs = spans(sample)
    assert [(mask, len(ids)) for mask, ids in runs][0::2] == [(1, 1)] * 3  # sampled, tool text, sampled, ...
    assert [mask for mask, _ in runs] == [1, 0, 1, 0, 1]
    for _, ids in runs[1::2]:  # what the policy did not sample decodes to the rendered template and tool answer
        text = tokenizer.decode(ids)
        assert text == between_text(tokenizer, 1, "value-a") and "<|im_start|>tool\nvalue-a<|im_end|>" in text
    from slime.rollout.tools import tool_schema

    schemas = [tool_schema(f) for f in (lookup, explode, hang)]  # offered to the model through the template
    prompt_text = tokenizer.apply_chat_template(PROMPT, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert '"name": "lookup"' in prompt_text
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert sample.tokens[: sample.prompt_length] == prompt_ids
    assert len(sample.rollout_log_probs) == sample.response_length == len(sample.loss_mask)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m == 0)
    assert sample.status == Sample.Status.COMPLETED

    # The trainer computes log_softmax(logits / T) at every sampled token over the final tokens: it must equal the
    # engine's log-probs, turn after turn (fp32, CPU).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([sample.tokens])).logits[0].float(), dim=-1)
    start = sample.prompt_length
    diffs = [abs(log_probs[start + i - 1, sample.tokens[start + i]].item() - sample.rollout_log_probs[i])
             for i, m in enumerate(sample.loss_mask) if m == 1]
    assert len(diffs) == 3 and max(diffs) < 1e-4


def test_tool_failures_become_messages_and_the_rollout_goes_on(stack):
    tokenizer = load_tokenizer(stack.model_dir)
    for parser, expected in (("calls_explode", "RuntimeError: tool bug"), ("calls_hang", "--tool-timeout"),
                             ("calls_malformed", "not valid JSON")):
        args, params = make_args(stack, tool_call_parser=f"{__name__}.{parser}", max_turns=2)
        started = time.perf_counter()
        sample = run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))
        assert time.perf_counter() - started < 10
        state = sample.metadata["multi_turn"]
        assert (state["turns"], state["tool_calls"], state["tool_errors"]) == (2, 1, 1), parser
        tool_text = tokenizer.decode(spans(sample)[1][1])
        assert "Error:" in tool_text and expected in tool_text, (parser, tool_text)
    metrics = multi_turn_metrics([sample])
    assert metrics["rollout/tool_errors_per_sample"] == 1 and metrics["rollout/turns_per_sample"] == 2


def test_inline_tool_answers_and_context_budget(stack):
    tokenizer = load_tokenizer(stack.model_dir)
    args, params = make_args(stack, tool_call_parser=f"{__name__}.inline_lookup", max_turns=2)
    sample = run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))
    assert tokenizer.decode(spans(sample)[1][1]) == "\n\n<information>value-z</information>\n\n"
    # an inline format names its tags in the prompt: no template tool block telling the model to write <tool_call>
    assert "# Tools" not in tokenizer.decode(sample.tokens[: sample.prompt_length])
    cut_at = sample.prompt_length + 3  # room for a sampled token, not for the tool answer after it
    args, params = make_args(stack, tool_call_parser=f"{__name__}.inline_lookup", rollout_max_context_len=cut_at)
    cut = run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))
    assert cut.status == Sample.Status.TRUNCATED and cut.metadata["multi_turn"]["cut_by_context"]
    assert len(cut.tokens) < cut_at and cut.loss_mask == [1]


def test_environment_drives_the_turns(stack):
    tokenizer = load_tokenizer(stack.model_dir)
    args, params = make_args(stack, env_path=f"{__name__}.make_env", tool_functions_path=None, max_turns=5)
    sample = run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))
    assert sample.metadata["multi_turn"]["turns"] == 2 and sample.reward == 0.5
    observation = tokenizer.decode(spans(sample)[1][1])
    assert "<|im_start|>user\nstep 1 seen<|im_end|>" in observation


def test_max_turns_above_one_makes_multi_turn_the_default_generate(stack):
    args, params = make_args(stack, max_turns=2, custom_rm_path=f"{__name__}.constant_reward")
    state = GenerateState(args)

    async def one():
        return await generate_and_rm(args, Sample(prompt=PROMPT, index=0), params, state=state)

    sample = run(one())
    assert sample.metadata["multi_turn"]["turns"] == 2 and sample.reward == 1.0
    json.dumps(sample.to_dict())  # the conversation state survives a debug dump / partial-rollout buffer


async def constant_reward(args, sample):
    return 1.0


def test_aborted_conversation_resumes_with_its_finished_turns(stack):
    """A sample aborted mid-conversation (a weight update) keeps its turns; the next rollout continues it, and
    with --mask-offpolicy-in-partial-rollout the tokens sampled before the abort are not trained."""
    args, params = make_args(stack, max_turns=2)
    first = run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))
    partial = Sample.from_dict(first.to_dict())
    state = partial.metadata["multi_turn"]
    # Roll back to the moment after turn 1's tool answer, as an abort of turn 2 leaves it.
    keep = partial.prompt_length + len(spans(first)[0][1]) + len(spans(first)[1][1])
    partial.tokens = partial.tokens[:keep]
    partial.response_length = keep - partial.prompt_length
    partial.loss_mask, partial.rollout_log_probs = partial.loss_mask[:partial.response_length], \
        partial.rollout_log_probs[:partial.response_length]
    state.update(turns=1, turn_lengths=state["turn_lengths"][:1])
    state["history"] = state["history"][:3]
    partial.status = Sample.Status.ABORTED
    args.mask_offpolicy_in_partial_rollout = True
    resumed = run(multi_turn.generate(args, partial, params))
    assert resumed.tokens[:keep] == first.tokens[:keep]
    assert resumed.metadata["multi_turn"]["turns"] == 2
    assert resumed.loss_mask[: keep - resumed.prompt_length] == [0] * (keep - resumed.prompt_length)
    assert resumed.loss_mask[keep - resumed.prompt_length:] == [1]


def test_bad_environment_is_a_clear_error(stack):
    args, params = make_args(stack, env_path=f"{__name__}.lookup", tool_functions_path=None)
    with pytest.raises(ValueError, match="--env-path .*no reset"):
        run(multi_turn.generate(args, Sample(prompt=PROMPT, index=0), params))


def test_prompt_rendered_at_load_time_is_rendered_again_with_the_tools(stack):
    """--apply-chat-template renders the prompt when the data is loaded, without the rollout's tools; the messages
    kept in metadata are rendered again, tools included."""
    from slime.rollout.dataset import render_chat_prompt
    from slime.rollout.tools import tool_schema

    tokenizer = load_tokenizer(stack.model_dir)
    args, params = make_args(stack, max_turns=2)
    loaded = Sample(prompt=render_chat_prompt(tokenizer, PROMPT), metadata={"messages": PROMPT}, index=0)
    sample = run(multi_turn.generate(args, loaded, params))
    schemas = [tool_schema(f) for f in (lookup, explode, hang)]
    expected = render_chat_prompt(tokenizer, PROMPT, tools=schemas)
    assert sample.tokens[: sample.prompt_length] == tokenizer(expected, add_special_tokens=False)["input_ids"]
