"""vmready.cli.progress: the progress line of a long action, and --wait/--no-wait."""

from __future__ import annotations

import io
import os
import pty
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from tests.cli.test_cli import CLITestCase
from tests.fixtures import STOP_TIMEOUT
from tests.reactor import reactor
from vmready.cli.actionprogress import ActionProgress
from vmready.cli.main import run
from vmready.cli.parser import build_parser
from vmready.cli.progress import Progress, TerminalLine, doing_words, is_terminal

CLEAR = "\r\x1b[K"


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class _Broken(io.StringIO):
    """A terminal that went away."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def state(name: str, task: str | None, status: str = "Stopping") -> dict[str, Any]:
    """An ``instance-state`` lifecycle event."""
    return {
        "type": "lifecycle",
        "metadata": {
            "action": "instance-state",
            "source": f"/1.0/instances/{name}",
            "context": {"status": status, "task_state": task},
        },
    }


def operation(op_id: str, name: str, metadata: Any) -> dict[str, Any]:
    """An operation object."""
    return {
        "id": op_id,
        "status": "Running",
        "status_code": 103,
        "resources": {"instances": [f"/1.0/instances/{name}"]},
        "metadata": metadata,
    }


def operation_event(op_id: str, name: str, metadata: Any) -> dict[str, Any]:
    """An operation event."""
    return {"type": "operation", "metadata": operation(op_id, name, metadata)}


# force_at: Unix second 1030, as the daemon writes it.
GRACE = {"shutdown": {"timeout": 30.0, "force_at": "1970-01-01T00:17:10Z"}}


class ProgressTests(SynchronousTestCase):
    """The renderer: events in, the line's text out."""

    def progress(self, command: str = "stop") -> Progress:
        return Progress("web1", command, doing_words(command), clock_time=lambda t: f"<{t:g}>")

    def test_beforeAnyEventTheLineSaysTheCommand(self) -> None:
        progress = self.progress()
        self.assertEqual(progress.text(1000.0), "web1: stopping…")
        self.assertEqual(progress.frame(1000.0, 0), "| web1: stopping…")
        self.assertEqual(progress.frame(1000.0, 5), "/ web1: stopping…")

    def test_theGracePeriodCountsDownThenSaysItForces(self) -> None:
        progress = self.progress()
        progress.follow(operation("op1", "web1", None))
        progress.event(state("web1", "powering-off"))
        self.assertEqual(progress.text(1000.0), "web1: stopping (powering off the VM)…")
        progress.event(operation_event("op1", "web1", GRACE))
        self.assertEqual(
            progress.text(1003.0),
            "web1: stopping (asking the guest to shut down; forcing at <1030>, in 27 s)…",
        )
        self.assertIn("in 1 s", progress.text(1029.5))
        self.assertEqual(
            progress.text(1030.0),
            "web1: stopping (forcing it off: the guest did not shut down within 30 s)…",
        )

    def test_aRestartSaysItBootsAgainOnceTheVMIsOff(self) -> None:
        progress = self.progress("restart")
        progress.follow(operation("op1", "web1", GRACE))
        self.assertIn("forcing at <1030>", progress.text(1000.0))
        done = {"shutdown": {**GRACE["shutdown"], "result": "clean"}}
        progress.event(operation_event("op1", "web1", done))
        self.assertEqual(progress.text(1001.0), "web1: restarting (booting the VM again)…")

    def test_metadataSeenBeforeTheOperationIdIsKnownCounts(self) -> None:
        progress = self.progress()
        progress.event(operation_event("op1", "web1", GRACE))
        progress.event(operation_event("op2", "web1", None))
        progress.follow(operation("op1", "web1", None))
        self.assertIn("forcing at <1030>", progress.text(1000.0))

    def test_otherInstancesAndOperationsAreIgnored(self) -> None:
        progress = self.progress()
        progress.follow(operation("op1", "web1", None))
        progress.event(state("web2", "powering-off"))
        progress.event(operation_event("op1", "web2", GRACE))
        progress.event(operation_event("op9", "web1", GRACE))
        progress.event({"type": "lifecycle", "metadata": "nonsense"})
        progress.event(state("web1", "not-a-task"))
        self.assertEqual(progress.text(1000.0), "web1: stopping…")

    def test_taskStatesNameTheStep(self) -> None:
        progress = self.progress("resize")
        progress.event(state("web1", "resize-prep", "Resizing"))
        self.assertEqual(progress.text(0), "web1: resizing (preparing)…")
        progress.event(state("web1", "resize-migrating", "Resizing"))
        self.assertEqual(progress.text(0), "web1: resizing (restarting the VM with the new size)…")
        progress.event(state("web1", None, "Running"))
        self.assertEqual(progress.text(0), "web1: resizing…")

    def test_commandWords(self) -> None:
        self.assertEqual(doing_words("snapshot", "s1"), "taking snapshot s1")
        self.assertEqual(doing_words("restore", "s1"), "restoring snapshot s1")
        self.assertEqual(doing_words("launch"), "launching")
        self.assertEqual(doing_words("revert-resize"), "reverting the resize")


class TerminalLineTests(SynchronousTestCase):
    """One line rewritten in place."""

    def test_showRewritesTheLineAndClearLeavesItEmpty(self) -> None:
        stream = io.StringIO()
        line = TerminalLine(stream, lambda: 80)
        line.show("a")
        line.show("a")  # unchanged: nothing written
        line.show("bb")
        line.clear()
        line.clear()
        self.assertEqual(stream.getvalue(), f"{CLEAR}a{CLEAR}bb{CLEAR}")

    def test_aLongLineIsCutToTheWidthSoItNeverWraps(self) -> None:
        stream = io.StringIO()
        TerminalLine(stream, lambda: 10).show("x" * 30)
        self.assertEqual(stream.getvalue(), CLEAR + "x" * 9)

    def test_aTerminalWithoutASizeIsTakenAs80Columns(self) -> None:
        master, replica = pty.openpty()
        self.addCleanup(os.close, master)
        with open(replica, "w") as stream:
            self.assertEqual(os.get_terminal_size(replica).columns, 0)
            line = TerminalLine(stream)
            line.show("x" * 100)
            self.assertEqual(line.shown, "x" * 79)

    def test_aBrokenTerminalIsLeftAlone(self) -> None:
        line = TerminalLine(_Broken(), lambda: 80)
        line.show("a")
        line.show("b")
        line.clear()
        self.assertEqual(line.shown, "")

    def test_whatIsATerminal(self) -> None:
        self.assertTrue(is_terminal(Terminal(), {"TERM": "xterm"}))
        self.assertFalse(is_terminal(Terminal(), {"TERM": "dumb"}))
        self.assertFalse(is_terminal(io.StringIO(), {"TERM": "xterm"}))


class ActionProgressTests(SynchronousTestCase):
    """The follower on a task.Clock: a frame a tick, from the operation on, cleared at the end."""

    def test_framesFromTheOperationOnUntilPaused(self) -> None:
        clock = Clock()
        clock.advance(1000)
        stream = io.StringIO()
        progress = Progress("web1", "stop", "stopping", clock_time=lambda t: f"<{t:g}>")
        follower = ActionProgress(progress, TerminalLine(stream, lambda: 200), clock)
        self.assertEqual(stream.getvalue(), "")
        follower.follow(operation("op1", "web1", GRACE))
        clock.advance(0.25)
        follower._event(state("web1", "powering-off"))
        clock.pump([0.25] * 8)
        follower.pause()
        clock.advance(1.0)
        follower.close()
        frames = stream.getvalue().split(CLEAR)
        grace = "web1: stopping (asking the guest to shut down; forcing at <1030>, in "
        self.assertEqual(
            frames[:4], ["", f"| {grace}30 s)…", f"/ {grace}30 s)…", f"- {grace}30 s)…"]
        )
        self.assertEqual(frames[-2], f"- {grace}28 s)…")  # at 1002.25: the eleventh frame
        self.assertEqual(len(frames), 1 + 3 + 8 + 1)  # start, the event, 8 ticks, cleared
        self.assertEqual(frames[-1], "")


class TerminalProgressTests(CLITestCase):
    """The real CLI against a real daemon, with stderr a terminal or not."""

    def setUp(self) -> None:
        super().setUp()
        self.patch(os, "environ", {**os.environ, "TERM": "xterm"})

    async def terminal(self, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), Terminal()
        code = await run(reactor, ["--socket", self.socket, *argv], out, err)
        return code, out.getvalue(), err.getvalue()

    async def test_stopSaysWhenTheGraceEndsAndThatItWillForce(self) -> None:
        await self.launch("web1")
        code, out, err = await self.terminal("stop", "web1")
        self.assertEqual((code, out), (0, "web1: STOPPED\n"))
        self.assertIn(" web1: stopping (asking the guest to shut down; forcing at ", err)
        self.assertRegex(err, r"forcing at \d\d:\d\d:\d\d, in 1 s\)…")
        # The line is cleared before the result is printed: it ends empty.
        self.assertTrue(err.endswith(CLEAR), err)
        self.assertNotIn("\n", err)
        history = await self.lifecycle.store.actions.list_actions("web1")
        self.assertIn(
            f"forced stop after {STOP_TIMEOUT:g}s timeout", [s.name for s in history[0].steps]
        )

    async def test_launchShowsItsProgressAfterTheCreatingLine(self) -> None:
        code, out, err = await self.terminal("launch", "web1")
        self.assertEqual((code, out), (0, "Creating web1\nweb1: RUNNING\n"))
        self.assertTrue(err.startswith(CLEAR + "| web1: launching"), err)
        self.assertTrue(err.endswith(CLEAR), err)

    async def test_programsAndNoWaitGetNoProgress(self) -> None:
        await self.launch("web1")
        code, out, err = await self.terminal("freeze", "web1", "--format", "json")
        self.assertEqual((code, err), (0, ""))
        code, out, err = await self.terminal("unfreeze", "web1", "--no-wait")
        self.assertEqual((code, err), (0, ""))
        self.assertRegex(
            out, r"^Operation /1\.0/operations/[0-9a-f-]{36}: Unfreeze instance web1\n$"
        )
        for pending in self.lifecycle.operations.list():
            await pending.when_done()

    async def test_notATerminalGetsNoProgress(self) -> None:
        await self.launch("web1")
        self.assertEqual(await self.cli("stop", "web1", "--wait"), (0, "web1: STOPPED\n", ""))

    async def test_aFailedActionClearsTheLineBeforeItsError(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        code, out, err = await self.terminal("rebuild", "web1")
        self.assertEqual((code, out), (1, ""))
        self.assertIn(CLEAR + "vmready: Error: cannot start web1", err)


class WaitOptionTests(SynchronousTestCase):
    """Every action takes --wait (the default) and --no-wait, but not both."""

    ACTIONS = (
        ["start", "n"],
        ["stop", "n"],
        ["restart", "n"],
        ["freeze", "n"],
        ["unfreeze", "n"],
        ["rebuild", "n"],
        ["resize", "n", "--cpus", "2"],
        ["confirm-resize", "n"],
        ["revert-resize", "n"],
        ["delete", "n"],
        ["snapshot", "create", "n", "s"],
        ["snapshot", "restore", "n", "s"],
        ["restore", "n", "s"],
    )

    def test_everyActionTakesWaitAndNoWait(self) -> None:
        parser = build_parser()
        for argv in self.ACTIONS:
            self.assertFalse(parser.parse_args(argv).no_wait, argv)
            self.assertFalse(parser.parse_args([*argv, "--wait"]).no_wait, argv)
            self.assertTrue(parser.parse_args([*argv, "--no-wait"]).no_wait, argv)

    def test_launchNoWaitAndWaitForReady(self) -> None:
        parser = build_parser()
        launch = parser.parse_args(["launch", "n"])
        self.assertEqual((launch.no_wait, launch.wait), (False, False))
        self.assertTrue(parser.parse_args(["launch", "n", "--no-wait"]).no_wait)
        self.assertTrue(parser.parse_args(["launch", "n", "--wait"]).wait)

    def test_waitAndNoWaitTogetherIsAUsageError(self) -> None:
        for argv in [*self.ACTIONS, ["launch", "n"]]:
            out, err = io.StringIO(), io.StringIO()
            running = run(reactor, [*argv, "--wait", "--no-wait"], out, err)
            code = self.successResultOf(Deferred.fromCoroutine(running))
            self.assertEqual(code, 2, argv)
            self.assertIn("not allowed with argument", err.getvalue())
