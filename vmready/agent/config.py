"""What the agent needs to run: its config drive, merged with command-line options.

The host writes a config drive for every instance, a directory holding:

- ``agent.crt``, ``agent.key``: the instance's client certificate and key;
- ``server.crt``: the daemon's certificate, the only one the agent accepts;
- ``agent.json`` (optional): ``instance``, ``virtio_ports``, ``transport``,
  ``devlxd_socket``, ``state_dir``; every key optional; relative paths are
  relative to the drive.

A command-line option wins over ``agent.json``, which wins over the defaults
for a real guest below.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from twisted.logger import Logger

from vmready.certs import CertificatePair

__all__ = [
    "DEFAULT_CONFIG_DRIVE",
    "DEFAULT_SOCKET",
    "DEFAULT_STATE_DIR",
    "DEFAULT_VIRTIO_PORTS",
    "AgentConfig",
    "ConfigError",
    "Transport",
    "load_config",
    "parse_count",
    "parse_seconds",
    "parse_transport",
]

DEFAULT_CONFIG_DRIVE = "/var/lib/vmready-agent/config"
DEFAULT_VIRTIO_PORTS = "/dev/virtio-ports"
DEFAULT_TRANSPORT = "vsock"
DEFAULT_SOCKET = "/dev/lxd/sock"
DEFAULT_STATE_DIR = "/run/vmready-agent"
DEFAULT_HEARTBEAT = 5.0
DEFAULT_RETRIES = 3

CLIENT_CERT = "agent.crt"
CLIENT_KEY = "agent.key"
SERVER_CERT = "server.crt"
SETTINGS = "agent.json"
# agent.json key → option name
_DRIVE_KEYS = {
    "instance": "instance",
    "virtio_ports": "virtio-ports",
    "transport": "transport",
    "devlxd_socket": "socket",
    "state_dir": "state-dir",
}
_PATH_KEYS = ("virtio_ports", "devlxd_socket", "state_dir")

log = Logger()


class ConfigError(Exception):
    """The configuration cannot work; the message is one line for the operator."""


@attrs.frozen
class Transport:
    """How to reach the host: real vsock, or hybrid vsock (unix sockets ``<path>_<port>``)."""

    kind: str  # "vsock" or "hvsock"
    path: str = ""

    def __str__(self) -> str:
        return self.kind if self.kind == "vsock" else f"hvsock:{self.path}"


def parse_transport(text: str) -> Transport:
    """``vsock`` or ``hvsock:<path>`` → Transport; ConfigError otherwise."""
    if text == "vsock":
        return Transport("vsock")
    kind, colon, path = text.partition(":")
    if kind == "hvsock" and colon and path:
        return Transport("hvsock", path)
    raise ConfigError(f"transport {text!r} is neither 'vsock' nor 'hvsock:<path>'")


@attrs.frozen
class AgentConfig:
    """Everything the agent service is built from."""

    identity: CertificatePair
    server_cert_pem: bytes
    transport: Transport
    socket: str = DEFAULT_SOCKET
    state_dir: str = DEFAULT_STATE_DIR
    virtio_ports: str = DEFAULT_VIRTIO_PORTS
    serial: str | None = None
    heartbeat: float = DEFAULT_HEARTBEAT
    retries: int = DEFAULT_RETRIES
    instance: str | None = None
    # ``--record FILE``: write the agent's side of the session there (a transcript).
    record: str | None = None


def _read(drive: str, name: str) -> bytes:
    path = os.path.join(drive, name)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def _certificate(drive: str, name: str) -> bytes:
    pem = _read(drive, name)
    try:
        x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise ConfigError(f"{os.path.join(drive, name)} is not a PEM certificate") from None
    return pem


def _public_der(key: Any) -> bytes:
    der: bytes = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return der


def _identity(drive: str) -> CertificatePair:
    cert_pem = _certificate(drive, CLIENT_CERT)
    key_pem = _read(drive, CLIENT_KEY)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise ConfigError(
            f"{os.path.join(drive, CLIENT_KEY)} is not an unencrypted PEM private key"
        ) from None
    if _public_der(key.public_key()) != _public_der(
        x509.load_pem_x509_certificate(cert_pem).public_key()
    ):
        raise ConfigError(f"{CLIENT_KEY} does not belong to {CLIENT_CERT} in {drive}")
    return CertificatePair(cert_pem, key_pem)


def _settings(drive: str) -> dict[str, Any]:
    """agent.json, with option names as keys; absent file → empty."""
    path = os.path.join(drive, SETTINGS)
    if not os.path.exists(path):
        return {}
    try:
        raw = json.loads(_read(drive, SETTINGS))
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        option = _DRIVE_KEYS.get(key)
        if option is None:
            log.warn("ignoring unknown key {key!r} in {path}", key=key, path=path)
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: {key} must be a non-empty string")
        if key in _PATH_KEYS:
            value = os.path.join(drive, value)  # an absolute value stays as it is
        settings[option] = value
    return settings


def parse_seconds(value: Any, name: str) -> float:
    """A positive, finite number of seconds for option ``--name``; ConfigError otherwise."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} must be a number of seconds, not {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"--{name} must be a positive number of seconds, not {value!r}")
    return seconds


def parse_count(value: Any, name: str) -> int:
    """A whole number, zero or more, for option ``--name``; ConfigError otherwise."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} must be a whole number, not {value!r}") from None
    if count < 0:
        raise ConfigError(f"--{name} must be zero or more, not {value!r}")
    return count


def load_config(options: Mapping[str, Any]) -> AgentConfig:
    """Read the config drive named by ``options["config-drive"]`` and apply ``options``.

    ``options`` uses the command-line names (``serial``, ``virtio-ports``,
    ``transport``, ``socket``, ``state-dir``, ``heartbeat``, ``retries``); a
    missing or None value falls back to agent.json, then to the default.
    """
    drive = os.path.abspath(options.get("config-drive") or DEFAULT_CONFIG_DRIVE)
    if not os.path.isdir(drive):
        raise ConfigError(f"config drive {drive} is not a directory")
    identity = _identity(drive)
    server_cert_pem = _certificate(drive, SERVER_CERT)
    merged = {**_settings(drive), **{k: v for k, v in options.items() if v is not None}}
    return AgentConfig(
        identity=identity,
        server_cert_pem=server_cert_pem,
        transport=parse_transport(merged.get("transport", DEFAULT_TRANSPORT)),
        socket=os.path.abspath(merged.get("socket", DEFAULT_SOCKET)),
        state_dir=os.path.abspath(merged.get("state-dir", DEFAULT_STATE_DIR)),
        virtio_ports=os.path.abspath(merged.get("virtio-ports", DEFAULT_VIRTIO_PORTS)),
        serial=os.path.abspath(merged["serial"]) if merged.get("serial") else None,
        heartbeat=parse_seconds(merged.get("heartbeat", DEFAULT_HEARTBEAT), "heartbeat"),
        retries=parse_count(merged.get("retries", DEFAULT_RETRIES), "retries"),
        instance=merged.get("instance"),
        record=os.path.abspath(merged["record"]) if merged.get("record") else None,
    )
