"""Replaying recorded sessions: every fixture matches, altered ones diverge, bad ones are refused.

The transcripts in ``tests/fixtures/transcripts/`` were recorded from real sessions by
``tests/record_transcripts.py`` (the daemon, fakeqemu and the real agent).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from vmready.cli import run
from vmready.replay import replay
from vmready.transcript import TranscriptError

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "transcripts")
FIXTURES = [
    "boot-to-ready.jsonl",
    "daemon-restart.jsonl",
    "agent-crash.jsonl",
    "ring-overflow.jsonl",
    "bad-input-barrage.jsonl",
    "guest-poweroff.jsonl",
    "operator-restart.jsonl",
]


def lines_of(name: str) -> list[str]:
    with open(os.path.join(HERE, name)) as f:
        return f.read().splitlines()


def without(name: str, unwanted: Any) -> list[str]:
    """The fixture's lines without the records ``unwanted`` accepts."""
    lines = lines_of(name)
    kept = lines[:1] + [line for line in lines[1:] if not unwanted(json.loads(line))]
    assert len(kept) < len(lines), f"nothing in {name} to remove"
    return kept


def first_line(lines: list[str], wanted: Any) -> tuple[int, dict[str, Any]]:
    """The line number (from 1) and record of the first record ``wanted`` accepts."""
    for index, line in enumerate(lines[1:], start=2):
        record = json.loads(line)
        if wanted(record):
            return index, record
    raise AssertionError("no such record")


def altered(name: str, change: Any) -> tuple[list[str], int]:
    """The fixture's lines with the first record ``change`` accepts rewritten; its line."""
    lines = lines_of(name)
    for index, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        if change(record):
            lines[index] = json.dumps(record)
            return lines, index + 1
    raise AssertionError(f"nothing in {name} to alter")


class FixtureTests(SynchronousTestCase):
    """Each recorded session replays against a fresh core and matches."""

    def assertMatches(self, name: str) -> None:
        result = replay(os.path.join(HERE, name))
        self.assertTrue(result.matched, result.describe())

    def test_bootToReadyMatches(self) -> None:
        self.assertMatches("boot-to-ready.jsonl")

    def test_daemonRestartMidSessionMatches(self) -> None:
        self.assertMatches("daemon-restart.jsonl")

    def test_agentCrashMatches(self) -> None:
        self.assertMatches("agent-crash.jsonl")

    def test_ringBufferOverflowWithFragmentsMatches(self) -> None:
        self.assertMatches("ring-overflow.jsonl")

    def test_badInputBarrageMatches(self) -> None:
        self.assertMatches("bad-input-barrage.jsonl")

    def test_guestPowerOffMidSessionMatches(self) -> None:
        self.assertMatches("guest-poweroff.jsonl")

    def test_operatorRestartMatches(self) -> None:
        self.assertMatches("operator-restart.jsonl")

    def test_theGuestPowerOffIsFedAndTheHostFollows(self) -> None:
        result = replay(os.path.join(HERE, "guest-poweroff.jsonl"))
        self.assertEqual(result.compared["action"], 1)
        records = [json.loads(line) for line in lines_of("guest-poweroff.jsonl")[1:]]
        shutdown = [r for r in records if r["kind"] == "qmp-event" and r["event"] == "SHUTDOWN"]
        self.assertEqual(shutdown[0]["data"], {"guest": True, "reason": "guest-shutdown"})
        actions = [r.get("action") for r in records if r["kind"] == "state"]
        self.assertEqual(
            actions[-3:], ["instance-state", "instance-state", "instance-shutdown"], actions
        )
        self.assertIn("instance-agent-stopped", actions)

    def test_theOperatorRestartIsReplayed(self) -> None:
        records = [json.loads(line) for line in lines_of("operator-restart.jsonl")[1:]]
        [action] = [r for r in records if r["kind"] == "operator-action"]
        self.assertEqual(action["action"], "restart")
        self.assertTrue(action["params"]["force"])
        actions = [r.get("action") for r in records if r["kind"] == "state"]
        self.assertEqual(actions.count("instance-ready"), 2)
        self.assertIn("instance-restarted", actions)

    def test_agentSideRecordingReplaysAgainstTheHost(self) -> None:
        result = replay(os.path.join(HERE, "boot-to-ready.agent.jsonl"))
        self.assertTrue(result.matched, result.describe())
        self.assertEqual((result.side, result.compared), ("agent", {"ring-write": 1, "http": 3}))

    def test_fixturesAreSmall(self) -> None:
        for name in os.listdir(HERE):
            self.assertLess(os.path.getsize(os.path.join(HERE, name)), 100 * 1024, name)

    def test_theOverflowFixtureHoldsAFullRingRead(self) -> None:
        reads = [json.loads(line) for line in lines_of("ring-overflow.jsonl")[1:]]
        sizes = [len(r["text"].encode()) for r in reads if r["kind"] == "ring-read"]
        self.assertIn(65536, sizes)

    def test_replayRunsOnTheGivenClock(self) -> None:
        clock = Clock()
        replay(os.path.join(HERE, "boot-to-ready.jsonl"), clock=clock)
        self.assertGreater(clock.seconds(), 2.0)

    def test_theRestartFixtureRestartsTheDaemon(self) -> None:
        kinds = [json.loads(line)["kind"] for line in lines_of("daemon-restart.jsonl")[1:]]
        self.assertIn("daemon-start", kinds)


class DivergenceTests(SynchronousTestCase):
    """An altered recording shows the first place the host did something else."""

    def test_aChangedConnectPortDiverges(self) -> None:
        def change(record: dict[str, Any]) -> bool:
            if record["kind"] != "ring-write":
                return False
            record["text"] = "CONNECT 2:4243\n"
            return True

        lines, line = altered("boot-to-ready.jsonl", change)
        result = replay(lines)
        assert result.divergence is not None
        self.assertEqual(result.divergence.line, line)
        self.assertEqual(result.divergence.expected, 'ring-write "CONNECT 2:4243\\n"')
        self.assertRegex(result.divergence.got, r'^ring-write "CONNECT 2:\d+\\n"$')

    def test_aChangedHTTPStatusDiverges(self) -> None:
        def change(record: dict[str, Any]) -> bool:
            if record["kind"] != "guest-response" or record.get("stream"):
                return False
            record["status"] = 500
            return True

        lines, line = altered("boot-to-ready.jsonl", change)
        result = replay(lines)
        assert result.divergence is not None
        self.assertEqual(result.divergence.line, line)
        self.assertTrue(result.divergence.expected.startswith("HTTP 500 "))
        self.assertTrue(result.divergence.expected.endswith(" to GET /1.0"))
        self.assertTrue(result.divergence.got.startswith("HTTP 200 "))

    def test_aMissingStateChangeDiverges(self) -> None:
        lines = [
            line
            for line in lines_of("boot-to-ready.jsonl")
            if "instance-agent-stopped" not in line
        ]
        result = replay(lines)
        assert result.divergence is not None
        self.assertEqual(result.divergence.expected, "nothing more")
        self.assertIn("instance-agent-stopped", result.divergence.got)

    def test_theDivergenceIsOneReadableLine(self) -> None:
        def change(record: dict[str, Any]) -> bool:
            if record["kind"] != "ring-write":
                return False
            record["text"] = "CONNECT 2:4243\n"
            return True

        lines, line = altered("boot-to-ready.jsonl", change)
        result = replay(lines)
        self.assertRegex(
            result.describe(),
            rf"^transcript <lines> diverged: first divergence at t=\d+\.\d{{3}}s \(line {line}\): "
            r'expected ring-write "CONNECT 2:4243\\n", got ring-write "CONNECT 2:\d+\\n"$',
        )


class RecordedInputTests(SynchronousTestCase):
    """The guest's power actions and the operator's are inputs: without them it diverges."""

    def test_withoutTheGuestPowerOffItDivergesWhereTheHostReactedToIt(self) -> None:
        def is_poweroff(record: dict[str, Any]) -> bool:
            return bool(record["kind"] == "qmp-event" and record["event"] == "SHUTDOWN")

        lines = without("guest-poweroff.jsonl", is_poweroff)
        line, record = first_line(lines, lambda r: r.get("action") == "instance-agent-stopped")
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        self.assertEqual(
            (result.divergence.line, result.divergence.t, result.divergence.got),
            (line, record["t"], "no state"),
        )
        self.assertTrue(
            result.divergence.expected.startswith("state instance-agent-stopped "),
            result.divergence,
        )

    def test_withoutTheOperatorRestartItDivergesWhereTheRestartBegan(self) -> None:
        lines = without("operator-restart.jsonl", lambda r: r["kind"] == "operator-action")
        line, _ = first_line(
            lines, lambda r: r["kind"] == "state" and r["context"].get("task_state") == "rebooting"
        )
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        self.assertEqual(result.divergence.line, line)
        self.assertIn('"task_state": "rebooting"', result.divergence.expected)

    def test_anOperatorActionTheCoreRefusesDiverges(self) -> None:
        def change(record: dict[str, Any]) -> bool:
            if record["kind"] != "operator-action":
                return False
            record["params"]["timeout"] = -1
            return True

        lines, line = altered("operator-restart.jsonl", change)
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        self.assertEqual(result.divergence.line, line)
        self.assertEqual(
            result.divergence.expected, 'operator restart {"force": true, "timeout": -1}'
        )
        self.assertTrue(
            result.divergence.got.startswith("operator restart refused (Invalid timeout -1"),
            result.divergence.got,
        )

    def test_aGuestPowerOffOfAVMThatIsGoneDiverges(self) -> None:
        lines = lines_of("guest-poweroff.jsonl")
        _, shutdown = first_line(lines, lambda r: r["kind"] == "qmp-event")
        last = json.loads(lines[-1])["t"]
        lines.append(json.dumps({**shutdown, "t": last + 1}))
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        self.assertEqual(
            (result.divergence.line, result.divergence.expected, result.divergence.got),
            (len(lines), "guest poweroff", "guest poweroff impossible: its VM is not running"),
        )

    def as_if_the_guest(self, event: str, data: dict[str, Any]) -> str:
        """What the host did instead, had the guest of guest-poweroff.jsonl done ``event``."""

        def change(record: dict[str, Any]) -> bool:
            if record["kind"] != "qmp-event":
                return False
            record.update(event=event, data=data)
            return True

        lines, _ = altered("guest-poweroff.jsonl", change)
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        return result.divergence.got

    def test_aRecordedGuestRebootIsOneInTheReplay(self) -> None:
        got = self.as_if_the_guest("RESET", {"guest": True, "reason": "guest-reset"})
        # A new boot: Ready is gone, the instance runs on.
        self.assertIn('"status": "Running"', got)

    def test_aRecordedGuestPanicIsOneInTheReplay(self) -> None:
        got = self.as_if_the_guest("GUEST_PANICKED", {"action": "poweroff"})
        self.assertIn('"power_state": "crashed"', got)

    def test_hostInitiatedEventsAreNotInputs(self) -> None:
        from vmready.replay import guest_power_action
        from vmready.transcript import Entry

        def action(event: str, data: dict[str, Any]) -> str | None:
            return guest_power_action(Entry(2, 1.0, "qmp-event", {"event": event, "data": data}))

        self.assertEqual(
            action("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"}), "poweroff"
        )
        self.assertEqual(action("RESET", {"guest": True, "reason": "guest-reset"}), "reboot")
        self.assertEqual(action("GUEST_PANICKED", {"action": "poweroff"}), "panic")
        # The panic's own SHUTDOWN is part of the panic.
        self.assertIsNone(action("SHUTDOWN", {"guest": True, "reason": "guest-panic"}))
        self.assertIsNone(action("SHUTDOWN", {"guest": False, "reason": "host-qmp-quit"}))
        self.assertIsNone(action("RESET", {"guest": False, "reason": "host-qmp-system-reset"}))
        for event in ("POWERDOWN", "STOP", "RESUME"):
            self.assertIsNone(action(event, {}))


class MalformedTests(SynchronousTestCase):
    """A transcript that cannot be replayed is refused, naming its line."""

    def refusal(self, lines: list[str]) -> TranscriptError:
        error: TranscriptError = self.assertRaises(TranscriptError, replay, lines)
        return error

    def test_notJSONNamesTheLine(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[6] = "{oops"
        error = self.refusal(lines)
        self.assertEqual(error.line, 7)
        self.assertIn("line 7: not JSON (", str(error))

    def test_aNewerVersionIsRefused(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[0] = lines[0].replace('"version":1', '"version":9')
        self.assertEqual(
            str(self.refusal(lines)).split(";")[0],
            "transcript <lines> line 1: format version 9 is newer than this vmready "
            "understands (1)",
        )

    def test_anOlderVersionIsRefusedClearly(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[0] = lines[0].replace('"version":1', '"version":0')
        self.assertIn(
            "format version 0 is older than this vmready replays (1)", str(self.refusal(lines))
        )

    def test_anUnknownKindIsRefused(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[3] = '{"t": 1, "kind": "teleport"}'
        self.assertIn("line 4: unknown record kind 'teleport'", str(self.refusal(lines)))

    def test_anUnknownKindSuggestsANewerVmready(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[3] = '{"t": 1, "kind": "teleport"}'
        self.assertIn("a kind added by a newer vmready?", str(self.refusal(lines)))

    def test_anOperatorActionNeedsItsParams(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[3] = '{"t": 1, "kind": "operator-action", "action": "stop"}'
        self.assertIn(
            'line 4: a operator-action record needs "params" (dict)', str(self.refusal(lines))
        )

    def test_aRecordMissingAFieldIsRefused(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[2] = '{"t": 1, "kind": "daemon-start"}'
        self.assertIn('line 3: a daemon-start record needs "port"', str(self.refusal(lines)))

    def test_notATranscriptIsRefused(self) -> None:
        self.assertIn("line 1: not a vmready transcript header", str(self.refusal(['{"a": 1}'])))

    def test_anEmptyFileIsRefused(self) -> None:
        self.assertIn("empty: no header", str(self.refusal([])))

    def test_aRotatedContinuationAloneIsRefused(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        header = json.loads(lines[0])
        header["continues"] = True
        lines[0] = json.dumps(header)
        self.assertIn("continues a rotated transcript", str(self.refusal(lines)))


class CommandLineTests(SynchronousTestCase):
    """``vmready replay FILE``: exit 0, 1 or 2, without a daemon."""

    def run_replay(self, *args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        argv = ["--socket", "/nonexistent/no-daemon.sock", "replay", *args]
        # No reactor: replaying needs none (and no daemon).
        code = self.successResultOf(Deferred.fromCoroutine(run(None, argv, out, err)))
        return code, out.getvalue(), err.getvalue()

    def write(self, lines: list[str]) -> str:
        path: str = self.mktemp()
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def test_aMatchExitsZero(self) -> None:
        code, out, err = self.run_replay(os.path.join(HERE, "boot-to-ready.jsonl"))
        self.assertEqual((code, err), (0, ""))
        self.assertEqual(
            out,
            "transcript boot-to-ready.jsonl matched: 19 records (host side, instance web1); "
            "compared 1 ring-write, 3 http, 9 state\n",
        )

    def test_aDivergenceExitsOne(self) -> None:
        def change(record: dict[str, Any]) -> bool:
            if record["kind"] != "ring-write":
                return False
            record["text"] = "CONNECT 2:4243\n"
            return True

        lines, line = altered("boot-to-ready.jsonl", change)
        code, out, _ = self.run_replay(self.write(lines))
        self.assertEqual(code, 1)
        self.assertIn(f"(line {line}): expected ring-write", out)

    def test_aMalformedTranscriptExitsTwo(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        lines[6] = "{oops"
        path = self.write(lines)
        code, out, err = self.run_replay(path)
        self.assertEqual((code, out), (2, ""))
        self.assertTrue(
            err.startswith(f"vmready: transcript {os.path.basename(path)} line 7: not JSON ("), err
        )

    def test_realtimeReplaysEachRecordAtItsRecordedTime(self) -> None:
        from vmready.replay import ReplaySession

        reactor = Clock()
        played: list[tuple[float, float, int]] = []
        original = ReplaySession.play

        def play(session: ReplaySession, entry: Any) -> None:
            played.append((reactor.seconds(), entry.t, len(out.getvalue().splitlines())))
            original(session, entry)

        self.patch(ReplaySession, "play", play)
        out, err = io.StringIO(), io.StringIO()
        argv = ["replay", "--realtime", os.path.join(HERE, "boot-to-ready.jsonl")]
        done = Deferred.fromCoroutine(run(reactor, argv, out, err))
        while not done.called:
            reactor.advance(0.05)
        self.assertEqual(self.successResultOf(done), 0)
        self.assertEqual(len(played), 19)
        for index, (now, t, printed) in enumerate(played):
            # Waited for its time first, and nothing about it was printed before.
            self.assertGreaterEqual(now, t)
            self.assertLess(now, t + 0.05 + 1e-9)
            self.assertEqual(printed, index)
        lines = out.getvalue().splitlines()
        self.assertTrue(lines[0].startswith("t=0.000s line 2: state "), lines[0])
        self.assertTrue(lines[-1].startswith("transcript boot-to-ready.jsonl matched"))

    def test_aMissingFileExitsTwo(self) -> None:
        code, _, err = self.run_replay("/nonexistent/x.jsonl")
        self.assertEqual(code, 2)
        self.assertIn("x.jsonl line 0: cannot read it", err)
