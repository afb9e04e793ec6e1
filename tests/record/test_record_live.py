"""Recording as it happens today: a real daemon and agent record a session that replays.

The fixtures in ``tests/fixtures/transcripts/`` were recorded once; this records a fresh
boot-to-Ready session on every run (``twistd vmready --record-dir`` and
``vmready-agent --record``) and replays both sides, so a change to what the
daemon records, or to what it does, cannot slip past the suite.
"""

from __future__ import annotations

import os
import signal

from twisted.trial.unittest import SynchronousTestCase

from tests.system import System
from vmready.protocols.transcriptreader import read_transcript
from vmready.record.replay import replay

NAME = "web1"
SECRET = "s3cret-api-key-value"


class LiveRecordingTests(SynchronousTestCase):
    def test_bootToReadyRecordedNowReplaysOnBothSides(self) -> None:
        system = System(self)
        record_dir = os.path.join(system.directory, "transcripts")
        system.start_daemon("--record-dir", record_dir)
        events = system.events()
        system.cli("launch", NAME, "--memory", "128")
        agent_file = os.path.join(record_dir, "agent.jsonl")
        agent = system.start_agent(NAME, "agent.log", "--record", agent_file)
        events.wait_for_action(NAME, "instance-agent-connected")
        self.assertEqual(system.notify(NAME).returncode, 0)
        events.wait_for_action(NAME, "instance-ready")
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        events.wait_for_action(NAME, "instance-agent-stopped")
        system.stop_daemon()

        host_file = os.path.join(record_dir, f"{NAME}.jsonl")
        kinds = {entry.kind for entry in read_transcript(host_file).entries}
        self.assertTrue({"ring-read", "ring-write", "guest-request", "state"} <= kinds, kinds)
        for path in (host_file, agent_file):
            result = replay(path)
            self.assertTrue(result.matched, result.describe())
        with open(host_file) as f:
            recorded = f.read()
        self.assertNotIn("BEGIN", recorded)  # no certificate or key ever written

    def test_secretsQMPEventsAndDaemonRestartsAreRecorded(self) -> None:
        system = System(self)
        record_dir = os.path.join(system.directory, "transcripts")
        system.start_daemon("--record-dir", record_dir)
        events = system.events()
        system.cli("launch", NAME, "--memory", "128", "-c", f"user.api-key={SECRET}")
        system.start_agent(NAME, "agent.log")
        events.wait_for_action(NAME, "instance-agent-connected")
        # The guest reads a secret-named key: it gets it, the transcript never has it.
        answer = system.guest_request(NAME, "GET", "/1.0/config/user.api-key")
        self.assertIn(SECRET, answer.body.decode())
        events.close()
        system.stop_daemon()
        system.start_daemon("--record-dir", record_dir)  # continues the transcript
        events = system.events()
        self.assertEqual(system.control(NAME, "poweroff"), b"ok\n")
        events.wait_for_action(NAME, "instance-shutdown")
        system.stop_daemon()

        host_file = os.path.join(record_dir, f"{NAME}.jsonl")
        with open(host_file) as f:
            self.assertNotIn(SECRET, f.read())
        entries = read_transcript(host_file).entries
        kinds = [entry.kind for entry in entries]
        self.assertEqual(kinds.count("daemon-start"), 1)
        self.assertIn("guest-request", kinds[: kinds.index("daemon-start")], "the secret was read")
        shutdowns = [
            entry
            for entry in entries
            if entry.kind == "qmp-event" and entry.fields["event"] == "SHUTDOWN"
        ]
        self.assertTrue(shutdowns, kinds)
        self.assertGreater(shutdowns[0].line, kinds.index("daemon-start"))
