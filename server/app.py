"""The FastAPI application: OpenAI's routes on one ServerLoop, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pagechat.server.engine_loop import ServerLoop
from pagechat.server.errors import APIError, install_error_handlers
from pagechat.server.jobs import Job, usage_of
from pagechat.server.metrics import ServerMetrics
from pagechat.server.prompts import PromptEncoder
from pagechat.server.responses import DONE, ChunkWriter, Header, sse, whole
from pagechat.server.sampling import Options, chat_options, completion_options
from pagechat.server.schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
)
from pagechat.server.watch import Watchers
from prometheus_client import CONTENT_TYPE_LATEST


@dataclass(slots=True)
class ServerState:
    """What the routes share: the engine loop, metrics, the HTTP side's encoder, and settings."""

    loop: ServerLoop
    metrics: ServerMetrics
    watchers: Watchers
    encoder: PromptEncoder
    model_name: str
    api_key: str | None = None
    max_n: int = 64  # choices per prompt at most: the engine's --max-seqs
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagechat",
            "max_model_len": self.encoder.limits.max_len,
        }


def _authorizer(state: ServerState):
    """A dependency that checks the Bearer key when the server has one."""

    async def check(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing API key: send Authorization: Bearer KEY", None, "no_key")
        if not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise APIError(401, "incorrect API key", None, "invalid_api_key")

    return check


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is read by then, so receive waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(job: Job, header: Header, request: Request, options: Options) -> Response:
    """Run a job to its end and answer at once; the client leaving first aborts it."""
    job.start()
    collect = asyncio.ensure_future(job.collect())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
        job.close()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    choices = collect.result()  # raises the job's APIError, if it failed
    logprobs = options.logprobs is not None
    return JSONResponse(whole(header, choices, usage_of(job.usages), logprobs, options.tools))


async def _chunks(job: Job, writer: ChunkWriter) -> AsyncIterator[str]:
    """A job's chunks as it runs; the client leaving cancels this generator, which aborts it."""
    job.start()
    try:
        if writer.header.kind == "chat":
            for index in range(job.num_choices):
                yield writer.opening(index)
        async for batch in job.deltas():
            for delta in batch:
                chunk = writer.delta(delta)
                if chunk:
                    yield chunk
        if writer.include_usage:
            yield writer.usage(usage_of(job.usages))
    except APIError as e:  # the status is sent already: the error goes in the stream
        yield sse(e.body())
    finally:
        job.close()
    yield DONE


_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _request_id(request: Request) -> str | None:
    """The client's X-Request-Id, which names the request to watchers and in the response id."""
    value = request.headers.get("x-request-id")
    if value is not None and not _REQUEST_ID.fullmatch(value):
        raise APIError(
            400,
            "X-Request-Id must be 1 to 128 letters, digits, '.', '_' or '-'",
            "x-request-id",
            "invalid_request_id",
        )
    return value


async def _answer(
    state: ServerState,
    kind: str,
    req: SamplingFields,
    prompts: list[list[int]],
    options: Options,
    request: Request,
) -> Response:
    header = Header.new(kind, state.model_name, _request_id(request))
    label = "api chat" if kind == "chat" else "api cmpl"  # as watchers' scheduler lists it
    job = Job(state.loop, prompts, options, state.encoder.limits, (label, header.id))
    logprobs = options.logprobs is not None
    if not req.stream:
        return await _whole(job, header, request, options)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    writer = ChunkWriter(header, logprobs, include_usage, options.tools)
    return StreamingResponse(_chunks(job, writer), media_type="text/event-stream")


def _v1_routes(state: ServerState) -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorizer(state))])

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [state.model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        state.check_model(model_id)
        return state.model_card()

    @v1.post("/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Response:
        state.check_model(req.model)
        options = chat_options(req, state.max_n, state.encoder.template)
        prompts = [state.encoder.chat(req.messages, options.tools)]
        return await _answer(state, "chat", req, prompts, options, request)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        options = completion_options(req, state.max_n)
        prompts = state.encoder.prompts(req.prompt)
        return await _answer(state, "completion", req, prompts, options, request)

    return v1


def _tool_routes(state: ServerState) -> APIRouter:
    """vLLM's routes beside /v1 that consoles use."""
    tools = APIRouter(dependencies=[Depends(_authorizer(state))])

    @tools.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        """Token ids as text: a console names the prompt a cached block came from."""
        state.check_model(req.model)
        return {"prompt": state.encoder.text(req.tokens)}

    return tools


def create_app(state: ServerState) -> FastAPI:
    """The server's application; its lifespan starts and stops the engine's thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.watchers.start(asyncio.get_running_loop())
        state.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="pagechat", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(_v1_routes(state))
    app.include_router(_tool_routes(state))

    @app.get("/pagechat/events", dependencies=[Depends(_authorizer(state))])
    async def events() -> Response:
        """The engine's records as `pagechat watch` reads them (core/wire.py): server-sent events,
        the EngineInfo first, then a JSON batch a message."""
        headers = {"cache-control": "no-cache"}
        return StreamingResponse(
            state.watchers.stream(), media_type="text/event-stream", headers=headers
        )

    @app.get("/health")
    async def health() -> Response:
        if state.loop.alive:
            return JSONResponse({"status": "ok"})
        raise APIError(503, f"the engine is not running: {state.loop.error or 'stopped'}")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app
