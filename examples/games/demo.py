"""Multi-turn rollouts of a text game (env_agent) and a tutor conversation (tool_agent + interaction).

    python -m examples.games.demo [hydra overrides]

Both are plugged in by name: the game through agent_loops.yaml (loop name `guess_number`), the tutor
through interactions.yaml (`tutor`); the dataset rows choose them with `agent_name` and
`extra_info.interaction_kwargs.name`. Prints each trajectory's end and the step's turn metrics.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray

from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def make_rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        rows.append(
            {
                "prompt": [{"role": "user", "content": "Guess my number between 1 and 20. Answer with one number."}],
                "agent_name": "guess_number",
                "data_source": "guess_number",
                "extra_info": {"index": i, "env_kwargs": {"seed": i}},
            }
        )
        a, b = 3 + i, 4 + 2 * i
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "agent_name": "tool_agent",
                "data_source": "tutor",
                "extra_info": {"index": i, "interaction_kwargs": {"name": "tutor", "ground_truth": a + b}},
            }
        )
    return rows


def main(overrides: list[str]) -> None:
    config = compose_config(
        [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={HERE / 'agent_loops.yaml'}",
            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={HERE / 'interactions.yaml'}",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
            "actor_rollout_ref.rollout.env.max_turns=4",
            "data.max_prompt_length=64",
            "data.max_response_length=96",
            "actor_rollout_ref.rollout.agent.num_workers=0",  # eight samples need no worker process: loops run here
            *overrides,
        ]
    )
    # Worker processes (agent.num_workers > 0) import the example's classes by name, so they get the repository on
    # their path. Through the environment the local Ray's processes inherit, not a runtime_env: with one, every actor
    # would wait for a worker process of its own instead of taking one Ray started ahead.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if os.environ.get("RAY_ADDRESS"):  # the cluster it names (as `ray job submit` sets it)
        ray.init()
    else:  # a Ray of its own on two cores
        ray.init(num_cpus=2, include_dashboard=False)
    manager = AgentLoopManager(prepare(config))
    batch = manager.generate_sequences(make_rows(4))
    for name, reward, end_reason in zip(
        batch.non_tensor_batch["agent_name"],
        batch.non_tensor_batch["reward_score"],
        batch.non_tensor_batch["end_reason"],
    ):
        print(f"{name:<14} finish={end_reason:<10} reward={reward}")
    print({key: value for key, value in batch.meta_info.items() if key.startswith("multi_turn/")})
    manager.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
