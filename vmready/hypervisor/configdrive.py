"""Each instance's config drive: what its guest needs to run the agent, in one directory.

The directory lives in the instance's run directory and is exported read-only
to the guest over virtio-9p with mount tag ``config`` (one export per VM: no
guest sees another's).  A fakeqemu guest, a host process, reads it directly.
It holds::

    agent.crt, agent.key       the instance's client certificate and key (0600)
    server.crt                 the daemon's certificate, which the agent pins
    agent.json                 the agent's settings: instance, serial port, transport
    vmready-agent.pyz          the agent (standard library only, Python >= 3.9)
    install.sh                 the loader's installer, run once in a systemd guest
    systemd/…, udev/…          the loader: a unit that copies the drive and starts the agent
    cloud-init/meta-data       instance-id and local-hostname
    cloud-init/user-data       the instance's cloud-init.user-data (empty when unset)

The certificates are written once, when the instance gets its identity; the
rest is rewritten before every boot, so a guest always boots the agent and
settings of the daemon that starts it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping

import attrs

from vmready.trust.certs import CertificatePair, write_private

__all__ = [
    "AGENT_CONFIG",
    "AGENT_ZIPAPP",
    "CLOUD_INIT_DIR",
    "USER_DATA_KEY",
    "DriveContents",
    "meta_data",
    "write_identity",
    "write_settings",
]

AGENT_CONFIG = "agent.json"
AGENT_ZIPAPP = "vmready-agent.pyz"
CLOUD_INIT_DIR = "cloud-init"
USER_DATA_KEY = "cloud-init.user-data"
_EXECUTABLE_SUFFIXES = (".sh", "-setup")


@attrs.frozen
class DriveContents:
    """What every drive carries besides its identity: the agent and its loader."""

    # The built zipapp to copy in (None: no agent file, as for tests of the drive itself).
    agent_zipapp: str | None = None
    # Loader files by their path on the drive.
    loader: Mapping[str, bytes] = attrs.field(factory=dict)


def meta_data(instance_uuid: str, name: str, extra: str = "") -> str:
    """cloud-init's meta-data (the guest API's ``/1.0/meta-data``): uuid, name, user.meta-data."""
    return f"instance-id: {instance_uuid}\nlocal-hostname: {name}\n{extra}"


def write_identity(directory: str, client: CertificatePair, server_cert_pem: bytes) -> None:
    """The instance's client pair and the daemon's certificate (all 0600)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_private(os.path.join(directory, "agent.key"), client.key_pem)
    write_private(os.path.join(directory, "agent.crt"), client.cert_pem)
    write_private(os.path.join(directory, "server.crt"), server_cert_pem)


def _write(path: str, data: bytes, mode: int) -> None:
    """Replace ``path`` atomically (a guest reading the drive never sees half a file).

    The partial file is the owner's alone until whole (user-data may hold
    secrets); it gets ``mode`` just before it takes the place of ``path``.
    """
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    partial = path + ".tmp"
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # a partial left by a crash keeps its mode otherwise
            f.write(data)
        os.chmod(partial, mode)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _loader_path(directory: str, relative: str) -> str:
    """Where a loader file goes: inside the drive, or ValueError."""
    parts = relative.split("/")
    if relative.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"loader file {relative!r} is not a plain path inside the drive")
    return os.path.join(directory, *parts)


def write_settings(
    directory: str,
    settings: Mapping[str, str],
    contents: DriveContents,
    instance_uuid: str,
    name: str,
    user_data: str,
    extra_meta_data: str = "",
) -> None:
    """agent.json, the agent, the loader and the cloud-init files, refreshed before a boot."""
    loader = {_loader_path(directory, file): data for file, data in contents.loader.items()}
    os.makedirs(directory, mode=0o700, exist_ok=True)
    encoded = json.dumps(dict(settings), indent=2, sort_keys=True) + "\n"
    _write(os.path.join(directory, AGENT_CONFIG), encoded.encode("utf-8"), 0o644)
    if contents.agent_zipapp is not None:
        with open(contents.agent_zipapp, "rb") as f:
            _write(os.path.join(directory, AGENT_ZIPAPP), f.read(), 0o644)
    for path, data in loader.items():
        executable = path.endswith(_EXECUTABLE_SUFFIXES)
        _write(path, data, 0o755 if executable else 0o644)
    cloud_init = os.path.join(directory, CLOUD_INIT_DIR)
    _write(
        os.path.join(cloud_init, "meta-data"),
        meta_data(instance_uuid, name, extra_meta_data).encode(),
        0o644,
    )
    _write(os.path.join(cloud_init, "user-data"), user_data.encode("utf-8"), 0o600)
