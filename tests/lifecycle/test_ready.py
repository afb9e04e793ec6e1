"""The agent link and the Ready state in the lifecycle, against real fakeqemu VMs.

A guest program stands in for the agent: it holds the VM's virtio port (the
fakeqemu guest socket) and writes status lines into the ring buffer, as the
agent does; the daemon's side is the real monitor over real QMP.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater

from tests.lifecycle.test_lifecycle import STOP_TIMEOUT, LifecycleTestCase, _async, _until
from tests.reactor import reactor
from tests.received import Received
from vmready.agentlink.link import PollIntervals
from vmready.domain.model import Conflict
from vmready.domain.states import READY_KEY, StatusCode
from vmready.hypervisor.cmdline import AGENT_PORT, CONNECT_PORT, fakeqemu_guest_paths
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.guestlink import GuestLink
from vmready.protocols.ringbuffer import AgentStatus
from vmready.trust.certs import fingerprint, generate

FAST = PollIntervals(follow_up=0.02, follow_up_window=5.0)
SERVER = generate("vmready-test-server")


class SerialGuest:
    """The agent's two ports, as the agent holds them: it says its status on the first
    (into the ring buffer), the host's CONNECT lines arrive on ``vmready.connect``."""

    def __init__(self, status: Received, connect: Received) -> None:
        self.status = status
        self.connect = connect

    @property
    def transport(self) -> Any:
        return self.status.transport

    @property
    def closed(self) -> Deferred[None]:
        return self.status.closed

    @property
    def received(self) -> bytes:
        """What the host wrote to the agent (on the connect port)."""
        return self.connect.received

    @received.setter
    def received(self, value: bytes) -> None:
        self.connect.received = value

    def say(self, line: bytes) -> None:
        assert self.status.transport is not None
        self.status.transport.write(line)


class AgentLinkTestCase(LifecycleTestCase):
    port = 40001

    async def guest_control(self, command: bytes) -> None:
        """Write ``command`` to vm1's fakeqemu guest control socket (poweroff, reboot…)."""
        spec = self.lifecycle.specs.spec_for(self.lifecycle.store.view.get_instance("vm1"))
        control = Protocol()
        await connectProtocol(
            UNIXClientEndpoint(reactor, os.path.join(spec.guest_dir, "control")), control
        )
        assert control.transport is not None
        control.transport.write(command)
        self.addCleanup(control.transport.loseConnection)

    def new_lifecycle(
        self, driver: HypervisorDriver | None = None, guest_api: bool = True
    ) -> Lifecycle:
        """A lifecycle whose guest API listens (on a new port), unless not ``guest_api``."""
        lifecycle = super().new_lifecycle(driver)
        type(self).port += 1
        if guest_api:
            self.guest_api_listens(lifecycle)
        return lifecycle

    def guest_api_listens(self, lifecycle: Lifecycle, **intervals: float) -> None:
        """``lifecycle``'s guest API listens: agents are followed, polled at FAST (or so)."""
        link = GuestLink(
            self.port, SERVER.cert_pem, "hvsock:/nonexistent", attrs.evolve(FAST, **intervals)
        )
        lifecycle.reach.listening(link)

    async def guest(self, name: str = "vm1") -> SerialGuest:
        """Open the instance's agent port as the agent would."""
        spec = self.lifecycle.specs.spec_for(self.lifecycle.store.view.get_instance(name))
        holders = []
        for port in (AGENT_PORT, CONNECT_PORT):
            holder = Received()
            path = os.path.join(spec.guest_dir, "virtio-ports", port)
            await connectProtocol(UNIXClientEndpoint(reactor, path), holder)
            holders.append(holder)

            def hang_up(holder: Received = holder) -> Deferred[None] | None:
                if holder.transport is not None and not holder.closed.called:
                    holder.transport.loseConnection()
                    return holder.closed
                return None

            self.addCleanup(hang_up)
        return SerialGuest(*holders)

    def agent_events(self, name: str = "vm1") -> list[str]:
        return [a for a in self.lifecycle_actions(name) if a.startswith("instance-agent-")]

    async def connected_guest(self, name: str = "vm1") -> SerialGuest:
        guest = await self.guest(name)
        guest.say(b"STARTED\n")
        await _until(lambda: b"CONNECT" in guest.received)
        guest.say(b"CONNECTED\n")
        await _until(lambda: self.lifecycle.running.agent_status(name) is AgentStatus.CONNECTED)
        return guest


class IdentityTests(AgentLinkTestCase):
    """Every instance gets its own certificate, handed over as a config drive."""

    @_async
    async def test_createWritesAConfigDriveWithTheInstancesOwnCertificate(self) -> None:
        record = await self.launch()
        drive = self.lifecycle.specs.config_drive(record)
        with open(os.path.join(drive, "agent.crt"), "rb") as f:
            certificate = f.read()
        with open(os.path.join(drive, "server.crt"), "rb") as f:
            self.assertEqual(f.read(), SERVER.cert_pem)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(drive, "agent.key")).st_mode), 0o600)
        found = self.store.certificates.instance_for_fingerprint(fingerprint(certificate))
        assert found is not None
        self.assertEqual(found.name, "vm1")
        with open(os.path.join(drive, "agent.json")) as f:
            settings = json.load(f)
        spec = self.lifecycle.specs.spec_for(record)
        self.assertEqual(
            settings,
            {
                "instance": "vm1",
                "port": AGENT_PORT,
                "transport": "hvsock:/nonexistent",
                "virtio_ports": os.path.join(spec.guest_dir, "virtio-ports"),
                "tcp_sockets": os.path.join(spec.guest_dir, "tcp"),
                "devlxd_socket": os.path.join(spec.run_dir, "guest", "lxd.sock"),
                "state_dir": os.path.join(spec.run_dir, "guest", "run"),
            },
        )

    @_async
    async def test_everyBootStartsWithAnEmptyGuestTmpfs(self) -> None:
        record = await self.launch()
        state_dir = fakeqemu_guest_paths(self.lifecycle.specs.spec_for(record))["state_dir"]
        os.makedirs(state_dir)
        with open(os.path.join(state_dir, "ready"), "w") as f:
            f.write("ready\n")
        await self.wait(await self.lifecycle.act("vm1", "restart", force=True))
        self.assertFalse(os.path.exists(os.path.join(state_dir, "ready")))

    @_async
    async def test_twoInstancesGetDifferentCertificates(self) -> None:
        first = await self.launch("vm1")
        second = await self.launch("vm2")
        pems = []
        for record in (first, second):
            with open(
                os.path.join(self.lifecycle.specs.config_drive(record), "agent.crt"), "rb"
            ) as f:
                pems.append(f.read())
        self.assertNotEqual(fingerprint(pems[0]), fingerprint(pems[1]))

    @_async
    async def test_deleteRevokesTheCertificate(self) -> None:
        record = await self.launch()
        with open(os.path.join(self.lifecycle.specs.config_drive(record), "agent.crt"), "rb") as f:
            certificate = f.read()
        await self.wait(await self.lifecycle.act("vm1", "delete"))
        self.assertIsNone(
            self.store.certificates.instance_for_fingerprint(fingerprint(certificate))
        )

    @_async
    async def test_instancesFromBeforeTheGuestAPIGetAnIdentityAtStart(self) -> None:
        self.lifecycle = self.new_lifecycle(guest_api=False)
        record = await self.launch()
        self.assertFalse(os.path.exists(self.lifecycle.specs.config_drive(record)))
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        self.assertEqual(await self.lifecycle.guestside.ensure_agent_identities(), 1)
        self.assertEqual(await self.lifecycle.guestside.ensure_agent_identities(), 0)
        drive = self.lifecycle.specs.config_drive(record)
        self.assertTrue(os.path.exists(os.path.join(drive, "agent.crt")))
        await self.lifecycle.recovery.recover()  # follow the VM again, so the cleanup stops it


class NewServerCertificateTests(AgentLinkTestCase):
    @_async
    async def test_aNewDaemonCertificateIsWrittenToEveryConfigDrive(self) -> None:
        record = await self.launch()
        renewed = generate("vmready-renewed")
        assert self.lifecycle.reach.link is not None
        self.lifecycle.reach.listening(
            attrs.evolve(self.lifecycle.reach.link, server_cert_pem=renewed.cert_pem)
        )
        await self.lifecycle.guestside.ensure_agent_identities()
        with open(
            os.path.join(self.lifecycle.specs.config_drive(record), "server.crt"), "rb"
        ) as f:
            self.assertEqual(f.read(), renewed.cert_pem)


class HandshakeTests(AgentLinkTestCase):
    """STARTED → CONNECT → CONNECTED over the real ring buffer, with lifecycle events."""

    @_async
    async def test_startedIsAnsweredWithConnectToTheDaemonsPort(self) -> None:
        await self.launch()
        guest = await self.guest()
        guest.say(b"STARTED\n")
        await _until(lambda: b"\n" in guest.received)
        self.assertEqual(guest.received, f"CONNECT 2:{self.port}\n".encode())
        self.assertEqual(self.lifecycle.running.agent_status("vm1"), AgentStatus.STARTED)
        self.assertEqual(self.agent_events(), ["instance-agent-started"])

    @_async
    async def test_connectedIsShownAndAnnounced(self) -> None:
        await self.launch()
        await self.connected_guest()
        self.assertEqual(
            self.agent_events(), ["instance-agent-started", "instance-agent-connected"]
        )

    @_async
    async def test_stoppingTheVMStopsTheAgent(self) -> None:
        await self.launch()
        await self.connected_guest()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        self.assertEqual(self.lifecycle.running.agent_status("vm1"), AgentStatus.STOPPED)
        self.assertEqual(self.agent_events()[-1], "instance-agent-stopped")

    @_async
    async def test_agentSayingStoppedIsAnnounced(self) -> None:
        """As an agent exits: STOPPED, then its port closes (VSERPORT_CHANGE): read then."""
        await self.launch()
        guest = await self.connected_guest()
        monitor = self.lifecycle.running.monitors["vm1"]
        guest.say(b"STOPPED\n")
        guest.status.transport.loseConnection()  # type: ignore[union-attr]
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertEqual(self.agent_events()[-1], "instance-agent-stopped")
        self.assertIs(monitor.link.port_open, False)

    @_async
    async def test_agentKilledWithoutAWordIsStoppedWhenItsPortStaysClosed(self) -> None:
        await self.launch()
        guest = await self.connected_guest()
        guest.status.transport.loseConnection()  # type: ignore[union-attr]  # SIGKILL
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertEqual(self.agent_events()[-1], "instance-agent-stopped")

    @_async
    async def test_stoppedWrittenWithoutClosingWaitsForTheSafetyRead(self) -> None:
        """An agent that writes without reopening is heard, only later: on the safety read."""
        self.guest_api_listens(self.lifecycle, safety=1.0)
        await self.launch()
        guest = await self.connected_guest()
        monitor = self.lifecycle.running.monitors["vm1"]
        reads = monitor.reads
        guest.say(b"STOPPED\n")
        await deferLater(reactor, 0.3, lambda: None)
        self.assertIs(self.lifecycle.running.agent_status("vm1"), AgentStatus.CONNECTED)
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertEqual(monitor.reads, reads + 1)

    @_async
    async def test_daemonRestartAdvertisesTheNewPortToARunningAgent(self) -> None:
        await self.launch()
        guest = await self.connected_guest()
        old_port = self.port
        await self.lifecycle.shutdown()
        guest.received = b""
        self.lifecycle = self.new_lifecycle()
        self.assertNotEqual(self.port, old_port)
        await self.lifecycle.recovery.recover()
        await _until(lambda: b"\n" in guest.received)
        self.assertEqual(guest.received, f"CONNECT 2:{self.port}\n".encode())
        guest.say(b"CONNECTED\n")
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.CONNECTED)

    @_async
    async def test_garbageOnTheSerialLineIsIgnored(self) -> None:
        await self.launch()
        guest = await self.guest()
        guest.say(b"\xff\xfe\x00 nonsense\nCONNECT 99999999999:1\n" + b"x" * 100_000 + b"\n")
        guest.say(b"STARTED\n")
        await _until(lambda: b"CONNECT" in guest.received)
        self.assertEqual(guest.received, f"CONNECT 2:{self.port}\n".encode())
        self.assertEqual(self.lifecycle.running.agent_status("vm1"), AgentStatus.STARTED)


class FrozenVMTests(AgentLinkTestCase):
    """A frozen VM's agent cannot speak: its ring buffer is not read, even after a restart."""

    @_async
    async def test_frozenVMAdoptedAtDaemonStartIsNotPolled(self) -> None:
        await self.launch()
        await self.connected_guest()
        await self.wait(await self.lifecycle.act("vm1", "freeze"))
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        monitor = self.lifecycle.running.monitors["vm1"]
        await deferLater(reactor, 0.5, lambda: None)  # 25 follow-up intervals
        self.assertEqual(monitor.reads, 0)
        await self.wait(await self.lifecycle.act("vm1", "unfreeze"))
        await _until(lambda: monitor.reads > 0)


class SilentAgentTests(AgentLinkTestCase):
    """An agent that stops repeating its status is taken as stopped (killed with SIGKILL)."""

    @_async
    async def test_agentThatFallsSilentIsAnnouncedStopped(self) -> None:
        # Hung: seen on a safety read.
        self.guest_api_listens(self.lifecycle, silence_timeout=0.5, safety=0.2)
        await self.launch()
        await self.connected_guest()
        # ... and the guest says nothing more: no heartbeat.
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertEqual(self.agent_events()[-1], "instance-agent-stopped")


class ReadyTests(AgentLinkTestCase):
    """PATCH Ready/Started as the lifecycle carries it out, and every way Ready is cleared."""

    @_async
    async def test_readySetsTheKeyAndStatusAndAnnouncesEveryTime(self) -> None:
        await self.launch()
        record = await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(record.config[READY_KEY], "true")
        self.assertEqual((record.status.name, record.status.code), ("Ready", StatusCode.READY))
        await self.lifecycle.guestside.set_ready("vm1", True)
        ready_events = [a for a in self.lifecycle_actions("vm1") if a == "instance-ready"]
        self.assertEqual(len(ready_events), 2)

    @_async
    async def test_startedClearsReadyWithoutAnEvent(self) -> None:
        await self.launch()
        await self.lifecycle.guestside.set_ready("vm1", True)
        record = await self.lifecycle.guestside.set_ready("vm1", False)
        self.assertEqual(record.config[READY_KEY], "false")
        self.assertEqual(record.status.name, "Running")
        self.assertEqual(self.lifecycle_actions("vm1").count("instance-ready"), 1)

    @_async
    async def test_aStoppedInstanceCannotBeReady(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        with self.assertRaises(Conflict):
            await self.lifecycle.guestside.set_ready("vm1", True)

    @_async
    async def test_apiStopSetsReadyFalse(self) -> None:
        await self.launch()
        await self.lifecycle.guestside.set_ready("vm1", True)
        await self.wait(await self.lifecycle.act("vm1", "stop", timeout=STOP_TIMEOUT))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").config[READY_KEY], "false")

    @_async
    async def test_guestPowerOffSetsReadyFalse(self) -> None:
        await self.launch()
        await self.lifecycle.guestside.set_ready("vm1", True)
        await self.guest_control(b"poweroff\n")
        await _until(
            lambda: self.lifecycle.store.view.get_instance("vm1").status.name == "Stopped"
        )
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").config[READY_KEY], "false")

    @_async
    async def test_guestRebootClearsReadyAndTheAgentStartsOver(self) -> None:
        record = await self.launch()
        await self.connected_guest()
        await self.lifecycle.guestside.set_ready("vm1", True)
        state_dir = fakeqemu_guest_paths(self.lifecycle.specs.spec_for(record))["state_dir"]
        os.makedirs(state_dir, exist_ok=True)
        await self.guest_control(b"reboot\n")
        await _until(lambda: not self.lifecycle.store.view.get_instance("vm1").ready)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").config[READY_KEY], "false")
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").status.name, "Running")
        self.assertFalse(os.path.exists(state_dir))
        self.assertEqual(self.lifecycle.running.agent_status("vm1"), AgentStatus.UNKNOWN)
        self.assertEqual(self.agent_events()[-1], "instance-agent-stopped")
        # The new boot's agent is followed like the first one.
        await self.connected_guest()

    @_async
    async def test_guestShutdownStopsTheAgentAtOnce(self) -> None:
        await self.launch()
        await self.connected_guest()
        await self.guest_control(b"poweroff\n")
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)

    @_async
    async def test_vmKilledSetsReadyFalse(self) -> None:
        await self.launch()
        await self.lifecycle.guestside.set_ready("vm1", True)
        pid = self.lifecycle.running.vms["vm1"].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _until(lambda: self.lifecycle.store.view.get_instance("vm1").status.name == "Error")
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").config[READY_KEY], "false")

    @_async
    async def test_daemonStartRemovesTheKeyAndReadyCanBeDeclaredAgain(self) -> None:
        await self.launch()
        await self.connected_guest()
        await self.lifecycle.guestside.set_ready("vm1", True)
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertNotIn(READY_KEY, record.config)
        self.assertEqual(record.status.name, "Running")
        await self.lifecycle.guestside.set_ready(
            "vm1", True
        )  # what the agent does once it reconnected
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").status.name, "Ready")
