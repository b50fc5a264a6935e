"""The SWE task layer of the coding-agent example (slime's `examples/coding_agent_rl/swe.py` module API): a row's
metadata -> the task, the workspace an episode starts from, the diff it leaves, and the grade of that diff in a
fresh sandbox.

Row schema (`--metadata-key metadata`): `instance_id`, `image` (the sandbox's userland: "host" for the local
sandbox), `workdir`, `problem_statement` (else the prompt), `files` ({path: text}, the repository, committed as its
base), one grader: `eval_cmd` (exit 0 = solved; run in `workdir` after the diff and `hidden_tests` ({path: text})
are in place) or `remote_env_info.f2p_script` (a self-contained test file run with python); `pre_commands` run
before the episode and before grading. A grader may print `TESTS_PASSED <k>/<n>`; the counts land in the
sample's metadata.

The grade never trusts the episode's sandbox: a fresh one gets the base repository, the agent's diff (tests the
agent changed included, but `hidden_tests` are written over them) and the hidden tests, so only the diff counts.
Reward: 1.0 when the grader exits 0, else 0.0. Not the orchestration (generate.py) nor a harness.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from typing import Any, NamedTuple

from slime.agent import sandbox as agent_sandbox
from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.agent.sandbox import Sandbox
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

PROTOCOL_SCALESWE = "scaleswe"
PROTOCOL_SWEBENCH = "swebench"  # SWE-bench's own grader (the `swebench` package and its images): not served here

# slime's name for the class an episode's sandbox is made from; here the local backend (slime's E2B is a hosted
# service). Called as E2BSandbox(image, **options); tests swap it for a fake.
E2BSandbox = LocalSandbox

_PATCH = "/tmp/__cagent_patch__.diff"
_PRE = "/tmp/__cagent_pre__.sh"
_F2P = "/tmp/__cagent_f2p__.py"
TESTS_PASSED = re.compile(r"TESTS_PASSED (\d+)/(\d+)")

SWE_PROMPT = os.environ.get(
    "SWE_CC_PROMPT",
    "Read PROBLEM_STATEMENT.md in the current directory and resolve the issue. Edit source files only (do NOT touch "
    "tests). After editing, run the relevant tests to verify your fix passes. Do NOT modify PROBLEM_STATEMENT.md and "
    "do NOT commit. When finished, print a one-line summary and exit.",
)


class EvalResult(NamedTuple):
    """Grading outcome; unpacks as `reward, applied = await run_evaluation(...)`."""

    reward: float
    applied_cleanly: bool
    tests_passed: tuple[int, int] | None = None  # (passed, total) when the grader printed TESTS_PASSED


def get_metadata(sample: Sample, protocol: str = PROTOCOL_SCALESWE) -> dict[str, Any]:
    """The task of a row (module docstring), in the shape the rest of this module reads."""
    if protocol != PROTOCOL_SCALESWE:
        raise ValueError(f"SWE protocol {protocol!r} is not served by this example (SWE_TRAIN_PROTOCOL / "
                         f"SWE_EVAL_PROTOCOL): use {PROTOCOL_SCALESWE!r}")
    m = sample.metadata or {}
    remote = m.get("remote_env_info") or {}
    label = sample.label if isinstance(sample.label, str) and len(sample.label) < 256 else None
    return {
        "protocol": PROTOCOL_SCALESWE,
        "instance_id": m.get("instance_id") or remote.get("instance_id") or label or "unknown",
        "image": m.get("image") or remote.get("image_url"),
        "workdir": m.get("workdir") or remote.get("workdir"),
        "problem_statement": m.get("problem_statement") or _prompt_text(sample.prompt),
        "files": m.get("files") or {},
        "grading": {"eval_cmd": m.get("eval_cmd"), "hidden_tests": m.get("hidden_tests") or {},
                    "f2p_script": remote.get("f2p_script"),
                    "pre_commands": m.get("pre_commands") or remote.get("pre_commands")},
    }


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    for message in prompt or []:
        if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


def evaluability_check(md: dict) -> str | None:
    """Why the row cannot be graded (None when it can)."""
    grading = md.get("grading") or {}
    if not (grading.get("eval_cmd") or grading.get("f2p_script")):
        return "no_grader"
    return None


async def write_repository(sb: Sandbox, workdir: str, files: dict[str, str]) -> None:
    """The task's files in `workdir`, owned by the agent and committed as the base the diff is taken against."""
    for path, text in sorted(files.items()):
        await sb.write_file(f"{workdir}/{path}", text, user="agent")
    await sb.exec(f"cd {shlex.quote(workdir)} && git init -q && git add -A && git -c user.name=slime -c "
                  "user.email=slime@localhost commit -qm base --allow-empty", user="agent", check=True, timeout=60)


async def prepare_workspace(sb: Sandbox, workdir: str, md: dict) -> None:
    """The agent's user, the repository, the pre-commands, then PROBLEM_STATEMENT.md in `workdir`."""
    await sb.exec(f"mkdir -p {shlex.quote(workdir)}", user="root", check=True, timeout=30)
    await agent_sandbox.ensure_agent_user(sb, workdir)
    if md.get("files"):
        await write_repository(sb, workdir, md["files"])
    pre_commands = (md.get("grading") or {}).get("pre_commands")
    if pre_commands:
        await apply_pre_commands(sb, workdir, pre_commands)
    await sb.write_file(f"{workdir}/PROBLEM_STATEMENT.md", md.get("problem_statement") or "", user="agent")


async def apply_pre_commands(sb: Sandbox, workdir: str, pre: list[str] | str) -> None:
    body = pre.replace("\\n", "\n") if isinstance(pre, str) else "\n".join(c for c in pre if c)
    await sb.write_file(_PRE, "set -e\n" + body, user="agent")
    await sb.exec(f"cd {shlex.quote(workdir)} && bash {_PRE}", user="agent", check=False, timeout=600)


async def git_diff(sb: Sandbox, workdir: str) -> str:
    """What the episode changed in `workdir` (new files included), without the problem statement and the harness's
    own folder."""
    cmd = (f"cd {shlex.quote(workdir)} && git add -N . && git diff -- . ':(exclude)PROBLEM_STATEMENT.md' "
           "':(exclude).harness/'")
    _, out, _ = await sb.exec(cmd, user="agent", timeout=120)
    return out


def eval_limits(timeout_sec: int) -> SandboxLimits:
    return SandboxLimits(memory_bytes=2 << 30, disk_bytes=512 << 20, episode_time_budget_sec=timeout_sec + 60)


async def run_evaluation(md: dict, *, diff_text: str, timeout_sec: int) -> EvalResult:
    """Grade `diff_text` in a fresh sandbox (module docstring)."""
    grading = md.get("grading") or {}
    workdir = md["workdir"]
    async with E2BSandbox(md["image"], limits=eval_limits(timeout_sec)) as ev:
        await ev.exec(f"mkdir -p {shlex.quote(workdir)}", user="root", check=True, timeout=30)
        await agent_sandbox.ensure_agent_user(ev, workdir)
        if md.get("files"):
            await write_repository(ev, workdir, md["files"])
        if grading.get("pre_commands"):
            await apply_pre_commands(ev, workdir, grading["pre_commands"])
        if not await _apply_diff(ev, workdir, diff_text):
            return EvalResult(0.0, False)
        for path, text in sorted((grading.get("hidden_tests") or {}).items()):
            await ev.write_file(f"{workdir}/{path}", text, user="agent")
        if grading.get("eval_cmd"):
            code, out, err = await ev.exec(f"cd {shlex.quote(workdir)} && {grading['eval_cmd']}", user="agent",
                                           timeout=timeout_sec)
        else:
            await ev.write_file(_F2P, grading["f2p_script"], user="agent")
            code, out, err = await ev.exec(f"cd {shlex.quote(workdir)} && python3 {_F2P}", user="agent",
                                           timeout=timeout_sec)
    counts = TESTS_PASSED.findall(out + err)
    tests_passed = (int(counts[-1][0]), int(counts[-1][1])) if counts else None
    return EvalResult(1.0 if code == 0 else 0.0, True, tests_passed)


async def _apply_diff(ev: Sandbox, workdir: str, diff_text: str) -> bool:
    if not diff_text.strip():
        return True
    await ev.write_file(_PATCH, diff_text, user="agent")
    ladder = " || ".join(f"({cmd})" for cmd in (f"git apply --3way --whitespace=nowarn {_PATCH}",
                                                 f"git apply --whitespace=nowarn {_PATCH}",
                                                 f"patch -p1 --no-backup-if-mismatch < {_PATCH}"))
    code, _, _ = await ev.exec(f"cd {shlex.quote(workdir)} && ({ladder})", user="agent", timeout=120)
    return code == 0
