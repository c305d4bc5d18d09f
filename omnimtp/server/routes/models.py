"""`/v1/models`, `/health` and `/metrics`: what the server serves and how it is doing."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omnimtp.server.routes.common import serving

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 {"status": "ok"} once the engine serves; 503 while it warms up ("loading") or stops."""
    context = serving(request)
    engines = [context.engine] + ([context.asr.engine] if context.asr is not None else [])
    if not all(engine.is_running for engine in engines):
        return JSONResponse({"status": "stopping"}, status_code=503)
    if not all(engine.is_ready for engine in engines):
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def list_models(request: Request):
    """OpenAI's model list; each model also says its family, endpoints and voices (`Engine.model_card`)."""
    context = serving(request)
    hearing = context.asr.model_names if context.asr is not None else ()  # (its names are the recognizer's)
    models = []
    for served, names in ((context, [n for n in context.model_names if n not in hearing]), (context.asr, hearing)):
        if names:
            card = served.engine.model_card()
            models += [{"id": name, "object": "model", "created": served.engine.created, "owned_by": "omnimtp",
                        **card} for name in names]
    return {"object": "list", "data": models}
