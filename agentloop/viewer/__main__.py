"""``python -m agentloop.viewer RUN_DIR``: serve the trajectory viewer for a run's output directory.

RUN_DIR is ``trainer.default_local_dir`` (``metrics.jsonl``; dumps in ``rollouts/`` or the directory
itself). ``--export STEP`` writes that step as one self-contained HTML file instead of serving.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from agentloop.http_server import serve
from agentloop.viewer.app import build_app
from agentloop.viewer.export import export_step
from agentloop.viewer.store import RunStore, StepNotFound


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agentloop.viewer", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's output directory (trainer.default_local_dir)")
    parser.add_argument("--rollouts", type=Path, help="where the dumps are, when not in RUN_DIR/rollouts or RUN_DIR")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    parser.add_argument("--export", type=int, metavar="STEP", help="write STEP as a self-contained HTML file and exit")
    parser.add_argument("-o", "--output", type=Path, help="the export's file (default RUN_DIR_NAME_step_STEP.html)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        parser.error(f"{args.run_dir} is not a directory; pass a run's output directory, e.g. outputs/arithmetic_grpo")
    store = RunStore(args.run_dir, args.rollouts)
    if args.export is not None:
        try:
            html = export_step(store, args.export)
        except (StepNotFound, ValueError) as error:
            parser.exit(1, f"cannot export step {args.export}: {error}\n")
        output = args.output or Path(f"{store.path.name}_step_{args.export}.html")
        output.write_text(html)
        print(f"wrote {output} ({len(html) / 1e6:.1f} MB)")
        return
    asyncio.run(_serve(store, args.host, args.port))


async def _serve(store: RunStore, host: str, port: int) -> None:
    server, bound = await serve(build_app(store), host, port)
    summary = store.run()
    print(f"{summary['found']}\nviewer for {store.path}: http://{host}:{bound}/  (Ctrl-C to stop)", flush=True)
    while not server.should_exit:
        await asyncio.sleep(0.2)


if __name__ == "__main__":
    main()
