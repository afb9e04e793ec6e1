"""What ``twistd vmready`` checks before twistd daemonizes: each refusal one line, status 1.

An endpoint string is described by Twisted itself: ``serverFromString``
parses it, and the endpoint's ``listen`` tells a reactor that only takes
note (``_WouldListen``) where it would listen.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from typing import Any, NoReturn

from twisted.internet.abstract import isIPv6Address
from twisted.internet.endpoints import (
    SSL4ServerEndpoint,
    TCP4ServerEndpoint,
    TCP6ServerEndpoint,
    UNIXServerEndpoint,
    serverFromString,
)
from twisted.internet.protocol import Factory
from twisted.python.lockfile import FilesystemLock

from vmready.agentlink import HybridVSockServerEndpoint, VSockServerEndpoint
from vmready.daemon.clusteroptions import ClusterSettings
from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.domain import LeaseHeld, MemberRetired, StoreError, default_reactor
from vmready.store import Store, display_location

_UNIX_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, the terminating NUL included


def fail(reason: str) -> NoReturn:
    """Stop twistd before it starts, with one line on stderr and status 1."""
    raise SystemExit(f"vmready: {reason}")


def check_data_dir(path: str) -> None:
    """The data dir exists (or can be made) and is writable."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        fail(f"data dir {path} is not writable: {e.strerror or e}")


# The endpoints whose listen() only asks the reactor, and what the checks below know.
_THROUGH_THE_REACTOR = (
    UNIXServerEndpoint,
    TCP4ServerEndpoint,
    TCP6ServerEndpoint,
    SSL4ServerEndpoint,
)


class _WouldListen:
    """A reactor that only notes where an endpoint would listen: TCP (or TLS) or unix."""

    tcp: tuple[str, int] | None = None
    unix: str | None = None

    def listenTCP(
        self, port: int, factory: object, backlog: int = 50, interface: str = ""
    ) -> None:
        self.tcp = (interface, port)

    def listenSSL(
        self,
        port: int,
        factory: object,
        contextFactory: object,
        backlog: int = 50,
        interface: str = "",
    ) -> None:
        self.tcp = (interface, port)

    def listenUNIX(self, address: str, factory: object, **settings: Any) -> None:
        self.unix = address


def check_listen_address(listen: str) -> None:
    """Refuse an endpoint string that twistd could not listen on; clear a stale unix socket."""
    would = _WouldListen()
    try:
        endpoint = serverFromString(would, listen)
    except Exception as e:  # each endpoint parser fails in its own way: report any of them
        fail(f"--listen {listen} is not a usable endpoint string: {e}")
    if not isinstance(endpoint, _THROUGH_THE_REACTOR):
        return
    endpoint.listen(Factory())
    if would.unix is not None:
        _check_unix_socket_path(listen, would.unix)
    elif would.tcp is not None:
        interface, port = would.tcp
        family = socket.AF_INET6 if isIPv6Address(interface) else socket.AF_INET
        _check_tcp_port_free(listen, family, interface, port)


def check_guest_listen_address(listen: str) -> None:
    """Refuse a guest API endpoint string that cannot work, in one line."""
    try:
        endpoint = serverFromString(default_reactor(), listen)
    except Exception as e:  # each endpoint parser fails in its own way: report any of them
        fail(f"--guest-listen {listen} is not a usable endpoint string: {e}")
    if isinstance(endpoint, HybridVSockServerEndpoint):
        longest = f"{endpoint.path}_{2**32 - 1}"
        if len(os.fsencode(longest)) >= _UNIX_PATH_MAX:
            fail(
                f"--guest-listen {listen}: socket path {longest} would be longer than "
                f"{_UNIX_PATH_MAX - 1} bytes; choose a shorter path="
            )
        directory = os.path.dirname(endpoint.path) or "."
        if not os.path.isdir(directory):
            fail(f"--guest-listen {listen}: directory {directory} does not exist")
    elif not isinstance(endpoint, VSockServerEndpoint):
        fail(f"--guest-listen {listen}: the guest API listens on vsock: or hvsock: only")


def check_https_address(text: str) -> None:
    """Refuse an ``--https-address`` whose port is taken (or cannot be bound here)."""
    address = HTTPSAddress.parse(text)
    if address.port == 0:
        return
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    _check_tcp_port_free(f"--https-address {text}", family, address.host, address.port)


def _check_unix_socket_path(listen: str, path: str) -> None:
    """A unix socket can be made at ``path``: nobody serves it, and nothing else is there."""
    if not path:
        fail(f"--listen {listen} names no socket path")
    if len(os.fsencode(path)) >= _UNIX_PATH_MAX:
        fail(f"--listen {listen}: socket path is longer than {_UNIX_PATH_MAX - 1} bytes")
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        fail(f"--listen {listen}: directory {directory} does not exist")
    _check_socket_lock(listen, path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        fail(f"--listen {listen}: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        _remove_stale_socket(listen, path)
        return
    except OSError as e:
        fail(f"--listen {listen}: cannot check socket {path}: {e.strerror or e}")
    finally:
        probe.close()
    fail(f"address unix:{path} is in use: another vmready daemon is listening there")


def _check_socket_lock(listen: str, path: str) -> None:
    """Twisted guards a unix socket with ``<path>.lock``: a live holder would stop us later."""
    lock = FilesystemLock(path + ".lock")
    try:
        acquired = lock.lock()
    except OSError as e:
        fail(f"--listen {listen}: cannot check the lock {path}.lock: {e.strerror or e}")
    if not acquired:
        holder = os.readlink(path + ".lock") if os.path.islink(path + ".lock") else "?"
        fail(
            f"address unix:{path} is locked by process {holder} ({path}.lock); "
            "another vmready daemon is starting or running there"
        )
    lock.unlock()


def _remove_stale_socket(listen: str, path: str) -> None:
    """Remove a socket left behind by a daemon that is gone."""
    try:
        os.unlink(path)
    except OSError as e:
        fail(f"--listen {listen}: cannot remove stale socket {path}: {e.strerror or e}")


def _check_tcp_port_free(listen: str, family: int, interface: str, port: int) -> None:
    """Listen on the port for a moment, as twistd will, so a taken port is refused now."""
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Twisted's ports do
        probe.bind((interface, port))
        probe.listen(1)
    except OverflowError:
        fail(f"cannot listen on {listen}: port {port} is not in 0-65535")
    except OSError as e:
        fail(f"cannot listen on {listen}: {e.strerror or e}")
    finally:
        probe.close()


def check_store(location: str, cluster: ClusterSettings | None, fingerprint: str) -> None:
    """Open the store once now (migrated, or refused in one line), before twistd daemonizes.

    A cluster member whose name another daemon holds (another certificate,
    its lease running) is refused here, with status 1; the daemon's own join
    decides again (two started at once: one of them stops, saying why).
    """
    try:
        store = Store.open(location)
    except StoreError as e:
        fail(str(e))
    try:
        if cluster is not None:
            store.members.check_join(cluster.name, fingerprint)
    except (LeaseHeld, MemberRetired) as e:
        fail(str(e))
    except Exception as e:  # the server went away since it opened: still one line
        fail(f"cannot read the cluster's members in {display_location(location)}: {e}")
    finally:
        store.close()
