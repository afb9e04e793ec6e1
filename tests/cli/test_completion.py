"""``vmready completion`` (driven in real shells) and "did you mean"."""

from __future__ import annotations

import io
import os
import shutil
import stat
import sys
import tempfile

from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase

from tests.cli.test_cli import _SOURCE_ROOT, CLITestCase
from tests.reactor import reactor
from vmready.cli.completion import command_specs, completion_script
from vmready.cli.main import run
from vmready.cli.parser import build_parser
from vmready.cli.suggest import closest, unknown_command

# Defines t WORDS…: complete the last word as the shell would, print one candidate a line.
_BASH_DRIVER = """
source "$1"
shift
COMP_WORDS=("$@")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
_vmready
(( ${#COMPREPLY[@]} )) && printf '%s\\n' "${COMPREPLY[@]}"
exit 0
"""
# zsh: compadd and _files stand in for the completion system's, printing what they get.
_ZSH_DRIVER = """
compdef() { :; }
source "$1"
shift
compadd() { shift; print -rl -- "$@"; }
_files() { print -r -- '<files>'; }
words=("$@")
CURRENT=$#
_vmready
"""


def _shell(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SkipTest(f"{name} is not installed (apt-get install {name}); its script is untested")
    return path


class ShellTestCase(TestCase):
    """Generated scripts written to a file, and a ``vmready`` on PATH that runs this CLI."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="vmr-compl-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        wrapper = os.path.join(self.dir, "vmready")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {sys.executable} -m vmready.cli.main "$@"\n')
        os.chmod(wrapper, stat.S_IRWXU)
        self.env = {
            **os.environ,
            "PATH": f"{self.dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": _SOURCE_ROOT,
        }

    def script(self, shell: str) -> str:
        path = os.path.join(self.dir, f"vmready.{shell}")
        with open(path, "w") as f:
            f.write(completion_script(build_parser(), shell))
        return path

    async def complete(self, shell: str, *words: str) -> list[str]:
        """The candidates ``shell`` offers for the last of ``words``."""
        program = _shell(shell)
        if shell == "fish":
            argv = ["-c", 'source $argv[1]; complete -C "$argv[2]"', self.script(shell)]
            argv.append(" ".join(words))
        else:
            driver = _BASH_DRIVER if shell == "bash" else _ZSH_DRIVER
            argv = ["-c", driver, shell, self.script(shell), *words]
        out, err, code = await getProcessOutputAndValue(program, argv, env=self.env)
        self.assertEqual((code, err), (0, b""), out)
        return [line.split("\t")[0] for line in out.decode().splitlines()]

    async def syntax(self, shell: str) -> None:
        out, err, code = await getProcessOutputAndValue(
            _shell(shell), ["-n", self.script(shell)], env=self.env
        )
        self.assertEqual((code, out, err), (0, b"", b""))


class BashCompletionTests(ShellTestCase):
    """The bash script, sourced and called as bash's completion would."""

    async def test_theScriptIsValidBash(self) -> None:
        await self.syntax("bash")

    async def test_commandsVerbsAndOptions(self) -> None:
        self.assertEqual(await self.complete("bash", "vmready", "st"), ["start", "stop"])
        self.assertEqual(
            await self.complete("bash", "vmready", "stop", "--"),
            ["--help", "--socket", "--format", "--wait", "--no-wait", "--force", "--timeout"],
        )
        self.assertEqual(
            await self.complete("bash", "vmready", "snapshot", ""),
            ["create", "delete", "list", "restore"],
        )
        self.assertEqual(
            await self.complete("bash", "vmready", "snapshot", "create", "--st"), ["--stateful"]
        )
        self.assertEqual(
            await self.complete("bash", "vmready", "--format", "json", "com"), ["completion"]
        )

    async def test_optionValuesAndFixedArguments(self) -> None:
        self.assertEqual(
            await self.complete("bash", "vmready", "list", "--format", ""),
            ["table", "json", "yaml", "csv"],
        )
        self.assertEqual(await self.complete("bash", "vmready", "launch", "--accel", "k"), ["kvm"])
        self.assertEqual(
            await self.complete("bash", "vmready", "completion", ""), ["bash", "zsh", "fish"]
        )
        self.assertEqual(
            await self.complete("bash", "vmready", "wait", "web1", "status=r"),
            ["status=running", "status=ready"],
        )
        # As bash splits it at "=" (COMP_WORDBREAKS): what follows the "=".
        self.assertEqual(
            await self.complete("bash", "vmready", "wait", "web1", "status", "=", "st"),
            ["stopped", "starting", "stopping"],
        )
        self.assertEqual(
            await self.complete("bash", "vmready", "wait", "web1", "status", "=", "ready", "--t"),
            ["--timeout"],
        )
        self.assertIn(
            self.dir + "/vmready.bash",
            await self.complete("bash", "vmready", "launch", "--image", self.dir + "/vmready.b"),
        )

    async def test_theScriptFollowsTheParser(self) -> None:
        script = completion_script(build_parser(), "bash")
        for spec in command_specs(build_parser()):
            self.assertIn(spec.key, script)
        self.assertIn("complete -F _vmready vmready\n", script)


class InstanceNameCompletionTests(CLITestCase, ShellTestCase):
    """Instance names come from the daemon, through ``vmready list --format csv -c n``."""

    def setUp(self) -> None:
        CLITestCase.setUp(self)
        ShellTestCase.setUp(self)
        self.env["VMREADY_SOCKET"] = os.path.join(self.dir, "nowhere.sock")

    async def test_bashCompletesInstanceNamesFromTheSocketOnTheLine(self) -> None:
        await self.launch("web1")
        await self.launch("web2")
        await self.launch("db1")
        words = ("vmready", "--socket", self.socket, "stop", "web")
        self.assertEqual(await self.complete("bash", *words), ["web1", "web2"])
        # launch names a new instance: nothing to complete.
        self.assertEqual(
            await self.complete("bash", "vmready", "--socket", self.socket, "launch", ""), []
        )
        # No daemon: no names, no noise.
        self.assertEqual(await self.complete("bash", "vmready", "stop", "w"), [])

    async def test_zshCompletesInstanceNames(self) -> None:
        await self.launch("web1")
        words = ("vmready", "--socket", self.socket, "info", "")
        self.assertEqual(await self.complete("zsh", *words), ["web1"])

    async def test_fishCompletesInstanceNames(self) -> None:
        await self.launch("web1")
        words = ("vmready", "--socket", self.socket, "info", "w")
        self.assertIn("web1", await self.complete("fish", *words))


class ZshAndFishCompletionTests(ShellTestCase):
    """The zsh and fish scripts: their syntax and a few completions (skipped without the shell)."""

    def test_zshScriptStructure(self) -> None:
        script = completion_script(build_parser(), "zsh")
        self.assertTrue(script.startswith("#compdef vmready\n"))
        self.assertIn("compdef _vmready vmready\n", script)
        self.assertIn("'vmready snapshot' 'create delete list restore'", script)

    def test_fishScriptStructure(self) -> None:
        script = completion_script(build_parser(), "fish")
        self.assertIn("complete -c vmready -n 'not __fish_seen_subcommand_from launch", script)
        self.assertIn(
            "complete -c vmready -n '__fish_seen_subcommand_from stop' -l timeout -x\n", script
        )

    async def test_zshSyntax(self) -> None:
        await self.syntax("zsh")

    async def test_fishSyntax(self) -> None:
        await self.syntax("fish")

    async def test_zshCompletes(self) -> None:
        self.assertIn("stop", await self.complete("zsh", "vmready", "st"))
        self.assertEqual(
            await self.complete("zsh", "vmready", "stop", "--format", ""),
            ["table", "json", "yaml", "csv"],
        )
        self.assertEqual(
            await self.complete("zsh", "vmready", "snapshot", ""),
            ["create", "delete", "list", "restore"],
        )
        self.assertIn("--no-wait", await self.complete("zsh", "vmready", "restart", "-"))
        self.assertEqual(await self.complete("zsh", "vmready", "replay", ""), ["<files>"])

    async def test_fishCompletes(self) -> None:
        self.assertEqual(await self.complete("fish", "vmready", "st"), ["start", "stop"])
        self.assertEqual(
            await self.complete("fish", "vmready", "stop", "--fo"), ["--force", "--format"]
        )
        self.assertEqual(
            await self.complete("fish", "vmready", "snapshot", ""),
            ["create", "delete", "list", "restore"],
        )


class CompletionCommandTests(TestCase):
    """``vmready completion SHELL`` prints the script, needing no daemon."""

    async def test_printsTheScript(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        argv = ["--socket", "/nonexistent.sock", "completion", "bash"]
        self.assertEqual(await run(reactor, argv, out, err), 0)
        self.assertEqual(out.getvalue(), completion_script(build_parser(), "bash"))

    async def test_unknownShellIsAUsageError(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        self.assertEqual(await run(reactor, ["completion", "tcsh"], out, err), 2)
        self.assertIn("invalid choice: 'tcsh'", err.getvalue())


class DidYouMeanTests(CLITestCase):
    """A mistyped command or instance name gets the closest one."""

    async def test_mistypedCommandExits2WithTheClosest(self) -> None:
        self.assertEqual(
            await self.cli("lsit"),
            (2, "", "vmready: unknown command 'lsit' (did you mean 'list'?)\n"),
        )
        self.assertEqual(
            await self.cli("--format", "json", "stpo", "web1"),
            (2, "", "vmready: unknown command 'stpo' (did you mean 'stop'?)\n"),
        )
        self.assertEqual(self.site.requests, [])

    async def test_unlikeAnyCommandPointsToHelp(self) -> None:
        self.assertEqual(
            await self.cli("xyzzy"),
            (2, "", "vmready: unknown command 'xyzzy' (see 'vmready --help')\n"),
        )

    async def test_mistypedInstanceGetsTheClosestName(self) -> None:
        await self.launch("web1")
        await self.launch("db1")
        expected = "vmready: Error: Instance web2 not found (did you mean 'web1'?)\n"
        self.assertEqual(await self.cli("info", "web2"), (1, "", expected))
        self.assertEqual(await self.cli("stop", "web2", "--force"), (1, "", expected))
        self.assertEqual(await self.cli("wait", "web2", "status=running"), (1, "", expected))
        self.assertEqual(
            await self.cli("snapshot", "create", "dbl", "s1"),
            (1, "", "vmready: Error: Instance dbl not found (did you mean 'db1'?)\n"),
        )

    async def test_noCloseNameLeavesTheErrorAsItIs(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("info", "zzzzzz"),
            (1, "", "vmready: Error: Instance zzzzzz not found\n"),
        )

    def test_closest(self) -> None:
        self.assertEqual(closest("restrat", ["restart", "restore"]), "restart")
        self.assertIsNone(closest("q", ["list"]))
        commands = ["list", "stop"]
        self.assertIsNone(unknown_command(["--socket", "x", "list"], commands))
        self.assertIsNone(unknown_command(["--help"], commands))
        self.assertIsNone(unknown_command([], commands))
