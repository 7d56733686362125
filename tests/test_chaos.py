"""Chaos in training: a rollout server is killed during one step's rollout and an agent-loop worker during
another's; every step completes with a complete batch, the replacement serves the trained weights, and the
reward still rises (the "yes or no" test model is rewarded for "yes")."""

from __future__ import annotations

from agentloop.dumps import read_rollout_dump
from agentloop.rows import write_rows
from tests.support.config import small_config
from trainer.ray_trainer import RayPPOTrainer


def test_training_survives_a_killed_server_and_a_killed_worker(local_ray, coin_model, tmp_path):
    import tests.support.probe_loops  # noqa: F401  (probe_chaos)

    chaos = {0: "worker", 5: "server"}  # row 0 is in step 1's batch, row 5 in step 2's (4 rows a step, in order)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "agent_name": "probe_chaos",
            "data_source": "chaos",
            "extra_info": {"index": i, "chaos": chaos.get(i), "chaos_marker": str(tmp_path / f"killed_{chaos.get(i)}")},
        }
        for i in range(32)
    ]
    train = write_rows(rows, str(tmp_path / "train.jsonl"))
    out = tmp_path / "run"
    trainer = RayPPOTrainer(
        small_config(
            f"actor_rollout_ref.model.path={coin_model}",
            f"data.train_files=[{train}]",
            "data.train_batch_size=4",
            "data.shuffle=false",
            "actor_rollout_ref.rollout.n=16",
            "actor_rollout_ref.rollout.data_parallel_size=2",
            "actor_rollout_ref.rollout.agent.num_workers=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.optim.lr=2e-3",
            "trainer.total_training_steps=8",
            "trainer.logger=[console]",
            f"trainer.rollout_data_dir={out / 'rollouts'}",
            f"trainer.default_local_dir={out}",
        )
    )
    try:
        history = trainer.fit()
        assert [line["step"] for line in history] == list(range(1, 9))
        assert (tmp_path / "killed_server").exists() and (tmp_path / "killed_worker").exists()
        for step in range(1, 9):
            records = read_rollout_dump(out / "rollouts" / f"step_{step:06d}.parquet")[1]
            assert len(records) == 64 and all(record["model_tokens"] > 0 for record in records)
        assert history[-1]["supervision/server_restarts"] == 1 and history[-1]["supervision/worker_restarts"] == 1
        manager = trainer.manager
        assert manager.workers.restarts == 1
        assert [event.kind for event in manager.pool.events] == ["restarted"]
        # the replacement (started right after step 2's rollout) holds the trained policy like the other server:
        # step 3's rollouts come from both, and the trainer scores every sampled token as the servers did
        # (that a replacement loads the latest push before serving is tests/test_supervision.py's check)
        assert history[2]["rollout/requests_per_server/0"] > 0 and history[2]["rollout/requests_per_server/1"] > 0
        assert history[2]["rollout_corr/abs_log_prob_diff"] < 1e-5
        rewards = [line["critic/score/mean"] for line in history]
        print("mean reward per step:", rewards)
        assert sum(rewards[-2:]) / 2 >= rewards[0] + 0.2, rewards  # step 1 is sampled before any update
    finally:
        trainer.shutdown()
