"""Replaying recorded sessions: every fixture matches, altered ones diverge, bad ones are refused.

The transcripts in ``tests/fixtures/transcripts/`` were recorded from real sessions by
``tests/record_transcripts.py`` (the daemon, fakeqemu and the real agent).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from tests.envelopes import sync_envelope
from vmready.cli.main import run
from vmready.domain.reactor import IVMReadyReactor
from vmready.protocols.transcript import TranscriptError
from vmready.record.replay import replay

HERE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "transcripts"
)
# Each recorded session, and what happens in it.
FIXTURES = {
    "boot-to-ready.jsonl": "boot to Ready",
    "daemon-restart.jsonl": "the daemon restarts mid-session",
    "agent-crash.jsonl": "the agent crashes",
    "ring-overflow.jsonl": "the ring buffer overflows, lines arriving in fragments",
    "bad-input-barrage.jsonl": "a barrage of bad input",
    "guest-poweroff.jsonl": "the guest powers off mid-session",
    "operator-restart.jsonl": "the operator restarts the instance",
}


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


def altered(
    name: str, wanted: Callable[[dict[str, Any]], object], edit: Callable[[dict[str, Any]], object]
) -> tuple[list[str], int]:
    """The fixture's lines with the first record ``wanted`` accepts changed by ``edit``;
    its line."""
    lines = lines_of(name)
    for index, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        if wanted(record):
            edit(record)
            lines[index] = json.dumps(record)
            return lines, index + 1
    raise AssertionError(f"nothing in {name} to alter")


def with_stopped_in_a_body() -> tuple[list[str], int]:
    """boot-to-ready.jsonl with the first guest API answer saying Stopped, not Started."""
    return altered(
        "boot-to-ready.jsonl",
        lambda record: record["kind"] == "guest-response" and not record.get("stream"),
        lambda record: record.update(body=record["body"].replace('"Started"', '"Stopped"')),
    )


def with_another_connect_port() -> tuple[list[str], int]:
    """boot-to-ready.jsonl with the host's CONNECT line naming port 4243; that line."""
    return altered(
        "boot-to-ready.jsonl",
        lambda record: record["kind"] == "ring-write",
        lambda record: record.update(text="CONNECT 2:4243\n"),
    )


class FixtureTests(SynchronousTestCase):
    """Each recorded session replays against a fresh core and matches."""

    def test_everyRecordedSessionMatches(self) -> None:
        results = {name: replay(os.path.join(HERE, name)) for name in FIXTURES}
        self.assertEqual(
            {
                f"{name} ({FIXTURES[name]})": result.describe()
                for name, result in results.items()
                if not result.matched
            },
            {},
        )
        self.assertEqual(
            sorted(FIXTURES),
            sorted(n for n in os.listdir(HERE) if n.endswith(".jsonl") and ".agent." not in n),
        )

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
        lines, line = with_another_connect_port()
        result = replay(lines)
        assert result.divergence is not None
        self.assertEqual(result.divergence.line, line)
        self.assertEqual(result.divergence.expected, 'ring-write "CONNECT 2:4243\\n"')
        self.assertRegex(result.divergence.got, r'^ring-write "CONNECT 2:\d+\\n"$')

    def test_aChangedHTTPStatusDiverges(self) -> None:
        lines, line = altered(
            "boot-to-ready.jsonl",
            lambda record: record["kind"] == "guest-response" and not record.get("stream"),
            lambda record: record.update(status=500),
        )
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
        lines, line = with_another_connect_port()
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
        lines, line = altered(
            "operator-restart.jsonl",
            lambda record: record["kind"] == "operator-action",
            lambda record: record["params"].update(timeout=-1),
        )
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

        lines, _ = altered(
            "guest-poweroff.jsonl",
            lambda record: record["kind"] == "qmp-event",
            lambda record: record.update(event=event, data=data),
        )
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        return result.divergence.got

    def test_aRecordedGuestRebootIsOneInTheReplay(self) -> None:
        got = self.as_if_the_guest("RESET", {"guest": True, "reason": "guest-reset"})
        # A new boot: Ready is gone, the instance runs on.
        self.assertIn('"status": "Running"', got)

    def test_aRecordedGuestPanicIsOneInTheReplay(self) -> None:
        got = self.as_if_the_guest("GUEST_PANICKED", {"action": "poweroff"})
        # ERROR, with the reason kept.
        self.assertIn('"display_status": "ERROR", "error": "guest kernel panicked', got)

    def test_hostInitiatedEventsAreNotInputs(self) -> None:
        from vmready.protocols.transcriptreader import Entry
        from vmready.record.replayinputs import guest_power_action

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


TELEPORT = '{"t": 1, "kind": "teleport"}'


class MalformedTests(SynchronousTestCase):
    """A transcript that cannot be replayed is refused, naming its line."""

    def refusal(self, lines: list[str]) -> TranscriptError:
        error: TranscriptError = self.assertRaises(TranscriptError, replay, lines)
        return error

    def refusal_with(self, index: int, line: str) -> TranscriptError:
        """The refusal of boot-to-ready.jsonl with its line ``index`` (from 0) replaced."""
        lines = lines_of("boot-to-ready.jsonl")
        lines[index] = line
        return self.refusal(lines)

    def version_refusal(self, version: int) -> str:
        """What a transcript whose header says format ``version`` is refused with."""
        header = lines_of("boot-to-ready.jsonl")[0]
        return str(self.refusal_with(0, header.replace('"version":1', f'"version":{version}')))

    def test_notJSONNamesTheLine(self) -> None:
        error = self.refusal_with(6, "{oops")
        self.assertEqual(error.line, 7)
        self.assertIn("line 7: not JSON (", str(error))

    def test_aNewerVersionIsRefused(self) -> None:
        self.assertEqual(
            self.version_refusal(9).split(";")[0],
            "transcript <lines> line 1: format version 9 is newer than this vmready "
            "understands (1)",
        )

    def test_anOlderVersionIsRefusedClearly(self) -> None:
        self.assertIn(
            "format version 0 is older than this vmready replays (1)", self.version_refusal(0)
        )

    def test_anUnknownKindIsRefused(self) -> None:
        error = self.refusal_with(3, TELEPORT)
        self.assertIn("line 4: unknown record kind 'teleport'", str(error))

    def test_anUnknownKindSuggestsANewerVmready(self) -> None:
        self.assertIn("a kind added by a newer vmready?", str(self.refusal_with(3, TELEPORT)))

    def test_anOperatorActionNeedsItsParams(self) -> None:
        error = self.refusal_with(3, '{"t": 1, "kind": "operator-action", "action": "stop"}')
        self.assertIn('line 4: a operator-action record needs "params" (dict)', str(error))

    def test_aRecordMissingAFieldIsRefused(self) -> None:
        error = self.refusal_with(2, '{"t": 1, "kind": "daemon-start"}')
        self.assertIn('line 3: a daemon-start record needs "port"', str(error))

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
        # Replaying needs no daemon and no more of a reactor than a clock.
        clock = cast(IVMReadyReactor, Clock())
        code = self.successResultOf(Deferred.fromCoroutine(run(clock, argv, out, err)))
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
        lines, line = with_another_connect_port()
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
        from vmready.record.replaysession import ReplaySession

        reactor = Clock()
        played: list[tuple[float, float, int]] = []
        original = ReplaySession.play

        def play(session: ReplaySession, entry: Any) -> None:
            played.append((reactor.seconds(), entry.t, len(out.getvalue().splitlines())))
            original(session, entry)

        self.patch(ReplaySession, "play", play)
        out, err = io.StringIO(), io.StringIO()
        argv = ["replay", "--realtime", os.path.join(HERE, "boot-to-ready.jsonl")]
        done = Deferred.fromCoroutine(run(cast(IVMReadyReactor, reactor), argv, out, err))
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

    def test_aBadHeaderExitsTwoNamingLineOne(self) -> None:
        lines = with_header(lines_of("boot-to-ready.jsonl"), host_port="abc")
        path = self.write(lines)
        code, out, err = self.run_replay(path)
        self.assertEqual((code, out), (2, ""))
        self.assertIn(f'transcript {os.path.basename(path)} line 1: "host_port"', err)

    def test_aRotatedAwayStartExitsTwo(self) -> None:
        lines = lines_of("boot-to-ready.jsonl")
        header = {**json.loads(lines[0]), "continues": True, "t": 1.2}
        lines = [json.dumps(header), *lines[1:8], json.dumps(header), *lines[8:]]
        code, _, err = self.run_replay(self.write(lines))
        self.assertEqual(code, 2)
        self.assertIn("the start of this session was rotated away", err)

    def test_realtimeRefusesABadHeaderToo(self) -> None:
        lines = with_header(lines_of("boot-to-ready.jsonl"), config="x")
        code, _, err = self.run_replay("--realtime", self.write(lines))
        self.assertEqual(code, 2)
        self.assertIn('line 1: "config" must be an object', err)

    def test_aMissingFileExitsTwo(self) -> None:
        code, _, err = self.run_replay("/nonexistent/x.jsonl")
        self.assertEqual(code, 2)
        self.assertIn("x.jsonl line 0: cannot read it", err)


def sync(metadata: Any) -> str:
    """A guest API answer's body, as the host serialises it."""
    return json.dumps(sync_envelope(metadata)) + "\n"


def record(t: float, kind: str, **fields: Any) -> str:
    return json.dumps({"t": t, "kind": kind, **fields})


def answered_get(t: float, request_id: int, path: str, metadata: Any) -> list[str]:
    """The agent's GET of ``path`` at ``t`` and the host's 200 with ``metadata`` 10 ms later."""
    return [
        record(t, "host-request", id=request_id, method="GET", path=path, body=""),
        record(
            round(t + 0.01, 3), "host-response", id=request_id, status=200, body=sync(metadata)
        ),
    ]


def with_header(lines: list[str], **changes: Any) -> list[str]:
    """The lines with the header's fields changed."""
    header = json.loads(lines[0])
    header.update(changes)
    return [json.dumps(header), *lines[1:]]


class ComparedTests(SynchronousTestCase):
    """What the host answers and does is compared in full, to the end."""

    def test_anAlteredResponseBodyDivergesNamingItsLine(self) -> None:
        lines, line = with_stopped_in_a_body()
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        self.assertEqual(result.divergence.line, line)
        self.assertTrue(result.divergence.expected.endswith(" to GET /1.0"))

    def test_aLongBodyShowsItsFirstDifferenceOnBothSides(self) -> None:
        lines, _ = with_stopped_in_a_body()
        divergence = replay(lines).divergence
        assert divergence is not None
        # The bodies only differ past the first 160 characters: a window shows where.
        self.assertIn('\\"state\\": \\"St⟨o⟩pped\\"}}\\n"', divergence.expected)
        self.assertIn('\\"state\\": \\"St⟨a⟩rted\\"}}\\n"', divergence.got)
        self.assertTrue(divergence.expected.startswith("…"), divergence.expected)
        self.assertTrue(divergence.expected.endswith(" to GET /1.0"), divergence.expected)
        self.assertNotEqual(divergence.expected.split(" to ")[0], divergence.got)
        for text in (divergence.expected, divergence.got):
            self.assertLess(len(text), 120, text)

    def test_aHostActionAfterTheLastRecordIsReported(self) -> None:
        # Cut after the agent connected: the host, hearing nothing more on its safety
        # reads, takes it as stopped (here after a second of silence) — after the last record.
        lines = lines_of("boot-to-ready.jsonl")
        header = json.loads(lines[0])
        poll = {**header["poll"], "silence_timeout": 1.0, "safety": 0.5}
        lines = with_header(lines, poll=poll)
        line, _ = first_line(lines, lambda r: r.get("action") == "instance-agent-connected")
        result = replay(lines[:line])
        assert result.divergence is not None, result.describe()
        self.assertEqual(result.divergence.expected, "nothing more")
        self.assertTrue(
            result.divergence.got.startswith("state instance-agent-stopped "),
            result.divergence.got,
        )
        self.assertGreater(result.divergence.t, json.loads(lines[line - 1])["t"])


class AgentSideTests(SynchronousTestCase):
    """An agent's recording: the instance primed from its answers, restarts followed."""

    def agent_lines(self, extra: list[str]) -> list[str]:
        """boot-to-ready.agent.jsonl up to CONNECTED, then ``extra``, then STOPPED."""
        lines = lines_of("boot-to-ready.agent.jsonl")
        connected, _ = first_line(lines, lambda r: r.get("text") == "CONNECTED\n")
        return [*lines[:connected], *extra, record(5.0, "serial-out", text="STOPPED\n")]

    def test_configAndMetaDataAnswersArePrimedFromTheRecording(self) -> None:
        uuid = "85aa3c18-49c6-4c36-aa87-c93da4de77d4"
        keys = [f"/1.0/config/user.{key}" for key in ("empty", "greeting", "meta-data")]
        meta_data = f"instance-id: {uuid}\nlocal-hostname: web1\nfoo: bar\n"
        lines = self.agent_lines(
            [
                *answered_get(1.0, 10, "/1.0/config", keys),
                *answered_get(1.1, 11, "/1.0/config/user.greeting", "hello"),
                *answered_get(1.2, 12, "/1.0/meta-data", meta_data),
            ]
        )
        result = replay(lines)
        self.assertTrue(result.matched, result.describe())
        self.assertEqual(result.compared["http"], 5)

    def test_whatTheHostDecidesIsStillCompared(self) -> None:
        # limits.* are not the guest's to read: the host refuses, whatever was recorded.
        lines = self.agent_lines(answered_get(1.0, 10, "/1.0/config/limits.memory", "128"))
        result = replay(lines)
        assert result.divergence is not None, result.describe()
        self.assertEqual(result.divergence.line, len(lines) - 1)
        self.assertTrue(result.divergence.got.startswith("HTTP 403 "), result.divergence.got)

    def test_aDaemonRestartStopsTheOldCoreWhenTheAgentLostIt(self) -> None:
        # The daemon went away after the agent connected: the agent's events stream
        # ended, it says STARTED again (unanswered) until a new daemon's CONNECT: one
        # as the new daemon adopts the VM, one answering the STARTED it reads then.
        lines = self.agent_lines(
            [
                record(2.0, "serial-out", text="STARTED\n"),
                record(3.0, "serial-in", text="CONNECT 2:555\nCONNECT 2:555\n"),
                record(3.1, "serial-out", text="CONNECTED\n"),
            ]
        )
        result = replay(lines)
        self.assertTrue(result.matched, result.describe())
        self.assertEqual(result.compared["ring-write"], 3)


class HeaderTests(SynchronousTestCase):
    """A header the core cannot be built from is refused, naming line 1."""

    def refusal(self, lines: list[str]) -> TranscriptError:
        error: TranscriptError = self.assertRaises(TranscriptError, replay, lines)
        return error

    def assertRefusedHeader(self, expected: str, **changes: Any) -> None:
        error = self.refusal(with_header(lines_of("boot-to-ready.jsonl"), **changes))
        self.assertEqual(error.line, 1)
        self.assertIn(expected, str(error))

    def test_aConfigThatIsNotAnObject(self) -> None:
        self.assertRefusedHeader("line 1: \"config\" must be an object, got 'x'", config="x")

    def test_aHostPortThatIsNotANumber(self) -> None:
        self.assertRefusedHeader(
            "line 1: \"host_port\" must be a port number, got 'abc'", host_port="abc"
        )

    def test_anInvalidConfigValue(self) -> None:
        self.assertRefusedHeader('line 1: "config": ', config={"limits.memory": "abc"})

    def test_aUuidThatIsNotAString(self) -> None:
        self.assertRefusedHeader('line 1: "uuid" must be a string', uuid=7)

    def test_aTimeThatIsNotANumberNamesItsLine(self) -> None:
        for bad in ("NaN", "Infinity"):
            lines = lines_of("boot-to-ready.jsonl")
            lines[4] = '{"t": ' + bad + ', "kind": "ring-read", "text": ""}'
            error = self.refusal(lines)
            self.assertEqual(error.line, 5)
            self.assertIn('line 5: "t" must be seconds', str(error))


class RotatedTests(SynchronousTestCase):
    """Joined rotated files: one session from its start, or refused clearly."""

    def joined(self, second: dict[str, Any]) -> list[str]:
        lines = lines_of("boot-to-ready.jsonl")
        header = json.loads(lines[0])
        return [lines[0], *lines[1:8], json.dumps({**header, **second}), *lines[8:]]

    def test_joinedFilesReplay(self) -> None:
        result = replay(self.joined({"continues": True, "t": 1.2}))
        self.assertTrue(result.matched, result.describe())

    def test_aSessionWhoseStartWasRotatedAwayIsRefused(self) -> None:
        lines = self.joined({"continues": True, "t": 1.2})
        lines = with_header(lines, continues=True, t=0.5)
        error = self.assertRaises(TranscriptError, replay, lines)
        self.assertEqual(error.line, 1)
        self.assertIn("the start of this session was rotated away", str(error))
        self.assertIn("--record-keep", str(error))
        self.assertNotIn("cat NAME.jsonl", str(error))

    def test_aContinuationOfAnotherInstanceIsRefused(self) -> None:
        other = "0b7c1b2e-0000-4000-8000-000000000001"
        lines = self.joined({"continues": True, "t": 1.2, "uuid": other})
        error = self.assertRaises(TranscriptError, replay, lines)
        self.assertEqual(error.line, 9)
        self.assertIn(f"a header of another instance named 'web1' (uuid {other}", str(error))
