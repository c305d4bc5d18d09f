"""`GET /` and `/playground`: the web playground, a page with its script and style shipped in the package
(`omnimtp/server/playground/`: no build step, nothing fetched from elsewhere). It speaks only the public API
(/v1/models, /v1/audio/speech, /v1/audio/voices, /v1/realtime), with the API key the user types in, so it
needs no route or permission of its own. `create_app(playground=False)` (`serve --no-playground`) leaves it out."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from omnimtp.server.errors import APIError

router = APIRouter()

_FILES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# The page names what it may load: only this server (no CDN, no external font), inline nothing.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob: data:; "
                               "connect-src 'self' ws: wss:",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("omnimtp.server").joinpath("playground", name).read_bytes()


@router.get("/")
@router.get("/playground")
async def page():
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/playground/{name}")
async def asset(name: str):
    if name not in _FILES:
        raise APIError(404, f"no playground file {name!r}", type="not_found_error", code="not_found")
    return Response(_read(name), media_type=_FILES[name], headers=_HEADERS)
