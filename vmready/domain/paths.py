"""Where vmready keeps its data by default, shared by the daemon and the CLI."""

from __future__ import annotations

import os

DATA_DIR_VARIABLE = "VMREADY_DATA_DIR"
SOCKET_VARIABLE = "VMREADY_SOCKET"
SOCKET_NAME = "vmready.sock"


def default_data_dir() -> str:
    """$VMREADY_DATA_DIR, else /var/lib/vmready for root, else ~/.local/share/vmready."""
    explicit = os.environ.get(DATA_DIR_VARIABLE)
    if explicit:
        return os.path.abspath(explicit)
    if os.geteuid() == 0:
        return "/var/lib/vmready"
    return os.path.join(os.path.expanduser("~"), ".local", "share", "vmready")


def default_socket() -> str:
    """$VMREADY_SOCKET, else the operator socket in the default data dir."""
    return os.environ.get(SOCKET_VARIABLE) or os.path.join(default_data_dir(), SOCKET_NAME)
