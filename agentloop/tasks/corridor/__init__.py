"""A toy multi-turn task for per-turn credit assignment: a corridor of junctions, one left/right choice at each.

``data`` lays out the episodes and builds the rows, ``env`` judges each choice (per-step feedback in
``info["reward"]``) and shows the next junction, and ``warm_start`` teaches the tiny model the answer form and
to follow the clues, then to answer at random, so the starting policy is right half the time and reinforcement
has one thing to learn: follow each junction's clue (``config/corridor_grpo.yaml`` names each of them;
``benchmarks/credit.py`` trains it with each advantage estimator).

Every episode runs all its junctions whatever the model chooses (a wrong turn is a dead end, walked back),
so a good and a bad trajectory differ only in their intermediate choices, and each choice has its own reward.
"""
