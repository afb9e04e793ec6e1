"""QMP as QEMU 7.2 speaks it: a sans-I/O session and the thin Protocol around it."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime, ITransport
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from fakeqemu._cmdline import QEMU_PACKAGE, QEMU_VERSION
from fakeqemu._jsonstream import ParsedObject, QMPInputSplitter
from fakeqemu._machine import Machine
from fakeqemu._migration import MIGRATION_CAPABILITIES
from fakeqemu._ringbuf import Base64Error, decode_qmp_base64, encode_qmp_utf8
from fakeqemu._runstate import MachineError

Message = dict[str, Any]
FileWriter = Callable[[str, bytes], None]

_TYPE_NAMES = {str: "string", int: "integer", bool: "boolean", list: "array", dict: "object"}
_REQUEST_MEMBERS = ("execute", "arguments", "id")
# The commands that only act on the machine: each answers {}.
_ACTIONS: dict[str, Callable[[Machine], None]] = {
    "cont": Machine.cont,
    "stop": Machine.stop,
    "system_powerdown": Machine.system_powerdown,
    "system_reset": Machine.system_reset,
    "quit": Machine.quit,
}


class CommandError(Exception):
    """A QMP error reply: QEMU's class and description."""

    def __init__(self, error_class: str, desc: str) -> None:
        super().__init__(desc)
        self.error_class = error_class
        self.desc = desc


@attrs.frozen
class Parameter:
    """One argument of a QMP command, as QEMU's schema declares it."""

    name: str
    kind: type
    required: bool = True
    choices: tuple[str, ...] = ()


def _version() -> dict[str, Any]:
    major, minor, micro = QEMU_VERSION
    return {"qemu": {"micro": micro, "minor": minor, "major": major}, "package": QEMU_PACKAGE}


def greeting() -> Message:
    """The banner QEMU sends on every new QMP connection."""
    return {"QMP": {"version": _version(), "capabilities": ["oob"]}}


def _check_arguments(
    schema: tuple[Parameter, ...], arguments: dict[str, Any], prefix: str = ""
) -> None:
    """Check arguments as QEMU's input visitor does; ``prefix`` is the path of a nested object."""
    for parameter in schema:
        if parameter.name not in arguments:
            if parameter.required:
                raise CommandError(
                    "GenericError", f"Parameter '{prefix}{parameter.name}' is missing"
                )
            continue
        value = arguments[parameter.name]
        wrong_type = not isinstance(value, parameter.kind) or (
            parameter.kind is int and isinstance(value, bool)
        )
        if wrong_type:
            raise CommandError(
                "GenericError",
                f"Invalid parameter type for '{prefix}{parameter.name}', "
                f"expected: {_TYPE_NAMES[parameter.kind]}",
            )
        if parameter.choices and value not in parameter.choices:
            # QEMU names an enum member without its path.
            raise CommandError(
                "GenericError", f"Parameter '{parameter.name}' does not accept value '{value}'"
            )
    declared = {p.name for p in schema}
    for name in arguments:
        if name not in declared:
            raise CommandError("GenericError", f"Parameter '{prefix}{name}' is unexpected")


_FORMAT = Parameter("format", str, required=False, choices=("utf8", "base64"))
_CAPABILITY_ENTRY = (
    Parameter("capability", str, choices=MIGRATION_CAPABILITIES),
    Parameter("state", bool),
)

COMMAND_SCHEMAS: dict[str, tuple[Parameter, ...]] = {
    "qmp_capabilities": (Parameter("enable", list, required=False),),
    "query-version": (),
    "query-status": (),
    "query-commands": (),
    "cont": (),
    "stop": (),
    "system_powerdown": (),
    "system_reset": (),
    "quit": (),
    "query-chardev": (),
    "ringbuf-read": (Parameter("device", str), Parameter("size", int), _FORMAT),
    "ringbuf-write": (Parameter("device", str), Parameter("data", str), _FORMAT),
    "migrate": (
        Parameter("uri", str),
        Parameter("blk", bool, required=False),
        Parameter("inc", bool, required=False),
        Parameter("detach", bool, required=False),
        Parameter("resume", bool, required=False),
    ),
    "query-migrate": (),
    "migrate-set-capabilities": (Parameter("capabilities", list),),
    "query-migrate-capabilities": (),
}


class QMPSession:
    """One monitor connection: negotiation, dispatch and event delivery, without I/O."""

    def __init__(self, machine: Machine, send: Callable[[Message], None], write_file: FileWriter):
        self._machine = machine
        self._send = send
        self._write_file = write_file
        self._splitter = QMPInputSplitter()
        self.negotiated = False
        self._oob = False
        self._unsubscribe = machine.subscribe(self._event)

    def start(self) -> None:
        """Send the greeting."""
        self._send(greeting())

    def close(self) -> None:
        """The client went away: stop sending it events."""
        self._unsubscribe()

    def data_received(self, data: bytes) -> None:
        """Bytes from the client: answer every request they complete, in order."""
        for item in self._splitter.feed(data):
            if isinstance(item, ParsedObject):
                self._request(item.value)
            else:
                self._send({"error": {"class": "GenericError", "desc": item.desc}})

    def _event(self, event: Message) -> None:
        if self.negotiated:
            self._send(event)

    def _request(self, request: Any) -> None:
        has_id = isinstance(request, dict) and "id" in request
        request_id = request.get("id") if has_id else None
        try:
            result = self._dispatch(request)
        except CommandError as e:
            error = {"class": e.error_class, "desc": e.desc}
            self._send({"id": request_id, "error": error} if has_id else {"error": error})
            return
        self._send({"return": result, "id": request_id} if has_id else {"return": result})

    def _dispatch(self, request: Any) -> Any:
        if not isinstance(request, dict):
            raise CommandError("GenericError", "QMP input must be a JSON object")
        # exec-oob is a member only once the client enabled the oob capability.
        members = (*_REQUEST_MEMBERS, "exec-oob") if self._oob else _REQUEST_MEMBERS
        for member in request:
            if member not in members:
                raise CommandError("GenericError", f"QMP input member '{member}' is unexpected")
        if "execute" in request and "exec-oob" in request:
            raise CommandError(
                "GenericError", "QMP input member 'execute' clashes with 'exec-oob'"
            )
        key = "exec-oob" if "exec-oob" in request else "execute"
        if key not in request:
            raise CommandError("GenericError", "QMP input lacks member 'execute'")
        command = request[key]
        if not isinstance(command, str):
            raise CommandError("GenericError", f"QMP input member '{key}' must be a string")
        arguments = request.get("arguments", {})
        if not isinstance(arguments, dict):
            raise CommandError("GenericError", "QMP input member 'arguments' must be an object")
        if not self.negotiated and command != "qmp_capabilities":
            raise CommandError(
                "CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'"
            )
        if self.negotiated and command == "qmp_capabilities":
            raise CommandError(
                "CommandNotFound", "Capabilities negotiation is already complete, command ignored"
            )
        schema = COMMAND_SCHEMAS.get(command)
        if schema is None:
            raise CommandError("CommandNotFound", f"The command {command} has not been found")
        if key == "exec-oob":
            # None of the commands fakeqemu emulates is allowed out of band.
            raise CommandError("GenericError", f"The command {command} does not support OOB")
        _check_arguments(schema, arguments)
        action = _ACTIONS.get(command)
        try:
            if action is not None:
                action(self._machine)
                return {}
            handler = getattr(self, "_cmd_" + command.replace("-", "_"))
            return handler(**{k.replace("-", "_"): v for k, v in arguments.items()})
        except MachineError as e:
            raise CommandError("GenericError", str(e)) from None

    # -- commands ---------------------------------------------------------

    def _cmd_qmp_capabilities(self, enable: list[Any] | None = None) -> Message:
        for index, capability in enumerate(enable or []):
            if not isinstance(capability, str):
                raise CommandError(
                    "GenericError",
                    f"Invalid parameter type for 'enable[{index}]', expected: string",
                )
            if capability != "oob":
                # QEMU 7.2 names a list element 'null' here (its visitor passes no name).
                raise CommandError(
                    "GenericError", f"Parameter 'null' does not accept value '{capability}'"
                )
        self.negotiated = True
        self._oob = "oob" in (enable or [])
        return {}

    def _cmd_query_version(self) -> Message:
        return _version()

    def _cmd_query_status(self) -> Message:
        return self._machine.query_status()

    def _cmd_query_commands(self) -> list[Message]:
        return [{"name": name} for name in COMMAND_SCHEMAS]

    def _cmd_query_chardev(self) -> list[Message]:
        return self._machine.wiring.query_chardev()

    def _cmd_ringbuf_read(self, device: str, size: int, format: str = "utf8") -> str:
        data = self._machine.wiring.ringbuf_read(device, size)
        if format == "base64":
            return base64.b64encode(data).decode("ascii")
        return encode_qmp_utf8(data)

    def _cmd_ringbuf_write(self, device: str, data: str, format: str = "utf8") -> Message:
        if format == "base64":
            self._machine.wiring.ringbuf_device(device)  # QEMU looks the device up before decoding
            try:
                payload = decode_qmp_base64(data)
            except Base64Error as e:
                raise CommandError("GenericError", str(e)) from None
        else:
            # QEMU holds strings as modified UTF-8, where U+0000 is \xC0\x80.
            payload = data.encode("utf-8", "surrogatepass").replace(b"\0", b"\xc0\x80")
        self._machine.wiring.ringbuf_write(device, payload)
        return {}

    def _cmd_migrate(self, uri: str, **_ignored: bool) -> Message:
        self._machine.migration.migrate(uri, self._write_file)
        return {}

    def _cmd_query_migrate(self) -> Message:
        return dict(self._machine.migration.info)

    def _cmd_migrate_set_capabilities(self, capabilities: list[Any]) -> Message:
        # QEMU checks the whole list before it changes anything.
        for index, entry in enumerate(capabilities):
            where = f"capabilities[{index}]"
            if not isinstance(entry, dict):
                raise CommandError(
                    "GenericError", f"Invalid parameter type for '{where}', expected: object"
                )
            _check_arguments(_CAPABILITY_ENTRY, entry, prefix=f"{where}.")
        for entry in capabilities:
            self._machine.migration.set_capability(entry["capability"], entry["state"])
        return {}

    def _cmd_query_migrate_capabilities(self) -> list[Message]:
        return self._machine.migration.query_capabilities()


def encode_message(message: Message) -> bytes:
    """QEMU's wire form: JSON with ``", "``/``": "`` separators and CRLF."""
    return json.dumps(message).encode("utf-8") + b"\r\n"


class QMPServerProtocol(Protocol):
    """Carries one QMPSession over a stream transport."""

    log = Logger()

    def __init__(self, factory: QMPServerFactory) -> None:
        self._factory = factory
        self._session: QMPSession | None = None
        self._early: list[bytes] = []

    def connectionMade(self) -> None:
        self._factory.client_arrived(self)

    def serve(self) -> None:
        """This client's turn: QEMU serves one monitor client at a time."""
        self._session = QMPSession(self._factory.machine, self._send, self._factory.write_file)
        self._session.start()
        early, self._early = self._early, []
        for chunk in early:
            self._session.data_received(chunk)

    def _send(self, message: Message) -> None:
        transport: ITransport | None = self.transport
        if transport is not None:
            transport.write(encode_message(message))

    def dataReceived(self, data: bytes) -> None:
        if self._session is None:
            self._early.append(data)
        else:
            self._session.data_received(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if self._session is not None:
            self._session.close()
        self._factory.client_left(self)


class QMPServerFactory(Factory):
    """Accepts monitor clients for one machine, serving them one after another."""

    def __init__(self, machine: Machine, write_file: FileWriter) -> None:
        self.machine = machine
        self.write_file = write_file
        self.clients: list[QMPServerProtocol] = []

    def buildProtocol(self, addr: object) -> QMPServerProtocol:
        return QMPServerProtocol(self)

    def client_arrived(self, client: QMPServerProtocol) -> None:
        """Queue a new client; the first in line is served."""
        if self.machine.exited is not None:
            # The machine is gone, and with it the monitor: hang up, say nothing.
            if client.transport is not None:
                client.transport.loseConnection()
            return
        self.clients.append(client)
        if len(self.clients) == 1:
            client.serve()

    def client_left(self, client: QMPServerProtocol) -> None:
        """Serve the next queued client, as QEMU accepts it once the socket is free."""
        was_active = bool(self.clients) and self.clients[0] is client
        if client in self.clients:
            self.clients.remove(client)
        if was_active and self.clients:
            self.clients[0].serve()

    def when_idle(self, clock: IReactorTime, timeout: float) -> Deferred[None]:
        """Fires once every client has gone (their last replies flushed), or after ``timeout``."""
        done: Deferred[None] = Deferred()

        def check() -> None:
            if done.called:
                return
            if not self.clients or clock.seconds() >= deadline:
                done.callback(None)
            else:
                clock.callLater(0.01, check)

        deadline = clock.seconds() + timeout
        check()
        return done

    def disconnect_all(self) -> None:
        """Drop every client, as a dying QEMU process does."""
        for client in list(self.clients):
            if client.transport is not None:
                client.transport.loseConnection()
