"""What the agent needs to run: its config drive, merged with command-line options.

The host writes a config drive for every instance, a directory holding:

- ``agent.crt``, ``agent.key``: the instance's client certificate and key;
- ``server.crt``: the daemon's certificate, the only one the agent accepts;
- ``agent.json`` (optional): ``instance``, ``port`` (the serial port name the
  host wired), ``transport``, ``network_mac`` and ``network_address`` (the
  fallback transport's NIC), and for fakeqemu guests ``virtio_ports``,
  ``devlxd_socket``, ``state_dir`` and ``tcp_sockets``; every key optional;
  relative paths are relative to the drive; unknown keys are ignored with a
  warning;
- ``guest-api.json`` (optional): this boot's meta-data, config and devices,
  answered while the host link is down (``vmready.agent.bootdata``).

A command-line option wins over ``agent.json``, which wins over the defaults
for a real guest below.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vmready.agent.bootdata import BootData, load_boot_data
from vmready.agent.logs import logger
from vmready.agent.network import DEFAULT_SYSFS_NET, NetworkPlan, parse_network
from vmready.agent.options import (
    DEFAULT_CONFIG_DRIVE,
    DEFAULT_HEARTBEAT,
    DEFAULT_RETRIES,
    DEFAULT_SOCKET,
    ConfigError,
    parse_count,
    parse_seconds,
    split_transport,
)
from vmready.agent.ports import (
    CONNECT_PORT_NAME,
    DEFAULT_DEV,
    DEFAULT_SYSFS_PORTS,
    DEFAULT_VIRTIO_PORTS,
    is_port_name,
    port_names,
)
from vmready.agent.tls import KeyMismatch, TLSConfigError, client_context

if TYPE_CHECKING:
    import ssl

DEFAULT_TRANSPORT = "vsock"
DEFAULT_STATE_DIR = "/run/vmready-agent"

CLIENT_CERT = "agent.crt"
CLIENT_KEY = "agent.key"
SERVER_CERT = "server.crt"
SETTINGS = "agent.json"
# agent.json key → option name (the command line's, or an internal one)
_DRIVE_KEYS = {
    "instance": "instance",
    "port": "port",
    "connect_port": "connect-port",
    "virtio_ports": "virtio-ports",
    "transport": "transport",
    "devlxd_socket": "socket",
    "state_dir": "state-dir",
    "tcp_sockets": "tcp-sockets",
    "network_mac": "network-mac",
    "network_address": "network-address",
}
_PATH_KEYS = ("virtio_ports", "devlxd_socket", "state_dir", "tcp_sockets")

log = logger(__name__)


@dataclass(frozen=True)
class Transport:
    """How to reach a vsock address: real vsock, or hybrid vsock (unix ``<path>_<port>``)."""

    kind: str  # "vsock" or "hvsock"
    path: str = ""

    def __str__(self) -> str:
        return self.kind if self.kind == "vsock" else f"hvsock:{self.path}"


def parse_transport(text: str) -> Transport:
    """``vsock`` or ``hvsock:<path>`` → Transport; ConfigError otherwise."""
    return Transport(*split_transport(text))


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent is built from."""

    client_cert: str  # paths: ssl loads the pair from files
    client_key: str
    server_cert_pem: bytes
    transport: Transport
    socket: str = DEFAULT_SOCKET
    state_dir: str = DEFAULT_STATE_DIR
    virtio_ports: str = DEFAULT_VIRTIO_PORTS
    # Where to look a port's name up without udev; None: only in virtio_ports (fakeqemu).
    virtio_sysfs: str | None = DEFAULT_SYSFS_PORTS
    dev_dir: str = DEFAULT_DEV
    # The port names to try, in order: the one the host wired first.
    ports: tuple[str, ...] = port_names(None)
    # The port the host writes its CONNECT lines to.
    connect_port: str = CONNECT_PORT_NAME
    serial: str | None = None
    heartbeat: float = DEFAULT_HEARTBEAT
    retries: int = DEFAULT_RETRIES
    instance: str | None = None
    # ``--record FILE``: write the agent's side of the session there (a transcript).
    record: str | None = None
    # fakeqemu guests: the unix sockets standing for the guest's TCP addresses.
    tcp_sockets: str | None = None
    # The fallback transport's NIC, configured before a tcp: dial.
    network: NetworkPlan | None = None
    sysfs_net: str = DEFAULT_SYSFS_NET
    # This boot's meta-data, config and devices: answered while the host link is down.
    boot_data: BootData | None = None
    # The TLS context load_config built checking the identity, for build_agent to use
    # (None: build_agent builds it; each build parses the files again).
    tls: ssl.SSLContext | None = field(default=None, compare=False, repr=False)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def _check_identity(drive: str) -> tuple[str, str, bytes, ssl.SSLContext]:
    """The client pair's paths, the server certificate, and the TLS context that ssl built
    from them (checking them as it did)."""
    cert, key, server = (os.path.join(drive, n) for n in (CLIENT_CERT, CLIENT_KEY, SERVER_CERT))
    _read(key)  # a missing or unreadable key says so first
    _read(cert)
    server_pem = _read(server)
    try:
        context = client_context(cert, key, server_pem, server)
    except KeyMismatch:
        raise ConfigError(f"{CLIENT_KEY} does not belong to {CLIENT_CERT} in {drive}") from None
    except TLSConfigError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename}: {e.strerror or e}") from None
    return cert, key, server_pem, context


def _settings(drive: str) -> dict[str, Any]:
    """agent.json, with option names as keys; absent file → empty."""
    path = os.path.join(drive, SETTINGS)
    if not os.path.exists(path):
        return {}
    try:
        raw = json.loads(_read(path))
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        option = _DRIVE_KEYS.get(key)
        if option is None:
            log.warning("ignoring unknown key %r in %s", key, path)
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: {key} must be a non-empty string")
        if key in _PATH_KEYS:
            value = os.path.join(drive, value)  # an absolute value stays as it is
        settings[option] = value
    return settings


def _network(merged: Mapping[str, Any], drive: str) -> NetworkPlan | None:
    mac, address = merged.get("network-mac"), merged.get("network-address")
    if mac is None and address is None:
        return None
    if mac is None or address is None:
        raise ConfigError(
            f"{os.path.join(drive, SETTINGS)}: network_mac and network_address go together"
        )
    try:
        return parse_network(mac, address)
    except ValueError as e:
        raise ConfigError(f"{os.path.join(drive, SETTINGS)}: {e}") from None


def _port(name: str | None, drive: str) -> tuple[str, ...]:
    if name is not None and not is_port_name(name):
        raise ConfigError(f"{os.path.join(drive, SETTINGS)}: port {name!r} is not a port name")
    return port_names(name)


def load_config(options: Mapping[str, Any]) -> AgentConfig:
    """Read the config drive named by ``options["config-drive"]`` and apply ``options``.

    ``options`` uses the command-line names (``serial``, ``virtio-ports``,
    ``transport``, ``socket``, ``state-dir``, ``heartbeat``, ``retries``,
    ``record``); a missing or None value falls back to agent.json, then to the
    default.
    """
    drive = os.path.abspath(options.get("config-drive") or DEFAULT_CONFIG_DRIVE)
    if not os.path.isdir(drive):
        raise ConfigError(f"config drive {drive} is not a directory")
    cert, key, server_pem, context = _check_identity(drive)
    merged = {**_settings(drive), **{k: v for k, v in options.items() if v is not None}}
    virtio_ports = merged.get("virtio-ports")
    return AgentConfig(
        client_cert=cert,
        client_key=key,
        server_cert_pem=server_pem,
        transport=parse_transport(merged.get("transport", DEFAULT_TRANSPORT)),
        socket=os.path.abspath(merged.get("socket", DEFAULT_SOCKET)),
        state_dir=os.path.abspath(merged.get("state-dir", DEFAULT_STATE_DIR)),
        virtio_ports=os.path.abspath(virtio_ports or DEFAULT_VIRTIO_PORTS),
        # A named ports directory is a fakeqemu guest's: the host's sysfs is not its own.
        virtio_sysfs=None if virtio_ports else DEFAULT_SYSFS_PORTS,
        ports=_port(merged.get("port"), drive),
        connect_port=merged.get("connect-port") or CONNECT_PORT_NAME,
        serial=os.path.abspath(merged["serial"]) if merged.get("serial") else None,
        heartbeat=parse_seconds(merged.get("heartbeat", DEFAULT_HEARTBEAT), "heartbeat"),
        retries=parse_count(merged.get("retries", DEFAULT_RETRIES), "retries"),
        instance=merged.get("instance"),
        record=os.path.abspath(merged["record"]) if merged.get("record") else None,
        tcp_sockets=os.path.abspath(merged["tcp-sockets"]) if merged.get("tcp-sockets") else None,
        network=_network(merged, drive),
        boot_data=load_boot_data(drive),
        tls=context,
    )
