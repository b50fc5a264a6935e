"""The one allowed port: a real HTTP server on the host's 127.0.0.1 answers the sandbox at the same address, a
streamed answer arrives whole, and another host port (listening too) stays out of reach."""

import asyncio

from aiohttp import web

from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.utils.misc import find_free_port

LIMITS = SandboxLimits(memory_bytes=256 << 20, disk_bytes=64 << 20, max_processes=64, episode_time_budget_sec=300)
FETCH = """
import json, sys, urllib.request
request = urllib.request.Request(sys.argv[1], data=json.dumps({"n": int(sys.argv[2])}).encode(),
                                 headers={"Authorization": "Bearer sid-7"})
with urllib.request.urlopen(request, timeout=10) as response:
    sys.stdout.write(response.read().decode())
"""


async def serve(port: int, seen: list) -> web.AppRunner:
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((request.headers["Authorization"], body, request.remote))
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(body["n"]):  # a streamed answer, in many chunks
            await response.write(f"chunk-{i};".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_only_the_allowed_port_reaches_the_host():
    async def case():
        allowed, other = find_free_port(), find_free_port()
        while other == allowed:
            other = find_free_port()
        seen_allowed, seen_other = [], []
        runners = [await serve(allowed, seen_allowed), await serve(other, seen_other)]
        try:
            async with LocalSandbox(limits=LIMITS, allowed_port=allowed) as sb:
                await sb.write_file("/tmp/fetch.py", FETCH)
                code, out, err = await sb.exec(f"python3 /tmp/fetch.py http://127.0.0.1:{allowed}/echo 2000",
                                               user="nobody")
                assert code == 0, err
                assert out == "".join(f"chunk-{i};" for i in range(2000))
                assert seen_allowed == [("Bearer sid-7", {"n": 2000}, "127.0.0.1")]
                code, _, err = await sb.exec(f"python3 /tmp/fetch.py http://127.0.0.1:{other}/echo 1")
                assert code == 1 and "Connection refused" in err
                assert seen_other == []
                # the host's other addresses are not routed either
                code, _, err = await sb.exec(f"python3 /tmp/fetch.py http://10.0.0.1:{allowed}/echo 1")
                assert code == 1 and "Network is unreachable" in err
                report = sb.report()
                assert report.refused_loopback_connections >= 1 and report.network_blocked_attempts >= 1
                assert sb._forward.connections == 1
                # a process inside cannot take the forwarded port for itself
                code, _, err = await sb.exec(
                    f"python3 -c \"import socket; socket.socket().bind(('127.0.0.1', {allowed}))\"")
                assert code == 1 and "Address already in use" in err
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(case())
