"""Coding-agent RL: the per-sample generate function (slime's `examples/coding_agent_rl/generate.py` module API).

    --custom-generate-function-path examples.coding_agent_rl.generate.generate

One episode per sample: a sandbox (swe.E2BSandbox: the local sandbox, `image: host`) with the CLI linked in from the
host folder scripts/setup_agent_clis.sh filled -> swe.prepare_workspace (the repository, PROBLEM_STATEMENT.md) ->
the harness runs the real CLI as the sandbox's `agent` user against the adapter (the only port the sandbox may
reach) -> swe.git_diff -> swe.run_evaluation in a fresh sandbox (hidden tests) -> adapter.finish_session: the
episode's token-exact Samples (slime.agent.trajectory) with the reward.

The CLI: env `SWE_AGENT` = `claude_code` (ClaudeCodeHarness + AnthropicAdapter, the default) or `codex` (CodexHarness
+ OpenAIAdapter over the Responses API). Budgets: `SWE_AGENT_TIME_BUDGET_SEC` (the episode's wall clock; the
sandbox kills everything at its end), `SWE_MAX_TURNS` (model calls per episode; the adapter answers 429 past it,
which ends the CLI), `SWE_EVAL_TIMEOUT_SEC`, `SWE_ROLLOUT_GUARD_SEC` (the whole sample), sandbox memory / disk
(`SWE_SANDBOX_MEMORY_MB`, `SWE_SANDBOX_DISK_MB`). Episodes run in parallel as the rollout sends samples; sandbox
starts are bounded by `SWE_BOOT_CONCURRENCY`.

A failure of the sandbox or the harness (an exception, the guard, an episode that never reached the model) returns
the sample ABORTED with `remove_sample` and `metadata["abort_reason"]`: the rollout keeps its group, leaves the
sample out of the group's statistics and trains nothing of it (slime.rollout.scoring.is_scorable,
slime.ray.train_data). It is never scored as a zero reward. A CLI that exits non-zero or runs out of time after
some turns is an episode like any other: its diff is graded (`metadata["agent_exit_code"]` says how it ended).

Per Sample: `metadata["multi_turn"]` (turns, tool calls) in slime.rollout.multi_turn's shape, `episode_seconds`,
`tests_passed`, `sandbox_limits_hit` (the local sandbox's report: memory, processes, cpu, disk, network, episode
time), `prefix_cache_info` (the adapter's cached prompt tokens); metrics.py turns them into `agent/*`.
Not the task layer (swe.py), not a harness (slime.agent.harness).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread
from slime.agent.harness import ClaudeCodeHarness, CodexHarness
from slime.agent.local_sandbox import SandboxLimits
from slime.rollout.dataset import load_tokenizer
from slime.utils.misc import SingletonMeta
from slime.utils.types import Sample

from . import swe
from .swe import E2BSandbox

logger = logging.getLogger(__name__)

_AGENTS = {"claude_code": (ClaudeCodeHarness, AnthropicAdapter), "codex": (CodexHarness, OpenAIAdapter)}
AGENT_NAME = os.environ.get("SWE_AGENT", "claude_code")
if AGENT_NAME not in _AGENTS:
    raise ValueError(f"SWE_AGENT={AGENT_NAME!r}: use one of {sorted(_AGENTS)}")
HARNESS_CLS, ADAPTER_CLS = _AGENTS[AGENT_NAME]
# How the example's CLIs run unless the environment says otherwise: Claude Code with its shell and file tools only (a
# shorter system prompt), Codex over the Responses API (the Codex scripts/setup_agent_clis.sh pins speaks nothing
# else; slime's harness default is "chat"). warm_start.py captures the prompt under the same settings.
CLI_ENV_DEFAULTS = {ClaudeCodeHarness.extra_args_env: "--tools Bash,Read,Edit,Write",
                    CodexHarness.wire_api_env: "responses"}
for _key, _value in CLI_ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

CLI_MOUNT = "/opt/slime-agent-clis"  # where the host's CLI folder appears in the sandbox
CLI_LINKS = {"claude_code": "claude", "codex": "codex"}
# The rollout's sampling params an API client would set (not its own decoding choices such as skip_special_tokens).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "sampling_seed")


@dataclass(frozen=True)
class SweConfig:
    eval_protocol: str
    train_protocol: str
    adapter_public_host: str | None
    adapter_bind_host: str
    adapter_port: int
    fork_merge_threshold: int | None
    agent_time_budget_sec: int
    eval_timeout_sec: int
    rollout_guard_sec: int
    boot_concurrency: int
    boot_retries: int
    max_turns: int
    cli_dir: str
    sandbox_memory_mb: int
    sandbox_disk_mb: int

    @classmethod
    def from_env(cls) -> SweConfig:
        agent_budget = int(os.environ.get("SWE_AGENT_TIME_BUDGET_SEC", "1800"))
        eval_timeout = int(os.environ.get("SWE_EVAL_TIMEOUT_SEC", "600"))
        guard = int(os.environ.get("SWE_ROLLOUT_GUARD_SEC", "0") or 0) or (agent_budget + eval_timeout + 180)
        fork = int(v) if (v := os.environ.get("SLIME_FORK_MERGE_MAX_RESPONSE_TOKENS")) else None
        return cls(
            eval_protocol=os.environ.get("SWE_EVAL_PROTOCOL", swe.PROTOCOL_SCALESWE),
            train_protocol=os.environ.get("SWE_TRAIN_PROTOCOL", swe.PROTOCOL_SCALESWE),
            adapter_public_host=os.environ.get("ADAPTER_PUBLIC_HOST", "127.0.0.1"),
            adapter_bind_host=os.environ.get("ADAPTER_BIND_HOST", "127.0.0.1"),
            adapter_port=int(os.environ.get("ADAPTER_PORT", "0")),
            fork_merge_threshold=fork,
            agent_time_budget_sec=agent_budget,
            eval_timeout_sec=eval_timeout,
            rollout_guard_sec=guard,
            boot_concurrency=int(os.environ.get("SWE_BOOT_CONCURRENCY", "16")),
            boot_retries=int(os.environ.get("SWE_BOOT_RETRIES", "2")),
            max_turns=int(os.environ.get("SWE_MAX_TURNS", "32")),
            cli_dir=os.environ.get("SLIME_AGENT_CLI_DIR", "/opt/slime-agent-clis"),
            sandbox_memory_mb=int(os.environ.get("SWE_SANDBOX_MEMORY_MB", "4096")),
            sandbox_disk_mb=int(os.environ.get("SWE_SANDBOX_DISK_MB", "1024")),
        )


CONFIG = SweConfig.from_env()
_BOOT_SEM = asyncio.Semaphore(CONFIG.boot_concurrency)


def sandbox_options(adapter_port: int) -> dict:
    """What an episode's local sandbox gets: its limits, the adapter's port, the host's CLI folder (read-only)."""
    limits = SandboxLimits(memory_bytes=CONFIG.sandbox_memory_mb << 20, disk_bytes=CONFIG.sandbox_disk_mb << 20,
                           episode_time_budget_sec=CONFIG.agent_time_budget_sec + 120)
    mounts = {CONFIG.cli_dir: CLI_MOUNT} if os.path.isdir(CONFIG.cli_dir) else {}
    return {"limits": limits, "allowed_port": adapter_port, "read_only_mounts": mounts}


@asynccontextmanager
async def boot_agent_sandbox(image: str, instance_id: str, adapter_port: int) -> AsyncIterator[Any]:
    """A fresh sandbox with the harness's CLI runnable (linked from the host folder, or installed from tarballs by
    the harness), retried `boot_retries` times; closed when the caller leaves."""
    sb, last_error = None, None
    for attempt in range(CONFIG.boot_retries):
        candidate = E2BSandbox(image, **sandbox_options(adapter_port))
        try:
            async with _BOOT_SEM:
                await candidate.__aenter__()
                try:
                    cli = CLI_LINKS[HARNESS_CLS.name]
                    await candidate.exec(f"if [ -x {CLI_MOUNT}/node_modules/.bin/{cli} ]; then mkdir -p /usr/local/bin"
                                         f" && ln -sf {CLI_MOUNT}/node_modules/.bin/{cli} /usr/local/bin/{cli}; fi",
                                         user="root", timeout=30)
                    await HARNESS_CLS().install_cli(candidate)
                except BaseException:
                    await candidate.__aexit__(None, None, None)
                    raise
            sb = candidate
            break
        except Exception as error:  # noqa: BLE001 - any boot failure is retried, then reported
            last_error = error
            logger.warning("[coding_agent_rl] %s: sandbox boot %d/%d failed: %s: %s", instance_id, attempt + 1,
                           CONFIG.boot_retries, type(error).__name__, str(error)[:300])
            await asyncio.sleep(1 + attempt + random.random())
    if sb is None:
        raise last_error
    try:
        yield sb
    finally:
        await sb.__aexit__(None, None, None)


class _AdapterService(metaclass=SingletonMeta):
    """The process's adapter (the CLI's protocol), served on its own thread for every episode's sandbox."""

    def __init__(self, args) -> None:
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.max_context_len = int(args.rollout_max_context_len or 0)
        tool_parser = args.sglang_tool_call_parser or getattr(args, "tool_call_parser", None) or "qwen"
        reasoning_parser = args.sglang_reasoning_parser or None
        headers = {"Authorization": f"Bearer {args.sglang_api_key}"} if getattr(args, "sglang_api_key", None) else {}
        kwargs = {"fork_threshold_tokens": CONFIG.fork_merge_threshold} if CONFIG.fork_merge_threshold else {}
        self.adapter = ADAPTER_CLS(tokenizer=self.tokenizer, sglang_url=f"http://{args.sglang_router_ip}:"
                                   f"{args.sglang_router_port}", tool_parser=tool_parser,
                                   reasoning_parser=reasoning_parser, max_turns=CONFIG.max_turns, headers=headers,
                                   **kwargs)
        # handler_cancellation: a CLI that hangs up cancels its turn's handler
        self.app_handle = run_app_in_thread(self.adapter.app, host=CONFIG.adapter_bind_host, port=CONFIG.adapter_port,
                                            thread_name=f"{AGENT_NAME}-adapter",
                                            runner_kwargs={"handler_cancellation": True,
                                                           "access_log_class": FilteredAccessLogger})
        self.adapter_url = f"http://{CONFIG.adapter_public_host}:{self.app_handle.port}"
        logger.info("[coding_agent_rl] %s adapter at %s (max_turns=%d, max_context_len=%d)", AGENT_NAME,
                    self.adapter_url, CONFIG.max_turns, self.max_context_len)


async def generate(args, base_sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False):
    """One coding-agent episode for `base_sample` (module docstring); always a list of Samples."""
    state = _AdapterService(args)
    md = swe.get_metadata(base_sample, CONFIG.eval_protocol if evaluation else CONFIG.train_protocol)
    instance_id = md["instance_id"]
    if not md["image"] or not md["workdir"]:
        return _abort_result(base_sample, "missing_image_or_workdir", instance_id)
    reason = swe.evaluability_check(md)
    if reason:
        return _abort_result(base_sample, f"unevaluatable:{reason}", instance_id)

    session_id = base_sample.session_id = _session_id(base_sample, instance_id)
    defaults = {key: value for key, value in sampling_params.items() if key in SAMPLING_KEYS}
    state.adapter.open_session(session_id, sampling_defaults=defaults, max_context_tokens=state.max_context_len)
    started = time.time()
    try:
        async with asyncio.timeout(CONFIG.rollout_guard_sec):
            async with boot_agent_sandbox(md["image"], instance_id, state.app_handle.port) as sb:
                await swe.prepare_workspace(sb, md["workdir"], md)
                agent_exit_code = await HARNESS_CLS().run(
                    sb, workdir=md["workdir"], session_id=session_id, adapter_url=state.adapter_url,
                    time_budget_sec=CONFIG.agent_time_budget_sec, prompt=swe.SWE_PROMPT)
                diff_text = await swe.git_diff(sb, md["workdir"])
                limits_hit = sb.report().limits_hit if hasattr(sb, "report") else []
            episode_seconds = time.time() - started
            result = await swe.run_evaluation(md, diff_text=diff_text, timeout_sec=CONFIG.eval_timeout_sec)
            reward = float(result.reward)
            if evaluation:
                return _eval_result(base_sample, reward=reward, applied_cleanly=result.applied_cleanly,
                                    agent_exit_code=agent_exit_code, instance_id=instance_id)
            samples = await state.adapter.finish_session(
                session_id, base_sample=base_sample, reward=reward,
                extra_metadata={"grading_solved": reward == 1.0, "instance_id": instance_id})
            if not samples:
                return _abort_result(base_sample, "adapter_session_empty", instance_id,
                                     agent_exit_code=agent_exit_code, sandbox_limits_hit=limits_hit)
            for sample in samples:
                _annotate(sample, agent_exit_code, episode_seconds, result, len(samples))
                sample.metadata["sandbox_limits_hit"] = limits_hit
            logger.info("[coding_agent_rl] %s: reward=%.1f applied=%s exit=%d %.1fs samples=%d", instance_id,
                        reward, result.applied_cleanly, agent_exit_code, episode_seconds, len(samples))
            return samples
    except TimeoutError:
        return _abort_result(base_sample, "wall_clock_timeout", instance_id)
    except Exception as error:  # noqa: BLE001 - a failed episode is reported on its sample, never trained
        logger.warning("[coding_agent_rl] %s: episode failed: %s: %s", instance_id, type(error).__name__, error)
        return _abort_result(base_sample, f"exception:{type(error).__name__}", instance_id, error=str(error))
    finally:
        state.adapter.drop_session(session_id)  # idempotent
        await asyncio.sleep(0)


def _annotate(sample: Sample, agent_exit_code: int, episode_seconds: float, result: swe.EvalResult,
              num_samples: int) -> None:
    stats = sample.metadata.get("turn_stats", [])
    sample.metadata.update(
        agent_exit_code=agent_exit_code, episode_seconds=episode_seconds, applied_cleanly=result.applied_cleanly,
        tests_passed=list(result.tests_passed) if result.tests_passed else None, samples_in_episode=num_samples,
        multi_turn={"turns": len(stats), "tool_calls": sum(t["tool_calls"] for t in stats), "tool_errors": 0,
                    "tool_seconds": 0.0, "turn_lengths": [t["output_tokens"] for t in stats],
                    "cut_by_context": sample.status == Sample.Status.TRUNCATED})


def _session_id(sample: Sample, instance_id: str) -> str:
    if sample.session_id:
        return sample.session_id
    if sample.index is not None and sample.group_index is not None:
        return f"cagent-{instance_id}-{sample.index}-{sample.group_index}-{secrets.token_hex(4)}"
    return f"cagent-{instance_id}-{secrets.token_hex(8)}"


def _abort_result(sample: Sample, reason: str, instance_id: str, **details) -> list[Sample]:
    """The sample as a failed episode: ABORTED, `remove_sample` (out of its group's statistics and of training),
    `metadata["abort_reason"]`; its reward is not a measurement."""
    sample.tokens = [0, 0]
    sample.response = ""
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.reward = 0.0
    sample.remove_sample = True
    sample.status = Sample.Status.ABORTED
    sample.metadata = {**(sample.metadata or {}), "abort_reason": reason, "instance_id": instance_id, **details}
    logger.warning("[coding_agent_rl] %s aborted: %s", instance_id, reason)
    return [sample]


def _eval_result(sample: Sample, *, reward: float, applied_cleanly: bool, agent_exit_code: int | None,
                 instance_id: str) -> list[Sample]:
    """Eval path: only the reward matters."""
    sample.tokens = [0, 0]
    sample.response = ""
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.reward = reward
    sample.remove_sample = True
    sample.status = Sample.Status.COMPLETED
    sample.metadata = {**(sample.metadata or {}), "instance_id": instance_id, "grading_solved": reward == 1.0,
                       "applied_cleanly": applied_cleanly, "agent_exit_code": agent_exit_code}
    return [sample]
