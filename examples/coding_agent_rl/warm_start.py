"""A tiny model warm-started to act as a coding agent's backend on the CPU: it calls the CLI's shell tool to run
the repository's tests, then answers.

    python -m examples.coding_agent_rl.warm_start OUT_DIR --agent claude_code|codex [--steps 60]

1. Capture: one episode of the real CLI (local sandbox, a task of tasks.py) against the adapter over the built-in
   engine with a random model, one model call of one token: the text of the CLI's first prompt as the adapter
   renders it (system prompt, tools, the task), which the model will see in every episode.
2. Build: a byte-level BPE tokenizer trained on that text (so the CLI's long prompt costs a few thousand tokens,
   not tens of thousands) and a random tiny Qwen3 with a long enough context.
3. SFT (plain torch, full sequences): after the first prompt the model writes the tool call that runs
   `python3 tests/test_mathlib.py`; after the tool's result it writes a one-line answer. The loss covers only
   those two completions.

Not RL (train.py does that, README.md), not a harness. The CLI must be installed (scripts/setup_agent_clis.sh).
Measured (Claude Code, 2026-12-05): 300 steps at lr 5e-3, loss 0.0017 per token; the greedy model then calls
Bash with `python3 tests/test_mathlib.py` and answers after the result (README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import tempfile
from pathlib import Path

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.harness import ClaudeCodeHarness, CodexHarness
from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.utils.types import Sample

from . import generate as _generate  # noqa: F401 - the CLIs' environment defaults (CLI_ENV_DEFAULTS)
from . import swe, tasks

AGENTS = {"claude_code": (ClaudeCodeHarness, AnthropicAdapter), "codex": (CodexHarness, OpenAIAdapter)}
SHELL_CALLS = {"claude_code": ("Bash", "command"), "codex": ("exec_command", "cmd")}
TEST_COMMAND = "python3 tests/test_mathlib.py"
FINAL_ANSWER = "I ran the tests."
CLI_MOUNT = "/opt/slime-agent-clis"
CLI_NAMES = {"claude_code": "claude", "codex": "codex"}
MAX_CONTEXT = 16384


def tool_call_text(agent: str) -> str:
    """The call as the model writes it and as the chat template re-renders it (qwen's <tool_call> JSON)."""
    name, key = SHELL_CALLS[agent]
    return "<tool_call>" + json.dumps({"name": name, "arguments": {key: TEST_COMMAND}}) + "</tool_call>"


def link_cli(agent: str) -> str:
    return (f"mkdir -p /usr/local/bin && ln -sf {CLI_MOUNT}/node_modules/.bin/{CLI_NAMES[agent]} "
            f"/usr/local/bin/{CLI_NAMES[agent]}")


async def capture_first_prompt(agent: str, model_dir: str | Path, engine_url: str, row: dict,
                               cli_dir: str = "/opt/slime-agent-clis") -> str:
    """The text of the CLI's first model call in an episode of `row` (step 1 of the module docstring)."""
    from transformers import AutoTokenizer

    harness_cls, adapter_cls = AGENTS[agent]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = adapter_cls(tokenizer=tokenizer, sglang_url=engine_url, max_turns=1)
    handle = run_app_in_thread(adapter.app, host="127.0.0.1", port=0, thread_name="capture-adapter")
    session_id = "capture"
    adapter.open_session(session_id, sampling_defaults={"max_new_tokens": 1, "temperature": 0.0})
    sample = Sample(index=0, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
    md = swe.get_metadata(sample)
    try:
        async with LocalSandbox("host", allowed_port=handle.port, read_only_mounts={cli_dir: CLI_MOUNT},
                                limits=SandboxLimits(memory_bytes=3 << 30, disk_bytes=512 << 20,
                                                     episode_time_budget_sec=300)) as sb:
            await sb.exec(link_cli(agent), user="root", check=True, timeout=30)
            await swe.prepare_workspace(sb, md["workdir"], md)
            await harness_cls().run(sb, workdir=md["workdir"], session_id=session_id,
                                    adapter_url=f"http://127.0.0.1:{handle.port}", time_budget_sec=180,
                                    prompt=swe.SWE_PROMPT)
        samples = await adapter.finish_session(session_id, base_sample=sample)
    finally:
        handle.stop()
    if not samples:
        raise RuntimeError(f"warm start: the {agent} CLI made no model call in the capture episode")
    first = min(samples, key=lambda s: s.metadata["turn_indices"][0])
    return tokenizer.decode(first.tokens[:first.prompt_length])


def visible_test_outputs(rows: list[dict]) -> list[str]:
    """What `python3 tests/test_mathlib.py` prints in each row's repository (run on the host, as the agent would)."""
    outputs = []
    for row in rows:
        with tempfile.TemporaryDirectory() as folder:
            for path, text in row["metadata"]["files"].items():
                (Path(folder) / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / path).write_text(text)
            done = subprocess.run(TEST_COMMAND.split(), cwd=folder, capture_output=True, text=True, timeout=60)
            outputs.append(done.stdout + done.stderr)
    return outputs


def sft_examples(agent: str, first_prompt: str, tool_outputs: list[str]) -> list[tuple[str, str]]:
    """(context, completion) pairs: the call after the first prompt; the answer after the call and its result (the
    result as the adapter renders it, plain and as an error, since CLIs report a failing command either way)."""
    call = tool_call_text(agent)
    pairs = [(first_prompt, call)]
    for output in tool_outputs:
        for result in (output, f"Error: {output}", f"Exit code 1\n{output}"):
            context = f"{first_prompt}{call}<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
            pairs.append((context, FINAL_ANSWER + "<|im_end|>"))
    return pairs


def build_warm_model(out_dir: str | Path, agent: str, first_prompt: str, tool_outputs: list[str], *, steps: int = 300,
                     lr: float = 5e-3, vocab_size: int = 2048, seed: int = 0) -> Path:
    """Steps 2 and 3: the tokenizer, the model, the SFT; saved to `out_dir` (a Hugging Face checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.utils.tiny_model import DEFAULT_CORPUS, build_tiny_model

    pairs = sft_examples(agent, first_prompt, tool_outputs)
    corpus = DEFAULT_CORPUS + [first_prompt] * 4 + [c for _, c in pairs] + tool_outputs
    out_dir = build_tiny_model(out_dir, arch="qwen3", corpus=corpus, vocab_size=vocab_size, seed=seed,
                               max_position_embeddings=MAX_CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    batches = []
    prompt_ids = tokenizer.encode(first_prompt, add_special_tokens=False)
    call_ids = tokenizer.encode(pairs[0][1], add_special_tokens=False)
    for context, completion in pairs:
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        completion_ids = tokenizer.encode(completion, add_special_tokens=False)
        ids = torch.tensor([context_ids + completion_ids])
        labels = torch.full_like(ids, -100)
        labels[0, len(context_ids):] = ids[0, len(context_ids):]
        call_end = len(prompt_ids) + len(call_ids)
        if context_ids[:call_end] == prompt_ids + call_ids:  # the call in an answer's context is trained too
            labels[0, len(prompt_ids):call_end] = ids[0, len(prompt_ids):call_end]
        batches.append((ids, labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    order = random.Random(seed)
    for _ in range(steps):  # every step: the call, and one of the answers
        for ids, labels in (batches[0], order.choice(batches[1:])):
            model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        losses = [float(model(input_ids=ids, labels=labels).loss) for ids, labels in batches]
    model.save_pretrained(out_dir, safe_serialization=True)
    (Path(out_dir) / "warm_start.json").write_text(json.dumps({
        "agent": agent, "steps": steps, "lr": lr, "final_losses": losses,
        "first_prompt_tokens": len(tokenizer.encode(first_prompt, add_special_tokens=False))}))
    return Path(out_dir)


def warm_start(out_dir: str | Path, agent: str, *, steps: int = 300, cli_dir: str = "/opt/slime-agent-clis",
               num_task_rows: int = 8) -> Path:
    """The whole recipe (module docstring): a random bootstrap model for the capture, then the warm model."""
    from slime.engine.server.launch import launch_server
    from slime.utils.tiny_model import build_tiny_model

    out_dir = Path(out_dir)
    rows = [json.loads(line) for line in tasks.build_tasks(out_dir / "tasks.jsonl", num_task_rows).read_text()
            .splitlines()]
    bootstrap = build_tiny_model(out_dir / "bootstrap", arch="qwen3", max_position_embeddings=4 * MAX_CONTEXT)
    server = launch_server(bootstrap, extra_args=["--max-model-len", str(4 * MAX_CONTEXT)],
                           log_path=out_dir / "bootstrap_server.log")
    try:
        first_prompt = asyncio.run(capture_first_prompt(agent, bootstrap, server.url, rows[0], cli_dir))
    finally:
        server.stop()
    (out_dir / "first_prompt.txt").write_text(first_prompt)
    outputs = sorted(set(visible_test_outputs(rows)))
    return build_warm_model(out_dir / "model", agent, first_prompt, outputs, steps=steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--agent", choices=sorted(AGENTS), default="claude_code")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cli-dir", default=os.environ.get("SLIME_AGENT_CLI_DIR", "/opt/slime-agent-clis"))
    opts = parser.parse_args()
    print(warm_start(opts.out_dir, opts.agent, steps=opts.steps, cli_dir=opts.cli_dir))
