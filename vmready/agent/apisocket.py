"""The guest API's unix socket (``/dev/lxd/sock``): its path prepared, bound, listening.

Imports ``os``, ``socket`` and ``stat`` only: the agent binds it with its first
``STARTED`` (``firstword``), before the imports of its event loop, so that a
workload finds the socket early and its request waits in the listen backlog
until the loop serves it, instead of the workload polling for a socket that
comes only after the agent's imports.
"""

from __future__ import annotations

import os
import socket
import stat

from vmready.agent.options import ConfigError

UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the terminating NUL included
BACKLOG = 128


def prepare_socket_path(path: str) -> None:
    """Make the socket's directory; remove a socket a dead agent left; refuse a live one."""
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConfigError(f"socket path {path} is longer than {UNIX_PATH_MAX} bytes")
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


def bind_socket(path: str) -> socket.socket:
    """The guest API's unix socket, bound and listening, owner only (0600) from the start."""
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask, not a chmod after bind: no moment where another user could connect.
    previous = os.umask(0o177)
    try:
        listening.bind(path)
        os.chmod(path, 0o600)
        listening.listen(BACKLOG)
    except OSError as e:
        listening.close()
        raise ConfigError(f"cannot serve the guest API on {path}: {e.strerror or e}") from None
    finally:
        os.umask(previous)
    listening.setblocking(False)
    return listening


def socket_identity(path: str) -> tuple[int, int]:
    """The socket file's device and inode: which bound socket it is."""
    here = os.lstat(path)
    return (here.st_dev, here.st_ino)


def remove_own_socket(path: str, identity: tuple[int, int] | None) -> None:
    """Unlink the socket file at ``path`` if it is still ours (another agent may have
    replaced it since)."""
    try:
        if socket_identity(path) == identity:
            os.unlink(path)
    except OSError:
        return
