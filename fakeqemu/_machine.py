"""The emulated machine: run state, chardevs, virtio serial ports, the guest, events, migration.

No I/O happens here.  Time comes from an injected ``IReactorTime``; events go
to subscribers; bytes for a guest go to whatever sink the guest attached; bytes
for a ``file`` chardev go to the sink its runner opened; the process-level
effects (exit, files) are requested through callbacks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
from twisted.internet.interfaces import IReactorTime

from fakeqemu._cmdline import MachineConfig, SerialPortSpec
from fakeqemu._migration import IncomingMigrationError, check_incoming, serialize_state
from fakeqemu._ringbuf import RingBuffer
from fakeqemu._throttle import EventThrottle

Event = dict[str, Any]
EventListener = Callable[[Event], None]
ExitHandler = Callable[[int, list[str]], None]

MIGRATION_CAPABILITIES = (
    "xbzrle",
    "rdma-pin-all",
    "auto-converge",
    "zero-blocks",
    "compress",
    "events",
    "postcopy-ram",
    "x-colo",
    "release-ram",
    "block",
    "return-path",
    "pause-before-switchover",
    "multifd",
    "dirty-bitmaps",
    "postcopy-blocktime",
    "late-block-activate",
    "x-ignore-shared",
    "validate-uuid",
    "background-snapshot",
    "zero-copy-send",
    "postcopy-preempt",
)


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


# How much a socket chardev's client may send while no guest holds the port.
_PENDING_LIMIT = 1024 * 1024
# pvpanic's ``events`` bit for a guest kernel panic (bit 1 is "crash loaded").
PVPANIC_PANICKED = 1


class RunState(enum.Enum):
    """QEMU's run states, as ``query-status`` names them."""

    PRELAUNCH = "prelaunch"
    RUNNING = "running"
    PAUSED = "paused"
    SHUTDOWN = "shutdown"
    INMIGRATE = "inmigrate"
    POSTMIGRATE = "postmigrate"
    GUEST_PANICKED = "guest-panicked"


class MachineError(Exception):
    """A command failed; the QMP layer reports it as ``GenericError`` with this text."""


@attrs.define
class SerialPort:
    """One virtserialport: its spec, the ring buffer it is wired to, and the guest end."""

    spec: SerialPortSpec
    ringbuf: RingBuffer | None
    guest: GuestSink | None = None
    # A socket chardev's id, when the port is wired to one instead of a ring buffer.
    socket_chardev: str | None = None
    # Bytes the socket's client sent while no guest held the port (QEMU reads them later).
    pending: bytearray = attrs.Factory(bytearray)

    @property
    def guest_name(self) -> str:
        """The name a Linux guest would see under /dev/virtio-ports/."""
        if self.spec.name:
            return self.spec.name
        return f"vport{self.spec.bus_name.replace('.', 'p')}n{self.spec.nr}"


class Machine:
    """A virtual machine as QMP and a guest see it."""

    def __init__(
        self,
        config: MachineConfig,
        clock: IReactorTime,
        exit_handler: ExitHandler | None = None,
        chardev_files: Mapping[str, ChardevFile] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self._exit_handler = exit_handler
        self.ringbufs = {spec.id: RingBuffer(spec.size) for spec in config.ringbufs}
        self._chardev_files = dict(chardev_files or {})
        missing = {spec.id for spec in config.file_chardevs} - set(self._chardev_files)
        if missing:
            raise ValueError(f"no file opened for the file chardevs {sorted(missing)}")
        # The guest's serial console (ttyS0): the processes that hold it open.
        self._consoles: list[GuestSink] = []
        # Guest connections through guestfwd rules (fakeqemu._guestfwd).
        self._forwards: list[GuestSink] = []
        # A guest kernel that panicked without a pvpanic device to tell the host: it hangs.
        self.guest_hung = False
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
        self._listeners: list[EventListener] = []
        self._throttle = EventThrottle(clock, self._send)
        self._controllers: list[GuestSink] = []
        self._capabilities = dict.fromkeys(MIGRATION_CAPABILITIES, False)
        self.migration: dict[str, Any] = {}
        self.exited: int | None = None
        # Whether the vCPUs start once an incoming migration completes (QEMU's autostart).
        self._autostart = not config.start_paused
        if config.incoming_path is not None:
            self.run_state = RunState.INMIGRATE
        elif config.start_paused:
            self.run_state = RunState.PRELAUNCH
        else:
            self.run_state = RunState.RUNNING

    # -- events -----------------------------------------------------------

    def subscribe(self, listener: EventListener) -> Callable[[], None]:
        """Deliver every future event to ``listener``; returns the unsubscriber."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def emit(self, name: str, data: dict[str, Any] | None = None) -> None:
        """Send an event to every subscriber, stamped as QEMU stamps them."""
        seconds, microseconds = divmod(round(self.clock.seconds() * 1_000_000), 1_000_000)
        event: Event = {
            "timestamp": {"seconds": seconds, "microseconds": microseconds},
            "event": name,
        }
        if data is not None:
            event["data"] = data
        # Guest-triggerable events are rate-limited as QEMU limits them (stamped now, sent
        # now or at the end of their one-second period).
        self._throttle.offer(event)

    def _send(self, event: Event) -> None:
        for listener in list(self._listeners):
            listener(event)

    # -- run state --------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the vCPUs run."""
        return self.run_state is RunState.RUNNING

    def query_status(self) -> dict[str, Any]:
        """``query-status``."""
        return {"status": self.run_state.value, "singlestep": False, "running": self.running}

    def cont(self) -> None:
        """``cont``: resume the vCPUs (during an incoming migration: once it completes)."""
        if self.run_state is RunState.INMIGRATE:
            self._autostart = True
            return
        if self.run_state in (RunState.SHUTDOWN, RunState.GUEST_PANICKED):
            raise MachineError("Resetting the Virtual Machine is required")
        if self.running:
            return
        self.run_state = RunState.RUNNING
        self.emit("RESUME")

    def stop(self) -> None:
        """``stop``: pause the vCPUs (during an incoming migration: keep them paused)."""
        if self.run_state is RunState.INMIGRATE:
            self._autostart = False
        elif self.running:
            self.run_state = RunState.PAUSED
            self.emit("STOP")

    def system_reset(self) -> None:
        """``system_reset``: the guest reboots, so its open ports close.

        QEMU resets the devices before it announces RESET, so a port with an id
        that the guest held reports ``VSERPORT_CHANGE`` (closed) first.
        """
        self._reboot_guest()
        self.emit("RESET", {"guest": False, "reason": "host-qmp-system-reset"})

    def system_powerdown(self) -> None:
        """``system_powerdown``: press the ACPI button; a guest may react (a hung one cannot)."""
        self.emit("POWERDOWN")
        if self.guest_hung:
            return
        for controller in list(self._controllers):
            controller.write(b"POWERDOWN\n")

    def quit(self) -> None:
        """``quit``: QEMU announces SHUTDOWN, answers, then exits."""
        self.emit("SHUTDOWN", {"guest": False, "reason": "host-qmp-quit"})
        self.clock.callLater(0, self.exit, 0, [])

    def terminate_on_signal(self, signal_number: int) -> None:
        """SIGTERM/SIGINT/SIGHUP to QEMU: SHUTDOWN with reason host-signal, then exit."""
        self.emit("SHUTDOWN", {"guest": False, "reason": "host-signal"})
        self.exit(0, [f"terminating on signal {signal_number}"])

    def exit(self, status: int, stderr_lines: list[str]) -> None:
        """Stop the machine for good; the runner closes sockets and ends the process."""
        if self.exited is not None:
            return
        self.exited = status
        self.run_state = RunState.SHUTDOWN
        self._throttle.stop()
        # The process ends: no device is reset, so no VSERPORT_CHANGE.
        self._close_guest_ends()
        for controller in list(self._controllers):
            controller.close()
        self._controllers.clear()
        for chardev_file in self._chardev_files.values():
            chardev_file.close()
        clients, self._chardev_clients = self._chardev_clients, {}
        for queue in clients.values():
            for client in queue:
                client.close()
        if self._exit_handler is not None:
            self._exit_handler(status, stderr_lines)

    # -- guest side -------------------------------------------------------

    def guest_actions(self) -> dict[str, Callable[[], None]]:
        """What a guest can do through its control socket."""
        return {
            "poweroff": self.guest_poweroff,
            "reboot": self.guest_reboot,
            "panic": self.guest_panic,
        }

    def guest_poweroff(self) -> None:
        """The guest OS powers itself off: SHUTDOWN from the guest, and QEMU exits."""
        self.emit("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"})
        self.clock.callLater(0, self.exit, 0, [])

    def guest_reboot(self) -> None:
        """The guest OS reboots: its devices reset (ports close), then QEMU reports RESET."""
        self._reboot_guest()
        self.emit("RESET", {"guest": True, "reason": "guest-reset"})

    def guest_panic(self) -> None:
        """The guest kernel panics.

        With a pvpanic device the kernel tells QEMU, and QEMU 7.2's default
        ``-action panic=shutdown`` follows.  Measured with a Debian 6.1 guest
        (``echo c > /proc/sysrq-trigger``, pvpanic-mmio loaded): GUEST_PANICKED
        with action poweroff, then SHUTDOWN guest-panic, exit 0 -- and no STOP:
        the vCPU only requests the stop, and QEMU exits before it handles the
        request.  (A panic written from the main thread, through qtest, does
        show STOP between the two.)  Without a pvpanic device the host sees
        nothing, as on real QEMU: the kernel hangs, or with ``panic=N`` on its
        command line (``-append``) reboots N seconds later (N < 0: at once).
        Measured without pvpanic and with ``panic=3``: no event, then RESET
        (guest, guest-reset) about three seconds later.  fakeqemu does not add
        the firmware's second RESET that followed it.
        """
        events = self.config.pvpanic_events
        if events is not None and events & PVPANIC_PANICKED:
            self.emit("GUEST_PANICKED", {"action": "poweroff"})
            self.emit("SHUTDOWN", {"guest": True, "reason": "guest-panic"})
            self.clock.callLater(0, self.exit, 0, [])
            return
        self.guest_hung = True
        timeout = self.config.kernel.panic_timeout() if self.config.kernel is not None else 0
        if timeout:
            self.clock.callLater(max(timeout, 0), self._reboot_after_panic)

    def _reboot_after_panic(self) -> None:
        if self.exited is None and self.guest_hung:
            self.guest_reboot()

    def attach_controller(self, sink: GuestSink) -> Callable[[], None]:
        """A guest's power management listens for ACPI events; returns the detacher."""
        self._controllers.append(sink)
        return lambda: self._controllers.remove(sink) if sink in self._controllers else None

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
        if port.guest is not None or self.exited is not None or self.guest_hung:
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
            if self.exited is None:
                self._port_changed(port, False)

    def _port_changed(self, port: SerialPort, is_open: bool) -> None:
        if port.spec.device_id:
            # Measured key order: {"open": true, "id": "agentport"}.
            self.emit("VSERPORT_CHANGE", {"open": is_open, "id": port.spec.device_id})

    def guest_wrote(self, port: SerialPort, data: bytes) -> None:
        """Bytes from the guest land in the wired ring buffer, the socket's client, or nowhere."""
        if self.exited is not None or self.guest_hung:
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
        if self.exited is not None or chardev_id not in self.socket_chardevs:
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
        if self.exited is not None:
            return
        if self._served(chardev_id) is not sink:
            self._waiting_bytes.setdefault(id(sink), bytearray()).extend(data)
            return
        self._deliver_from_host(chardev_id, data)

    def _deliver_from_host(self, chardev_id: str, data: bytes) -> None:
        for port in self.ports:
            if port.socket_chardev != chardev_id:
                continue
            if port.guest is not None and not self.guest_hung:
                port.guest.write(data)
            elif len(port.pending) + len(data) <= _PENDING_LIMIT:
                # Nobody holds the port: QEMU leaves the bytes unread until someone does.
                port.pending.extend(data)

    def attach_console(self, sink: GuestSink) -> Callable[[], None] | None:
        """A guest process opens the serial console (ttyS0); returns the detacher.

        None when there is nothing to open: no ``-serial``, a hung guest, or a
        machine that is gone.  Several processes may hold a tty at once.
        """
        if self.config.serial_chardev is None or self.exited is not None or self.guest_hung:
            return None
        self._consoles.append(sink)
        return lambda: self._consoles.remove(sink) if sink in self._consoles else None

    def attach_forward(self, sink: GuestSink) -> Callable[[], None] | None:
        """A guest process connects through a guestfwd rule; returns the detacher.

        None when no guest can connect (a hung guest, a machine that is gone).
        A reboot or the machine's exit closes the connection.
        """
        if self.exited is not None or self.guest_hung:
            return None
        self._forwards.append(sink)
        return lambda: self._forwards.remove(sink) if sink in self._forwards else None

    def console_wrote(self, data: bytes) -> None:
        """A guest process wrote to ttyS0: the bytes go to the serial port's chardev."""
        chardev = self.config.serial_chardev
        if chardev is None or self.exited is not None or self.guest_hung:
            return
        if chardev in self._chardev_files:
            self._chardev_files[chardev].write(data)
        else:
            self.ringbufs[chardev].write(data)

    def _reboot_guest(self) -> None:
        """The guest's devices reset: every process holding a port or the console is gone."""
        self.guest_hung = False
        for port in self.ports:
            guest, port.guest = port.guest, None
            if guest is not None:
                self._port_changed(port, False)
                guest.close()
        self._close_consoles()

    def _close_guest_ends(self) -> None:
        for port in self.ports:
            guest, port.guest = port.guest, None
            if guest is not None:
                guest.close()
        self._close_consoles()

    def _close_consoles(self) -> None:
        consoles, self._consoles = self._consoles, []
        forwards, self._forwards = self._forwards, []
        for sink in [*consoles, *forwards]:
            sink.close()

    # -- chardevs ---------------------------------------------------------

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
        return [f"compat_monitor{i}" for i in range(len(self.config.qmp_sockets))]

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
        serial = self.config.serial_chardev
        for spec in self.config.ringbufs:
            ring = self.ringbufs[spec.id]
            open_ = spec.id == serial or any(
                p.ringbuf is ring and p.guest is not None for p in self.ports
            )
            result.append({"frontend-open": open_, "filename": "ringbuf", "label": spec.id})
        for file_spec in self.config.file_chardevs:
            result.append(
                {
                    "frontend-open": file_spec.id == serial,
                    "filename": "file",
                    "label": file_spec.id,
                }
            )
        for socket_spec in self.config.socket_chardevs:
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
        for label, path in zip(self.monitor_labels(), self.config.qmp_sockets, strict=True):
            result.append(
                {"frontend-open": True, "filename": f"unix:{path},server=on", "label": label}
            )
        return result

    # -- migration --------------------------------------------------------

    def query_migrate_capabilities(self) -> list[dict[str, Any]]:
        """``query-migrate-capabilities``."""
        return [{"state": v, "capability": k} for k, v in self._capabilities.items()]

    def set_migrate_capability(self, capability: str, state: bool) -> None:
        """One entry of ``migrate-set-capabilities``."""
        if capability not in self._capabilities:
            raise MachineError(f"Parameter 'capability' does not accept value '{capability}'")
        self._capabilities[capability] = state

    def _migration_event(self, status: str) -> None:
        self.migration = {"status": status}
        if self._capabilities["events"]:
            self.emit("MIGRATION", {"status": status})

    def migrate(self, uri: str, write_file: Callable[[str, bytes], None]) -> None:
        """``migrate`` to ``exec:cat > PATH``: save the state, leaving the VM in postmigrate."""
        if self.run_state is RunState.POSTMIGRATE:
            raise MachineError("Can't migrate the vm that was paused due to previous migration")
        if self.run_state is RunState.INMIGRATE:
            raise MachineError("Guest is waiting for an incoming migration")
        self._migration_event("setup")
        path = _exec_cat_target(uri)
        if path is None:
            # QEMU enters setup before it looks at the URI, then fails the migration.
            self._migration_event("failed")
            raise MachineError("Parameter 'uri' expects a valid migration protocol")
        self.clock.callLater(0, self._finish_migration, path, write_file)

    def _finish_migration(self, path: str, write_file: Callable[[str, bytes], None]) -> None:
        if self.exited is not None:
            return
        started = self.clock.seconds()
        if self._capabilities["events"]:
            self.emit("MIGRATION_PASS", {"pass": 1})
        self._migration_event("active")
        was_running = self.running
        state = serialize_state(self.config, {k: v.peek() for k, v in self.ringbufs.items()})
        try:
            write_file(path, state)
        except OSError:
            self._migration_event("failed")
            self.migration["error-desc"] = "Unable to write to command: Broken pipe"
            return
        if was_running:
            self.run_state = RunState.PAUSED
            self.emit("STOP")
        self.run_state = RunState.POSTMIGRATE
        if self._capabilities["events"]:
            self.emit("MIGRATION_PASS", {"pass": 2})
        self._migration_event("completed")
        total_ms = int((self.clock.seconds() - started) * 1000)
        self.migration.update(
            {
                "setup-time": 0,
                "downtime": 0,
                "total-time": total_ms,
                "ram": {"total": self.config.memory_bytes, "transferred": len(state)},
            }
        )

    def load_incoming(self, data: bytes) -> None:
        """Finish ``-incoming``: resume from the state, or exit 1 with QEMU's lines."""
        try:
            check_incoming(self.config, self.config.incoming_path or "", data)
        except IncomingMigrationError as e:
            self.exit(1, e.lines)
            return
        self.migration = {"status": "completed"}
        if not self._autostart:
            self.run_state = RunState.PAUSED
        else:
            self.run_state = RunState.RUNNING
            self.emit("RESUME")


def _exec_cat_target(uri: str) -> str | None:
    prefix = "exec:cat >"
    if not uri.startswith(prefix):
        return None
    path = uri[len(prefix) :].strip()
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        path = path[1:-1]
    return path or None
