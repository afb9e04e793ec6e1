"""Each instance's config drive: what its guest needs to run the agent, in one directory.

The directory lives in the instance's run directory and is exported read-only
to the guest over virtio-9p with mount tag ``config`` (one export per VM: no
guest sees another's).  A fakeqemu guest, a host process, reads it directly.
It holds::

    agent.crt, agent.key       the instance's client certificate and key (0600)
    server.crt                 the daemon's certificate, which the agent pins
    agent.json                 the agent's settings: instance, serial port, transport
    guest-api.json             this boot's meta-data, guest-visible config and devices (0600):
                               the agent answers them before its link to the host is up
    vmready-agent.pyz          the agent (standard library only, Python >= 3.9)
    install.sh                 the loader's installer, run once in a systemd guest
    systemd/…, udev/…          the loader: a unit that copies the drive and starts the agent
    cloud-init/meta-data       instance-id and local-hostname
    cloud-init/user-data       the instance's user-data (empty when unset)

A VM that boots a disk image also gets the same files, with cloud-init's, on
its NoCloud seed (``vmready.hypervisor.nocloud``), written beside the drive:
kernels without 9p read that.  The certificates are written once, when the
instance gets its identity; the rest is rewritten before every boot, so a
guest always boots the agent, settings and data of the daemon that starts it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping

import attrs

from vmready.domain import HypervisorError
from vmready.hypervisor.guestdata import GuestData
from vmready.hypervisor.nocloud import seed_path, write_seed
from vmready.trust import CertificatePair, write_private

AGENT_CONFIG = "agent.json"
AGENT_ZIPAPP = "vmready-agent.pyz"
CLOUD_INIT_DIR = "cloud-init"
# What the agent reads as ``vmready.agent.bootdata.BOOT_DATA``.
GUEST_API = "guest-api.json"
_EXECUTABLE_SUFFIXES = (".sh", "-setup")


@attrs.frozen
class DriveContents:
    """What every drive carries besides its identity: the agent and its loader."""

    # The built zipapp to copy in (None: no agent file, as for tests of the drive itself).
    agent_zipapp: str | None = None
    # Loader files by their path on the drive.
    loader: Mapping[str, bytes] = attrs.field(factory=dict)


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
    guest: GuestData,
) -> None:
    """Refresh the drive for the next boot: settings, agent, loader, the guest's data; its seed.

    HypervisorError, and nothing written, when the guest's data is more than a
    guest is given.
    """
    problem = guest.problem()
    if problem is not None:
        raise HypervisorError(f"cannot prepare the boot of {guest.name}: {problem}")
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
    _write(os.path.join(cloud_init, "meta-data"), guest.meta_data.encode(), 0o644)
    _write(os.path.join(cloud_init, "user-data"), guest.user_data.encode("utf-8"), 0o600)
    _write(os.path.join(directory, GUEST_API), guest.guest_api(), 0o600)
    if guest.image:
        write_seed(seed_path(directory), guest, directory)
