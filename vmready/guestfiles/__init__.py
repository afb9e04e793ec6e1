"""The vmready agent loader: the files every instance's config drive carries to install the agent.

Like LXD's ``install.sh`` and ``lxd-agent.service``: run ``install.sh`` once in a
systemd guest and the guest starts ``vmready-agent`` from the config drive on
every boot (docs/guest-image.md).  In a stock cloud image the vendor-data's
boothook (``cloud-init/vmready-boothook``) runs ``install.sh`` from the NoCloud
seed at every boot (docs/real-guests.md).
"""

from __future__ import annotations

from importlib import resources

__all__ = ["BOOTHOOK", "LOADER_FILES", "boothook", "executable", "loader_files"]

# Paths on the config drive, as in this package.
LOADER_FILES = (
    "install.sh",
    "systemd/vmready-agent.service",
    "systemd/vmready-agent-setup",
    "systemd/cloud-init-local.conf",
    "udev/99-vmready-agent.rules",
)
# The vendor-data boothook that runs install.sh from a stock image's NoCloud seed.
BOOTHOOK = "cloud-init/vmready-boothook"


def _read(name: str) -> bytes:
    node = resources.files(__name__)
    for part in name.split("/"):
        node = node.joinpath(part)
    return node.read_bytes()


def loader_files() -> dict[str, bytes]:
    """The loader's files keyed by their path on the config drive."""
    return {name: _read(name) for name in LOADER_FILES}


def boothook() -> bytes:
    """The vendor-data boothook (``#cloud-boothook``) every NoCloud seed carries."""
    return _read(BOOTHOOK)


def executable(name: str) -> bool:
    """Whether the loader file at config-drive path ``name`` must be written mode 0755."""
    return name.endswith((".sh", "-setup"))
