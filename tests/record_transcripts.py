"""Record the transcripts in ``tests/fixtures/transcripts/`` from real sessions (opt-in).

Each scenario runs the real daemon (``twistd vmready --record-dir``), fakeqemu
VMs and, where there is one, the real agent (``vmready-agent --record``), and
copies the transcripts they wrote into ``tests/fixtures/transcripts/``.  Run it again
after a change to what the host does on purpose::

    VMREADY_RECORD_TRANSCRIPTS=1 trial tests.record_transcripts

``tests/record/test_replay.py`` replays every one of them and expects a match.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from tests.system import EventReader, System, eventually

NAME = "web1"
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "transcripts")
# A steady pace: the overflow needs a burst to land between two reads.
PACE = ("--agent-poll-safety", "0.5", "--agent-poll-agentless", "0.5")


class RecordTranscripts(SynchronousTestCase):
    """One real session per fixture."""

    def setUp(self) -> None:
        if not os.environ.get("VMREADY_RECORD_TRANSCRIPTS"):
            raise self.skipTest("set VMREADY_RECORD_TRANSCRIPTS=1 to record the fixtures")
        self.system = System(self)
        self.record_dir = os.path.join(self.system.directory, "transcripts")
        self.start()

    def start(self) -> None:
        self.system.start_daemon("--record-dir", self.record_dir, *PACE)
        self.events: EventReader = self.system.events()
        self.cursor = 0

    def saw(self, *actions: str) -> None:
        """Wait for the next ``actions`` of the instance (in any order) after the last ones."""
        found = [self.events.wait_for_action(NAME, a, after=self.cursor) for a in actions]
        self.cursor = max(found) + 1

    def agent(self, record: str | None = None) -> subprocess.Popen[bytes]:
        options = ("--record", os.path.join(self.record_dir, record)) if record else ()
        agent = self.system.start_agent(NAME, "agent.log", *options)
        self.saw("instance-agent-connected")
        return agent

    def ready(self) -> None:
        notified = self.system.notify(NAME)
        self.assertEqual(notified.returncode, 0, notified.stderr)
        self.saw("instance-ready")

    def stop_agent(self, agent: subprocess.Popen[bytes]) -> None:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        self.saw("instance-agent-stopped")

    def keep(self, name: str, recorded: str = f"{NAME}.jsonl") -> None:
        self.system.stop_daemon()
        os.makedirs(HERE, exist_ok=True)
        shutil.copy(os.path.join(self.record_dir, recorded), os.path.join(HERE, name))

    def test_bootToReady(self) -> None:
        self.system.cli("launch", NAME, "--memory", "128")
        agent = self.agent("agent.jsonl")
        self.ready()
        self.stop_agent(agent)
        self.keep("boot-to-ready.jsonl")
        shutil.copy(
            os.path.join(self.record_dir, "agent.jsonl"),
            os.path.join(HERE, "boot-to-ready.agent.jsonl"),
        )

    def test_daemonRestartMidSession(self) -> None:
        self.system.cli("launch", NAME, "--memory", "128")
        agent = self.agent()
        self.ready()
        self.system.stop_daemon()
        self.start()
        # The agent may reconnect before this daemon's event stream is read: ask instead.
        eventually(
            lambda: (
                self.system.info(NAME)["status"] == "Ready"
                and self.system.info(NAME)["agent"] == {"status": "connected"}
            ),
            "Ready and the agent connected again",
        )
        self.stop_agent(agent)
        self.keep("daemon-restart.jsonl")

    def test_agentCrash(self) -> None:
        self.system.cli("launch", NAME, "--memory", "128")
        agent = self.agent()
        self.ready()
        agent.kill()
        agent.wait(timeout=30)
        agent = self.system.start_agent(NAME, "agent2.log")
        # The agent remembered Ready across its crash and says so again.
        self.saw("instance-agent-started", "instance-agent-connected", "instance-ready")
        self.stop_agent(agent)
        self.keep("agent-crash.jsonl")

    def test_ringBufferOverflow(self) -> None:
        self.system.cli("launch", NAME, "--memory", "128")
        port = self.system.guest_port(NAME)
        port.send(b"STARTED\n")
        port.wait_for_line(lambda line: line.startswith(b"CONNECT"), "CONNECT")
        # More than the 64 KiB ring holds, at once: the host's next read starts mid-line.
        burst = (b"y" * 200 + b"\n") * 330 + b"STARTED\n"
        port.send(burst)
        port.received = b""
        port.wait_for_line(lambda line: line.startswith(b"CONNECT"), "a second CONNECT")
        port.send(b"CONNECTED\n")
        self.saw("instance-agent-connected")
        port.send(b"STOPPED\n")
        self.saw("instance-agent-stopped")
        port.close()
        self.keep("ring-overflow.jsonl")

    def test_badInputBarrage(self) -> None:
        self.system.cli(
            "launch", NAME, "--memory", "128", "-c", "user.api-token=s3cret", "-c", "user.motd=hi"
        )
        port = self.system.guest_port(NAME)
        # Noise, bytes that are not UTF-8, an over-long line, a NUL, then a real status.
        port.send(b"hello?\n\xff\xfe\xfd\n" + b"z" * 300 + b"\nSTAR\x00TED\nSTARTED\n")
        port.wait_for_line(lambda line: line.startswith(b"CONNECT"), "CONNECT")
        port.send(b"STOPPED\n")
        self.saw("instance-agent-stopped")
        port.close()
        agent = self.agent()
        for method, target, body in [
            ("PATCH", "/1.0", b"{not json"),
            ("PATCH", "/1.0", b'{"state": "ready"}'),
            ("PATCH", "/1.0", b'{"state": 1}'),
            ("PATCH", "/1.0", b"{}"),
            ("PATCH", "/1.0", b'{"state": "Ready"}'),
            ("PATCH", "/1.0", b'{"state": "Started"}'),
            ("GET", "/1.0/config", None),
            ("GET", "/1.0/config/user.api-token", None),
            ("GET", "/1.0/config/user.motd", None),
            ("GET", "/1.0/config/limits.memory", None),
            ("GET", "/1.0/config/user.missing", None),
            ("GET", "/1.0/meta-data", None),
            ("GET", "/1.0/nope", None),
            ("DELETE", "/1.0", None),
            ("GET", "/1.0/events?type=bogus", None),
            ("PATCH", "/1.0", b'{"state": "Ready"}'),
        ]:
            self.system.guest_request(NAME, method, target, body)
        self.saw("instance-ready")
        self.stop_agent(agent)
        self.keep("bad-input-barrage.jsonl")

    def test_guestPowerOffMidSession(self) -> None:
        self.system.cli("launch", NAME, "--memory", "128")
        agent = self.agent()
        self.ready()
        # The guest OS powers itself off (fakeqemu: SHUTDOWN from the guest, then it exits).
        self.assertEqual(self.system.control(NAME, "poweroff"), b"ok\n")
        self.saw("instance-agent-stopped", "instance-shutdown")
        # Its agent went down with it.
        agent.kill()
        agent.wait(timeout=30)
        self.keep("guest-poweroff.jsonl")

    def test_operatorRestart(self) -> None:
        self.system.cli("launch", NAME, "--memory", "128")
        agent = self.agent()
        self.ready()
        # The guest (and its agent) go down with the forced restart; a new boot's agent starts.
        agent.kill()
        agent.wait(timeout=30)
        self.system.cli("restart", NAME, "--force")
        self.saw("instance-restarted")
        agent = self.agent()
        # A new boot: Ready again only once its workload says so.
        self.ready()
        self.stop_agent(agent)
        self.keep("operator-restart.jsonl")
