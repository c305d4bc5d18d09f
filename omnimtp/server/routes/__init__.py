"""The HTTP API, one module per API (FastAPI `APIRouter`s), all on the one engine of `ServingContext`."""
