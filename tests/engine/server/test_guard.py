"""The engine server as an attacker and a careless client meet it (a real server subprocess on a tiny model, keys
set): a malicious pickle runs nothing, keys are enforced, admin routes refuse remote peers, big or deeply nested
bodies are refused before they are parsed while /health answers, weights load only from allowed folders, bad
fields are named, and SIGTERM ends a server whose weight-group set-up waits on a peer that never comes."""

import asyncio
import base64
import os
import pickle
import signal
import socket
import time

import httpx
import pytest

from slime.engine.server.guard import AccessPolicy
from tests.helpers import args_helpers

API_KEY, ADMIN_KEY = "user-key-1", "admin-key-2"
SERVER_ARGS = ["--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--max-request-bytes", str(4 * 1024 * 1024)]
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_malicious_pickle_runs_nothing_and_is_a_400(client, tmp_path):
    marker = tmp_path / "pwned"
    payloads = [
        [("model.norm.weight", WritesAFile(marker))],
        WritesAFile(marker),
        # the builtins that bypassed SGLang's first (deny-list) fix
        [("x", getattr)],
        [("x", __import__)],
    ]
    for payload in payloads:
        body = {"serialized_named_tensors": [base64.b64encode(pickle.dumps(payload)).decode()]}
        response = client.post("/update_weights_from_tensor", json=body, headers=ADMIN)
        assert response.status_code == 400, response.text
        assert "not part of the tensor-handle format" in response.json()["error"]["message"]
    assert not marker.exists()
    assert client.get("/get_weight_version", headers=USER).json()["weight_version"] == "0"  # nothing was loaded


def test_api_keys_are_enforced(client):
    assert client.get("/health").status_code == 200  # open: probes carry no key
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert client.post("/generate", json=body).status_code == 401
    assert client.post("/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/generate", json=body, headers=USER).status_code == 200
    assert client.post("/generate", json=body, headers=ADMIN).status_code == 200  # the admin key serves too
    assert client.get("/v1/models", headers=USER).status_code == 200
    missing = client.get("/v1/models")
    assert missing.status_code == 401 and "--api-key" in missing.json()["error"]["message"]
    # state-changing routes need the admin key, not the user key
    assert client.post("/flush_cache", headers=USER).status_code == 401
    assert client.post("/flush_cache", headers=ADMIN).status_code == 200


def test_admin_routes_refuse_remote_peers():
    policy = AccessPolicy(admin_api_key=ADMIN_KEY)
    assert policy.refusal("/update_weights_from_tensor", f"Bearer {ADMIN_KEY}", "127.0.0.1") is None
    assert policy.refusal("/update_weights_from_tensor", f"Bearer {ADMIN_KEY}", "::1") is None
    status, message = policy.refusal("/update_weights_from_tensor", f"Bearer {ADMIN_KEY}", "10.1.2.3")
    assert status == 403 and "--allow-remote-admin" in message
    remote_ok = AccessPolicy(admin_api_key=ADMIN_KEY, allow_remote_admin=True)
    assert remote_ok.refusal("/update_weights_from_tensor", f"Bearer {ADMIN_KEY}", "10.1.2.3") is None
    assert remote_ok.refusal("/update_weights_from_tensor", None, "10.1.2.3")[0] == 401
    assert AccessPolicy().refusal("/generate", None, "10.1.2.3") is None  # no key set: generation is open
    # the adapter routes change what the engine serves: admin routes too
    for route in ("/load_lora_adapter_from_tensors", "/load_lora_adapter_from_distributed"):
        assert policy.refusal(route, f"Bearer {ADMIN_KEY}", "10.1.2.3")[0] == 403
        assert remote_ok.refusal(route, "Bearer user-key", "10.1.2.3")[0] == 401


def test_big_body_is_413_at_once_while_health_answers(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
            big = b'{"text": "' + b"a" * (50 * 1024 * 1024) + b'"}'
            started = time.perf_counter()
            sending = asyncio.ensure_future(http.post("/generate", content=big, headers=USER))
            await asyncio.sleep(0.05)
            health = await http.get("/health")
            response = await sending
            return response, health, time.perf_counter() - started

    response, health, seconds = asyncio.run(run())
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]
    assert health.status_code == 200
    assert seconds < 10


def test_chunked_big_body_is_413(client):
    def chunks():
        for _ in range(64):
            yield b"[" * (128 * 1024)

    response = client.post("/generate", content=chunks(), headers=USER)
    assert response.status_code == 413


def test_deep_nesting_and_bad_fields_are_named_400s(client):
    deep = client.post("/generate", content=b"[" * 100_000 + b"]" * 100_000, headers=USER)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    stop = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"stop": 123}}, headers=USER)
    assert stop.status_code == 400 and "sampling_params.stop" in stop.json()["error"]["message"]


def test_disk_loads_only_from_allowed_folders(client, tiny_qwen3):
    import tempfile
    from pathlib import Path

    from slime.utils.tiny_model import build_tiny_model

    # The default allowlist is the served checkpoint's parent folder (pytest's base temp folder here).
    with tempfile.TemporaryDirectory(dir=Path.home()) as elsewhere:
        outside = build_tiny_model(Path(elsewhere) / "other", arch="qwen3")
        response = client.post("/update_weights_from_disk", json={"model_path": str(outside)}, headers=ADMIN)
    assert response.status_code == 400 and "--weights-dir-allowlist" in response.json()["error"]["message"]
    inside = client.post("/update_weights_from_disk", json={"model_path": str(tiny_qwen3)}, headers=ADMIN)
    assert inside.status_code == 200, inside.text
    escape = client.post("/update_weights_from_disk", json={"model_path": "/etc/../etc"}, headers=ADMIN)
    assert escape.status_code == 400


def test_sigterm_ends_a_server_waiting_on_a_closed_weight_group_port(tiny_qwen3, tmp_path):
    from slime.engine.server.launch import launch_server

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: the rendezvous keeps retrying
    port = closed.getsockname()[1]
    server = launch_server(tiny_qwen3, log_path=tmp_path / "server.log")
    try:
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"}

        def hang():
            with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as http:
                try:
                    http.post("/init_weights_update_group", json=body)
                except httpx.HTTPError:
                    pass

        import threading

        threading.Thread(target=hang, daemon=True).start()
        time.sleep(2.0)
        started = time.perf_counter()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=10)
        assert time.perf_counter() - started < 10
    finally:
        server.stop()
        closed.close()



def test_rollout_and_router_carry_the_keys(server):
    from slime.ray.router import RouterProcess, register_worker
    from slime.utils.engine_access import engine_admin_headers, router_headers
    from slime.utils.http_utils import HTTPRequestError, abort_all_requests, request_json, run

    args = args_helpers.make_args(sglang_api_key=API_KEY, sglang_admin_api_key=ADMIN_KEY)
    router = RouterProcess(policy="round_robin", api_key=API_KEY)
    try:
        register_worker(router.url, server.url, api_key=API_KEY)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
        answer = run(request_json("POST", f"{router.url}/generate", body, headers=router_headers(args)))
        assert answer["meta_info"]["completion_tokens"] == 3  # the router authenticated to the engine
        with pytest.raises(HTTPRequestError, match="401"):
            run(request_json("POST", f"{router.url}/generate", body, num_retries=0))
        assert run(abort_all_requests(router.url, router_headers(args), engine_admin_headers(args))) == [server.url]
        with pytest.raises(HTTPRequestError, match="401"):  # the user key cannot abort: admin route
            run(abort_all_requests(router.url, router_headers(args), router_headers(args)))
    finally:
        router.shutdown()
