"""``python -m agentloop.tools.sandbox``: run one small program sandboxed and print the active layers."""

from __future__ import annotations

import asyncio
import json

from agentloop.tools.sandbox import SandboxLimits, run_sandboxed


def main() -> None:
    run = asyncio.run(run_sandboxed("print(sum(range(10)))", SandboxLimits.from_config({})))
    print(
        json.dumps(
            {"stdout": run.stdout, "stderr": run.stderr, "exit_code": run.exit_code, "layers": run.layers}, indent=2
        )
    )


if __name__ == "__main__":
    main()
