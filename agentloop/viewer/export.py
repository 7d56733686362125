"""One step as a self-contained HTML file: the page with its script, styles and data inlined."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agentloop.viewer.store import RunStore

STATIC = Path(__file__).parent / "static"
STYLE_TAG = '<link rel="stylesheet" href="static/viewer.css">'
SCRIPT_TAG = re.compile(r'<script src="static/([\w-]+\.js)"></script>')
DATA_MARK = "<!--AGENTLOOP_DATA-->"


def export_step(store: RunStore, step: int) -> str:
    """The page for ``step`` that opens from a file: every answer the page would ask the server for, inlined."""
    table = store.step(step)
    data: dict[str, Any] = {
        "/api/run": {**store.run(), "live": False, "steps": [step]},
        f"/api/steps/{step}": table,
    }
    for row in table["samples"]:
        data[f"/api/steps/{step}/samples/{row['sample']}"] = store.sample(step, row["sample"])
    for uid in dict.fromkeys(row["uid"] for row in table["samples"] if row["uid"] is not None):
        data[f"/api/steps/{step}/groups/{uid}"] = store.group(step, uid)
    page = (STATIC / "index.html").read_text()
    if STYLE_TAG not in page or DATA_MARK not in page or not SCRIPT_TAG.search(page):
        raise RuntimeError("the viewer's index.html lacks the style, data or script tags the export replaces")
    page = page.replace(STYLE_TAG, f"<style>\n{(STATIC / 'viewer.css').read_text()}\n</style>", 1)
    page = SCRIPT_TAG.sub(lambda tag: f"<script>\n{(STATIC / tag.group(1)).read_text()}\n</script>", page)
    # after the scripts: the data's text must not be taken for a script tag
    return page.replace(
        DATA_MARK, f'<script id="agentloop-data" type="application/json">{_script_safe(data)}</script>', 1
    )


def _script_safe(data: Any) -> str:
    # "</" would end the script element early; "<\/" is the same JSON string
    return json.dumps(data, ensure_ascii=False).replace("</", "<\\/")
