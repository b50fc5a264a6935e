"""A local backend of slime's `Sandbox` protocol (slime.agent.sandbox): Linux namespaces, a private RAM-backed file
tree, kernel-enforced limits and one forwarded loopback port, on the machine the rollout runs on."""

from slime.agent.local_sandbox.cgroups import CgroupUnavailable
from slime.agent.local_sandbox.host import SandboxUnavailable, local_sandbox_problems
from slime.agent.local_sandbox.limits import SandboxLimits, SandboxReport
from slime.agent.local_sandbox.local import LocalSandbox

__all__ = ["CgroupUnavailable", "LocalSandbox", "SandboxLimits", "SandboxReport", "SandboxUnavailable",
           "local_sandbox_problems"]
