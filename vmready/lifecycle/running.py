"""The VMs the lifecycle follows, and what their agents last said."""

from __future__ import annotations

from vmready.agentlink import AgentMonitor
from vmready.domain import HypervisorError
from vmready.hypervisor import RunningVM
from vmready.protocols import AgentStatus


class RunningVMs:
    """The VMs the lifecycle follows, and what their agents last said.

    ``lifecycle.watching`` adds and removes them (``attach``, ``detach``); the
    other parts only look.
    """

    def __init__(self) -> None:
        self.vms: dict[str, RunningVM] = {}
        # The agent monitor of each followed VM with an agent port.
        self.monitors: dict[str, AgentMonitor] = {}
        # What each agent said last, kept once its VM is gone (``stopped``).
        self.last_agent_status: dict[str, AgentStatus] = {}

    def has_vm(self, name: str) -> bool:
        """Whether the instance's VM runs and is followed."""
        vm = self.vms.get(name)
        return vm is not None and not vm.gone

    def vm(self, name: str) -> RunningVM:
        """The instance's followed VM, or HypervisorError."""
        vm = self.vms.get(name)
        if vm is None or vm.gone:
            raise HypervisorError(f"Instance {name} has no running VM")
        return vm

    def agent_status(self, name: str) -> AgentStatus:
        """What the instance's agent last said (``stopped`` once its VM is gone)."""
        monitor = self.monitors.get(name)
        if monitor is not None:
            return monitor.status
        return self.last_agent_status.get(name, AgentStatus.UNKNOWN)

    def forget(self, name: str) -> None:
        """The instance is gone: nothing of its agent is kept."""
        self.last_agent_status.pop(name, None)

    def renamed(self, name: str, new_name: str) -> None:
        """A stopped instance was renamed: what its agent said last goes with it."""
        status = self.last_agent_status.pop(name, None)
        if status is not None:
            self.last_agent_status[new_name] = status
