"""``twistd vmready``: the daemon's Options and makeService, and nothing else."""

from __future__ import annotations

import os
import resource
import socket
import sys
import tempfile
from typing import Any

from twisted.python import usage

from vmready.daemon import DaemonConfig, VMReadyService
from vmready.model import StoreError
from vmready.paths import default_data_dir
from vmready.store import Store

HYPERVISORS = ("fakeqemu", "qemu")


class Options(usage.Options):
    """Options for ``twistd vmready``."""

    optParameters = [
        ["data-dir", "d", None, "Where the store, certificates and VM sockets live."],
        [
            "listen",
            "l",
            None,
            "Operator API endpoint string (default: unix:<data-dir>/vmready.sock).",
        ],
        ["hypervisor", None, "fakeqemu", "fakeqemu (default) or qemu."],
        ["qemu-binary", None, None, "The hypervisor binary (default: per --hypervisor)."],
        [
            "power-sync-interval",
            None,
            "10",
            "Seconds between power-state reconciliations; 0 or less disables it.",
        ],
        ["stop-timeout", None, "30", "Seconds a clean stop waits before forcing."],
    ]

    def postOptions(self) -> None:
        if self["hypervisor"] not in HYPERVISORS:
            raise usage.UsageError(f"--hypervisor must be one of {', '.join(HYPERVISORS)}")
        for option in ("power-sync-interval", "stop-timeout"):
            try:
                self[option] = float(self[option])
            except ValueError:
                raise usage.UsageError(f"--{option} must be a number of seconds") from None
        self["data-dir"] = os.path.abspath(self["data-dir"] or default_data_dir())
        if not self["listen"]:
            path = os.path.join(self["data-dir"], "vmready.sock").replace(":", "\\:")
            self["listen"] = f"unix:{path}"


def _fail(reason: str) -> Any:
    """Stop twistd before it starts, with one line on stderr and status 1."""
    raise SystemExit(f"vmready: {reason}")


def check_data_dir(path: str) -> None:
    """The data dir exists (or can be made) and is writable."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        _fail(f"data dir {path} is not writable: {e.strerror or e}")


def check_listen_address(endpoint: str) -> None:
    """Refuse an address another process already serves; clear a stale unix socket."""
    if not endpoint.startswith("unix:"):
        return
    path = endpoint[len("unix:") :].split(":")[0].replace("\\", "")
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # a socket left behind by a daemon that is gone
        return
    finally:
        probe.close()
    _fail(f"address unix:{path} is in use: another vmready daemon is listening there")


def raise_file_limit() -> None:
    """The daemon holds a QMP connection per running VM: lift the soft descriptor limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def makeService(options: Options) -> VMReadyService:
    """Check what can be checked before twistd daemonizes, then build the service."""
    from twisted.internet import reactor

    data_dir = options["data-dir"]
    check_data_dir(data_dir)
    store_path = os.path.join(data_dir, "vmready.sqlite")
    try:
        Store.open(store_path).close()
    except StoreError as e:
        _fail(str(e))
    check_listen_address(options["listen"])
    raise_file_limit()
    config = DaemonConfig(
        data_dir=data_dir,
        listen=options["listen"],
        hypervisor=options["hypervisor"],
        qemu_binary=options["qemu-binary"],
        power_sync_interval=options["power-sync-interval"],
        stop_timeout=options["stop-timeout"],
    )
    print(f"vmready: data dir {data_dir}, API on {options['listen']}", file=sys.stderr)
    return VMReadyService(reactor, config)
