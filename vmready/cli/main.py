"""``vmready``: the operator's command line, a client of the daemon's API on its unix socket.

Every command is one or a few requests to the operator API.  Actions wait for
their operation by default and report its error; ``wait`` subscribes to the
event stream first and then wakes on the event, never polling.  Exit status:
0 success; 1 the daemon refused or the action failed (``wait``: timed out);
2 usage error, unknown instance, no daemon or lost the daemon; 3 (``wait``
only) the instance was deleted or went to Error while waiting for another
status; 128 + the signal's number when interrupted: 130 for SIGINT (Ctrl-C),
143 for SIGTERM.  An interrupted command prints nothing more.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from io import BytesIO
from types import FrameType
from typing import IO, Any, NoReturn
from urllib.parse import quote, urlencode

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectError, ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    FileBodyProducer,
    ResponseDone,
    ResponseFailed,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from zope.interface import implementer

from vmready.domain.paths import default_socket
from vmready.hypervisor.accel import ACCEL_CHOICES, ACCEL_KEY
from vmready.hypervisor.bootsource import APPEND_KEY, IMAGE_KEY, INITRD_KEY, KERNEL_KEY

__all__ = ["APIError", "Client", "DaemonUnreachable", "main", "run", "to_yaml"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_GONE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM ends with 128 + 15

FORMATS = ("table", "json", "yaml")
# Statuses ``wait`` understands; "running" is also met by Ready (Ready counts as running).
WAIT_STATUSES = (
    "running",
    "ready",
    "stopped",
    "frozen",
    "error",
    "starting",
    "stopping",
    "freezing",
)
AGENT_CONDITION = "agent"
_SATISFIES = {
    "running": frozenset({"running", "ready"}),
    AGENT_CONDITION: frozenset({"connected"}),
}
_RUNNING_STATUSES = frozenset({"running", "ready", "frozen", "freezing", "starting", "stopping"})
_START_HINT = "is it running? start it with: twistd -n vmready"
_HOST = "http://vmready"


# -- errors -----------------------------------------------------------------


class CommandError(Exception):
    """Ends a command with a message on stderr and an exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class DaemonUnreachable(CommandError):
    """The daemon's socket cannot be connected to."""

    def __init__(self, socket_path: str, reason: str) -> None:
        super().__init__(
            f"cannot reach the vmready daemon at {socket_path}: {reason} ({_START_HINT})",
            EXIT_USAGE,
        )


class APIError(CommandError):
    """The daemon answered with LXD's error envelope."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(f"Error: {error}", EXIT_USAGE if code == 404 else EXIT_FAILED)
        self.code = code
        self.error = error


class _UsageError(Exception):
    """The command line is wrong; ``usage`` is the usage line of the (sub)command, if known."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


# -- the HTTP client ---------------------------------------------------------


@implementer(IAgentEndpointFactory)
class _UnixSocket:
    """Every request goes to the daemon's unix socket, whatever the URL's host."""

    def __init__(self, reactor: Any, path: str) -> None:
        self._reactor = reactor
        self._path = path

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        """The unix socket endpoint."""
        return UNIXClientEndpoint(self._reactor, self._path)


class _LineStream(Protocol):
    """Receives a streamed response body and hands over each complete line."""

    MAX_LINE = 4 * 1024 * 1024

    def __init__(self, on_line: Callable[[bytes], None], daemon: str) -> None:
        self._on_line = on_line
        self._daemon = daemon
        self._buffer = b""
        self.closing = False
        self.ended: Deferred[str | None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        """Split into lines; a line longer than MAX_LINE ends the stream."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.strip() and not self.closing:
                self._on_line(line)
        if len(self._buffer) > self.MAX_LINE:
            self.close()

    def close(self) -> None:
        """Stop reading (closes the connection)."""
        if not self.closing and self.transport is not None:
            self.closing = True
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        """Fires ``ended`` with None when we closed it, else with why it ended (for the user)."""
        if self.closing:
            self.ended.callback(None)
        elif reason.check(ResponseDone):
            self.ended.callback(f"{self._daemon} closed the event stream")
        else:
            # ResponseFailed's message is a list of Failure reprs: say what happened instead.
            self.ended.callback(f"lost the connection to {self._daemon}")


class _BodyReader(Protocol):
    """Collects a whole response body (``readBody`` warns about unix transports)."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self.done: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        """Keep the chunk."""
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        """The body is complete, or the connection broke."""
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self._chunks))
        else:
            self.done.errback(reason)


class Client:
    """The operator API over the daemon's unix socket, with LXD's envelopes unwrapped."""

    def __init__(self, reactor: Any, socket_path: str) -> None:
        self.reactor = reactor
        self.socket_path = socket_path
        self.daemon = f"the vmready daemon at {socket_path}"
        self._agent = Agent.usingEndpointFactory(reactor, _UnixSocket(reactor, socket_path))

    def _failed(self, error: ResponseFailed) -> Exception:
        """What to raise for a request or response that broke off."""
        if any(reason.check(CancelledError) for reason in error.reasons):
            # We cancelled it (a signal ends the command): not the daemon's doing.
            return CancelledError()
        return CommandError(f"lost the connection to {self.daemon}", EXIT_USAGE)

    async def _read_body(self, response: IResponse) -> bytes:
        """The whole body of ``response``."""
        reader = _BodyReader()
        response.deliverBody(reader)
        try:
            return await reader.done
        except ResponseFailed as e:
            raise self._failed(e) from None

    async def _send(self, method: str, path: str, body: Any = None) -> IResponse:
        headers = Headers({b"User-Agent": [b"vmready-cli"]})
        producer = None
        if body is not None:
            headers.addRawHeader(b"Content-Type", b"application/json")
            producer = FileBodyProducer(BytesIO(json.dumps(body).encode("utf-8")))
        try:
            response: IResponse = await self._agent.request(
                method.encode("ascii"), (_HOST + path).encode("utf-8"), headers, producer
            )
            return response
        except ConnectError as e:
            raise DaemonUnreachable(self.socket_path, _connect_reason(e)) from None
        except ResponseFailed as e:
            raise self._failed(e) from None

    async def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One request; the whole envelope, or APIError for an error envelope."""
        response = await self._send(method, path, body)
        raw = await self._read_body(response)
        try:
            envelope = json.loads(raw)
        except ValueError:
            envelope = None
        if not isinstance(envelope, dict):
            raise CommandError(
                f"unexpected answer from the daemon (HTTP {response.code}): {raw[:200]!r}",
                EXIT_USAGE,
            )
        if envelope.get("type") == "error" or response.code >= 400:
            raise APIError(
                int(envelope.get("error_code") or response.code),
                str(envelope.get("error") or f"HTTP {response.code}"),
            )
        return envelope

    async def get(self, path: str) -> Any:
        """GET and return the metadata."""
        return (await self.request("GET", path))["metadata"]

    async def get_raw(self, path: str) -> bytes:
        """GET a body that is not an envelope (a console log); APIError for an error envelope."""
        response = await self._send("GET", path)
        raw = await self._read_body(response)
        if response.code >= 400:
            try:
                envelope = json.loads(raw)
                error = str(envelope.get("error") or f"HTTP {response.code}")
            except (ValueError, AttributeError):
                error = f"HTTP {response.code}"
            raise APIError(response.code, error)
        return raw

    async def operation(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """Start an action; returns its operation object."""
        envelope = await self.request(method, path, body)
        operation: dict[str, Any] = envelope["metadata"]
        return operation

    async def wait_operation(self, operation: dict[str, Any]) -> dict[str, Any]:
        """The operation once it finished (``/wait`` without a limit)."""
        done: dict[str, Any] = await self.get(
            f"/1.0/operations/{quote(str(operation['id']), safe='')}/wait?timeout=-1"
        )
        return done

    async def events(
        self, types: Sequence[str], on_event: Callable[[dict[str, Any]], None]
    ) -> _LineStream:
        """Subscribe to ``/1.0/events``; returns once the daemon has subscribed us."""
        arguments = {"type": ",".join(types)}
        query = f"?{urlencode(arguments, errors='surrogateescape')}" if types else ""
        response = await self._send("GET", f"/1.0/events{query}")
        if response.code != 200:
            raw = await self._read_body(response)
            try:
                error = str(json.loads(raw).get("error"))
            except (ValueError, AttributeError):
                error = f"HTTP {response.code}"
            raise APIError(response.code, error)

        def line(raw: bytes) -> None:
            try:
                event = json.loads(raw)
            except ValueError:
                return
            if isinstance(event, dict):
                on_event(event)

        stream = _LineStream(line, self.daemon)
        response.deliverBody(stream)
        return stream


def _connect_reason(error: ConnectError) -> str:
    """Why a connect failed, as the OS says it ("No such file or directory")."""
    if isinstance(error.osError, int):
        return os.strerror(error.osError)
    return str(error.args[0]) if error.args else str(error)


# -- output -------------------------------------------------------------------


_PLAIN = re.compile(r"[A-Za-z_/.][A-Za-z0-9_./ :@+-]*")
_YAML_WORDS = frozenset(
    {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~", ".inf", ".nan"}
)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list | tuple):
        return "[]"
    text = str(value)
    plain = (
        _PLAIN.fullmatch(text) is not None
        and text.lower() not in _YAML_WORDS
        and ": " not in text
        and not text.endswith((":", " "))
    )
    return text if plain else json.dumps(text, ensure_ascii=False)


def _is_block(value: Any) -> bool:
    return isinstance(value, dict | list | tuple) and len(value) > 0


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            if _is_block(item):
                lines.append(f"{pad}{_yaml_scalar(str(key))}:")
                lines.extend(_yaml_lines(item, indent + 2))
            else:
                lines.append(f"{pad}{_yaml_scalar(str(key))}: {_yaml_scalar(item)}")
        return lines
    if isinstance(value, list | tuple) and value:
        lines = []
        for item in value:
            if _is_block(item):
                nested = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {nested[0][indent + 2 :]}")
                lines.extend(nested[1:])
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
        return lines
    return [pad + _yaml_scalar(value)]


def to_yaml(value: Any) -> str:
    """A small YAML emitter for JSON data: block style, strings quoted JSON-style when needed."""
    return "\n".join(_yaml_lines(value, 0)) + "\n"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned on the widest cell, two spaces apart."""
    widths = [len(header) for header in headers]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [list(headers), *rows]
    ]
    return "\n".join(lines) + "\n"


def _time(value: Any) -> str:
    """An API timestamp (RFC 3339 text or Unix seconds) for a table."""
    if value is None or value == "":
        return "-"
    if isinstance(value, int | float):
        stamp = datetime.datetime.fromtimestamp(value, tz=datetime.UTC)
        return stamp.strftime("%Y-%m-%d %H:%M:%S")
    return str(value).replace("T", " ").removesuffix("Z").split(".")[0]


def _dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _write(stream: IO[str], text: str) -> None:
    """Write and flush ``text``; what the stream cannot encode is written as escapes."""
    # JSON may decode to lone surrogates (a "\ud800" escape), argv holds undecodable bytes
    # as surrogates, and stdout may not be UTF-8: none of that may crash the output.
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
    stream.flush()


class Output:
    """Where and how a command prints: stdout/stderr and the chosen format."""

    def __init__(self, out: IO[str], err: IO[str], format: str) -> None:
        self.out = out
        self.err = err
        self.format = format

    def text(self, text: str) -> None:
        """Text on stdout, as is."""
        _write(self.out, text)

    def line(self, text: str) -> None:
        """One line on stdout."""
        self.text(text + "\n")

    def data(self, value: Any, table: Callable[[Any], str]) -> None:
        """Data in the chosen format; ``table`` renders the table format."""
        if self.format == "json":
            self.text(json.dumps(value, indent=2) + "\n")
        elif self.format == "yaml":
            self.text(to_yaml(value))
        else:
            self.text(table(value))

    def raw(self, data: bytes) -> None:
        """Bytes on stdout, as the guest wrote them (through the text stream where it has none)."""
        buffer = getattr(self.out, "buffer", None)
        if buffer is None:
            self.text(data.decode("utf-8", "replace"))
            return
        self.out.flush()
        buffer.write(data)
        buffer.flush()

    def usage(self, usage: str) -> None:
        """A usage line on stderr, as is."""
        _write(self.err, usage)

    def error(self, message: str) -> None:
        """One line on stderr, prefixed ``vmready:``."""
        _write(self.err, f"vmready: {message}\n")


def _instances_table(instances: list[dict[str, Any]]) -> str:
    rows = [
        [
            str(instance["name"]),
            str(instance["status"]).upper(),
            _dash(instance.get("display_status")),
            _dash(instance.get("task_state")),
            _dash(instance.get("power_state")),
            f"{instance['limits']['memory_mib']}MiB",
            str(instance["limits"]["cpus"]),
        ]
        for instance in instances
    ]
    return _table(["NAME", "STATUS", "DISPLAY", "TASK", "POWER", "MEMORY", "CPUS"], rows)


def _layout_line(layout: Any) -> str:
    if not isinstance(layout, dict):
        return "- (never started)"
    return f"{layout.get('name')} ({layout.get('description')})"


def _boot_lines(boot: Any) -> list[str]:
    """The boot source, accelerator and transport lines of ``vmready info``."""
    if not isinstance(boot, dict):
        return []
    accel = boot.get("accel") or {}
    current = accel.get("current")
    running = f"{current} ({accel.get('reason')})" if current else "- (never started)"
    lines = [
        f"Boot source: {_dash(boot.get('source'))}",
        f"Accelerator: {running}; requested {_dash(accel.get('requested'))}",
    ]
    if boot.get("transport"):
        lines.append(f"Guest API transport: {boot['transport']}")
    return lines


def _info_table(instance: dict[str, Any]) -> str:
    lines = [
        f"Name: {instance['name']}",
        f"UUID: {instance['uuid']}",
        f"Type: {instance.get('type', 'virtual-machine')}",
        f"Status: {str(instance['status']).upper()}",
        f"Display status: {instance.get('display_status', '-')}",
        f"VM state: {_dash(instance.get('vm_state'))}",
        f"Task state: {_dash(instance.get('task_state'))}",
        f"Power state: {_dash(instance.get('power_state'))}",
        f"Agent: {_dash((instance.get('agent') or {}).get('status'))}",
        f"Serial layout: {_layout_line(instance.get('serial_layout'))}",
        *_boot_lines(instance.get("boot")),
        f"Memory: {instance['limits']['memory_mib']}MiB",
        f"CPUs: {instance['limits']['cpus']}",
        f"Created: {_time(instance.get('created_at'))}",
        f"Updated: {_time(instance.get('updated_at'))}",
    ]
    if instance.get("error"):
        lines.append(f"Error: {instance['error']}")
    config = instance.get("config") or {}
    lines.append("Config:" if config else "Config: (none)")
    lines.extend(f"  {key}: {config[key]}" for key in sorted(config))
    devices = instance.get("devices") or {}
    if devices:
        lines.append("Devices:")
        for name in sorted(devices):
            settings = ", ".join(f"{k}={v}" for k, v in sorted(devices[name].items()))
            lines.append(f"  {name}: {settings}")
    return "\n".join(lines) + "\n"


def _snapshots_table(snapshots: list[dict[str, Any]]) -> str:
    rows = [
        [
            str(snapshot["name"]),
            "yes" if snapshot.get("stateful") else "no",
            _dash(snapshot.get("serial_layout")),
            _time(snapshot.get("created_at")),
        ]
        for snapshot in snapshots
    ]
    return _table(["NAME", "STATEFUL", "LAYOUT", "CREATED"], rows)


def _actions_table(actions: list[dict[str, Any]]) -> str:
    rows: list[list[str]] = []
    for action in actions:
        rows.append(
            [
                str(action["action"]),
                _dash(action.get("result") or "running"),
                _time(action.get("started_at")),
                _time(action.get("finished_at")),
                _dash(action.get("error")),
            ]
        )
        for step in action.get("steps") or []:
            rows.append(
                [
                    f"  {step['name']}",
                    _dash(step.get("result") or "running"),
                    _time(step.get("started_at")),
                    _time(step.get("finished_at")),
                    _dash(step.get("error")),
                ]
            )
    return _table(["ACTION", "RESULT", "STARTED", "FINISHED", "ERROR"], rows)


def _event_line(event: dict[str, Any]) -> str:
    """One event as a readable line."""
    stamp = _time(event.get("timestamp"))
    kind = str(event.get("type", "?"))
    metadata = event.get("metadata") or {}
    if kind == "lifecycle":
        name = str(metadata.get("source", "")).removeprefix("/1.0/instances/")
        context = metadata.get("context") or {}
        details = " ".join(
            f"{key}={_dash(value)}"
            for key, value in context.items()
            if not _is_block(value) and not (key == "error" and not value)
        )
        return f"{stamp} {kind} {metadata.get('action', '?')} {name} {details}".rstrip()
    if kind == "operation":
        error = f": {metadata['err']}" if metadata.get("err") else ""
        return (
            f"{stamp} {kind} {metadata.get('description', '?')} "
            f"{metadata.get('status', '?')}{error}"
        )
    return f"{stamp} {kind} {json.dumps(metadata)}"


# -- commands -----------------------------------------------------------------


def _instance_path(name: str, *rest: str) -> str:
    # argv may hold undecodable bytes (as surrogates): send them as they were.
    return "/".join(["/1.0/instances", quote(name, safe="", errors="surrogateescape"), *rest])


async def _instance(client: Client, name: str) -> dict[str, Any]:
    instance: dict[str, Any] = await client.get(_instance_path(name))
    return instance


async def _finish_action(
    client: Client, output: Output, name: str, operation: dict[str, Any], args: argparse.Namespace
) -> int:
    """Wait for the operation (unless --no-wait), report its failure or the resulting status."""
    if args.no_wait:
        output.line(f"Operation /1.0/operations/{operation['id']}: {operation['description']}")
        return EXIT_OK
    done = await client.wait_operation(operation)
    if done.get("status_code") != 200:
        raise CommandError(f"Error: {done.get('err') or done.get('status')}")
    if args.command == "delete":
        output.line(f"Deleted {name}")
        return EXIT_OK
    instance = await _instance(client, name)
    output.line(f"{name}: {str(instance['status']).upper()} ({instance['display_status']})")
    return EXIT_OK


async def _cmd_launch(client: Client, output: Output, args: argparse.Namespace) -> int:
    config: dict[str, str] = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _UsageError(f"-c expects key=value, got {item!r}")
        config[key] = value
    if args.memory is not None:
        config["limits.memory"] = args.memory
    if args.cpus is not None:
        config["limits.cpu"] = str(args.cpus)
    # Paths are the caller's: the daemon does not share this working directory.
    for option, key in (
        ("image", IMAGE_KEY),
        ("kernel", KERNEL_KEY),
        ("initrd", INITRD_KEY),
    ):
        value = getattr(args, option)
        if value is not None:
            config[key] = os.path.abspath(value)
    if args.append is not None:
        config[APPEND_KEY] = args.append
    if args.accel is not None:
        config[ACCEL_KEY] = args.accel
    ready: Waiter | None = None
    if args.wait:
        # Subscribe before the instance exists, so no event can be missed.
        ready = Waiter(client, args.name, "ready")
        await ready.subscribe()
    try:
        operation = await client.operation(
            "POST", "/1.0/instances", {"name": args.name, "config": config}
        )
        # Only now: the daemon accepted the name and config.
        output.line(f"Creating {args.name}")
        code = await _finish_action(client, output, args.name, operation, args)
        if ready is None or code != EXIT_OK:
            return code
        return await ready.wait(args.timeout, output)
    finally:
        if ready is not None:
            ready.close()


async def _cmd_console(client: Client, output: Output, args: argparse.Namespace) -> int:
    if not args.show_log:
        raise _UsageError(
            "vmready console attaches to nothing yet: use --show-log to print the console log"
        )
    log = await client.get_raw(f"{_instance_path(args.name)}/console")
    output.raw(log)
    return EXIT_OK


async def _cmd_list(client: Client, output: Output, args: argparse.Namespace) -> int:
    instances = await client.get("/1.0/instances?recursion=1")
    output.data(instances, _instances_table)
    return EXIT_OK


async def _cmd_info(client: Client, output: Output, args: argparse.Namespace) -> int:
    output.data(await _instance(client, args.name), _info_table)
    return EXIT_OK


async def _cmd_state(client: Client, output: Output, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"action": args.command}
    if getattr(args, "force", False):
        body["force"] = True
    if getattr(args, "timeout", None) is not None:
        body["timeout"] = args.timeout
    operation = await client.operation("PUT", _instance_path(args.name, "state"), body)
    return await _finish_action(client, output, args.name, operation, args)


async def _cmd_instance_action(client: Client, output: Output, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.command == "resize":
        if args.memory is None and args.cpus is None:
            raise _UsageError("resize needs --memory and/or --cpus")
        if args.memory is not None:
            body["memory"] = args.memory
        if args.cpus is not None:
            body["cpus"] = args.cpus
    path = _instance_path(args.name, "actions", args.command)
    operation = await client.operation("POST", path, body)
    return await _finish_action(client, output, args.name, operation, args)


async def _cmd_snapshot(client: Client, output: Output, args: argparse.Namespace) -> int:
    body = {"name": args.snapshot, "stateful": args.stateful}
    operation = await client.operation("POST", _instance_path(args.name, "snapshots"), body)
    return await _finish_action(client, output, args.name, operation, args)


async def _cmd_restore(client: Client, output: Output, args: argparse.Namespace) -> int:
    body = {"restore": args.snapshot, "stateful": args.stateful, "force": args.force}
    operation = await client.operation("PUT", _instance_path(args.name), body)
    return await _finish_action(client, output, args.name, operation, args)


async def _cmd_snapshots(client: Client, output: Output, args: argparse.Namespace) -> int:
    snapshots = await client.get(_instance_path(args.name, "snapshots"))
    output.data(snapshots, _snapshots_table)
    return EXIT_OK


async def _cmd_delete(client: Client, output: Output, args: argparse.Namespace) -> int:
    if not args.force:
        instance = await _instance(client, args.name)
        if str(instance["status"]).lower() in _RUNNING_STATUSES:
            raise CommandError(
                f"Error: instance {args.name} is {str(instance['status']).upper()}: "
                "stop it first or pass --force"
            )
    operation = await client.operation("DELETE", _instance_path(args.name))
    return await _finish_action(client, output, args.name, operation, args)


async def _cmd_actions(client: Client, output: Output, args: argparse.Namespace) -> int:
    output.data(await client.get(_instance_path(args.name, "actions")), _actions_table)
    return EXIT_OK


async def _cmd_monitor(client: Client, output: Output, args: argparse.Namespace) -> int:
    types = [part for value in args.type for part in value.split(",") if part]
    printing_failed: Deferred[int] = Deferred()

    def show(event: dict[str, Any]) -> None:
        try:
            if output.format == "json":
                output.line(json.dumps(event))
            elif output.format == "yaml":
                output.text("---\n" + to_yaml(event))
            else:
                output.line(_event_line(event))
        except OSError:
            # stdout went away (``vmready monitor | head``): that ends the monitor.
            if not printing_failed.called:
                printing_failed.callback(EXIT_OK)

    stream = await client.events(types, show)
    printing_failed.addCallback(lambda _: stream.close())
    try:
        why = await stream.ended
    finally:
        stream.close()  # when cancelled (a signal): before the reactor drops the connection
    if why is not None:
        raise CommandError(why, EXIT_USAGE)
    return EXIT_OK


def _parse_condition(condition: str) -> str:
    if condition.strip().lower() == "agent":
        return AGENT_CONDITION
    key, sep, value = condition.partition("=")
    if not sep or key.strip().lower() != "status":
        raise _UsageError(f"unknown condition {condition!r}: expected status=<status> or agent")
    status = value.strip().lower()
    if status not in WAIT_STATUSES:
        raise _UsageError(
            f"unknown status {value.strip()!r} in {condition!r}: "
            f"expected one of {', '.join(WAIT_STATUSES)}"
        )
    return status


class Waiter:
    """``wait``: subscribe to lifecycle events, check the instance once, wake on the event."""

    def __init__(self, client: Client, name: str, status: str) -> None:
        self.client = client
        self.name = name
        self.status = status
        self.wanted = _SATISFIES.get(status, frozenset({status}))
        self.last_status: str | None = None
        self.saw_event = False
        self.outcome: Deferred[tuple[int, str | None]] = Deferred()
        self._stream: _LineStream | None = None
        self._source = _instance_path(name)

    async def subscribe(self) -> None:
        """Open the event stream; when this returns, the daemon has subscribed us."""
        self._stream = await self.client.events(["lifecycle"], self._event)
        self._stream.ended.addCallback(self._stream_ended)

    def close(self) -> None:
        """Stop listening."""
        if self._stream is not None:
            self._stream.close()

    async def wait(self, timeout: float | None, output: Output) -> int:
        """Check the current status, then wait for the event; the exit status."""
        try:
            instance = await _instance(self.client, self.name)
        except APIError as e:
            # Unknown instance or a daemon error; unless an event already decided.
            if not self.outcome.called:
                raise CommandError(f"Error: {e.error}", EXIT_USAGE) from None
        else:
            if self.status == AGENT_CONDITION:
                status = str((instance.get("agent") or {}).get("status", "unknown")).lower()
                if instance.get("status") == "Error":
                    status = "error"
            else:
                status = str(instance["status"]).lower()
            # A match is a match; anything else only counts when no event overtook the
            # answer (then it may be older than what the events said).
            if status in self.wanted or not self.saw_event:
                self._observe(status, str(instance.get("error") or "") or None)
        timer: IDelayedCall | None = None
        if timeout is not None and not self.outcome.called:
            timer = self.client.reactor.callLater(timeout, self._settle, EXIT_FAILED, None)
        try:
            code, message = await self.outcome
        finally:
            if timer is not None and timer.active():
                timer.cancel()
        if code == EXIT_FAILED:
            now = (self.last_status or "unknown").upper()
            if self.status == AGENT_CONDITION:
                raise CommandError(
                    f"timed out after {timeout:g}s waiting for the agent of {self.name} "
                    f"to connect (agent: {now})",
                    EXIT_FAILED,
                )
            raise CommandError(
                f"timed out after {timeout:g}s waiting for {self.name} status={self.status} "
                f"(status: {now})",
                EXIT_FAILED,
            )
        if code != EXIT_OK:
            raise CommandError(message or "wait failed", code)
        if self.status == AGENT_CONDITION:
            output.line(f"{self.name}: agent {(self.last_status or 'connected').upper()}")
            return EXIT_OK
        output.line(f"{self.name}: {(self.last_status or self.status).upper()}")
        return EXIT_OK

    def _event(self, event: dict[str, Any]) -> None:
        metadata = event.get("metadata") or {}
        if metadata.get("source") != self._source:
            return
        context = metadata.get("context") or {}
        action = metadata.get("action")
        self.saw_event = True
        if self.status == AGENT_CONDITION and action not in ("instance-deleted", "instance-error"):
            if str(action).startswith("instance-agent-") and context.get("status"):
                self._observe(str(context["status"]).lower(), None)
            return
        if action == "instance-deleted":
            self._observe("deleted", None)
        elif action == "instance-error":
            self._observe("error", str(context.get("error") or "") or None)
        elif action == "instance-ready":
            self._observe("ready", None)
        elif action == "instance-state" and context.get("status"):
            status = str(context["status"]).lower()
            if status == "error" and "error" not in self.wanted:
                # The state event does not carry the reason: ask for it, once.
                self.last_status = status
                Deferred.fromCoroutine(self._error_reason()).addCallback(
                    lambda reason: self._observe("error", reason)
                )
            else:
                self._observe(status, None)

    async def _error_reason(self) -> str | None:
        try:
            instance = await _instance(self.client, self.name)
        except CommandError:
            return None
        return str(instance.get("error") or "") or None

    def _observe(self, status: str, error: str | None) -> None:
        self.last_status = status
        if status in self.wanted:
            self._settle(EXIT_OK, None)
        elif status == "deleted":
            self._settle(EXIT_GONE, f"instance {self.name} was deleted while waiting")
        elif status == "error":
            reason = f": {error}" if error else ""
            self._settle(EXIT_GONE, f"instance {self.name} went to ERROR while waiting{reason}")

    def _stream_ended(self, why: str | None) -> None:
        if why is not None:
            self._settle(EXIT_USAGE, why)

    def _settle(self, code: int, message: str | None) -> None:
        if not self.outcome.called:
            self.outcome.callback((code, message))


async def _cmd_wait(client: Client, output: Output, args: argparse.Namespace) -> int:
    status = _parse_condition(args.condition)
    waiter = Waiter(client, args.name, status)
    await waiter.subscribe()
    try:
        return await waiter.wait(args.timeout, output)
    finally:
        waiter.close()


_COMMANDS: dict[str, Callable[[Client, Output, argparse.Namespace], Any]] = {
    "launch": _cmd_launch,
    "list": _cmd_list,
    "info": _cmd_info,
    "start": _cmd_state,
    "stop": _cmd_state,
    "restart": _cmd_state,
    "freeze": _cmd_state,
    "unfreeze": _cmd_state,
    "rebuild": _cmd_instance_action,
    "resize": _cmd_instance_action,
    "confirm-resize": _cmd_instance_action,
    "revert-resize": _cmd_instance_action,
    "delete": _cmd_delete,
    "snapshot": _cmd_snapshot,
    "restore": _cmd_restore,
    "snapshots": _cmd_snapshots,
    "console": _cmd_console,
    "actions": _cmd_actions,
    "monitor": _cmd_monitor,
    "wait": _cmd_wait,
}


# -- the command line ---------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``run`` owns the exit status."""

    def error(self, message: str) -> NoReturn:
        """A usage error."""
        raise _UsageError(message, self.format_usage())


def _seconds(text: str) -> float:
    """A ``--timeout``: a finite number, 0 or more (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    # float() also accepts "nan" and "inf", which no timer can take.
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


_WAIT_HELP = """\
CONDITION is status=<status>, case-insensitive, one of:
  running (also met by ready), ready, stopped, frozen, error, starting,
  stopping, freezing;
or "agent": the instance's guest agent is connected to the daemon.

wait subscribes to the daemon's events first, then checks the instance once,
then wakes on the matching lifecycle event; it never polls.

exit status:
  0  the condition was met
  1  timed out (--timeout)
  2  usage error, unknown instance, or the daemon is unreachable or failed
  3  the instance was deleted or went to Error while waiting for another status
  130  interrupted (SIGINT, Ctrl-C); 143 for SIGTERM
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``vmready`` argument parser."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--socket",
        default=argparse.SUPPRESS,
        help="the daemon's API socket (default: $VMREADY_SOCKET or <data dir>/vmready.sock)",
    )
    common.add_argument(
        "--format",
        choices=FORMATS,
        default=argparse.SUPPRESS,
        help="output format where the output is data (default: table)",
    )
    action = _Parser(add_help=False)
    action.add_argument(
        "--no-wait",
        action="store_true",
        help="return once the operation is created instead of waiting for it",
    )

    parser = _Parser(
        prog="vmready",
        description="Operate vmready instances through the daemon's API.",
        epilog=(
            "exit status: 0 success; 1 the daemon refused or the action failed; "
            "2 usage error, unknown instance or no daemon; 130 interrupted (143: SIGTERM); "
            "see 'vmready wait -h' for wait"
        ),
    )
    parser.add_argument(
        "--socket", default=None, help="the daemon's API socket (also accepted after COMMAND)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="output format where the output is data (also accepted after COMMAND)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help: str, *parents: _Parser) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, parents=[common, *parents])

    launch = add("launch", "create and start an instance", action)
    launch.add_argument("name")
    launch.add_argument("--memory", help="memory, MiB or with a unit (512, 2GiB)")
    launch.add_argument("--cpus", type=int, help="number of vCPUs")
    launch.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key (user.*, cloud-init.*, limits.*); repeatable",
    )
    launch.add_argument("--image", metavar="PATH", help="boot this qcow2 or raw disk image")
    launch.add_argument("--kernel", metavar="PATH", help="boot this Linux kernel (bzImage)")
    launch.add_argument("--initrd", metavar="PATH", help="with --kernel: its initramfs")
    launch.add_argument("--append", metavar="TEXT", help="with --kernel: its command line")
    launch.add_argument(
        "--accel",
        choices=ACCEL_CHOICES,
        help="kvm, tcg, or auto (default: KVM where it runs guests, else TCG)",
    )
    launch.add_argument(
        "--wait", action="store_true", help="then wait until the workload reports Ready"
    )
    launch.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS", help="how long --wait waits at most"
    )

    add("list", "list instances with their status")
    add("info", "show one instance").add_argument("name")
    add("start", "start an instance", action).add_argument("name")
    for name, text in (("stop", "stop an instance"), ("restart", "restart an instance")):
        sub = add(name, text, action)
        sub.add_argument("name")
        sub.add_argument("--force", action="store_true", help="power off at once")
        sub.add_argument(
            "--timeout",
            type=_seconds,
            metavar="SECONDS",
            help="how long a clean shutdown may take before it is forced (default: the daemon's)",
        )
    for name, text in (
        ("freeze", "pause an instance's VM"),
        ("unfreeze", "resume a frozen instance"),
        ("rebuild", "rebuild an instance (also recovers one in Error)"),
    ):
        add(name, text, action).add_argument("name")
    resize = add(
        "resize", "change memory and/or vCPUs (then confirm-resize or revert-resize)", action
    )
    resize.add_argument("name")
    resize.add_argument("--memory", help="new memory, MiB or with a unit")
    resize.add_argument("--cpus", type=int, help="new number of vCPUs")
    add("confirm-resize", "keep the new size of a resized instance", action).add_argument("name")
    add("revert-resize", "go back to the size before the resize", action).add_argument("name")
    delete = add("delete", "delete an instance", action)
    delete.add_argument("name")
    delete.add_argument("--force", action="store_true", help="delete even if it is running")
    snapshot = add(
        "snapshot", "take a snapshot of an instance (its config; --stateful: its VM)", action
    )
    snapshot.add_argument("name")
    snapshot.add_argument("snapshot", metavar="SNAPSHOT")
    snapshot.add_argument(
        "--stateful",
        action="store_true",
        help="also save the running VM's state (it pauses while QEMU writes it)",
    )
    restore = add("restore", "restore an instance from one of its snapshots", action)
    restore.add_argument("name")
    restore.add_argument("snapshot", metavar="SNAPSHOT")
    restore.add_argument(
        "--stateful", action="store_true", help="resume the VM from the saved state"
    )
    restore.add_argument(
        "--force",
        action="store_true",
        help="with --stateful: let QEMU try even if the device set changed since the snapshot",
    )
    console = add("console", "show an instance's serial console")
    console.add_argument("name")
    console.add_argument(
        "--show-log", action="store_true", help="print the console log (what the guest wrote)"
    )
    add("snapshots", "list an instance's snapshots").add_argument("name")
    add("actions", "show an instance's action history").add_argument("name")
    monitor = add("monitor", "print events as they happen, until interrupted")
    monitor.add_argument(
        "--type",
        action="append",
        default=[],
        help="event types to show: lifecycle, operation (default: all); repeatable",
    )
    wait = commands.add_parser(
        "wait",
        help="wait until an instance reaches a status, or its agent connects",
        description="Wait until an instance reaches a status.",
        epilog=_WAIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    wait.add_argument("name")
    wait.add_argument("condition", metavar="CONDITION", help="status=<status>, or agent")
    wait.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS", help="give up after this many seconds"
    )
    replay = commands.add_parser(
        "replay",
        help="replay a recorded session against a fresh in-memory daemon (no daemon needed)",
        description=(
            "Replay a transcript (recorded by twistd vmready --record-dir, vmready.record=true "
            "or vmready-agent --record) against a fresh daemon core and a fakeqemu VM on a "
            "deterministic clock, and compare what the host does with the recording."
        ),
        epilog=(
            "exit status: 0 the host did what it did in the recording; 1 it diverged (the "
            "first divergence is printed); 2 the transcript is malformed or of an "
            "unsupported version (its line is named)"
        ),
    )
    replay.add_argument("file", metavar="FILE", help="the transcript (JSON lines)")
    replay.add_argument(
        "--realtime",
        action="store_true",
        help="replay at the recorded pace, printing each record (default: as fast as possible)",
    )
    return parser


def _replayed_line(entry: Any) -> str:
    """What ``vmready replay --realtime`` prints for a record it just replayed."""
    from vmready.protocols.transcript import data_from_fields

    shown = entry.fields.get("text")
    if shown is None and entry.kind in ("ring-read", "ring-write"):
        shown = data_from_fields(entry.fields).decode("utf-8", "replace")
    detail = {k: v for k, v in entry.fields.items() if k not in ("text", "data", "body")}
    text = json.dumps(shown) if shown is not None else json.dumps(detail)
    return f"t={entry.t:.3f}s line {entry.line}: {entry.kind} {text[:100]}"


async def _cmd_replay(reactor: Any, output: Output, args: argparse.Namespace) -> int:
    """``vmready replay FILE``: runs in this process; the daemon is not involved."""
    from vmready.protocols.transcript import TranscriptError
    from vmready.record.replay import replay, replay_realtime

    try:
        if args.realtime:
            # Each record at its recorded time: wait, replay it, then say it.
            result = await replay_realtime(
                args.file, reactor, lambda entry: output.line(_replayed_line(entry))
            )
        else:
            result = replay(args.file)
    except TranscriptError as e:
        output.error(str(e))
        return EXIT_USAGE
    output.line(result.describe())
    return EXIT_OK if result.matched else EXIT_FAILED


async def run(
    reactor: Any,
    argv: Sequence[str],
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """Run one ``vmready`` command line; returns the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    parser = build_parser()
    output = Output(out, err, "table")
    try:
        args = parser.parse_args(list(argv))
        output.format = args.format
        if args.command == "replay":
            return await _cmd_replay(reactor, output, args)
        client = Client(reactor, args.socket or default_socket())
        result: int = await _COMMANDS[args.command](client, output, args)
        return result
    except _UsageError as e:
        output.usage(e.usage)
        output.error(f"error: {e}")
        return EXIT_USAGE
    except CommandError as e:
        output.error(e.message)
        return e.exit_code
    except SystemExit as e:
        # argparse's --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE


class _ConsoleRun:
    """One command line run in the reactor, ended by its result or by SIGINT/SIGTERM.

    A signal cancels the command, so its event stream and requests close as it
    unwinds and it reports nothing, then stops the reactor: exit 128 + signal.
    The reactor is stopped once, by whichever comes first.
    """

    def __init__(self, reactor: Any, argv: Sequence[str]) -> None:
        self._reactor = reactor
        self._argv = argv
        self._command: Deferred[int] | None = None
        self._stopping = False
        self.exit_code: int | None = None
        self.failure: Failure | None = None

    def start(self) -> None:
        """Take over SIGINT and SIGTERM from the reactor's handlers, then run the command."""
        self._reactor.addSystemEventTrigger("before", "shutdown", self._shutting_down)
        for signum in (signal.SIGINT, signal.SIGTERM):
            # An ignored SIGINT (a background job of a non-interactive shell) stays ignored.
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self._signalled)
        self._command = Deferred.fromCoroutine(run(self._reactor, self._argv))
        self._command.addBoth(self._finished)

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        # Runs between any two bytecodes: hand over to the reactor, as Twisted's handlers do.
        self._reactor.callFromThread(self.interrupt, 128 + signum)

    def interrupt(self, exit_code: int) -> None:
        """End with ``exit_code`` unless the command already ended: cancel it, stop the reactor."""
        if self.exit_code is None:
            self.exit_code = exit_code
            if self._command is not None:
                self._command.cancel()
        self._stop()

    def _finished(self, result: int | Failure) -> None:
        if self.exit_code is None:
            if isinstance(result, Failure):
                self.failure = result
                self.exit_code = EXIT_FAILED
            else:
                self.exit_code = result
        # Else interrupted: how the cancelled command ended (CancelledError) is no news.
        self._stop()

    def _shutting_down(self) -> None:
        # The reactor stops, maybe not by us: nothing may call stop() again.
        self._stopping = True
        self.interrupt(EXIT_INTERRUPTED)

    def _stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._reactor.stop()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``vmready`` console script."""
    from twisted.internet import reactor

    console = _ConsoleRun(reactor, sys.argv[1:] if argv is None else argv)
    reactor.callWhenRunning(console.start)
    try:
        reactor.run()
    except KeyboardInterrupt:
        # Ctrl-C before ``start`` took SIGINT over.
        sys.exit(EXIT_INTERRUPTED)
    if console.failure is not None:
        sys.stderr.write(f"vmready: internal error: {console.failure.getErrorMessage()}\n")
        console.failure.printTraceback(sys.stderr)
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_INTERRUPTED if console.exit_code is None else console.exit_code)


if __name__ == "__main__":
    main()
