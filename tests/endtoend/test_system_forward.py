"""The forward transport end to end on fakeqemu: the same daemon, agent and CLI as real guests.

Real guests on a host without ``/dev/vhost-vsock`` reach the guest API through
QEMU's restricted user-mode network (``guestfwd`` to ``socat`` to the daemon's
``guest-fwd.sock``); ``tests/endtoend/test_real_guest.py`` proves that with a real
kernel.  Here the same daemon option, ``--guest-transport forward``, runs on
fakeqemu, whose guestfwd runs the very same ``socat`` command per guest
connection: the agent is told ``CONNECT tcp:10.0.2.100:8443``, dials it through
the VM's forward, and Ready reaches the daemon over mutual TLS — in seconds,
with no kernel to boot.
"""

from __future__ import annotations

import os
import shutil

from twisted.trial.unittest import SynchronousTestCase

from tests.conformance.support import REQUIRE_QEMU_VARIABLE
from tests.system import System, eventually
from vmready.domain.states import READY_KEY

NAME = "fw1"


class ForwardTransportTests(SynchronousTestCase):
    """``--guest-transport forward``: CONNECT tcp:…, one socat per connection, mutual TLS."""

    def setUp(self) -> None:
        if shutil.which("socat") is None:
            if os.environ.get(REQUIRE_QEMU_VARIABLE) == "1":
                self.fail(f"{REQUIRE_QEMU_VARIABLE}=1 but socat is not installed")
            self.skipTest("socat is not installed (Debian: apt-get install socat)")
        self.system = System(self)
        self.system.start_daemon("--guest-transport", "forward")

    def test_agentLinksThroughTheForwardAndReadyArrives(self) -> None:
        system = self.system
        events = system.events()
        system.cli("launch", NAME, "--memory", "128")
        info = system.info(NAME)
        self.assertEqual(info["boot"]["transport"], "forward")
        system.start_agent(NAME)
        events.wait_for_action(NAME, "instance-agent-connected")
        log = eventually(
            lambda: (
                system.agent_log() if "CONNECT tcp:10.0.2.100:8443" in system.agent_log() else None
            ),
            "the agent told CONNECT tcp:10.0.2.100:8443",
        )
        # A fakeqemu guest's TCP address is a socket in its guest dir, run through guestfwd.
        self.assertIn(
            "qmp.sock.guest/tcp/10.0.2.100:8443\nvmready-agent: connected to the host", log
        )
        notified = system.notify(NAME)
        self.assertEqual(notified.returncode, 0, notified.stderr)
        system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertEqual(system.info(NAME)["config"][READY_KEY], "true")

    def test_aNewDaemonIsReachedThroughTheSameForward(self) -> None:
        system = self.system
        system.cli("launch", NAME, "--memory", "128")
        system.start_agent(NAME)
        system.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(system.notify(NAME).returncode, 0)
        system.cli("wait", NAME, "status=ready", "--timeout", "30")
        system.stop_daemon()
        system.start_daemon("--guest-transport", "forward")
        # The agent re-links through the forward and re-reports Ready by itself.
        system.cli("wait", NAME, "status=ready", "--timeout", "30")
        self.assertEqual(system.info(NAME)["agent"]["status"], "connected")
