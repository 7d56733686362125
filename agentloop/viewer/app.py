"""The viewer's web app: the page, its static files and the JSON it reads (``api/...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from agentloop.viewer.export import export_step
from agentloop.viewer.store import RunStore, StepNotFound

STATIC = Path(__file__).parent / "static"


def build_app(store: RunStore) -> FastAPI:
    """Routes over one run directory; every answer is read fresh from disk, so a running job's new steps appear."""
    app = FastAPI(title=f"agentloop viewer: {store.path}")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def answer(read: Any, *args: Any) -> Any:
        try:
            return read(*args)
        except StepNotFound as error:
            raise HTTPException(404, str(error)) from error
        except (ValueError, OSError) as error:  # unreadable or vanished file: say which, keep serving
            raise HTTPException(422, str(error)) from error

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/run")
    def run() -> dict[str, Any]:
        return store.run()

    @app.get("/api/steps/{step}")
    def step(step: int) -> dict[str, Any]:
        return answer(store.step, step)

    @app.get("/api/steps/{step}/samples/{sample}")
    def sample(step: int, sample: int) -> dict[str, Any]:
        return answer(store.sample, step, sample)

    @app.get("/api/steps/{step}/groups/{uid:path}")
    def group(step: int, uid: str) -> dict[str, Any]:
        return answer(store.group, step, uid)

    @app.get("/export/{step}")
    def export(step: int) -> HTMLResponse:
        html = answer(export_step, store, step)
        filename = f"{store.path.name}_step_{step}.html"
        return HTMLResponse(html, headers={"Content-Disposition": f'attachment; filename="{filename}"'})

    return app
