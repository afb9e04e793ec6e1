"""``VSERPORT_CHANGE`` as a guest program causes it: the same checks on real QEMU and fakeqemu.

The agent link is driven by this event (the daemon reads the agent's ring
buffer when the guest opens or closes its port), so fakeqemu must emit it
exactly when QEMU does: only for a port with an ``id=``, on the guest's open
and on its close, with that id, nothing for a port without one, and at most
one a second per port (QEMU's rate limit on guest-triggerable events: the
first at once, then only the last of a second's changes, at its end).

One guest program does the same on both backends:

1. opens the port *without* an id (unwired, as the legacy name is) and closes
   it (writing to it would block in a real guest: no host end is connected);
2. opens the agent's port (with an id, on the ring buffer), writes
   ``STARTED``, closes it: the open is sent at once, the close a second later;
3. after 2.5 s opens it again, writes ``CONNECTED``, holds it 1.5 s, closes
   it: both sent at once (each in a period of its own);
4. 0.3 s later opens and closes it twice in a row: only the last close is
   sent, at the end of the period the previous close began;
5. powers the VM off 2 s later.

On real QEMU the program is the ``/init`` of a real Linux guest: the demo
guest's kernel and initramfs (its busybox and modules), with this ``/init``
appended as a second archive, booted under TCG.  On fakeqemu the check plays
the guest through its guest sockets.  Both must show the same events, in the
same order, and the same ring-buffer contents.
"""

from __future__ import annotations

import abc
import stat

from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.task import deferLater

from tests.conformance.checks import BackendTestCase, GuestEnd, _async
from tests.conformance.support import (
    AGENT_PORT,
    AGENT_RING,
    LEGACY_PORT,
    EventLog,
    base_arguments,
    cannot_run,
    monitor,
    start_daemonized,
)
from tests.reactor import reactor
from vmready.hypervisor.guestimage.initramfs import ArchiveEntry, newc_archive
from vmready.protocols.qmp import QMPClientProtocol

# The guest's /init: load the demo initramfs's modules, run the program, power off.
GUEST_PROGRAM = r"""#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
while read -r module; do
    insmod "/lib/modules/$module.ko" 2>/dev/null
done </lib/modules/load-order
port() {
    for entry in /sys/class/virtio-ports/*; do
        [ "$(cat "$entry/name" 2>/dev/null)" = "$1" ] && echo "/dev/${entry##*/}"
    done
}
tries=0
while [ -z "$(port {agent})" ] || [ -z "$(port {legacy})" ]; do
    tries=$((tries + 1))
    [ "$tries" -le 100 ] || { echo "conformance: no virtio ports"; poweroff -f; }
    sleep 0.1
done
echo "conformance: ports $(port {legacy}) $(port {agent})"
exec 4>"$(port {legacy})"
exec 4>&-
echo "STARTED" > "$(port {agent})"
sleep 2.5
exec 3>"$(port {agent})"
echo "CONNECTED" >&3
sleep 1.5
exec 3>&-
sleep 0.3
exec 3>"$(port {agent})"
exec 3>&-
exec 3>"$(port {agent})"
exec 3>&-
sleep 2
echo "conformance: done"
poweroff -f
""".replace("{agent}", AGENT_PORT).replace("{legacy}", LEGACY_PORT)

# Only the agent's port has an id; the legacy one is unwired and has none.
PORTS = [
    "-device",
    "virtio-serial-pci,id=vs0",
    "-chardev",
    f"ringbuf,id={AGENT_RING},size=4096",
    "-device",
    f"virtserialport,chardev={AGENT_RING},name={AGENT_PORT},bus=vs0.0,id={AGENT_PORT}",
    "-device",
    f"virtserialport,name={LEGACY_PORT},bus=vs0.0",
]
EXPECTED_EVENTS = [
    ("VSERPORT_CHANGE", {"open": is_open, "id": AGENT_PORT})
    for is_open in (True, False, True, False, False)
]


class PortEventChecks(BackendTestCase):
    """The guest program above, and the events and ring-buffer bytes it leaves."""

    events: EventLog

    @abc.abstractmethod
    async def run_guest_program(self) -> QMPClientProtocol:
        """Start the VM and have its guest run the program; the monitor (events followed)."""

    @abc.abstractmethod
    async def finish(self, client: QMPClientProtocol) -> None:
        """After the checks: the guest powers off (QEMU), or the VM is told to quit."""

    @_async
    async def test_portEventsFollowTheGuestsOpensAndCloses(self) -> None:
        client = await self.run_guest_program()
        await self.port_events(len(EXPECTED_EVENTS))
        # Read before the guest powers off (it waits 2 s after its last close).
        read = await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 4096})
        await self.finish(client)
        events = [
            (event.name, event.data)
            for event in self.events.events
            if event.name == "VSERPORT_CHANGE"
        ]
        self.assertEqual(events, EXPECTED_EVENTS)
        self.assertEqual([list(data) for _, data in events], [["open", "id"]] * 5)
        self.assertEqual(read, "STARTED\nCONNECTED\n")

    def follow(self, client: QMPClientProtocol) -> None:
        """Collect ``client``'s events from now on."""
        self.events = EventLog(client)

    def diagnosis(self) -> str:
        """What to show when the events do not come (the guest's console, say)."""
        return ""

    async def port_events(self, count: int, timeout: float = 90.0) -> None:
        """Wait until ``count`` VSERPORT_CHANGE events have arrived (bounded)."""
        for _ in range(int(timeout / 0.05)):
            if self.events.names().count("VSERPORT_CHANGE") >= count:
                return
            await deferLater(reactor, 0.05, lambda: None)
        self.fail(
            f"{count} VSERPORT_CHANGE events did not arrive: "
            f"{[(event.name, event.data) for event in self.events.events]}"
            f"{self.diagnosis()}"
        )


class FakeQemuPortEventChecks(PortEventChecks):
    """fakeqemu, its guest played through the guest sockets."""

    async def open_port(self, name: str) -> GuestEnd:
        guest = GuestEnd()
        path = self.workspace.file(f"qmp.sock.guest/virtio-ports/{name}")
        await connectProtocol(UNIXClientEndpoint(reactor, path), guest)
        self.addCleanup(guest.hang_up)
        return guest

    async def close(self, guest: GuestEnd) -> None:
        """Close as a guest process does: over once close() returns (read by fakeqemu)."""
        guest.hang_up()
        await self.sleep(0.05)

    async def sleep(self, seconds: float) -> None:
        await deferLater(reactor, seconds, lambda: None)

    async def run_guest_program(self) -> QMPClientProtocol:
        socket_path = start_daemonized(self.backend, self.workspace, [*base_arguments(), *PORTS])
        client = await monitor(socket_path)
        self.addCleanup(client.close)
        self.follow(client)
        legacy = await self.open_port(LEGACY_PORT)
        await self.close(legacy)
        agent = await self.open_port(AGENT_PORT)
        agent.send(b"STARTED\n")
        await self.close(agent)
        await self.sleep(2.5)
        agent = await self.open_port(AGENT_PORT)
        agent.send(b"CONNECTED\n")
        await self.sleep(1.5)
        await self.close(agent)
        await self.sleep(0.3)
        for _ in range(2):
            await self.close(await self.open_port(AGENT_PORT))
        return client

    async def finish(self, client: QMPClientProtocol) -> None:
        await client.execute("quit")


class QemuPortEventChecks(PortEventChecks):
    """Real QEMU with a real Linux guest running the program as its /init."""

    def setUp(self) -> None:
        super().setUp()
        from vmready.hypervisor.guestimage.build import ensure_guest
        from vmready.hypervisor.guestimage.cache import default_cache_dir
        from vmready.hypervisor.guestimage.commands import GuestImageError

        try:
            self.guest = ensure_guest(default_cache_dir(), log=lambda line: None)
        except (GuestImageError, OSError) as e:  # the build needs packages and tools
            cannot_run(self, f"the demo guest cannot be built here: {e}")

    def initrd(self) -> str:
        """The demo initramfs with this check's /init appended (the later archive wins)."""
        with open(self.guest.initrd, "rb") as f:
            demo = f.read()
        init = ArchiveEntry("init", stat.S_IFREG | 0o755, GUEST_PROGRAM.encode())
        path = self.workspace.file("initrd.img")
        with open(path, "wb") as f:
            f.write(demo + newc_archive([init]))
        return path

    async def run_guest_program(self) -> QMPClientProtocol:
        arguments = [
            *base_arguments(accel="tcg"),
            "-m",
            "256",
            "-no-reboot",
            "-kernel",
            self.guest.vmlinux or self.guest.kernel,
            "-initrd",
            self.initrd(),
            "-append",
            "console=ttyS0 panic=-1 quiet",
            "-serial",
            f"file:{self.workspace.file('console.log')}",
            "-S",
            *PORTS,
        ]
        socket_path = start_daemonized(self.backend, self.workspace, arguments)
        client = await monitor(socket_path)
        self.addCleanup(client.close)
        self.follow(client)
        await client.execute("cont")
        return client

    def diagnosis(self) -> str:
        console = self.workspace.read("console.log") or ""
        return f"; the guest's console ends: {console[-1500:]!r}"

    async def finish(self, client: QMPClientProtocol) -> None:
        await self.events.wait_for("SHUTDOWN", timeout=60.0)
        console = self.workspace.read("console.log") or ""
        self.assertIn("conformance: done", console, console[-2000:])
