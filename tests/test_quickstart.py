"""The README's run command: the rollout quickstart prints batch shapes and one decoded trajectory."""

import subprocess
import sys
from pathlib import Path

from tests.support.runs import joining_the_suite_ray

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rollout_quickstart.py"


def test_rollout_quickstart_runs(local_ray):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=joining_the_suite_ray()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "batch of 8 trajectories" in out
    assert "responses          (8, 32)" in out and "input_ids          (8, 96)" in out
    assert "prompt: '<|im_start|>user\\nWhat is 3 + 4?<|im_end|>\\n<|im_start|>assistant\\n'" in out
    assert "response_mask: [1" in out
