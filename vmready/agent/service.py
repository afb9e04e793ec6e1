"""The running agent: the handshake core wired to the serial port, the host and the socket.

``AgentService`` carries out what ``AgentCore`` decides: it writes status lines
through the ``SerialKeeper``, dials the host with ``open_link`` (after the
delay the core asked for, abandoning a dial the core gave up on), holds the
link watch, reasserts a remembered Ready on every new link, and answers the
devlxd proxy's question "where is the host now?".  ``build_agent`` puts the
real pieces together from an ``AgentConfig``.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from typing import Any

from twisted.application import strports
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IAgent

from vmready.agent.config import AgentConfig, ConfigError
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
from vmready.agent.host import (
    HostConnector,
    HostRefused,
    LinkWatch,
    describe_failure,
    open_link,
    patch_state,
)
from vmready.agent.memory import ReadyMemory
from vmready.agent.proxy import GuestAPIProxy, HostRoute, HostUnreachable, proxy_site
from vmready.agent.recording import AgentRecorder, RecordingAgent, RecordingSerialKeeper
from vmready.agent.serial import SerialKeeper, choose_port

__all__ = ["DIAL_TIMEOUT", "AgentService", "build_agent", "prepare_socket_path"]

# Connect, TLS, GET /1.0 and the event stream's headers, together.
DIAL_TIMEOUT = 15.0
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the terminating NUL included

Dialer = Callable[[HostAddress], Deferred[LinkWatch]]


class AgentService(MultiService):
    """The in-guest agent: serial handshake, link to the host, Ready memory, devlxd socket."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        core: AgentCore,
        agent_for: Callable[[HostAddress], IAgent],
        describe: Callable[[HostAddress], str],
        memory: ReadyMemory,
        heartbeat: float,
        dial_timeout: float = DIAL_TIMEOUT,
        dial: Dialer | None = None,
    ) -> None:
        """Add the serial keeper with ``attach_serial`` and listeners with ``addService``.

        ``dial`` opens a validated link (default: ``open_link`` with ``agent_for``).
        """
        super().__init__()
        self.clock = clock
        self.core = core
        self.agent_for = agent_for
        self.describe = describe
        self.memory = memory
        self.dial_timeout = dial_timeout
        self.dial = dial or self._open_link
        self.serial: SerialKeeper | None = None
        self.exit_code = 0
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._dialing: tuple[int, Deferred[LinkWatch]] | None = None
        self._links: dict[int, LinkWatch] = {}
        # The first child: its first beat comes before the serial port is open and is not
        # said; the port's opening says the status, so a start writes one STARTED.
        self._heartbeat = TimerService(heartbeat, self.beat)
        self._heartbeat.clock = clock
        self._heartbeat.setServiceParent(self)

    def attach_serial(self, serial: SerialKeeper) -> None:
        """Use ``serial`` (built with this service's callbacks) as the port; started after it."""
        self.serial = serial
        serial.setServiceParent(self)

    def stopService(self) -> Deferred[None]:
        """Say STOPPED and drop the link, then close the serial port (flushed) and the socket."""
        closing = [watch.when_closed() for watch in self._links.values()]
        self.execute(self.core.stop())
        closing.append(super().stopService())
        stopped: Deferred[None] = gatherResults(closing).addCallback(lambda _: None)
        return stopped

    # -- inputs -------------------------------------------------------------

    def beat(self) -> None:
        """A heartbeat is due."""
        self.execute(self.core.heartbeat())

    def serial_opened(self) -> None:
        """The serial port (re)opened."""
        self.execute(self.core.serial_opened())

    def serial_data(self, data: bytes) -> None:
        """Bytes from the host arrived on the serial port."""
        self.execute(self.core.data_received(data))

    def serial_gave_up(self, reason: str) -> None:
        """The serial port is gone for good: exit with an error."""
        self.log.critical("vmready-agent exits: {reason}", reason=reason)
        self.exit_code = 1
        self.on_fatal(reason)

    def route(self) -> HostRoute:
        """Where the devlxd proxy sends a request now; HostUnreachable while the link is down."""
        address = self.core.link
        if address is None:
            raise HostUnreachable(self.core.unreachable_reason)
        return HostRoute(self.agent_for(address), self.describe(address))

    def remember_state(self, state: str) -> None:
        """The host accepted a guest program's state: remember Ready for this boot."""
        self.memory.remember(state == "Ready")
        self.log.info("the workload declared {state}", state=state)

    # -- commands -----------------------------------------------------------

    def execute(self, commands: list[Command]) -> None:
        """Carry out the core's commands, in order."""
        for command in commands:
            if isinstance(command, WriteStatus):
                self._write(command)
            elif isinstance(command, Dial):
                self._dial(command)
            elif isinstance(command, AbandonDial):
                if self._dialing is not None and self._dialing[0] == command.dial_id:
                    self._dialing[1].cancel()
            elif isinstance(command, CloseLink):
                watch = self._links.pop(command.dial_id, None)
                if watch is not None:
                    watch.close()
            elif isinstance(command, ReassertReady):
                self._reassert_ready(command)

    def _write(self, command: WriteStatus) -> None:
        # While the port is closed a line is dropped: its reopening says the status anew.
        if self.serial is not None:
            self.serial.write(command.line)

    def _dial(self, command: Dial) -> None:
        dialing = Deferred.fromCoroutine(self._dial_after(command.delay, command.address))
        self._dialing = (command.dial_id, dialing)
        dialing.addCallbacks(
            self._dial_succeeded,
            self._dial_failed,
            callbackArgs=(command.dial_id,),
            errbackArgs=(command.dial_id,),
        )

    async def _dial_after(self, delay: float, address: HostAddress) -> LinkWatch:
        if delay > 0:
            await deferLater(self.clock, delay)
        return await self.dial(address).addTimeout(self.dial_timeout, self.clock)

    def _open_link(self, address: HostAddress) -> Deferred[LinkWatch]:
        return Deferred.fromCoroutine(open_link(self.agent_for(address)))

    def _dial_succeeded(self, watch: LinkWatch, dial_id: int) -> None:
        if self._dialing is not None and self._dialing[0] == dial_id:
            self._dialing = None
        self._links[dial_id] = watch
        self.execute(self.core.dial_succeeded(dial_id))
        watch.lost.addCallback(self._link_lost, dial_id)

    def _link_lost(self, reason: str, dial_id: int) -> None:
        self._links.pop(dial_id, None)
        self.execute(self.core.link_lost(dial_id, reason))

    def _dial_failed(self, failure: Failure, dial_id: int) -> None:
        if self._dialing is not None and self._dialing[0] == dial_id:
            self._dialing = None
        self.execute(self.core.dial_failed(dial_id, describe_failure(failure)))

    def _reassert_ready(self, command: ReassertReady) -> None:
        if not self.memory.is_ready():
            return
        where = self.describe(command.address)
        self.log.info("reasserting the workload's Ready to the host at {where}", where=where)
        asserting = Deferred.fromCoroutine(patch_state(self.agent_for(command.address), "Ready"))
        asserting.addTimeout(self.dial_timeout, self.clock)
        asserting.addErrback(self._reassert_failed, where)

    def _reassert_failed(self, failure: Failure, where: str) -> None:
        refused = " (refused)" if failure.check(HostRefused) else ""
        self.log.warn(
            "could not reassert Ready to the host at {where}{refused}: {reason}",
            where=where,
            refused=refused,
            reason=describe_failure(failure),
        )


def _listen_string(path: str) -> str:
    escaped = path.replace("\\", "\\\\").replace(":", "\\:")
    # Owner only; the lock file lets a restarted agent replace the socket a dead one left.
    return f"unix:{escaped}:mode=600:lockfile=1"


def prepare_socket_path(path: str) -> None:
    """Make the socket's directory; remove a socket a dead agent left; refuse a live one."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise ConfigError(f"socket path {path} is longer than {_UNIX_PATH_MAX} bytes")
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"cannot prepare the socket {path}: {e.strerror or e}") from None
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket; not replacing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody answers: left behind by an agent that is gone
            return
        except OSError as e:
            raise ConfigError(f"cannot check the socket {path}: {e.strerror or e}") from None
    raise ConfigError(f"{path} is in use: another vmready-agent is serving it")


def build_agent(reactor: Any, config: AgentConfig) -> AgentService:
    """The agent for ``config``, on the real reactor, serial port and socket."""
    try:
        connector = HostConnector(
            reactor, config.transport, config.identity, config.server_cert_pem
        )
    except Exception as e:  # pyOpenSSL refuses the pair in its own ways
        raise ConfigError(f"the agent's certificate and key are unusable: {e}") from None
    core = AgentCore(retries=config.retries, describe=connector.describe)
    agent_for: Callable[[HostAddress], IAgent] = connector.agent
    recorder: AgentRecorder | None = None
    if config.record is not None:
        try:
            recorder = AgentRecorder(config.record, config.instance)
        except OSError as e:
            raise ConfigError(f"cannot record to {config.record}: {e.strerror or e}") from None
        recording = recorder

        def agent_for(address: HostAddress) -> IAgent:
            return RecordingAgent(connector.agent(address), recording)

    service = AgentService(
        reactor,
        core,
        agent_for,
        connector.describe,
        ReadyMemory(config.state_dir),
        config.heartbeat,
    )
    prepare_socket_path(config.socket)
    proxy = GuestAPIProxy(service.route, service.remember_state, reactor)
    strports.service(_listen_string(config.socket), proxy_site(proxy)).setServiceParent(service)
    forced = config.serial

    def locate() -> str:
        return forced if forced is not None else choose_port(config.virtio_ports)

    on_data = service.serial_data
    keeper_class = SerialKeeper
    if recorder is not None:
        keeper_class = RecordingSerialKeeper
        recording_to = recorder

        def on_data(data: bytes) -> None:
            recording_to.serial_in(data)
            service.serial_data(data)

    keeper = keeper_class(reactor, locate, on_data, service.serial_opened, service.serial_gave_up)
    if isinstance(keeper, RecordingSerialKeeper) and recorder is not None:
        keeper.recorder = recorder
    service.attach_serial(keeper)
    return service
