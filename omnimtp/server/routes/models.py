"""`/v1/models`, `/health` and `/metrics`: what the server serves and how it is doing."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omnimtp.server.routes.common import serving

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 {"status": "ok"} once the engine serves; 503 while it warms up ("loading") or stops."""
    engine = serving(request).engine
    if not engine.is_running:
        return JSONResponse({"status": "stopping"}, status_code=503)
    if not engine.is_ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def list_models(request: Request):
    """OpenAI's model list; each model also says its family, endpoints and voices (`Engine.model_card`)."""
    context = serving(request)
    card = context.engine.model_card()
    models = [{"id": name, "object": "model", "created": context.engine.created, "owned_by": "omnimtp", **card}
              for name in context.model_names]
    return {"object": "list", "data": models}
