"""Print the requirement an optional extra of pyproject.toml declares (``python .ci/extra.py sglang``), so the
scripts here install the range pyproject declares instead of a copy of it."""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
print(*project["optional-dependencies"][sys.argv[1]])
