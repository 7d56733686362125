"""The cluster recipe of docs/guides/multi-node.md as written: ``ray start --head`` and ``ray start --address=...`` as
real processes (three raylets on 127.0.0.1, each offering its role's resource), then the documented training command
joining them with ``trainer.ray_address``. The cluster is this test's own: its temporary directory, free ports, a
token of its own, and it is stopped by its process groups (never ``ray stop``, which would stop every Ray on the
machine)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentloop.rows import write_rows
from agentloop.tasks.arithmetic.data import make_rows
from tests.support.config import SMALL
from tests.test_cluster import PLACEMENT
from tests.test_main_ppo import TOOL_RUN

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``ray start --block`` in a session of its own (its raylet and helpers are its process group), once its log
    says the node runs. Ray gives a raylet 30 s to register; on a loaded machine that may pass: one more try then."""
    for attempt in range(2):
        node = subprocess.Popen(
            [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--dashboard-agent-listen-port={free_port()}",
             "--object-store-memory=100000000", *flags],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text() and node.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        if node.poll() is None:
            return node
        assert attempt == 0 and "timed out during startup" in log.read_text(), log.read_text()[-3000:]
        stop([node])
    raise AssertionError("unreachable")


def stop(nodes: list[subprocess.Popen]) -> None:
    """SIGINT to each node's process group (``ray start --block`` stops its processes on it), SIGKILL after 20 s."""
    for node in reversed(nodes):
        with_group(node, signal.SIGINT)
    deadline = time.monotonic() + 20
    for node in nodes:
        try:
            node.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        with_group(node, signal.SIGKILL)


def with_group(node: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(node.pid, signum)
    except ProcessLookupError:
        pass


def test_the_documented_recipe_trains_on_ray_start_nodes(tmp_path):
    # a token of this cluster's own, in a file as examples/cluster/*.sh make it: Ray >= 2.5x starts a head with token
    # authentication, and a node or a job joins only with the head's token (docs/guides/multi-node.md)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    # Ray's socket paths must stay under 107 bytes: a short directory of its own, not pytest's
    port, nodes, temp = free_port(), [], tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        nodes.append(
            start_node(
                ["--head", f"--port={port}", f"--ray-client-server-port={free_port()}", "--include-dashboard=false",
                 f"--temp-dir={temp}", "--num-cpus=1", '--resources={"trainer_node": 8}'],
                env, tmp_path / "head.log",
            )
        )  # fmt: skip
        for role in ("rollout_node", "agent_node"):
            flags = [
                f"--address=127.0.0.1:{port}",
                f"--temp-dir={temp}",
                "--num-cpus=1",
                f"--resources={json.dumps({role: 8})}",
            ]
            nodes.append(start_node(flags, env, tmp_path / f"{role}.log"))
        train = write_rows(make_rows(4), str(tmp_path / "train.jsonl"))
        command = [
            sys.executable, "-m", "trainer.main_ppo", *SMALL, *TOOL_RUN, f"data.train_files=[{train}]",
            "trainer.total_training_steps=1", "trainer.logger=[console]", "trainer.test_freq=-1",
            f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.ray_address=127.0.0.1:{port}", *PLACEMENT,
        ]  # fmt: skip
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:])
        steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1]
    finally:
        stop(nodes)
        shutil.rmtree(temp, ignore_errors=True)


def test_the_cluster_scripts_parse_and_run_the_tested_placement():
    for script in ("start_ray_ssh.sh", "slurm_job.sbatch"):
        path = REPO / "examples" / "cluster" / script
        checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, (script, checked.stderr)
        text = path.read_text()
        for override in (PLACEMENT[0], PLACEMENT[1], PLACEMENT[3]):  # as the shell reads them: mappings quoted
            key, value = override.split("=", 1)
            assert f"{key}='{value}'" in text if "{" in value else override in text, (script, override)
        assert "RAY_AUTH_MODE=token" in text and "RAY_AUTH_TOKEN_PATH" in text and "trainer.ray_address=" in text
