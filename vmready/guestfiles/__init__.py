"""The vmready agent loader: the files every instance's config drive carries to install the agent.

Like LXD's ``install.sh`` and ``lxd-agent.service``: run ``install.sh`` once in a
systemd guest and the guest starts ``vmready-agent`` from the config drive on
every boot (docs/guest-image.md).
"""

from __future__ import annotations

from importlib import resources

__all__ = ["LOADER_FILES", "executable", "loader_files"]

# Paths on the config drive, as in this package.
LOADER_FILES = (
    "install.sh",
    "systemd/vmready-agent.service",
    "systemd/vmready-agent-setup",
    "udev/99-vmready-agent.rules",
)


def loader_files() -> dict[str, bytes]:
    """The loader's files keyed by their path on the config drive."""
    package = resources.files(__name__)
    files = {}
    for name in LOADER_FILES:
        node = package
        for part in name.split("/"):
            node = node.joinpath(part)
        files[name] = node.read_bytes()
    return files


def executable(name: str) -> bool:
    """Whether the loader file at config-drive path ``name`` must be written mode 0755."""
    return name.endswith((".sh", "-setup"))
