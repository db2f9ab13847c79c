"""The OpenAI-compatible HTTP server over a Cluster of routed backends."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from mvllm.engine.params import SamplingParams, check_budget, check_prompt
from mvllm.errors import InvalidRequestError, MvllmError
from mvllm.model.tokenizer import Tokenizer
from mvllm.server.cluster import Cluster
from mvllm.server.protocol import ChatRequest, CompletionRequest, PolicyRequest, WarmRequest, error
from mvllm.server.stream import EventStream, Run, Shape, until_done
from mvllm.slo import SloError, parse_slo


def build_app(cluster: Cluster, tokenizer: Tokenizer, model_name: str, vocab_size: int,
              warm_prefix: str | list[int] | None = None, context: int | None = None) -> FastAPI:
    """context: the model's own context length, for when no backend reports one (a foreign remote).
    `cluster`: the Cluster itself, or an API process's link to the core's (server/api.py), which answers the
    same calls."""
    @asynccontextmanager
    async def lifespan(_app):
        cluster.start(asyncio.get_running_loop())
        if warm_prefix:
            await cluster.warm(tokenizer.encode(warm_prefix))
        yield

    app = FastAPI(title="mvllm", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        if first.get("type") == "json_invalid" or (not loc and first.get("type") in ("model_attributes_type",
                                                                                     "dict_type")):
            return error(400, "the request body is not a valid JSON object", None, "invalid_json")
        return error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                     ".".join(loc) or None, "invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")

    @app.exception_handler(InvalidRequestError)
    async def _bad(_, exc: InvalidRequestError):
        return error(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(MvllmError)
    async def _unavailable(_, exc: MvllmError):
        return error(503, str(exc), kind="service_unavailable", code="backend_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}", kind="internal_error", code="internal_error")

    max_len = min((s["max_model_len"] for s in cluster.snapshots.values() if s.get("max_model_len")),
                  default=context or 2048)

    def served(body) -> None:
        if body.model is not None and body.model != model_name:
            raise InvalidRequestError(f"model {body.model!r} is not served here; this server serves "
                                      f"{model_name!r}", "model")

    def check(body, token_ids: list[int], max_tokens: int | None, default: int | None = None) -> SamplingParams:
        """max_tokens: what the client asked for, which must fit the context with the prompt (a 400 as
        vLLM's otherwise); absent: `default` capped at the context's end, or up to the context's end."""
        check_prompt(token_ids, vocab_size, max_len)
        room = max_len - len(token_ids)
        params = body.sampling_params(max_tokens if max_tokens is not None else min(default or room, room))
        if max_tokens is not None:
            check_budget(len(token_ids), max_tokens, max_len)
        return params

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        token_ids = tokenizer.encode(prompt)
        params = check(body, token_ids, body.max_tokens, default=16)  # OpenAI's completions default
        return await respond(body, token_ids, params, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        served(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        token_ids = tokenizer.apply_chat_template(messages)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = check(body, token_ids, asked)
        return await respond(body, token_ids, params, request, chat=True)

    async def respond(body, token_ids, params, request: Request, chat: bool):
        arrival = time.time()
        rid, backend = await cluster.submit(token_ids, params, arrival, "chatcmpl" if chat else "cmpl")
        run = Run(cluster, tokenizer, rid, backend, token_ids, params, arrival)
        shape = Shape(rid, model_name, backend, chat)
        headers = {"x-mvllm-backend": backend, "x-request-id": rid}
        if body.stream:
            return EventStream(run, shape, body.include_usage, headers)
        await until_done(run, request)
        if run.error:
            return error(500 if run.tokens else 503, run.error, kind="server_error", code="backend_failed")
        return JSONResponse(shape.whole(run), headers=headers)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mvllm", "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        code, body = await cluster.health()
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return Response(await cluster.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/backends")
    async def backends():
        return await cluster.snapshot_all()

    @app.post("/v1/warm")
    async def warm(body: WarmRequest):
        names = cluster.backend_names
        if body.backend is not None and body.backend not in names:
            raise InvalidRequestError(f"unknown backend {body.backend!r}; backends are {', '.join(names)}",
                                      "backend")
        ids = tokenizer.encode(body.prompt)
        if not ids or len(ids) >= max_len:
            raise InvalidRequestError(f"a warm prefix needs 1 to {max_len - 1} tokens", "prompt")
        return {"cached_tokens": await cluster.warm(ids, body.backend)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Empty every backend's prefix cache (vLLM's endpoint); only while no request is in flight."""
        done = await cluster.reset_prefix_cache()
        busy = [name for name, ok in done.items() if not ok]
        if busy:
            raise InvalidRequestError(f"backend(s) {', '.join(busy)} have requests in flight; reset when idle", None)
        return {"reset": sorted(done)}

    @app.post("/v1/policy")
    async def policy(body: PolicyRequest):
        """Route new requests by another policy (bench does this between runs on one server)."""
        try:
            slo = parse_slo([body.slo], "slo") if body.slo is not None else None
        except SloError as e:
            raise InvalidRequestError(str(e), "slo") from None
        if body.slo is not None and not slo:
            raise InvalidRequestError("slo names no bound; e.g. \"ttft:2000 tpot:100\"", "slo")
        return {"policy": await cluster.set_policy(body.policy, slo)}

    return app
