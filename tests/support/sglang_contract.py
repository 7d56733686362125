"""SGLang's own JSON contract for /generate, loaded from the installed wheel (``pip install --no-deps sglang``).

Only ``sglang/api/v1/api_types.py`` is loaded (by path, needing only msgspec): importing the sglang
package would pull its GPU dependencies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_api_types() -> ModuleType | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "api" / "v1" / "api_types.py"
    if not path.exists() or importlib.util.find_spec("msgspec") is None:
        return None
    module_spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
