"""Old and new agents in VMs with the old and the new serial layout (docs/upgrading.md).

Real processes: ``twistd vmready`` started with ``--serial-layout legacy`` (a
daemon from before the rename) or the default, fakeqemu VMs, and
``vmready-agent``.  A new agent finds its port by itself; an *old* agent knows
only ``org.linuxcontainers.lxd``, which is what ``--serial`` pointing at that
port reproduces.
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from tests.system import System, eventually
from vmready.hypervisor.cmdline import AGENT_PORT, LEGACY_PORT


def legacy_port(system: System, name: str) -> str:
    """The old-named port of the instance's VM, as a guest process opens it."""
    return os.path.join(os.path.dirname(system.serial_port(name)), LEGACY_PORT)


class AgentAcrossTheRenameTests(SynchronousTestCase):
    """The four combinations of layout and agent, and an upgrade under a running VM."""

    def launch(self, layout: str, old_agent: bool) -> System:
        system = System(self)
        system.start_daemon("--serial-layout", layout)
        system.cli("launch", "vm1", "--memory", "64")
        options = ("--serial", legacy_port(system, "vm1")) if old_agent else ()
        system.start_agent("vm1", "agent.log", *options)
        return system

    def assertReadyWorks(self, system: System) -> None:
        self.assertEqual(system.cli("wait", "vm1", "agent", "--timeout", "60").returncode, 0)
        self.assertEqual(system.notify("vm1").returncode, 0)
        self.assertEqual(system.listed_status("vm1"), "READY")

    def test_newLayoutNewAgentUsesTheNewPort(self) -> None:
        system = self.launch("current", old_agent=False)
        self.assertReadyWorks(system)
        self.assertIn(f"serial port: {system.serial_port('vm1')}\n", system.agent_log())
        self.assertEqual(system.info("vm1")["serial_layout"]["name"], "current")

    def test_legacyLayoutNewAgentFallsBackToTheOldPort(self) -> None:
        system = self.launch("legacy", old_agent=False)
        self.assertReadyWorks(system)
        self.assertIn(
            f"serial port: {legacy_port(system, 'vm1')} (legacy name)", system.agent_log()
        )
        self.assertEqual(system.info("vm1")["serial_layout"]["name"], "legacy")

    def test_legacyLayoutOldAgentKeepsWorking(self) -> None:
        system = self.launch("legacy", old_agent=True)
        self.assertReadyWorks(system)

    def test_newLayoutOldAgentStartsButIsNotHeard(self) -> None:
        system = self.launch("current", old_agent=True)
        eventually(lambda: "(legacy name)" in system.agent_log(), "the old agent to open its port")
        waited = system.cli("wait", "vm1", "agent", "--timeout", "3", check=False)
        self.assertEqual(waited.returncode, 1)
        self.assertIn("(agent: UNKNOWN)", waited.stderr)
        kept = system.notify("vm1")  # kept by the agent for a link that never comes
        self.assertEqual(kept.returncode, 0)
        self.assertIn("host not reachable: the host has not sent CONNECT yet", kept.stderr)
        self.assertIn("the agent will tell it Ready when the link returns", kept.stderr)
        self.assertEqual(system.listed_status("vm1"), "RUNNING")

    def test_upgradedDaemonKeepsAnOldAgentWorkingUntilTheVMRestarts(self) -> None:
        system = self.launch("legacy", old_agent=True)
        self.assertReadyWorks(system)
        system.stop_daemon()
        system.start_daemon()  # the upgrade: the default layout is the new one
        # The legacy VM is still read through the chardev it was started with.
        eventually(lambda: system.listed_status("vm1") == "READY", "Ready re-reported")
        info = system.info("vm1")
        self.assertEqual(info["serial_layout"]["name"], "legacy")
        self.assertEqual(info["agent"]["status"], "connected")
        # A restart gives the VM the new layout, with both ports (and the CONNECT port).
        system.cli("restart", "vm1", "--force")
        self.assertEqual(system.info("vm1")["serial_layout"]["name"], "current")
        ports = os.listdir(os.path.dirname(system.serial_port("vm1")))
        self.assertEqual(sorted(ports), sorted([AGENT_PORT, LEGACY_PORT, "vmready.connect"]))
