"""A custom reward function as verl's ``custom_reward_function.path`` / ``.name`` name one."""


def length_parity_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    """Deterministic in the decoded response, so a test can recompute it: 1 for an even length, else 0."""
    return {
        "score": float(len(solution_str) % 2 == 0) + bonus,
        "chars": len(solution_str),
        "turns": extra_info["num_turns"],
    }
