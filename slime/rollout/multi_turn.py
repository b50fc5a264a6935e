"""Multi-turn rollouts with tool calls or an environment, token-in-token-out.

    --custom-generate-function-path slime.rollout.multi_turn.generate   (the default when --max-turns > 1)

One sample is one conversation: sample a turn, find its tool calls (`--tool-call-parser`), run the tools
(`--tool-functions-path`, bounded by `--tool-timeout`), render their results with the tokenizer's chat template (or
inline, for the `xml_tags` format: `--tool-response-template`), continue; or hand the turn to an environment
(`--env-path`) and render its observation as a user message. Stops at a turn without a call, `--max-turns`, the
response budget (`--rollout-max-response-len`, all turns and tool text together) or the context budget
(`--rollout-max-context-len`, prompt included; default the checkpoint's max_position_embeddings).

The trajectory contract: `sample.tokens` is the prompt ids followed, turn by turn, by exactly the ids the engine
sampled (loss mask 1, `rollout_log_probs` = the engine's) and the ids of the rendered template / tool / environment
text between turns (loss mask 0, log-prob 0). Sampled text is never re-tokenized: the text between turns is rendered
from the conversation with a placeholder in the assistant's place and only what follows it is tokenized. With
`--partial-rollout` an aborted conversation keeps its finished turns (state in `sample.metadata["multi_turn"]`) and
resumes where it stopped. Not the tools themselves (`slime.rollout.tools`), not the parsers
(`slime.utils.tool_parsers`) and not the agent adapters (`slime.agent`).
"""

from __future__ import annotations

import functools

from slime.rollout.dataset import render_chat_prompt, tokenizer_for
from slime.rollout.environment import check_step_result, make_environment, maybe_await
from slime.rollout.generate_request import (
    add_turn_images,
    encode_multimodal_text,
    encode_with_images,
    sample_continuation,
)
from slime.rollout.multimodal_data import load_image_named, messages_with_images, messages_without_pixels
from slime.rollout.tools import load_tools, run_tool_call
from slime.utils.tool_parsers import get_parser, stop_strings_for
from slime.utils.types import Sample

PLACEHOLDER = "\u2063slime-turn\u2063"  # invisible separator: never in a real conversation
DEFAULT_INLINE_TEMPLATE = "\n\n<information>{result}</information>\n\n"


@functools.lru_cache(maxsize=8)
def _parser(name: str):
    return get_parser(name)


@functools.lru_cache(maxsize=8)
def _model_max_len(checkpoint: str) -> int | None:
    """The checkpoint's max_position_embeddings: the context budget when --rollout-max-context-len is not given."""
    import json
    from pathlib import Path

    config = Path(checkpoint) / "config.json"
    return json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None


def _messages(sample: Sample) -> list[dict]:
    """The conversation to start from: the chat messages (kept in metadata when --apply-chat-template rendered the
    prompt at load time, without this rollout's tools), or a text prompt as one user message."""
    prompt = sample.prompt
    if not isinstance(prompt, list) and isinstance(sample.metadata.get("messages"), list):
        prompt = sample.metadata["messages"]
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def _schemas(args, sample: Sample, tools: dict) -> list[dict]:
    extra = sample.metadata.get("tools") if isinstance(sample.metadata, dict) else None
    return [schema for _, schema in tools.values()] + list(extra or [])


def render_between_turns(tokenizer, history: list[dict], new_messages: list[dict], schemas) -> str:
    """The template text after the last assistant turn in `history` up to the next generation prompt, for
    `new_messages` (tool results or an observation): rendered with a placeholder in the assistant's place."""
    conversation = history[:-1] + [{"role": "assistant", "content": PLACEHOLDER}] + new_messages
    text = render_chat_prompt(tokenizer, conversation, tools=schemas or None)
    position = text.rfind(PLACEHOLDER)
    if position < 0:
        raise ValueError("the chat template dropped the assistant turn; multi-turn rollouts need a template that "
                         "renders assistant messages")
    return text[position + len(PLACEHOLDER):]


def _initial_state(sample: Sample) -> dict:
    return {"turns": 0, "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0, "cut_by_context": False,
            "turn_lengths": [], "turn_text": "", "history": None, "env_reward": 0.0}


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    tokenizer = tokenizer_for(args)
    if tokenizer is None:
        raise ValueError("multi-turn rollouts need --hf-checkpoint (its chat template renders the turns)")
    tools = load_tools(tuple(args.tool_functions_path or ()))
    schemas = _schemas(args, sample, tools)
    parser = _parser(args.tool_call_parser)
    # Inline formats (Search-R1's <search>) describe their tags in the prompt: a template's tool block would
    # instruct the model to write <tool_call> instead, which the parser would never see.
    offered = [] if getattr(parser, "inline_response", False) else schemas
    env = make_environment(args)
    state = sample.metadata.setdefault("multi_turn", _initial_state(sample))
    if state["history"] is None:
        state["history"] = _messages(sample)
        if env is not None:
            first = await maybe_await(env.reset(sample))
            if first:
                state["history"].append({"role": "user", "content": first})
    if sample.multimodal_inputs and (not sample.tokens or sample.multimodal_train_inputs is None):
        encode_multimodal_text(args, sample, render_chat_prompt(tokenizer, state["history"], tools=offered or None))
    elif not sample.tokens:
        sample.tokens = tokenizer(render_chat_prompt(tokenizer, state["history"], tools=offered or None),
                                  add_special_tokens=False)["input_ids"]
    elif sample.response_length and args.mask_offpolicy_in_partial_rollout:
        sample.loss_mask = [0] * sample.response_length  # resumed: what was sampled came from older weights
    stops = list(sampling_params.get("stop") or []) + stop_strings_for(parser, schemas)
    max_turns = args.max_turns
    context_flag = "eval_max_context_len" if evaluation else "rollout_max_context_len"
    max_context = getattr(args, context_flag, None) or _model_max_len(args.hf_checkpoint)
    timeout_s, max_chars = args.tool_timeout, args.max_tool_response_chars

    while True:
        budget = sampling_params["max_new_tokens"] - sample.response_length
        if max_context is not None:
            budget = min(budget, max_context - len(sample.tokens))
        if budget <= 0:
            sample.status = Sample.Status.TRUNCATED
            state["cut_by_context"] = max_context is not None and len(sample.tokens) >= max_context
            break
        before = sample.response_length
        text = await sample_continuation(args, sample, {**sampling_params, "max_new_tokens": budget,
                                                        "stop": stops or None})
        state["turn_text"] += text
        state["turn_lengths"].append(sample.response_length - before)
        if sample.status == Sample.Status.ABORTED:
            return sample  # partial rollout: resumes this turn next time
        state["turns"] += 1
        turn_text, state["turn_text"] = state["turn_text"], ""
        state["history"].append({"role": "assistant", "content": turn_text})
        if sample.status != Sample.Status.COMPLETED:
            break  # length: out of budget mid-turn
        if state["turns"] >= max_turns and env is None:
            break  # no tool runs for a call the model would never see answered
        new_messages, done = await _react(args, env, parser, schemas, tools, turn_text, state, timeout_s, max_chars,
                                          sample)
        if done or state["turns"] >= max_turns:
            break
        new_messages, new_images = observation_images(new_messages)
        between = new_messages if isinstance(new_messages, str) else \
            render_between_turns(tokenizer, state["history"], new_messages, offered)
        encoded = encode_with_images(args, between, new_images) if new_images else None
        between_ids = encoded.input_ids if encoded else tokenizer(between, add_special_tokens=False)["input_ids"]
        if max_context is not None and len(sample.tokens) + len(between_ids) >= max_context:
            sample.status, state["cut_by_context"] = Sample.Status.TRUNCATED, True
            break
        add_turn_images(sample, new_images, encoded)
        sample.append_response_tokens(args, tokens=between_ids, trainable=False, text=between)
        if not isinstance(new_messages, str):
            state["history"].extend(new_messages)
        else:
            state["history"][-1]["content"] += between
        sample.status = Sample.Status.PENDING
    if env is not None and args.custom_rm_path is None and args.rm_type is None:
        sample.reward = state["env_reward"]
    return sample


def observation_images(new_messages):
    """(messages for the chat template, their decoded images in order): a message's `images` become image parts at
    its `<image>` placeholders (multimodal_data.py); text and tool messages pass unchanged."""
    if isinstance(new_messages, str) or not any("images" in m for m in new_messages):
        return new_messages, []
    messages, images = [], []
    for message in new_messages:
        message = dict(message)
        decoded = [load_image_named(item, f"--env-path observation image {i}")
                   for i, item in enumerate(message.pop("images", []))]
        if decoded:
            [message] = messages_without_pixels(messages_with_images([message], decoded, "--env-path observation"))
        messages.append(message)
        images += decoded
    return messages, images


async def _react(args, env, parser, schemas, tools, turn_text: str, state: dict, timeout_s: float,
                 max_chars: int, sample: Sample):
    """What answers a finished assistant turn: (tool / observation messages or inline text, done)."""
    if env is not None:
        observation, reward, done, _ = check_step_result(await maybe_await(env.step(turn_text)), args.env_path)
        state["env_reward"] += reward
        if isinstance(observation, dict):  # text with images (a vision-language model's environment)
            return [{"role": "user", "content": observation["text"], "images": observation.get("images", [])}], done
        return [{"role": "user", "content": observation or ""}], done or observation is None
    parsed = parser(turn_text, schemas)
    if not parsed.calls:
        return [], True
    results = [await run_tool_call(call, tools, timeout_s, max_chars, sample) for call in parsed.calls]
    state["tool_calls"] += len(results)
    state["tool_errors"] += sum(r.error is not None for r in results)
    state["tool_seconds"] += sum(r.seconds for r in results)
    if getattr(parser, "inline_response", False):
        template = args.tool_response_template or DEFAULT_INLINE_TEMPLATE
        return "".join(template.format(result=r.text) for r in results), False
    return [{"role": "tool", "name": r.name, "content": r.text} for r in results], False
