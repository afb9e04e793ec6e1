"""What flows between a machine's guest and its host: chardevs and the guest's ends of them.

The chardev backends (ring buffers, ``file`` chardevs, unix sockets and the
host processes connected to them) and what the guest holds: its virtio serial
ports, its serial console (ttyS0) and its connections through guestfwd rules.
No I/O happens here: bytes for a guest go to whatever sink the guest attached,
bytes for a ``file`` chardev to the sink its runner opened.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from fakeqemu._config import MachineConfig
from fakeqemu._devices import SerialPortSpec
from fakeqemu._ringbuf import RingBuffer
from fakeqemu._runstate import MachineError

if TYPE_CHECKING:
    from fakeqemu._machine import Machine

# How much a socket chardev's client may send while no guest holds the port.
_PENDING_LIMIT = 1024 * 1024


class GuestSink(Protocol):
    """The guest's end of a port or of the control channel."""

    def write(self, data: bytes) -> None:
        """Deliver bytes to the guest."""

    def close(self) -> None:
        """The guest end goes away (reset, reboot, machine exit)."""


class ChardevFile(Protocol):
    """Where a ``file`` chardev's output goes: the file QEMU holds open for the VM's life."""

    def write(self, data: bytes) -> None:
        """Append bytes to the file."""

    def close(self) -> None:
        """The machine is gone."""


@attrs.define
class SerialPort:
    """One virtserialport: its spec, the ring buffer it is wired to, and the guest end."""

    spec: SerialPortSpec
    ringbuf: RingBuffer | None
    guest: GuestSink | None = None
    # A socket chardev's id, when the port is wired to one instead of a ring buffer.
    socket_chardev: str | None = None
    # Bytes the socket's client sent while no guest holds the port (QEMU reads them later).
    pending: bytearray = attrs.Factory(bytearray)

    @property
    def guest_name(self) -> str:
        """The name a Linux guest would see under /dev/virtio-ports/."""
        if self.spec.name:
            return self.spec.name
        return f"vport{self.spec.bus_name.replace('.', 'p')}n{self.spec.nr}"


class Wiring:
    """One machine's chardevs and the guest's ends of them.

    Nothing reaches a guest that is hung or a machine that is gone: the
    machine says which through its ``guest_hung`` and ``exited``.
    """

    def __init__(
        self,
        machine: Machine,
        config: MachineConfig,
        chardev_files: Mapping[str, ChardevFile],
    ) -> None:
        self._machine = machine
        self._config = config
        self.ringbufs = {spec.id: RingBuffer(spec.size) for spec in config.ringbufs}
        self._chardev_files = dict(chardev_files)
        missing = {spec.id for spec in config.file_chardevs} - set(self._chardev_files)
        if missing:
            raise ValueError(f"no file opened for the file chardevs {sorted(missing)}")
        # The guest's serial console (ttyS0): the processes that hold it open.
        self._consoles: list[GuestSink] = []
        # Guest connections through guestfwd rules (fakeqemu._guestfwd).
        self._forwards: list[GuestSink] = []
        self.socket_chardevs = {spec.id: spec for spec in config.socket_chardevs}
        # Each socket chardev's clients: the first is served, the others wait their turn.
        self._chardev_clients: dict[str, list[GuestSink]] = {}
        # What a waiting client sent before its turn, delivered once it is served.
        self._waiting_bytes: dict[int, bytearray] = {}
        self.ports = [
            SerialPort(
                spec,
                self.ringbufs.get(spec.chardev) if spec.chardev else None,
                socket_chardev=spec.chardev if spec.chardev in self.socket_chardevs else None,
            )
            for spec in config.serial_ports
        ]

    def _reachable(self) -> bool:
        return self._machine.exited is None and not self._machine.guest_hung

    def find_port(self, guest_name: str) -> SerialPort | None:
        """The port a guest opens by its /dev/virtio-ports/ name."""
        for port in self.ports:
            if port.guest_name == guest_name:
                return port
        return None

    def open_port(self, port: SerialPort, sink: GuestSink) -> bool:
        """The guest opens the port; a port is opened by one reader at a time.

        QEMU reports ``VSERPORT_CHANGE`` when the guest opens a port that has an
        ``id=``, and nothing for a port without one (measured with a Debian 6.1
        guest: opening and closing ``/dev/vport0p1`` gave open true, then false).
        """
        if port.guest is not None or not self._reachable():
            return False
        port.guest = sink
        self._port_changed(port, True)
        if port.pending:
            waiting, port.pending = bytes(port.pending), bytearray()
            sink.write(waiting)
        return True

    def close_port(self, port: SerialPort, sink: GuestSink) -> None:
        """The guest closed its end."""
        if port.guest is sink:
            port.guest = None
            if self._machine.exited is None:
                self._port_changed(port, False)

    def _port_changed(self, port: SerialPort, is_open: bool) -> None:
        if port.spec.device_id:
            # Measured key order: {"open": true, "id": "agentport"}.
            self._machine.emit("VSERPORT_CHANGE", {"open": is_open, "id": port.spec.device_id})

    def guest_wrote(self, port: SerialPort, data: bytes) -> None:
        """Bytes from the guest land in the wired ring buffer, the socket's client, or nowhere."""
        if not self._reachable():
            return
        if port.ringbuf is not None:
            port.ringbuf.write(data)
        elif port.socket_chardev is not None:
            client = self._served(port.socket_chardev)
            if client is not None:
                client.write(data)

    # -- socket chardevs (host side) --------------------------------------

    def _served(self, chardev_id: str) -> GuestSink | None:
        queue = self._chardev_clients.get(chardev_id)
        return queue[0] if queue else None

    def chardev_connected(self, chardev_id: str, sink: GuestSink) -> Callable[[], None] | None:
        """A host process connects to a socket chardev; returns the detacher (None: gone).

        One client is served at a time; a second waits, unserved, until the
        first leaves (QEMU 7.2 leaves it in the listen backlog: measured).
        """
        if self._machine.exited is not None or chardev_id not in self.socket_chardevs:
            return None
        self._chardev_clients.setdefault(chardev_id, []).append(sink)
        return lambda: self._chardev_disconnected(chardev_id, sink)

    def _chardev_disconnected(self, chardev_id: str, sink: GuestSink) -> None:
        queue = self._chardev_clients.get(chardev_id, [])
        was_served = bool(queue) and queue[0] is sink
        if sink in queue:
            queue.remove(sink)
        self._waiting_bytes.pop(id(sink), None)
        if was_served and queue:
            waiting = self._waiting_bytes.pop(id(queue[0]), None)
            if waiting:
                self._deliver_from_host(chardev_id, bytes(waiting))

    def host_wrote(self, chardev_id: str, sink: GuestSink, data: bytes) -> None:
        """A socket chardev's client sent bytes: to the guest's port, once it is served."""
        if self._machine.exited is not None:
            return
        if self._served(chardev_id) is not sink:
            self._waiting_bytes.setdefault(id(sink), bytearray()).extend(data)
            return
        self._deliver_from_host(chardev_id, data)

    def _deliver_from_host(self, chardev_id: str, data: bytes) -> None:
        for port in self.ports:
            if port.socket_chardev != chardev_id:
                continue
            if port.guest is not None and not self._machine.guest_hung:
                port.guest.write(data)
            elif len(port.pending) + len(data) <= _PENDING_LIMIT:
                # Nobody holds the port: QEMU leaves the bytes unread until someone does.
                port.pending.extend(data)

    def attach_console(self, sink: GuestSink) -> Callable[[], None] | None:
        """A guest process opens the serial console (ttyS0); returns the detacher.

        None when there is nothing to open: no ``-serial``, a hung guest, or a
        machine that is gone.  Several processes may hold a tty at once.
        """
        if self._config.serial_chardev is None or not self._reachable():
            return None
        self._consoles.append(sink)
        return lambda: self._consoles.remove(sink) if sink in self._consoles else None

    def attach_forward(self, sink: GuestSink) -> Callable[[], None] | None:
        """A guest process connects through a guestfwd rule; returns the detacher.

        None when no guest can connect (a hung guest, a machine that is gone).
        A reboot or the machine's exit closes the connection.
        """
        if not self._reachable():
            return None
        self._forwards.append(sink)
        return lambda: self._forwards.remove(sink) if sink in self._forwards else None

    def console_wrote(self, data: bytes) -> None:
        """A guest process wrote to ttyS0: the bytes go to the serial port's chardev."""
        chardev = self._config.serial_chardev
        if chardev is None or not self._reachable():
            return
        if chardev in self._chardev_files:
            self._chardev_files[chardev].write(data)
        else:
            self.ringbufs[chardev].write(data)

    def reset_guest(self) -> None:
        """The guest's devices reset: every process holding a port or the console is gone."""
        for port in self.ports:
            guest, port.guest = port.guest, None
            if guest is not None:
                self._port_changed(port, False)
                guest.close()
        self._close_consoles()

    def close(self) -> None:
        """The machine is gone: every guest end, file and host client closes.

        The process ends: no device is reset, so no VSERPORT_CHANGE.
        """
        for port in self.ports:
            guest, port.guest = port.guest, None
            if guest is not None:
                guest.close()
        self._close_consoles()
        for chardev_file in self._chardev_files.values():
            chardev_file.close()
        clients, self._chardev_clients = self._chardev_clients, {}
        for queue in clients.values():
            for client in queue:
                client.close()

    def _close_consoles(self) -> None:
        consoles, self._consoles = self._consoles, []
        forwards, self._forwards = self._forwards, []
        for sink in [*consoles, *forwards]:
            sink.close()

    # -- ring buffers and the monitor's view ------------------------------

    def replace_ringbuf(self, device: str, ring: RingBuffer) -> RingBuffer:
        """Put ``ring`` in place of the ring buffer chardev ``device``; returns the replaced one.

        The ports wired to it use the new one from now on.  For tools that
        script what a ring buffer holds (``vmready replay``): a subclass of
        ``RingBuffer`` whose ``read`` returns recorded bytes, say.
        """
        original = self.ringbuf_device(device)
        self.ringbufs[device] = ring
        for port in self.ports:
            if port.ringbuf is original:
                port.ringbuf = ring
        return original

    def ringbuf_device(self, device: str) -> RingBuffer:
        """The ring buffer chardev named ``device``, with QEMU's lookup errors."""
        if device in self.ringbufs:
            return self.ringbufs[device]
        if (
            device in self.monitor_labels()
            or device in self._chardev_files
            or device in self.socket_chardevs
        ):
            raise MachineError(f"{device} is not a ringbuf device")
        raise MachineError(f"Device '{device}' not found")

    def monitor_labels(self) -> list[str]:
        """Chardev labels QEMU gives its QMP monitors."""
        return [f"compat_monitor{i}" for i in range(len(self._config.qmp_sockets))]

    def ringbuf_read(self, device: str, size: int) -> bytes:
        """``ringbuf-read``: drain up to ``size`` bytes."""
        ring = self.ringbuf_device(device)
        if size <= 0:
            raise MachineError("size must be greater than zero")
        return ring.read(size)

    def ringbuf_write(self, device: str, data: bytes) -> None:
        """``ringbuf-write``: append to the buffer, and nothing more.

        The host reads its own bytes back with ``ringbuf-read``; no guest ever
        sees them: QEMU's ring buffer has no path from the host to the guest
        (``qmp_ringbuf_write`` only fills the buffer; measured with a real guest).
        """
        self.ringbuf_device(device).write(data)

    def query_chardev(self) -> list[dict[str, Any]]:
        """``query-chardev``: ring buffers and files, then the monitors.

        A ring buffer on a virtio port is open while a guest holds the port; a
        chardev behind the serial port is open from the start (measured).
        """
        result: list[dict[str, Any]] = []
        serial = self._config.serial_chardev
        for spec in self._config.ringbufs:
            ring = self.ringbufs[spec.id]
            open_ = spec.id == serial or any(
                p.ringbuf is ring and p.guest is not None for p in self.ports
            )
            result.append({"frontend-open": open_, "filename": "ringbuf", "label": spec.id})
        for file_spec in self._config.file_chardevs:
            result.append(
                {
                    "frontend-open": file_spec.id == serial,
                    "filename": "file",
                    "label": file_spec.id,
                }
            )
        for socket_spec in self._config.socket_chardevs:
            served = "" if self._served(socket_spec.id) is not None else "disconnected:"
            result.append(
                {
                    "frontend-open": any(
                        p.socket_chardev == socket_spec.id and p.guest is not None
                        for p in self.ports
                    ),
                    "filename": f"{served}unix:{socket_spec.path},server=on",
                    "label": socket_spec.id,
                }
            )
        for label, path in zip(self.monitor_labels(), self._config.qmp_sockets, strict=True):
            result.append(
                {"frontend-open": True, "filename": f"unix:{path},server=on", "label": label}
            )
        return result
