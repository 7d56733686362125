"""``import agentloop`` makes OpenMP's idle threads wait passively (see agentloop/__init__.py), unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# prints the policy in the environment at the moment torch is first imported: libgomp reads it then, and only then
PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Watch())
import {module}
import torch
print(seen[0])
"""


def _policy(module: str, **env: str) -> str:
    environment = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"} | env
    command = [sys.executable, "-c", PROBE.format(module=module)]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.parametrize("module", ["agentloop", "trainer.fsdp_workers"])
def test_passive_before_torch_loads(module: str) -> None:
    assert _policy(module).strip() == "PASSIVE"


def test_user_setting_kept() -> None:
    assert _policy("agentloop", OMP_WAIT_POLICY="ACTIVE").strip() == "ACTIVE"
