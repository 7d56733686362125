"""A sandbox for model-written Python: a fresh process tree per run, limited and isolated in layers.

OS layers where the machine allows them (new mount, network, pid and user namespaces; a read-only
file system but for the working directory; an unprivileged uid; rlimits), and a Python audit hook
as the fallback that names what it refused. ``python -m agentloop.tools.sandbox`` prints the layers
active on this machine. The tool built on it is ``agentloop.tools.python_exec.PythonExecTool``.
"""

from agentloop.tools.sandbox.limits import SandboxLimits
from agentloop.tools.sandbox.runner import SandboxRun, SandboxUnavailable, run_sandboxed

__all__ = ["SandboxLimits", "SandboxRun", "SandboxUnavailable", "run_sandboxed"]
