"""SGLang-compatible HTTP server for the built-in engine: the native API slime's rollout and trainer use
(/generate, weight updates, pause, abort, memory release, ...) and the OpenAI-compatible API (`openai_api.py`),
so the engine and a real SGLang server are interchangeable behind sglang-router.

    python -m slime.engine.server --model-path DIR [--host 127.0.0.1] [--port 30000] [--max-num-seqs 64 ...]

One process, one Engine, one driver thread stepping it (`engine_loop.py`). Not a multi-engine launcher
(Ray actors start one server per engine) and not a router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from slime.engine.memory_tags import MEMORY_TAGS, EngineWeightsMissingError
from slime.engine.sampling_params import SamplingParams
from slime.engine.server.engine_loop import EngineLoop
from slime.engine.server.guard import AccessPolicy, GuardMiddleware
from slime.engine.server.io import json_response, read_json, sse_line, unless_disconnected
from slime.engine.server.protocol import (
    RequestError,
    error_body,
    generate_response,
    parse_generate_request,
    require_fields,
)
from slime.engine.server.weights import EngineWeightReceiver

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
SERVER_VERSION = "slime-engine"
SHUTDOWN_GRACE_S = 5


class ServerState:
    """What the routes share: the driver loop, the engine's static facts, the weight updater, held memory tags."""

    def __init__(self, engine, model_path: str, served_model_name: str, server_args: dict, weight_dirs: list[Path]):
        self.engine_loop = EngineLoop(engine)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.server_args = server_args
        self.hf_config = _read_hf_config(model_path)
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.max_model_len
        self.weights = EngineWeightReceiver(self.engine_loop, engine.model_runner.device, weight_dirs, model_path)
        self.released_tags: set[str] = set()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]


def create_app(engine, model_path: str, served_model_name: str | None = None, server_args: dict | None = None,
               policy: AccessPolicy | None = None, weight_dirs: list[Path] | None = None):
    """The FastAPI app serving `engine` behind `policy` (keys, admin routes, body limit; default: open on loopback,
    admin routes for loopback peers only); its driver thread starts and stops with the app. /update_weights_from_disk
    loads only from `weight_dirs` (default: the checkpoint's parent folder)."""
    from slime.engine.server.lora_routes import register_lora_routes
    from slime.engine.server.openai_api import register_openai_routes

    weight_dirs = weight_dirs or [Path(model_path).resolve().parent]
    state = ServerState(engine, model_path, served_model_name or model_path, server_args or {}, weight_dirs)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.engine_loop.start()
        yield
        state.engine_loop.abort_all()
        state.engine_loop.stop()
        engine.shutdown()  # a sharded engine's other ranks

    app = FastAPI(title="slime engine", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(RequestError)
    async def _bad_request(_request: Request, error: RequestError):
        return JSONResponse(error_body(str(error)), status_code=400)

    @app.exception_handler(EngineWeightsMissingError)
    async def _weights_missing(_request: Request, error: EngineWeightsMissingError):
        return JSONResponse(error_body(str(error), 503), status_code=503)

    _register_generate_routes(app, state)
    _register_control_routes(app, state)
    _register_weight_routes(app, state)
    _register_info_routes(app, state)
    register_lora_routes(app, state)
    register_openai_routes(app, state)
    app.add_middleware(GuardMiddleware, policy=policy or AccessPolicy())
    return app


# ---- /generate -------------------------------------------------------------------------------------------------
def _register_generate_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        body = await read_json(request)
        parse = (parse_generate_request, body, state.tokenize, state.vocab_size, state.max_model_len)
        # Tokenizing text (up to the body limit, megabytes) runs off the event loop, so /health keeps answering.
        parsed = await asyncio.to_thread(*parse) if isinstance(body, dict) and "text" in body else parse[0](*parse[1:])
        # sglang-router (0.3.2) drops request fields it does not know, return_routed_experts among them: an engine
        # started with enable_return_routed_experts answers every request that does not say false with its routing.
        return_routed_experts = parsed.return_routed_experts
        if return_routed_experts is None:
            return_routed_experts = state.engine.config.enable_return_routed_experts

        def render(output):
            texts = state.token_texts(output.output_token_ids) if parsed.return_text_in_logprobs else None
            return generate_response(output, parsed.return_logprob, texts, parsed.routed_experts_start_len)

        # Image references are decoded (files read, base64 decoded) off the event loop and the engine's thread.
        for item in parsed.items:
            if item.images:
                item.images = await asyncio.to_thread(_decode_images, item.images)

        if parsed.stream:
            item = parsed.items[0]
            outputs = state.engine_loop.generate(item.prompt_token_ids, item.sampling_params, item.rid,
                                                 return_routed_experts=return_routed_experts,
                                                 lora_name=item.lora_path, images=item.images)
            first = await outputs.__anext__()  # a rejected request (e.g. duplicate rid) is a 400, not a broken stream

            async def events():
                yield sse_line(render(first))
                async for output in outputs:
                    yield sse_line(render(output))
                yield sse_line("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async def run_one(item):
            final = None
            outputs = state.engine_loop.generate(
                item.prompt_token_ids, item.sampling_params, item.rid, incremental=False,
                return_routed_experts=return_routed_experts, lora_name=item.lora_path, images=item.images,
            )
            async for output in outputs:
                final = output
            return render(final)

        results = await unless_disconnected(request, asyncio.gather(*(run_one(item) for item in parsed.items)))
        if results is None:
            return PlainTextResponse("client disconnected", status_code=499)
        return json_response(results if parsed.is_batch else results[0])


def _decode_images(references: list) -> list:
    """The RGB images of a request's image_data; a bad reference is a 400 naming it."""
    from slime.utils.image_inputs import load_image

    try:
        return [load_image(reference) for reference in references]
    except ValueError as error:
        raise RequestError(f"'image_data': {error}") from error


# ---- pause / abort / cache / memory / health -------------------------------------------------------------------
def _register_control_routes(app: FastAPI, state: ServerState) -> None:
    loop = state.engine_loop

    @app.get("/health")
    async def health():
        if not loop.is_alive:
            return JSONResponse(error_body("engine driver thread is not running", 503), status_code=503)
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate():
        if not loop.is_alive:
            return JSONResponse(error_body("engine driver thread is not running", 503), status_code=503)
        if loop.is_paused:
            # Paused for a weight update or with memory released: alive, but no token can be generated now.
            return PlainTextResponse("")
        params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)

        async def one_token():
            async for output in loop.generate([0], params):
                if output.finished:
                    return output

        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as error:
            return JSONResponse(error_body(f"health generation failed: {error!r}", 503), status_code=503)
        return PlainTextResponse("")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await loop.call(state.engine.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            "Cache not flushed: requests are in flight; abort or finish them first.\n", status_code=400
        )

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = require_fields(
            await read_json(request, allow_empty=True),
            "/abort_request",
            {},
            {"rid": (str, ""), "abort_all": (bool, False), "abort_message": (str, None)},
        )
        if body["abort_all"]:
            num_aborted = await asyncio.wrap_future(loop.abort_all())
        elif body["rid"]:
            num_aborted = int(await asyncio.wrap_future(loop.abort(body["rid"])))
        else:
            raise RequestError("/abort_request needs 'rid' or 'abort_all': true")
        return {"success": True, "num_aborted": num_aborted}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = require_fields(
            await read_json(request, allow_empty=True), "/pause_generation", {}, {"mode": (str, "in_place")}
        )
        if body["mode"] not in ("in_place", "abort"):
            raise RequestError(f"/pause_generation field 'mode' must be 'in_place' or 'abort', got {body['mode']!r}")
        await asyncio.wrap_future(loop.set_hold("paused", True))
        if body["mode"] == "abort":
            await asyncio.wrap_future(loop.abort_all())
        return {"success": True, "message": f"Generation paused ({body['mode']})."}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await read_json(request, allow_empty=True)
        await asyncio.wrap_future(loop.set_hold("paused", False))
        return {"success": True, "message": "Generation continued."}

    def parse_tags(body, endpoint: str, extra: dict | None = None) -> dict:
        body = require_fields(body, endpoint, {}, {"tags": (list, list(MEMORY_TAGS)), **(extra or {})})
        unknown = sorted(set(body["tags"]) - set(MEMORY_TAGS))
        if unknown or not body["tags"]:
            raise RequestError(f"{endpoint} field 'tags' must be a non-empty subset of {list(MEMORY_TAGS)}")
        return body

    # In-flight requests survive a release: the engine preempts them and they recompute after the resume.
    # `discard_weights` (not SGLang's): the caller pushes every weight before the next generation, so the engine
    # drops its weights instead of copying them to the host; requests wait until they are all loaded again.
    @app.post("/release_memory_occupation")
    async def release_memory(request: Request):
        body = parse_tags(await read_json(request, allow_empty=True), "/release_memory_occupation",
                          {"discard_weights": (bool, False)})
        tags = list(body["tags"])
        if body["discard_weights"] and "weights" not in tags:
            raise RequestError("/release_memory_occupation field 'discard_weights' needs 'weights' among the tags")
        await asyncio.wrap_future(loop.set_hold("memory_released", True))
        await loop.call(state.engine.release_memory, tags, body["discard_weights"])
        state.released_tags.update(tags)
        return {"success": True, "message": f"Released memory {tags}."}

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request):
        tags = list(parse_tags(await read_json(request, allow_empty=True), "/resume_memory_occupation")["tags"])
        await loop.call(state.engine.resume_memory, tags)
        state.released_tags.difference_update(tags)
        if not state.released_tags:
            await asyncio.wrap_future(loop.set_hold("memory_released", False))
        return {"success": True, "message": f"Resumed memory {tags}."}


# ---- weights ---------------------------------------------------------------------------------------------------
def _register_weight_routes(app: FastAPI, state: ServerState) -> None:
    weights = state.weights

    def result(payload: dict):
        return JSONResponse(payload, status_code=200 if payload["success"] else 400)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        return result(await weights.update_from_tensor(await read_json(request)))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        return result(await weights.update_from_disk(await read_json(request)))

    @app.post("/pull_weights")
    async def pull_weights(request: Request):
        return result(await weights.pull(await read_json(request)))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        return result(await weights.init_group(await read_json(request)))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        return result(await weights.update_from_distributed(await read_json(request)))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        return result(await weights.destroy_group(await read_json(request, allow_empty=True)))

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": state.engine.weight_version}


# ---- info ------------------------------------------------------------------------------------------------------
def _register_info_routes(app: FastAPI, state: ServerState) -> None:
    def model_info() -> dict:
        # GetModelInfoResponse fields that sglang-router reads, plus SGLang's own.
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "served_model_name": state.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": state.hf_config.get("model_type"),
            "architectures": state.hf_config.get("architectures"),
            "max_context_length": state.max_model_len,
            "max_req_input_len": state.max_model_len - 1,
            "vocab_size": state.vocab_size,
            "eos_token_ids": _eos_token_ids(state),
            "pad_token_id": state.tokenizer.pad_token_id,
            "bos_token_id": state.tokenizer.bos_token_id,
        }

    def server_info() -> dict:
        return {
            **state.server_args,
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "served_model_name": state.served_model_name,
            "context_length": state.max_model_len,
            "tp_size": state.engine.config.tp_size,
            "ep_size": state.engine.config.ep_size,
            "dp_size": 1,
            "version": SERVER_VERSION,
            "weight_version": state.engine.weight_version,
            "dtype": str(state.engine.model_runner.dtype).removeprefix("torch."),  # resolved, never "auto"
            "internal_states": [
                {"paused": state.engine_loop.is_paused, "num_in_flight_requests": state.engine_loop.num_in_flight}
            ],
        }

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])


# ---- engine facts ----------------------------------------------------------------------------------------------
def _read_hf_config(model_path: str) -> dict:
    config_file = Path(model_path) / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def _eos_token_ids(state: ServerState) -> list[int]:
    return sorted(state.engine.eos_token_ids)


# ---- entry point -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from slime.engine.engine import Engine
    from slime.engine.server.config import parse_settings
    from slime.utils.misc import freeze_startup_objects

    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.perf_counter()
    engine = Engine(settings.model_path, **settings.engine)
    freeze_startup_objects()  # no full garbage collection rescans them in the middle of a generation step
    logger.info("engine ready in %.1f s", time.perf_counter() - started)
    if settings.host not in ("127.0.0.1", "::1", "localhost") and settings.policy.api_key is None:
        logger.warning("serving on %s without --api-key: anyone who can reach the port can generate", settings.host)
    server_args = {"host": settings.host, "port": settings.port, **settings.engine}
    app = create_app(engine, settings.model_path, settings.served_model_name, server_args, settings.policy,
                     settings.allowed_weight_dirs())
    # In-flight requests get a few seconds after SIGTERM, so no request (a weight-group set-up waiting on a peer
    # that never comes) can keep the process alive.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)

