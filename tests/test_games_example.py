"""The games example: its env and interaction on their own, and the demo through the full stack."""

import asyncio
import subprocess
import sys
from pathlib import Path

from examples.games.guess_number import GuessNumberEnv
from examples.games.tutor import ArithmeticTutor
from tests.support.runs import joining_the_suite_ray

ROOT = Path(__file__).resolve().parent.parent


def test_guess_number_env():
    env = GuessNumberEnv(seed=3, low=1, high=20)
    env.reset()
    assert env.step("no idea") == ("Answer with a number.", False, {"reward": 0.0})
    assert env.step(f"I guess {env.secret - 1}")[0] == "Higher."
    assert env.step(f"{env.secret + 1}")[0] == "Lower."
    assert env.step(f"It is {env.secret}") == ("Correct!", True, {"reward": 1.0})


def test_tutor_interaction():
    tutor = ArithmeticTutor({"hint": "Add again."})

    async def dialogue():
        await tutor.start_interaction("t", ground_truth=7)
        wrong = await tutor.generate_response("t", [{"role": "assistant", "content": "It is 8"}], ground_truth=7)
        right = await tutor.generate_response(
            "t", [{"role": "assistant", "content": "<think>3+4</think>It is 7"}], ground_truth=7
        )
        return wrong, right, await tutor.calculate_score("t")

    wrong, right, score = asyncio.run(dialogue())
    assert wrong == (False, "Not quite. Add again.", 0.0, {}) and right[0] is True and score == 1.0


def test_demo_runs_through_the_stack(local_ray):
    result = subprocess.run(
        [sys.executable, "-m", "examples.games.demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=joining_the_suite_ray(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "finish=" in line]
    assert len(lines) == 8
    assert {line.split()[0] for line in lines} == {"guess_number", "tool_agent"}
    assert "multi_turn/num_turns_histogram" in result.stdout
