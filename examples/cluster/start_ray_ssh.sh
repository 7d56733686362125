#!/usr/bin/env bash
# Start a Ray cluster over ssh, one role per machine, then run a training job on the head.
#
#   examples/cluster/start_ray_ssh.sh HEAD=trainer_node host2=rollout_node host3=agent_node -- --config-name my_job ...
#
# Each HOST=ROLE starts Ray on HOST offering the custom resource ROLE (8 units), the first one as the head. Every
# machine needs the same Python environment (installed from the lock) at the same path, reachable over ssh without a
# password, and the model, the output directory and anything a key names by path where the parts that read them run
# (docs/guides/multi-node.md). Everything after `--` goes to `python -m trainer.main_ppo` on the head.
#
# Ray >= 2.5x starts a head with token authentication: every node and the job must present the head's token. This
# script makes one, copies it to each machine (readable by you only) and points Ray at it (RAY_AUTH_MODE=token,
# RAY_AUTH_TOKEN_PATH), as tests/test_cluster_recipe.py does on one machine.
set -euo pipefail

PYTHON_ENV=${PYTHON_ENV:-$HOME/agentloop/.venv}  # the environment's directory on every machine
REPO=${REPO:-$HOME/agentloop}                   # the checkout the job runs from on the head
RAY_PORT=${RAY_PORT:-6379}
TOKEN_FILE=${TOKEN_FILE:-.agentloop-ray-token}   # relative to the home directory on every machine

roles=()
while [[ $# -gt 0 && $1 != "--" ]]; do roles+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
if [[ ${#roles[@]} -lt 1 ]]; then
  echo "usage: $0 HEAD=ROLE [HOST=ROLE ...] -- <trainer.main_ppo arguments>" >&2
  exit 2
fi

head=${roles[0]%%=*}
head_ip=$(ssh "$head" hostname -I | awk '{print $1}')
token=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
env="source $PYTHON_ENV/bin/activate && export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=\$HOME/$TOKEN_FILE"
for entry in "${roles[@]}"; do
  host=${entry%%=*} role=${entry#*=}
  if [[ $host == "$head" ]]; then
    start="ray start --head --port=$RAY_PORT --node-ip-address=$head_ip"
  else
    start="ray start --address=$head_ip:$RAY_PORT"
  fi
  echo "starting Ray on $host with resource $role"
  ssh "$host" "umask 077 && cat > \$HOME/$TOKEN_FILE" <<<"$token"
  ssh "$host" "$env && $start --resources='{\"$role\": 8}'"
done

# stop Ray on every machine when the job ends, however it ends (ray stop ends every Ray of the user on a machine:
# give the job machines of its own)
trap 'for entry in "${roles[@]}"; do ssh "${entry%%=*}" "$env && ray stop" || true; done' EXIT

ssh "$head" "$env && cd $REPO && python -m trainer.main_ppo trainer.ray_address=$head_ip:$RAY_PORT \
  trainer.resources_per_rank='{trainer_node: 1}' \
  +actor_rollout_ref.rollout.resources_per_server.rollout_node=1 \
  actor_rollout_ref.rollout.agent.resources_per_worker='{agent_node: 1}' $(printf '%q ' "$@")"
