"""``python -m vmready.daemon.demo``: one fakeqemu VM, the agent handshake step by step.

A lower-level walk-through than the daemon: it starts a fakeqemu process
(daemonized, as the daemon starts QEMU) with vmready's own command line,
connects with vmready's QMP client, plays the guest agent through the VM's
guest sockets, and drives the handshake, printing each step: STARTED read
from the ring buffer, CONNECT written to the ``vmready.connect`` port's
socket (QEMU's ``ringbuf-write`` never reaches a guest), CONNECTED read back.
"""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
import uuid

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater, react

from vmready.domain import IVMReadyReactor
from vmready.hypervisor import AGENT_PORT, AGENT_RING, CONNECT_PORT, VMSpec, build_command_line
from vmready.protocols import AgentStatus, HostEcho, RingBufferReader, StatusLine, format_connect
from vmready.protocols.qmp import QMPClientProtocol, QMPEvent, connect_qmp

RING = AGENT_RING
RING_SIZE = 4096
DEMO_VSOCK_PORT = 49152


def demo_spec(workdir: str, name: str) -> VMSpec:
    """The demo VM: vmready's own serial layout, from the one command-line builder."""
    return VMSpec(
        name=name,
        uuid=str(uuid.uuid4()),
        memory_mib=256,
        cpus=1,
        run_dir=workdir,
        ring_size=RING_SIZE,
    )


def fakeqemu_command(spec: VMSpec) -> list[str]:
    """The QEMU command line vmready gives a VM, run on fakeqemu."""
    return build_command_line(spec, [sys.executable, "-m", "fakeqemu"])


class ScriptedGuest(Protocol):
    """Stands in for the in-guest agent: answers CONNECT with CONNECTED."""

    def __init__(self) -> None:
        self.received = b""
        self.connect_seen: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if b"\n" in self.received and not self.connect_seen.called:
            line, _, self.received = self.received.partition(b"\n")
            self.connect_seen.callback(line)

    def say(self, line: bytes) -> None:
        """Write one status line to the port."""
        assert self.transport is not None
        self.transport.write(line + b"\n")


def step(text: str) -> None:
    """Print one line of the walk-through."""
    print(f"  {text}", flush=True)


async def read_agent(client: QMPClientProtocol, reader: RingBufferReader) -> AgentStatus:
    """Drain the ring buffer once and return the agent status it shows."""
    chunk = await client.execute(
        "ringbuf-read", {"device": RING, "size": RING_SIZE, "format": "base64"}
    )
    for record in reader.feed(base64.b64decode(chunk), buffer_size=RING_SIZE):
        if isinstance(record, StatusLine):
            step(f"ring buffer: agent says {record.status.name}")
        elif isinstance(record, HostEcho):
            step(f"ring buffer: our own CONNECT {record.cid}:{record.port} echoed back, skipped")
    return reader.status


async def run_demo(reactor: IVMReadyReactor, workdir: str, name: str) -> None:
    """Start the VM, watch it, do the handshake, then shut it down."""
    os.makedirs(workdir, exist_ok=True)
    print(f"vmready demo: starting VM {name!r} on fakeqemu in {workdir}")
    spec = demo_spec(workdir, name)
    started = subprocess.run(fakeqemu_command(spec), capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(f"fakeqemu refused to start: {started.stderr.strip()}")
    client = await connect_qmp(reactor, spec.qmp_socket)
    events: list[QMPEvent] = []
    client.subscribe(events.append)
    status = await client.execute("query-status")
    step(f"QMP: connected to QEMU {client.greeting and client.greeting['version']['qemu']}")
    step(f"QMP: query-status → {status['status']}")

    guest = ScriptedGuest()
    ports = os.path.join(spec.guest_dir, "virtio-ports")
    await connectProtocol(UNIXClientEndpoint(reactor, os.path.join(ports, AGENT_PORT)), guest)
    replies = ScriptedGuest()
    await connectProtocol(UNIXClientEndpoint(reactor, os.path.join(ports, CONNECT_PORT)), replies)
    step(f"guest: agent opened /dev/virtio-ports/{AGENT_PORT} and {CONNECT_PORT}")
    guest.say(b"STARTED")

    reader = RingBufferReader()
    while await read_agent(client, reader) is not AgentStatus.STARTED:
        await deferLater(reactor, 0.05, lambda: None)
    connect = format_connect(2, DEMO_VSOCK_PORT)
    host = Protocol()
    await connectProtocol(UNIXClientEndpoint(reactor, spec.connect_socket), host)
    assert host.transport is not None
    host.transport.write(connect)
    step(f"host: wrote {connect.decode().strip()!r} to {CONNECT_PORT}")
    line = await replies.connect_seen
    step(f"guest: received {line.decode()!r}; reports CONNECTED")
    guest.say(b"CONNECTED")
    while await read_agent(client, reader) is not AgentStatus.CONNECTED:
        await deferLater(reactor, 0.05, lambda: None)
    step("host: agent link is CONNECTED")

    host.transport.loseConnection()
    await client.execute("quit")
    await client.when_closed()
    step(f"QMP events seen: {', '.join(e.name for e in events)}")
    print("vmready demo: VM shut down cleanly")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m vmready.daemon.demo``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workdir", default=os.path.abspath(".vmready-demo"))
    parser.add_argument("--name", default="demo")
    args = parser.parse_args(argv)
    react(lambda reactor: Deferred.fromCoroutine(run_demo(reactor, args.workdir, args.name)))


if __name__ == "__main__":
    main()
