"""Running LXD's clients against a ``System``'s daemon: ``lxc`` as a process, pylxd in-process.

``lxc`` is Debian's ``lxd-client`` package; CI installs it (``.ci/run``).
Where it is missing a test skips, saying so, except under
``VMREADY_REQUIRE_LXC=1`` or ``VMREADY_REQUIRE_QEMU=1`` (CI sets them), where
a missing ``lxc`` is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from typing import Any

from pylxd import Client
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.conformance.support import REQUIRE_QEMU_VARIABLE
from tests.system import DEADLINE, System

__all__ = ["REQUIRE_LXC_VARIABLE", "EventSocket", "Lxc", "lxc_binary", "pylxd_client"]

REQUIRE_LXC_VARIABLE = "VMREADY_REQUIRE_LXC"


def lxc_binary(case: SynchronousTestCase) -> str:
    """The ``lxc`` binary; a skip where it is missing, a failure where it is required."""
    found = shutil.which("lxc")
    if found is not None:
        return found
    why = "lxc (Debian's lxd-client package) is not installed"
    required = [
        name
        for name in (REQUIRE_LXC_VARIABLE, REQUIRE_QEMU_VARIABLE)
        if os.environ.get(name) == "1"
    ]
    if required:
        case.fail(f"{required[0]}=1 but {why}")
    raise SkipTest(why)


class Lxc:
    """``lxc`` pointed at a ``System``'s daemon through ``LXD_SOCKET``, its own config dir."""

    def __init__(self, case: SynchronousTestCase, system: System) -> None:
        self.case = case
        self.binary = lxc_binary(case)
        config = os.path.join(system.directory, "lxc-config")
        os.makedirs(config, exist_ok=True)
        self.env = {
            **os.environ,
            "LXD_SOCKET": system.socket_path,
            "LXD_CONF": config,
            "HOME": system.directory,
        }

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``lxc ARGS``; by default it must succeed.

        Its standard input is ``stdin``, else empty: ``lxc init`` and ``lxc
        launch`` read YAML from a standard input that is not a terminal, and
        would wait forever on one that never ends.
        """
        result = subprocess.run(
            [self.binary, *args],
            input="" if stdin is None else stdin,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            env=self.env,
            check=False,
        )
        if check:
            self.case.assertEqual(
                result.returncode, 0, f"lxc {' '.join(args)}: {result.stdout}{result.stderr}"
            )
        return result

    def out(self, *args: str, stdin: str | None = None) -> str:
        """What a successful ``lxc ARGS`` prints."""
        return self.run(*args, stdin=stdin).stdout

    def status(self, name: str) -> str:
        """The STATE column ``lxc list`` shows for ``name``."""
        return self.out("list", name, "-c", "s", "--format", "csv").strip()


def pylxd_client(system: System) -> Client:
    """pylxd's client on the daemon's unix socket."""
    return Client(endpoint=system.socket_path)


class EventSocket:
    """pylxd's ``client.events()`` WebSocket, read on a thread; its messages so far."""

    def __init__(self, client: Client, types: Any = None) -> None:
        self.socket = client.events(event_types=types)
        self.socket.connect()
        self._thread = threading.Thread(target=self.socket.run, daemon=True)
        self._thread.start()

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Every event received so far."""
        return list(self.socket.messages)

    def actions(self, name: str) -> list[str]:
        """The lifecycle actions received about instance ``name``."""
        source = f"/1.0/instances/{name}"
        return [
            str(message["metadata"].get("action"))
            for message in self.messages
            if message.get("type") == "lifecycle" and message["metadata"].get("source") == source
        ]

    def close(self) -> None:
        """Hang up and let the reading thread end."""
        self.socket.close()
        self._thread.join(DEADLINE)
