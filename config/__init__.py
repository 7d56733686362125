"""agentloop's YAML configs as a package, so hydra finds them as ``pkg://agentloop.conf`` in any install."""
