"""HTTP layer of the coordinator: FastAPI routes over :class:`CoordinatorService`.

JSON API under ``/api`` (OpenAPI schema at ``/openapi.json``, docs at ``/docs``), ``/healthz``, Prometheus text at
``/metrics`` and the dashboard (static files) at ``/``. The run's authority answers ``GET /api/authority``,
``POST /api/tickets`` (a request signed by the peer, see :mod:`swarmloco.protocol.trust.ticket_request`),
``GET /api/revocations`` (the signed list) and ``GET /api/checkpoint`` (the signed head it vouches for). Bad input
gets a 4xx with an ``error`` message; an unexpected server-side failure answers 503 (retryable) rather than 500.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmloco.coordinator.dialback import DialBacker
from swarmloco.coordinator.ingest import IngestPipeline, unexpected
from swarmloco.coordinator.linktest import MAX_BYTES as MAX_LINK_BYTES
from swarmloco.coordinator.linktest import LinkTester
from swarmloco.coordinator.service import CoordinatorService
from swarmloco.protocol.trust.ticket_request import MAX_REQUEST_BYTES

__all__ = ["create_app", "with_fast_reports"]

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

RunId = Annotated[str | None, Query(max_length=64, description="Only this run")]
PeerId = Annotated[str | None, Query(max_length=128, description="Only this peer (base58 peer id)")]
Limit = Annotated[int, Query(ge=1, le=1000, description="Page size")]
# SQLite integers are 64-bit: a larger cursor would raise OverflowError in the store instead of a 422
Cursor = Annotated[int | None, Query(ge=0, le=2**63 - 1, description="`next_cursor` of the previous page")]
Order = Annotated[Literal["asc", "desc"], Query(description="Order by id")]


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote a hostile string, and a lone surrogate in it
    cannot be encoded as UTF-8 (the default rendering would fail with a 503 instead of the intended 4xx)."""

    def render(self, content: Any) -> bytes:
        return _render(content)


def _error(status: int, message: str) -> JSONResponse:
    return AsciiJSONResponse(status_code=status, content={"error": message})


def _client(request: Request) -> str:
    """The request's source address ("?" when the server does not know it)."""
    return request.client.host if request.client else "?"


async def _read_capped(request: Request, cap: int) -> bytes | None:
    """Read the request body, giving up (None) as soon as it exceeds ``cap`` bytes. A client that goes away
    mid-body (or is cut off by the request deadline) reads as an empty body: nobody is left to hear the 400."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
        return None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                return None
            chunks.append(chunk)
    except ClientDisconnect:
        return b""
    return b"".join(chunks)


def _render(content: Any) -> bytes:
    """JSON as every answer of this API is rendered (see :class:`AsciiJSONResponse`)."""
    return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def with_fast_reports(app: ASGIApp, service: CoordinatorService, pipeline: IngestPipeline) -> ASGIApp:
    """``app`` with ``POST /api/reports`` answered in front of it, through ``pipeline``, as FastAPI's route answers
    it (same statuses and bodies) but without its routing, middleware and dependency machinery, which cost the
    coordinator about as much CPU per report as verifying it. Every other request goes to ``app``."""
    cap = service.config.max_report_bytes
    too_large = _render({"error": f"report larger than {cap} bytes"})

    async def respond(send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def post_report(scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and (len(value) > 18 or int(value) > cap):
                return await respond(send, 413, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone mid-body: an empty body, answered 400 to nobody
                chunks = []
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                return await respond(send, 413, too_large)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        client = scope["client"][0] if scope.get("client") else "?"
        answer = await pipeline.submit(b"".join(chunks), client=client)
        await respond(send, answer.status, _render(answer.body))

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/api/reports" or scope["method"] != "POST":
            return await app(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await post_report(scope, receive, tracked)
        except Exception as exc:
            logger.exception("unexpected error while serving a report")
            if not started:
                await respond(send, 503, _render(unexpected(exc).body))

    return route


def create_app(service: CoordinatorService, pipeline: IngestPipeline | None = None) -> FastAPI:
    """Build the ASGI app; ``service`` owns the store and policies. Reports go through ``pipeline`` when there is
    one (see :func:`with_fast_reports` for the route the server mounts in front), else one thread each."""
    dial_backer = DialBacker()
    link_tester = LinkTester()
    app = FastAPI(title="swarmloco coordinator", version="1", summary="Records swarm runs, peers, rounds, metrics.",
                  default_response_class=AsciiJSONResponse)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()[:5]]
        return _error(422, "invalid request: " + "; ".join(parts))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return _error(503, f"coordinator error ({type(exc).__name__}); retry later")

    @app.post("/api/reports", summary="Submit one signed report (see protocol/trust/reports.py for the schema)",
              responses={400: {}, 401: {}, 403: {}, 409: {}, 413: {}, 422: {}, 429: {}})
    async def post_report(request: Request) -> JSONResponse:
        raw = await _read_capped(request, service.config.max_report_bytes)
        if raw is None:
            return _error(413, f"report larger than {service.config.max_report_bytes} bytes")
        client = _client(request)
        # SQLite fsync must not stall the event loop
        if pipeline is not None:
            answer = await pipeline.submit(raw, client=client)
        else:
            answer = await run_in_threadpool(service.ingest, raw, client=client)
        return AsciiJSONResponse(status_code=answer.status, content=answer.body)

    @app.get("/api/authority", summary="The run's authority: its peer id, which signs tickets, and the admission "
                                       "policy")
    def get_authority() -> dict[str, Any]:
        return service.authority.info()

    @app.post("/api/tickets", summary="Request an admission ticket with a request signed by the peer's key (see "
                                      "protocol/trust/ticket_request.py)",
              responses={400: {}, 401: {}, 403: {}, 409: {}, 413: {}, 422: {}, 429: {}})
    async def post_ticket(request: Request) -> JSONResponse:
        raw = await _read_capped(request, MAX_REQUEST_BYTES)
        if raw is None:
            return _error(413, f"ticket request larger than {MAX_REQUEST_BYTES} bytes")
        client = _client(request)
        answer = await run_in_threadpool(service.request_ticket, raw, client=client)
        return AsciiJSONResponse(status_code=answer.status, content=answer.body)

    @app.get("/api/manifest", summary="The run manifest: run id, versions, authority and admission, bootstrap "
                                      "multiaddrs and the settings every peer shares (`swarmloco peer --join URL`)")
    def get_manifest() -> dict[str, Any]:
        return service.manifest()

    @app.get("/api/dialback", summary="Connect once to PORT at the address this request came from: whether this "
                                      "machine can be reached from outside (swarmloco doctor)",
             responses={400: {}, 429: {}})
    async def get_dialback(request: Request, port: int) -> JSONResponse:
        client = _client(request)
        answer = await dial_backer.dial(client, port)
        return AsciiJSONResponse(status_code=answer.status, content=answer.body)

    @app.get("/api/linktest", summary="BYTES of incompressible data, for `swarmloco doctor` to time this link's "
                                      "download (rate-limited per address)", responses={400: {}, 429: {}})
    async def get_linktest(request: Request, size: Annotated[int, Query(alias="bytes")] = 1 << 20) -> Response:
        slot, status, refusal = link_tester.admit(_client(request), size)
        if refusal:
            return _error(status, refusal)
        return StreamingResponse(link_tester.payload(slot, size), media_type="application/octet-stream",
                                 headers={"Content-Length": str(size), "Cache-Control": "no-store"})

    @app.post("/api/linktest", summary="Read and discard a body of at most 16 MiB, for `swarmloco doctor` to time "
                                       "this link's upload", responses={400: {}, 413: {}, 429: {}})
    async def post_linktest(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isascii() and declared.isdigit() and len(declared) < 10 else 0
        slot, status, refusal = link_tester.admit(_client(request), max(1, size), too_large=413)
        if refusal:
            return _error(status, refusal)
        started, got = time.monotonic(), 0
        try:
            async for chunk in request.stream():
                got += len(chunk)
                if got > MAX_LINK_BYTES:
                    return _error(413, f"at most {MAX_LINK_BYTES} bytes")
        except ClientDisconnect:
            return _error(400, "the upload was cut off")
        finally:
            link_tester.done(slot)
        return AsciiJSONResponse({"bytes": got, "seconds": round(time.monotonic() - started, 6)})

    @app.get("/api/revocations", summary="Peers revoked by the authority, as a list it signed (newest serial wins)")
    def get_revocations() -> dict[str, Any]:
        return service.authority.revocations()

    @app.get("/api/checkpoint", summary="The heaviest certified state the authority vouches for, with each "
             "member's seniority, signed (newest wins)")
    def get_checkpoint() -> JSONResponse:
        value = service.checkpoint(refresh=True)
        if value is None:
            return _error(404, "no checkpoint yet: the authority signs one once a certified round is reported")
        return JSONResponse(value)

    @app.get("/api/runs", summary="Runs recorded by this coordinator")
    def get_runs(limit: Limit = 100, cursor: Cursor = None, order: Order = "asc") -> dict[str, Any]:
        return service.runs(limit=limit, cursor=cursor, descending=order == "desc")

    @app.get("/api/peers", summary="Peers with hardware, contribution and online state")
    def get_peers(run_id: RunId = None, peer_id: PeerId = None, limit: Limit = 100, cursor: Cursor = None,
                  order: Order = "asc") -> dict[str, Any]:
        return service.peers(run_id=run_id, peer_id=peer_id, limit=limit, cursor=cursor,
                             descending=order == "desc")

    @app.get("/api/accounting", summary="A run's goodput and cost, and what its eval loss bought: verified and "
             "wasted tokens, device-hours by kind, cost with --price, eval loss over tokens and device-hours")
    def get_accounting(run_id: RunId = None) -> dict[str, Any]:
        return service.accounting(run_id)

    @app.get("/api/rounds", summary="Rounds with members, tokens, state hash, durations, outcome")
    def get_rounds(run_id: RunId = None, peer_id: PeerId = None, limit: Limit = 100, cursor: Cursor = None,
                   order: Order = "asc") -> dict[str, Any]:
        return service.rounds(run_id=run_id, peer_id=peer_id, limit=limit, cursor=cursor,
                              descending=order == "desc")

    @app.get("/api/metrics", summary="Training metrics reported by peers")
    def get_metrics(run_id: RunId = None, peer_id: PeerId = None, limit: Limit = 100, cursor: Cursor = None,
                    order: Order = "asc") -> dict[str, Any]:
        return service.metrics(run_id=run_id, peer_id=peer_id, limit=limit, cursor=cursor,
                               descending=order == "desc")

    @app.get("/healthz", summary="Liveness and database reachability")
    def healthz() -> dict[str, Any]:
        return service.health()

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def prometheus() -> Response:
        return Response(content=service.prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)  # no favicon, and no 404 in the browser console

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
