"""The running agent: the handshake core wired to the serial port, the host and the socket.

``Agent`` carries out what ``AgentCore`` decides, on an asyncio loop: it writes
status lines through the ``SerialKeeper``, says its status every heartbeat,
dials the host (after the delay the core asked for, abandoning a dial the core
gave up on), holds the link watch, reasserts a remembered Ready on every new
link, and answers the devlxd proxy's question "where is the host now?".
``build_agent`` puts the real pieces together from an ``AgentConfig``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Callable

from vmready.agent.apisocket import (
    bind_socket,
    prepare_socket_path,
    remove_own_socket,
    socket_identity,
)
from vmready.agent.bootdata import BootData
from vmready.agent.boottimes import BootTimeline, process_start
from vmready.agent.config import AgentConfig
from vmready.agent.connectport import ConnectPortReader
from vmready.agent.core import (
    AbandonDial,
    AgentCore,
    CloseLink,
    Command,
    Dial,
    HostAddress,
    ReassertReady,
    WriteStatus,
)
from vmready.agent.firstword import FirstWord
from vmready.agent.host import (
    HostConnector,
    HostEndpoint,
    HostRefused,
    LinkWatch,
    describe_failure,
    open_link,
    patch_state,
)
from vmready.agent.logs import logger
from vmready.agent.memory import ReadyMemory
from vmready.agent.options import ConfigError
from vmready.agent.ports import FoundPort, find_port
from vmready.agent.proxy import GuestAPIProxy, HostRoute, HostUnreachable
from vmready.agent.sdnotify import ServiceManager, from_os_environment
from vmready.agent.serial import SerialKeeper
from vmready.agent.tls import TLSConfigError, client_context, pinned_der
from vmready.protocols import AgentStatus

if TYPE_CHECKING:
    from vmready.agent.recording import AgentRecorder

# Connect, TLS, GET /1.0 and the event stream's headers, together.
DIAL_TIMEOUT = 15.0

log = logger(__name__)

Dialer = Callable[[HostAddress], Awaitable[LinkWatch]]
Reasserter = Callable[[HostAddress], Awaitable[None]]
Deliverer = Callable[[HostAddress, str], Awaitable[None]]


class Agent:
    """The in-guest agent: serial handshake, link to the host, Ready memory, devlxd socket."""

    def __init__(
        self,
        core: AgentCore,
        endpoint_for: Callable[[HostAddress], HostEndpoint],
        describe: Callable[[HostAddress], str],
        memory: ReadyMemory,
        heartbeat: float,
        dial_timeout: float = DIAL_TIMEOUT,
        dial: Dialer | None = None,
        reassert: Reasserter | None = None,
        recorder: AgentRecorder | None = None,
        deliver: Deliverer | None = None,
        boot_data: BootData | None = None,
        manager: ServiceManager | None = None,
        timeline: BootTimeline | None = None,
    ) -> None:
        """Add the serial keeper with ``attach_serial`` and the socket with ``attach_socket``.

        ``dial`` opens a validated link, ``reassert`` sends Ready again, ``deliver``
        sends a state the workload declared while the host was unreachable
        (defaults: ``open_link`` and ``patch_state`` on ``endpoint_for``'s endpoint).
        ``boot_data`` answers what it can while the link is down; ``manager`` is
        told when the socket serves (default: nobody); ``timeline`` dates this
        process's first STARTED and CONNECTED on the console (default: from now).
        """
        self.core = core
        self.endpoint_for = endpoint_for
        self.describe = describe
        self.memory = memory
        self.heartbeat = heartbeat
        self.dial_timeout = dial_timeout
        self.dial: Dialer = dial or self._open_link
        self.reassert: Reasserter = reassert or functools.partial(self._patch_state, state="Ready")
        self.deliver: Deliverer = deliver or self._patch_state
        self.recorder = recorder
        self.serial: SerialKeeper | None = None
        self._first_word: FirstWord | None = None
        self.connect_port: ConnectPortReader | None = None
        self.boot_data = boot_data
        self.manager = manager or ServiceManager()
        self.timeline = timeline or BootTimeline()
        self.proxy = GuestAPIProxy(
            self.route,
            self.remember_state,
            hold_state=self.hold_state,
            local=boot_data.answer if boot_data is not None else None,
        )
        self.socket_path: str | None = None
        self.exit_code = 0
        self._listening: socket.socket | None = None
        self._socket_identity = (0, 0)
        self._server: asyncio.AbstractServer | None = None
        self._stop_requested: asyncio.Future[None] | None = None
        self._beat_handle: asyncio.TimerHandle | None = None
        self._dialing: tuple[int, asyncio.Task[LinkWatch]] | None = None
        self._links: dict[int, LinkWatch] = {}
        self._background: set[asyncio.Task[None]] = set()

    def attach_serial(self, serial: SerialKeeper, first_word: FirstWord | None = None) -> None:
        """Use ``serial`` (built with this agent's callbacks) as the port; it adopts the
        port ``first_word`` opened, where the agent said STARTED before its loop ran."""
        self.serial = serial
        self._first_word = first_word
        if first_word is not None:
            _said_first(self, first_word)

    def attach_connect_port(self, reader: ConnectPortReader) -> None:
        """Read the host's CONNECT lines with ``reader`` (built with ``connect_data``)."""
        self.connect_port = reader

    def attach_socket(self, listening: socket.socket, path: str) -> None:
        """Serve the guest API on ``listening``, the bound unix socket at ``path``."""
        self._listening = listening
        self.socket_path = path
        self._socket_identity = socket_identity(path)

    # -- running ------------------------------------------------------------

    async def start(self) -> None:
        """Serve the socket (then tell the service manager), open the serial port, beat."""
        loop = asyncio.get_running_loop()
        self._stop_requested = loop.create_future()
        if self._listening is not None:
            self._server = await asyncio.start_unix_server(self.proxy.handle, sock=self._listening)
        self.manager.ready(self._ready_status())
        if self.serial is not None:
            first_word, self._first_word = self._first_word, None
            if first_word is not None:
                first_word.say_again()  # before vmready.connect opens, which makes the host read
            self.serial.start(first_word)
        if self.connect_port is not None:
            self.connect_port.start()
        self._beat_handle = loop.call_later(self.heartbeat, self.beat)

    def _ready_status(self) -> str:
        """What ``systemctl status`` shows once the agent serves."""
        if self.socket_path is None:
            return "started; waiting for the host"
        answering = "; answering meta-data and config" if self.boot_data is not None else ""
        return f"serving {self.socket_path}{answering}; waiting for the host"

    def request_stop(self) -> None:
        """Stop soon (SIGTERM, SIGINT, or a fatal error)."""
        if self._stop_requested is not None and not self._stop_requested.done():
            self._stop_requested.set_result(None)

    async def run(self) -> int:
        """Start, run until asked to stop, stop; the exit status."""
        await self.start()
        assert self._stop_requested is not None
        await self._stop_requested
        await self.stop()
        return self.exit_code

    async def stop(self) -> None:
        """Say STOPPED and drop the link, close the serial port (flushed), then the socket."""
        self.manager.stopping("stopping")
        if self._beat_handle is not None:
            self._beat_handle.cancel()
        closing = [watch.closed() for watch in self._links.values()]
        self.execute(self.core.stop())
        await asyncio.gather(*closing)
        for task in list(self._background):
            task.cancel()
        if self.connect_port is not None:
            await self.connect_port.stop()
        if self.serial is not None:
            await self.serial.stop()
        if self._server is not None:
            self._server.close()
            self.proxy.close_connections()
            await self._server.wait_closed()
            self._server = None
        if self._listening is not None and self.socket_path is not None:
            remove_own_socket(self.socket_path, self._socket_identity)
            self._listening.close()
        if self.recorder is not None:
            self.recorder.close()

    # -- inputs -------------------------------------------------------------

    def beat(self) -> None:
        """A heartbeat is due."""
        self.execute(self.core.heartbeat())
        self._beat_handle = asyncio.get_running_loop().call_later(self.heartbeat, self.beat)

    def serial_opened(self) -> None:
        """The serial port (re)opened."""
        self.execute(self.core.serial_opened())

    def serial_data(self, data: bytes) -> None:
        """Bytes from the host arrived on the serial port."""
        if self.recorder is not None:
            self.recorder.serial_in(data)
        self.execute(self.core.data_received(data))

    def connect_data(self, data: bytes) -> None:
        """Bytes from the host arrived on the connect port."""
        if self.recorder is not None:
            self.recorder.serial_in(data)
        self.execute(self.core.connect_port_data(data))

    def serial_gave_up(self, reason: str) -> None:
        """The serial port is gone for good: exit with an error."""
        log.critical("vmready-agent exits: %s", reason)
        self.exit_code = 1
        self.request_stop()

    def route(self) -> HostRoute:
        """Where the devlxd proxy sends a request now; HostUnreachable while the link is down."""
        self.timeline.mark("relay")
        address = self.core.link
        if address is None:
            raise HostUnreachable(self.core.unreachable_reason)
        return HostRoute(self.endpoint_for(address), self.describe(address))

    def remember_state(self, state: str) -> None:
        """The host accepted a guest program's state: remember Ready for this boot."""
        log.info("the workload declared %s", state)
        _remembered(self, state)

    def hold_state(self, state: str) -> None:
        """A guest program declared ``state`` while the host was unreachable: deliver it later."""
        self.memory.hold(state)
        log.info("the workload declared %s while the host is unreachable; kept for later", state)

    # -- commands -----------------------------------------------------------

    def execute(self, commands: list[Command]) -> None:
        """Carry out the core's commands, in order."""
        for command in commands:
            if isinstance(command, WriteStatus):
                self._write(command)
            elif isinstance(command, Dial):
                self.timeline.mark("CONNECT")
                self._dial(command)
            elif isinstance(command, AbandonDial):
                if self._dialing is not None and self._dialing[0] == command.dial_id:
                    self._dialing[1].cancel()
                    self._dialing = None
            elif isinstance(command, CloseLink):
                watch = self._links.pop(command.dial_id, None)
                if watch is not None:
                    watch.close()
            elif isinstance(command, ReassertReady):
                self._reassert_ready(command)

    def _write(self, command: WriteStatus) -> None:
        # While the port is closed a line is dropped: its reopening says the status anew.
        written = self.serial is not None and self.serial.write(command.line, command.announce)
        if written and self.recorder is not None:
            self.recorder.serial_out(command.line)
        if written and self.timeline.mark(command.status.name):
            if command.status is AgentStatus.STARTED:
                log.info("%s", self.timeline.line("process", "STARTED"))
            elif command.status is AgentStatus.CONNECTED:
                log.info("%s", self.timeline.line("CONNECT", "CONNECTED"))

    def _dial(self, command: Dial) -> None:
        task = asyncio.ensure_future(self._dial_after(command.delay, command.address))
        self._dialing = (command.dial_id, task)
        task.add_done_callback(lambda done: self._dial_done(done, command.dial_id))

    async def _dial_after(self, delay: float, address: HostAddress) -> LinkWatch:
        if delay > 0:
            await asyncio.sleep(delay)
        return await asyncio.wait_for(self.dial(address), self.dial_timeout)

    async def _open_link(self, address: HostAddress) -> LinkWatch:
        return await open_link(self.endpoint_for(address))

    async def _patch_state(self, address: HostAddress, state: str) -> None:
        await patch_state(self.endpoint_for(address), state)

    def _dial_done(self, task: asyncio.Task[LinkWatch], dial_id: int) -> None:
        if self._dialing is not None and self._dialing[0] == dial_id:
            self._dialing = None
        if task.cancelled():
            return  # abandoned: the core has moved on
        error = task.exception()
        if error is not None:
            self.execute(self.core.dial_failed(dial_id, describe_failure(error)))
            return
        watch = task.result()
        self._links[dial_id] = watch
        watch.lost.add_done_callback(lambda lost: self._link_lost(lost.result(), dial_id))
        self.execute(self.core.dial_succeeded(dial_id))

    def _link_lost(self, reason: str, dial_id: int) -> None:
        self._links.pop(dial_id, None)
        self.execute(self.core.link_lost(dial_id, reason))

    def _reassert_ready(self, command: ReassertReady) -> None:
        where = self.describe(command.address)
        held = self.memory.pending()
        if held is not None:
            log.info("telling the host at %s the workload's %s, declared meanwhile", where, held)
            task = asyncio.ensure_future(self._deliver_held(command.address, where, held))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        if not self.memory.is_ready():
            return
        log.info("reasserting the workload's Ready to the host at %s", where)
        task = asyncio.ensure_future(self._reassert(command.address, where))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reassert(self, address: HostAddress, where: str) -> None:
        try:
            await asyncio.wait_for(self.reassert(address), self.dial_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            refused = " (refused)" if isinstance(e, HostRefused) else ""
            log.warning(
                "could not reassert Ready to the host at %s%s: %s",
                where,
                refused,
                describe_failure(e),
            )

    async def _deliver_held(self, address: HostAddress, where: str, state: str) -> None:
        try:
            await asyncio.wait_for(self.deliver(address, state), self.dial_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # kept: the next link tries again
            log.warning(
                "could not tell the host at %s the workload's %s: %s",
                where,
                state,
                describe_failure(e),
            )
            return
        _remembered(self, state)  # a Ready kept since before the link is dated when delivered


def _remembered(agent: Agent, state: str) -> None:
    """The host has ``state``: remember it; the first Ready is dated on the console."""
    agent.memory.remember(state == "Ready")
    if state == "Ready" and agent.timeline.mark("Ready"):
        log.info("%s", agent.timeline.line("relay", "Ready"))


def _said_first(agent: Agent, first_word: FirstWord) -> None:
    """Date the STARTED this process said before its loop ran (never a recording one's)."""
    if agent.timeline.note("STARTED", first_word.said_at):
        log.info("%s", agent.timeline.line("process", "STARTED"))


def _connector(
    config: AgentConfig, context: ssl.SSLContext, pinned: bytes
) -> tuple[HostConnector, AgentRecorder | None]:
    """How the agent dials the host, and its recorder (``--record``) if it records."""
    connector = HostConnector(
        config.transport, context, pinned, config.tcp_sockets, config.network
    )
    if config.record is None:
        return connector, None
    # Only when recording: the transcript's modules are imports the agent saves.
    from vmready.agent.recording import AgentRecorder, RecordingConnector

    try:
        recorder = AgentRecorder(config.record, config.instance)
    except OSError as e:
        raise ConfigError(f"cannot record to {config.record}: {e.strerror or e}") from None
    recording = RecordingConnector(
        recorder, config.transport, context, pinned, config.tcp_sockets, config.network
    )
    return recording, recorder


def _api_socket(path: str, first_word: FirstWord | None) -> socket.socket:
    """The guest API's socket: the one bound with the first STARTED, else bound now."""
    early = first_word.take_api_socket(path) if first_word is not None else None
    if early is not None:
        return early
    prepare_socket_path(path)
    return bind_socket(path)


def build_agent(config: AgentConfig, first_word: FirstWord | None = None) -> Agent:
    """The agent for ``config``, on the real serial port and socket; ConfigError if it cannot.

    ``first_word``: the status port where this process said STARTED already, for the
    agent to adopt (``firstword``).
    """
    try:
        context = config.tls or client_context(
            config.client_cert, config.client_key, config.server_cert_pem
        )
        pinned = pinned_der(config.server_cert_pem)
    except TLSConfigError as e:
        raise ConfigError(f"the agent's certificate and key are unusable: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename}: {e.strerror or e}") from None
    connector, recorder = _connector(config, context, pinned)
    core = AgentCore(retries=config.retries, describe=connector.describe)
    agent = Agent(
        core,
        connector.at,
        connector.describe,
        ReadyMemory(config.state_dir),
        config.heartbeat,
        recorder=recorder,
        boot_data=config.boot_data,
        manager=from_os_environment(),
        timeline=BootTimeline(started=process_start()),
    )
    agent.attach_socket(_api_socket(config.socket, first_word), config.socket)
    forced = config.serial

    def locate() -> FoundPort:
        if forced is not None:
            return FoundPort(forced, os.path.basename(forced))
        return find_port(config.ports, config.virtio_ports, config.virtio_sysfs, config.dev_dir)

    agent.attach_serial(
        SerialKeeper(locate, agent.serial_data, agent.serial_opened, agent.serial_gave_up),
        first_word,
    )

    def locate_connect_port() -> FoundPort:
        names = (config.connect_port,)
        return find_port(names, config.virtio_ports, config.virtio_sysfs, config.dev_dir)

    agent.attach_connect_port(ConnectPortReader(locate_connect_port, agent.connect_data))
    return agent
