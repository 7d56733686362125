"""Turn chat prompts into one padded batch through the full stack, then show one trajectory.

python examples/rollout_quickstart.py [hydra overrides, e.g. actor_rollout_ref.rollout.n=4]
"""

import os
import sys

import ray
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare

PROMPTS = ["What is 3 + 4?", "Say hello to the world.", "Compute 12 * 7 please.", "Which way: left or right?"]


def main(overrides: list[str]) -> None:
    config = compose_config(
        # one event loop in this process runs the agent loops (agent.num_workers=0): four prompts need no worker process
        [
            "actor_rollout_ref.rollout.n=2",
            "data.max_response_length=32",
            "data.max_prompt_length=64",
            "actor_rollout_ref.rollout.agent.num_workers=0",
            *overrides,
        ]
    )
    if os.environ.get("RAY_ADDRESS"):  # the cluster it names (as `ray job submit` sets it)
        ray.init()
    else:  # a Ray of its own on two cores
        ray.init(num_cpus=2, include_dashboard=False)
    manager = AgentLoopManager(prepare(config))  # prepare: builds the tiny default model on the first run
    rows = [{"prompt": [{"role": "user", "content": text}], "data_source": "quickstart"} for text in PROMPTS]
    output = manager.generate_sequences(rows)

    print(f"batch of {len(output)} trajectories")
    for key, tensor in output.batch.items():
        print(f"  {key:<18} {tuple(tensor.shape)}  {tensor.dtype}")
    print("meta_info:", {key: value for key, value in output.meta_info.items()})

    tokenizer = AutoTokenizer.from_pretrained(manager.config.actor_rollout_ref.model.path)
    sample = output.batch[0]
    prompt = sample["prompts"][sample["attention_mask"][: sample["prompts"].shape[0]].bool()]
    length = int(sample["attention_mask"][sample["prompts"].shape[0] :].sum())
    print("\nprompt:", repr(tokenizer.decode(prompt)))
    print("response:", repr(tokenizer.decode(sample["responses"][:length])))
    print("response_mask:", sample["response_mask"][:length].tolist())
    print("rollout_log_probs:", [round(x, 3) for x in sample["rollout_log_probs"][:length].tolist()])
    manager.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
