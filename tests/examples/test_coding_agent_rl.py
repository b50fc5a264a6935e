"""The real Claude Code and Codex CLIs, each in a local sandbox, against the adapters over the built-in engine: a
tiny model warm-started (examples/coding_agent_rl/warm_start.py) to run the repository's tests with the CLI's shell
tool, then answer. Checked: the episode ends within its budgets with a tool call and more than one turn; what the
CLI logged it received (its own JSON event log) is exactly what the trajectory trains (the trained ids decode to
it); the hidden tests grade the diff. And the failures: a hung CLI, a crashing CLI, a sandbox past its memory and a
CLI dialing the network are contained, reported on the sample and never trained.

Needs the CLIs (scripts/setup_agent_clis.sh) and a host that can run local sandboxes (root, user namespaces); skips
otherwise. The Claude Code episode runs by default; the rest are slow-marked (SLIME_RUN_SLOW=1).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

CLI_DIR = Path(os.environ.get("SLIME_AGENT_CLI_DIR", "/opt/slime-agent-clis"))
pytestmark = pytest.mark.skipif(not (CLI_DIR / "node_modules/.bin/claude").exists()
                                or not (CLI_DIR / "node_modules/.bin/codex").exists(),
                                reason="the agent CLIs are not installed: bash scripts/setup_agent_clis.sh")
SFT_STEPS = 300


def sandbox_problems() -> list[str]:
    from slime.agent.local_sandbox import local_sandbox_problems

    return local_sandbox_problems()


@pytest.fixture(autouse=True)
def _needs_sandbox():
    if sandbox_problems():
        pytest.skip("local sandboxes cannot run here: " + "; ".join(sandbox_problems()))


@pytest.fixture(scope="module")
def random_engine(tmp_path_factory):
    """The built-in engine on a random tiny model with a context long enough for Claude Code's prompt."""
    from slime.engine.server.launch import launch_server
    from slime.utils.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("random_model"), arch="qwen3", max_position_embeddings=32768)
    server = launch_server(model, extra_args=["--max-model-len", "32768"])
    yield model, server
    server.stop()


def warm_model(tmp_path_factory, agent: str) -> Path:
    from examples.coding_agent_rl.warm_start import warm_start

    return warm_start(tmp_path_factory.mktemp(f"warm_{agent}"), agent, steps=SFT_STEPS, cli_dir=str(CLI_DIR))


class Episode:
    """One episode through the pieces generate() uses, keeping what generate() throws away for the checks: the
    CLI's own event log (`{workdir}/.harness/trajectory.jsonl`) and the sandbox's report."""

    def __init__(self, agent: str, model: Path, engine_url: str):
        from examples.coding_agent_rl.warm_start import AGENTS

        self.agent, self.model = agent, model
        self.harness_cls, self.adapter_cls = AGENTS[agent]
        self.engine_url = engine_url

    async def run(self, row: dict, *, max_turns: int = 4, time_budget_sec: int = 240, memory_mb: int = 3072,
                  command: str | None = None, sampling: dict | None = None):
        from transformers import AutoTokenizer

        from examples.coding_agent_rl import swe
        from examples.coding_agent_rl.warm_start import CLI_MOUNT, link_cli
        from slime.agent.aiohttp_threaded import run_app_in_thread
        from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
        from slime.utils.types import Sample

        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        adapter = self.adapter_cls(tokenizer=self.tokenizer, sglang_url=self.engine_url, max_turns=max_turns)
        handle = run_app_in_thread(adapter.app, host="127.0.0.1", port=0, thread_name="test-adapter")
        adapter.open_session("episode", sampling_defaults=sampling or {"temperature": 0.0, "max_new_tokens": 64})
        sample = Sample(index=0, group_index=0, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
        md = swe.get_metadata(sample)
        harness = self.harness_cls()
        try:
            limits = SandboxLimits(memory_bytes=memory_mb << 20, disk_bytes=512 << 20,
                                   episode_time_budget_sec=time_budget_sec + 60)
            async with LocalSandbox("host", allowed_port=handle.port, read_only_mounts={str(CLI_DIR): CLI_MOUNT},
                                    limits=limits) as sb:
                await sb.exec(link_cli(self.agent), user="root", check=True, timeout=30)
                await swe.prepare_workspace(sb, md["workdir"], md)
                ctx_url = f"http://127.0.0.1:{handle.port}"
                if command is None:
                    self.exit_code = await harness.run(sb, workdir=md["workdir"], session_id="episode",
                                                       adapter_url=ctx_url, time_budget_sec=time_budget_sec,
                                                       prompt=swe.SWE_PROMPT)
                else:  # a stand-in for the CLI (hung, crashing, greedy for memory or network)
                    from slime.agent.harness import run_agent
                    from slime.agent.sandbox import ensure_agent_user

                    await ensure_agent_user(sb, md["workdir"])
                    self.exit_code = await run_agent(sb, workdir=md["workdir"], start_cmd=command, env={},
                                                     time_budget_sec=time_budget_sec)
                self.cli_log = await sb.read_file(f"{md['workdir']}/.harness/trajectory.jsonl", user="root")
                self.diff = await swe.git_diff(sb, md["workdir"])
                self.report = sb.report()
            self.grade = await swe.run_evaluation(md, diff_text=self.diff, timeout_sec=120)
            self.samples = await adapter.finish_session("episode", base_sample=sample, reward=self.grade.reward)
        finally:
            handle.stop()
        return self


def trained_turns(tokenizer, samples) -> list[tuple[int, str]]:
    """(turn index, its trained ids decoded) for each trained turn, in turn order. A turn whose reply the CLI sent
    back re-tokenized differently, followed by a short turn, is context and not trained (slime's trajectory
    manager), so a random model's episode may train fewer turns than the CLI received."""
    runs = []
    for sample in samples:
        response = sample.tokens[sample.prompt_length:]
        ids, spans = [], []
        for token, mask in zip(response, sample.loss_mask):
            if mask:
                ids.append(token)
            elif ids:
                spans.append(ids)
                ids = []
        spans += [ids] if ids else []
        runs += list(zip(sample.metadata["turn_indices"], spans))
    return [(index, tokenizer.decode(ids)) for index, ids in sorted(runs, key=lambda run: run[0])]


def trained_texts(tokenizer, samples) -> list[str]:
    return [text for _, text in trained_turns(tokenizer, samples)]


def cli_received(agent: str, cli_log: str) -> list[list[tuple]]:
    """Per model call, what the CLI says it got: ("text", str) and ("call", name, input) items in order."""
    turns = []
    for line in cli_log.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        # Claude Code logs an API error (the turn cap's 429) as an assistant message of model "<synthetic>"
        if agent == "claude_code" and event.get("type") == "assistant" and event["message"].get("model") != "<synthetic>":
            items = [("text", b["text"]) if b["type"] == "text" else ("call", b["name"], b["input"])
                     for b in event["message"]["content"] if b["type"] in ("text", "tool_use")]
            if turns and event["message"]["id"] == turns[-1][0]:  # one message, logged block by block
                turns[-1][1].extend(items)
            else:
                turns.append((event["message"]["id"], items))
    return [items for _, items in turns]


def check_trained_equals_received(agent: str, episode: Episode) -> None:
    from slime.utils.tool_parsers import get_parser

    turns = trained_turns(episode.tokenizer, episode.samples)
    parser = get_parser("qwen")
    expected = []
    for _, text in turns:
        text = text.removesuffix("<|im_end|>")
        parsed = parser(text, [{"type": "function", "function": {"name": n}} for n in ("Bash", "exec_command")])
        items = [("text", parsed.content.strip())] if parsed.content.strip() else []
        items += [("call", call.name, call.arguments) for call in parsed.calls]
        expected.append(items)
    if agent == "claude_code":
        received = cli_received(agent, episode.cli_log)
        assert [received[i] for i, _ in turns] == expected
    assert any(item[0] == "call" for items in expected for item in items)


def task_row(index: int = 0) -> dict:
    import random

    from examples.coding_agent_rl.tasks import build_row

    return build_row(index, random.Random(index))


def test_claude_code_episode_trains_what_the_cli_received(random_engine):
    """The real Claude Code in the local sandbox, a random model (it writes text, no tool call): every turn's
    trained ids decode to the text the CLI logged it received; later turns hit the prefix cache; the turn cap ends
    the episode; the hidden tests grade the (empty) diff."""
    model, server = random_engine
    episode = asyncio.run(Episode("claude_code", model, server.url).run(
        task_row(), max_turns=2, sampling={"temperature": 1.0, "sampling_seed": 7, "max_new_tokens": 12}))
    received = cli_received("claude_code", episode.cli_log)
    turns = [(i, text.removesuffix("<|im_end|>")) for i, text in trained_turns(episode.tokenizer, episode.samples)]
    # the turn cap ends the episode after two replies; every trained turn decodes to the reply the CLI logged for
    # that turn (Claude Code logs a text block trimmed of surrounding whitespace), and the last turn is trained
    assert len(received) == 2 and turns and turns[-1][0] == 1, episode.cli_log[-3000:]
    assert [[("text", t.strip())] for _, t in turns] == [received[i] for i, _ in turns], episode.cli_log[-3000:]
    assert episode.grade.applied_cleanly and episode.grade.tests_passed[1] == 15
    later = [t for s in episode.samples for i, t in zip(s.metadata["turn_indices"], s.metadata["turn_stats"]) if i]
    assert any(t["cached_tokens"] > 0.8 * t["prompt_tokens"] for t in later)  # the long prompt: one shared prefix
    assert not episode.report.limits_hit


@pytest.fixture(scope="module")
def claude_engine(tmp_path_factory):
    from slime.engine.server.launch import launch_server

    model = warm_model(tmp_path_factory, "claude_code")
    server = launch_server(model, extra_args=["--max-model-len", "16384"])
    yield model, server
    server.stop()


@pytest.mark.slow
def test_warm_claude_code_episode_calls_a_tool_token_exact(claude_engine):
    model, server = claude_engine
    episode = asyncio.run(Episode("claude_code", model, server.url).run(task_row()))
    assert episode.exit_code == 0, episode.cli_log[-2000:]
    turns = sum(len(s.metadata["turn_indices"]) for s in episode.samples)
    assert turns >= 2
    check_trained_equals_received("claude_code", episode)
    for sample in episode.samples:
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert sample.metadata["turn_stats"][-1]["prompt_tokens"] > 0
    later = [t for s in episode.samples for t in s.metadata["turn_stats"][1:]]
    assert later and all(t["cached_tokens"] > 0.8 * t["prompt_tokens"] for t in later)  # one shared prefix
    assert episode.grade.applied_cleanly and episode.grade.tests_passed is not None
    assert not episode.report.limits_hit


@pytest.mark.slow
def test_codex_episode_over_the_responses_api(random_engine):
    """The real Codex in the local sandbox over the Responses API (streamed), a random model: the text Codex printed
    as its answer is exactly the turn's trained ids decoded; the 22k-token prompt fits; the cut turn
    (response.incomplete, max_output_tokens) ends the episode with Codex's error, contained."""
    model, server = random_engine
    episode = asyncio.run(Episode("codex", model, server.url).run(
        task_row(1), max_turns=2, sampling={"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 12}))
    [text] = trained_texts(episode.tokenizer, episode.samples)
    printable = "".join(c for c in text if c.isprintable())
    assert printable and printable in "".join(c for c in episode.cli_log if c.isprintable() or c == "\n")
    assert "Incomplete response returned, reason: max_output_tokens" in episode.cli_log
    assert episode.exit_code == 1 and not episode.report.limits_hit
    assert episode.grade.applied_cleanly


@pytest.mark.slow
@pytest.mark.parametrize("command, expect", [
    ("sleep 3600", "time_budget"),
    ("bash -c 'kill -SEGV $$'", "crash"),  # the CLI's process dies of a signal
    ("python3 -c 'x = bytearray(3 << 30); print(len(x))'", "memory"),
    ("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 443), timeout=5)'", "network"),
])
def test_failing_clis_are_contained_and_reported(random_engine, command, expect):
    from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED

    model, server = random_engine
    episode = asyncio.run(Episode("claude_code", model, server.url).run(
        task_row(2), command=command, time_budget_sec=20 if expect == "time_budget" else 120, memory_mb=1024))
    assert episode.samples == []  # nothing reached the model: nothing to train
    if expect == "time_budget":
        assert episode.exit_code == EXIT_TIME_BUDGET_EXCEEDED
    elif expect == "crash":
        assert episode.exit_code == 128 + 11
    elif expect == "memory":
        assert episode.exit_code != 0 and "memory" in episode.report.limits_hit
    else:
        assert episode.exit_code != 0 and "network" in episode.report.limits_hit


@pytest.mark.slow
def test_generate_marks_a_failed_episode_instead_of_scoring_it(random_engine, monkeypatch):
    """generate() over the same engine with a CLI that crashes at once: one ABORTED sample, remove_sample, the
    reason and the exit code on it; no reward is measured."""
    import dataclasses

    import examples.coding_agent_rl.generate as gen
    from slime.agent.harness import ClaudeCodeHarness
    from slime.utils.misc import SingletonMeta
    from slime.utils.types import Sample

    model, server = random_engine
    host, port = server.url.rsplit("/", 1)[1].split(":")
    monkeypatch.setattr(gen, "CONFIG", dataclasses.replace(gen.CONFIG, agent_time_budget_sec=60, boot_retries=1,
                                                           cli_dir=str(CLI_DIR)))
    monkeypatch.setattr(gen, "HARNESS_CLS", ClaudeCodeHarness)
    monkeypatch.setattr(ClaudeCodeHarness, "command", lambda self, prompt: "bash -c 'exit 3'")
    SingletonMeta.clear_instances(gen._AdapterService)
    args = SimpleNamespace(hf_checkpoint=str(model), rollout_max_context_len=16384, sglang_tool_call_parser=None,
                           sglang_reasoning_parser=None, sglang_router_ip=host, sglang_router_port=int(port))
    row = task_row(3)
    sample = Sample(index=0, group_index=0, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
    try:
        [out] = asyncio.run(gen.generate(args, sample, {"temperature": 0.0}))
    finally:
        gen._AdapterService(args).app_handle.stop()
        SingletonMeta.clear_instances(gen._AdapterService)
    assert out.status == Sample.Status.ABORTED and out.remove_sample
    assert out.metadata["abort_reason"] == "adapter_session_empty" and out.metadata["agent_exit_code"] == 3
    assert out.loss_mask == [0]
