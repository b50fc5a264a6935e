"""`python -m slime.agent.local_sandbox [limits] -- CMD`: run one shell command in a fresh local sandbox, print its
output, then the sandbox's report as a JSON last line; the exit code is the command's. With no CMD, say whether
this host can run local sandboxes."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from slime.agent.local_sandbox.host import local_sandbox_problems
from slime.agent.local_sandbox.limits import MiB, SandboxLimits
from slime.agent.local_sandbox.local import LocalSandbox


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = SandboxLimits()
    parser = argparse.ArgumentParser(prog="python -m slime.agent.local_sandbox", description=__doc__)
    parser.add_argument("--user", default="root", help="the sandbox user that runs CMD (root or nobody here)")
    parser.add_argument("--memory-mb", type=int, default=defaults.memory_bytes // MiB)
    parser.add_argument("--disk-mb", type=int, default=defaults.disk_bytes // MiB)
    parser.add_argument("--max-processes", type=int, default=defaults.max_processes)
    parser.add_argument("--cpu-time-sec", type=int, default=defaults.cpu_time_sec)
    parser.add_argument("--episode-time-budget-sec", type=float, default=defaults.episode_time_budget_sec)
    parser.add_argument("--timeout", type=int, default=600, help="seconds CMD may run")
    parser.add_argument("--allowed-port", type=int, default=None,
                        help="a host 127.0.0.1 port the sandbox may reach (at the same address inside)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the shell command line")
    return parser.parse_args(argv)


async def run_one(args: argparse.Namespace) -> int:
    limits = SandboxLimits(memory_bytes=args.memory_mb * MiB, disk_bytes=args.disk_mb * MiB,
                           max_processes=args.max_processes, cpu_time_sec=args.cpu_time_sec,
                           episode_time_budget_sec=args.episode_time_budget_sec)
    cmd = " ".join(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    async with LocalSandbox(limits=limits, allowed_port=args.allowed_port) as sb:
        code, out, err = await sb.exec(cmd, user=args.user, timeout=args.timeout)
        sys.stdout.write(out)
        sys.stderr.write(err)
        print(json.dumps({"exit_code": code, **sb.report().to_dict()}))
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.cmd or args.cmd == ["--"]:
        problems = local_sandbox_problems()
        print("local sandboxes: " + ("available" if not problems else "unavailable: " + "; ".join(problems)))
        return 1 if problems else 0
    return asyncio.run(run_one(args))


if __name__ == "__main__":
    sys.exit(main())
