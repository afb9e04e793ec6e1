"""vmready.hypervisor.agentbundle: the agent zipapp a stock guest runs, and the guard on it.

The guard: an ast walk over the bundled modules fails on any import outside
the standard library and the bundle itself.  The proof: the built zipapp runs
with ``python3 -S -I`` in an empty environment, and, where a Python 3.9 is
found, under it against a fake host, from STARTED through notify to STOPPED.
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile

from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from tests.agent.test_agent_main import Process, demo_guest
from tests.reactor import reactor
from vmready.agent.ports import PORT_NAME
from vmready.hypervisor import agentbundle

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPECTED = {
    "vmready/__init__.py",
    "vmready/protocols/__init__.py",
    "vmready/protocols/ringbuffer.py",
    "vmready/protocols/transcript.py",
    "vmready/agent/__init__.py",
    "vmready/agent/answers.py",
    "vmready/agent/apisocket.py",
    "vmready/agent/bootdata.py",
    "vmready/agent/boottimes.py",
    "vmready/agent/config.py",
    "vmready/agent/connectport.py",
    "vmready/agent/core.py",
    "vmready/agent/firstword.py",
    "vmready/agent/host.py",
    "vmready/agent/httpcodec.py",
    "vmready/agent/httpwire.py",
    "vmready/agent/logs.py",
    "vmready/agent/main.py",
    "vmready/agent/memory.py",
    "vmready/agent/minimum.py",
    "vmready/agent/network.py",
    "vmready/agent/notify.py",
    "vmready/agent/options.py",
    "vmready/agent/ports.py",
    "vmready/agent/proxy.py",
    "vmready/agent/recording.py",
    "vmready/agent/records.py",
    "vmready/agent/sdnotify.py",
    "vmready/agent/serial.py",
    "vmready/agent/service.py",
    "vmready/agent/tls.py",
}


def python39() -> str | None:
    """A Python 3.9 to run the zipapp with: $VMREADY_PYTHON39, pyenv's, or python3.9."""
    candidates = [os.environ.get("VMREADY_PYTHON39", "")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3")))
    candidates.append(shutil.which("python3.9") or "")
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def older_python() -> str | None:
    """A Python older than 3.9 (pyenv's), to see the agent refuse it."""
    pattern = os.path.expanduser("~/.pyenv/versions/3.[678].*/bin/python3")
    for candidate in sorted(glob.glob(pattern)):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def module_of(path: str) -> str:
    """``vmready/agent/core.py`` → ``vmready.agent.core``."""
    name = path[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module file of this checkout (not an attribute of a package)."""
    return os.path.isfile(os.path.join(CHECKOUT, *name.split(".")) + ".py")


def foreign_imports(sources: dict[str, str], stdlib: frozenset[str]) -> list[str]:
    """Every import in ``sources`` (path → text) of neither the stdlib nor ``sources``."""
    bundled = {module_of(path) for path in sources}
    found = []
    for path, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text, path)):
            names: list[str] = []
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                if node.level:
                    found.append(f"{path}:{node.lineno}: a relative import")
                    continue
                base = node.module or ""
                # ``from vmready.trust import certs`` imports the module vmready.trust.certs.
                modules = [
                    f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")
                ]
                names = modules or [base]
            for name in names:
                top = name.split(".")[0]
                if name in bundled or (top != "vmready" and top in stdlib):
                    continue
                found.append(f"{path}:{node.lineno}: {name}")
    return found


class BundleContentsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vra-bundle-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_theBundleIsExactlyTheAgentAndTheModulesItShares(self) -> None:
        self.assertEqual(set(agentbundle.bundled_files()), EXPECTED)

    def test_theZipappHoldsTheBundleAndItsEntryPoint(self) -> None:
        path = agentbundle.build_zipapp(self.directory)
        self.assertEqual(os.path.basename(path), "vmready-agent.pyz")
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            main = archive.read("__main__.py").decode()
        compiled = [name[:-3] + ".pyc" for name in EXPECTED]
        self.assertEqual(names, ["__main__.py", *sorted([*EXPECTED, *compiled])])
        self.assertEqual(
            main.splitlines()[1:], ["import vmready.agent.main", "vmready.agent.main.main()"]
        )
        with open(path, "rb") as f:
            self.assertEqual(f.readline(), b"#!/usr/bin/env python3\n")

    def test_theSameSourcesGiveTheSameBytes(self) -> None:
        first = agentbundle.build_zipapp(os.path.join(self.directory, "a.pyz"))
        os.utime(os.path.join(CHECKOUT, "vmready", "protocols", "ringbuffer.py"))  # a newer mtime
        second = agentbundle.build_zipapp(os.path.join(self.directory, "b.pyz"))
        with open(first, "rb") as a, open(second, "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_entriesCarryNoTimeNorOwner(self) -> None:
        with zipfile.ZipFile(agentbundle.build_zipapp(self.directory)) as archive:
            stamps = {(info.date_time, info.external_attr >> 16) for info in archive.infolist()}
        self.assertEqual(stamps, {((1980, 1, 1, 0, 0, 0), 0o100644)})

    def test_aFailedBuildLeavesTheOldZipappAndNoPartialFile(self) -> None:
        path = os.path.join(self.directory, "vmready-agent.pyz")
        with open(path, "wb") as f:
            f.write(b"the old agent")
        broken = os.path.join(self.directory, "no-sources")
        os.makedirs(os.path.join(broken, "vmready", "agent"))
        self.assertRaises(OSError, agentbundle.build_zipapp, path, broken)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), b"the old agent")
        self.assertEqual(sorted(os.listdir(self.directory)), ["no-sources", "vmready-agent.pyz"])

    def test_theZipappIsExecutable(self) -> None:
        path = agentbundle.build_zipapp(self.directory)
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o755)


class ImportGuardTests(SynchronousTestCase):
    """Nothing bundled may import anything a stock guest does not have."""

    def sources(self) -> dict[str, str]:
        texts = {}
        for path in agentbundle.bundled_files():
            with open(os.path.join(CHECKOUT, path), encoding="utf-8") as f:
                texts[path] = f.read()
        return texts

    def test_theBundleImportsOnlyTheStandardLibraryAndItself(self) -> None:
        self.assertEqual(foreign_imports(self.sources(), frozenset(sys.stdlib_module_names)), [])

    def test_theGuardCatchesAThirdPartyImport(self) -> None:
        sources = {
            **self.sources(),
            "vmready/agent/extra.py": "import twisted\nfrom attrs import frozen\n",
        }
        self.assertEqual(
            foreign_imports(sources, frozenset(sys.stdlib_module_names)),
            ["vmready/agent/extra.py:1: twisted", "vmready/agent/extra.py:2: attrs"],
        )

    def test_theGuardCatchesAHostModule(self) -> None:
        sources = {
            **self.sources(),
            "vmready/agent/extra.py": (
                "from vmready.trust import certs\nimport vmready.trust.tls\n"
            ),
        }
        self.assertEqual(
            foreign_imports(sources, frozenset(sys.stdlib_module_names)),
            [
                "vmready/agent/extra.py:1: vmready.trust.certs",
                "vmready/agent/extra.py:2: vmready.trust.tls",
            ],
        )


def run_isolated(python: str, zipapp: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -S -I zipapp args`` with an empty environment, from an empty directory."""
    with tempfile.TemporaryDirectory(prefix="vra-cwd-") as cwd:
        return subprocess.run(
            [python, "-S", "-I", zipapp, *args],
            env={},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


class IsolatedRunTests(SynchronousTestCase):
    """The zipapp needs nothing but the interpreter: no site-packages, no environment."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vra-bundle-")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.zipapp = agentbundle.build_zipapp(self.directory)

    def test_helpRunsWithoutSiteOrEnvironment(self) -> None:
        result = run_isolated(sys.executable, self.zipapp, "--help")
        self.assertEqual((result.returncode, result.stderr), (0, ""))
        self.assertTrue(
            result.stdout.startswith("usage: vmready-agent [options]\n"), result.stdout
        )

    def test_aBadDriveIsOneLineAndStatusOne(self) -> None:
        result = run_isolated(sys.executable, self.zipapp, "--config-drive", "/nonexistent")
        self.assertEqual(
            (result.returncode, result.stderr),
            (1, "vmready-agent: config drive /nonexistent is not a directory\n"),
        )

    def test_thisPythonImportsTheBundledBytecodeWithoutCompiling(self) -> None:
        # Compiled here, a module names its file as the bundle does; compiled from the
        # zip's source, it would name it inside the archive's path.
        probe = (
            "import sys; sys.path.insert(0, sys.argv[1]); import vmready.agent.service as s; "
            "print(s.Agent.start.__code__.co_filename)"
        )
        result = subprocess.run(
            [sys.executable, "-S", "-I", "-c", probe, self.zipapp],
            env={},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        self.assertEqual((result.stdout, result.stderr), ("vmready/agent/service.py\n", ""))

    def test_aUsageErrorIsStatusTwo(self) -> None:
        result = run_isolated(sys.executable, self.zipapp, "--heartbeat", "0")
        self.assertEqual(result.returncode, 2)
        self.assertEqual(
            result.stderr.splitlines()[0],
            "vmready-agent: --heartbeat must be a positive number of seconds, not '0'",
        )

    def test_anOlderPythonIsRefusedInOneLine(self) -> None:
        python = older_python()
        if python is None:
            raise SkipTest("no Python older than 3.9 here (pyenv's 3.6, 3.7 or 3.8)")
        result = run_isolated(python, self.zipapp, "--help")
        self.assertEqual(result.returncode, 1)
        self.assertRegex(
            result.stderr,
            r"\Avmready-agent: needs Python 3\.9 or newer, and this is Python 3\.[678]\.\d+\n\Z",
        )

    def test_helpRunsUnderPython39(self) -> None:
        python = python39()
        if python is None:
            raise SkipTest("no Python 3.9 here (set VMREADY_PYTHON39, or install pyenv's 3.9)")
        result = run_isolated(python, self.zipapp, "--help")
        self.assertEqual((result.returncode, result.stderr), (0, ""))


class Python39EndToEndTests(TestCase):
    """The zipapp under Python 3.9, against a fake host: the minimum guest, really run."""

    def setUp(self) -> None:
        python = python39()
        if python is None:
            raise SkipTest("no Python 3.9 here (set VMREADY_PYTHON39, or install pyenv's 3.9)")
        self.python = python
        self.base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.zipapp = agentbundle.build_zipapp(self.base)
        # The host's CONNECT lines come on a port of their own, as from a vmready daemon.
        self.drive, self.socket, self.peer, self.connect_port, self.host = demo_guest(
            self, self.base, relative=True
        )

    def spawn(self, *args: str) -> Process:
        process = Process()
        transport = reactor.spawnProcess(
            process,
            self.python,
            [self.python, "-S", "-I", self.zipapp, *args],
            env={},
            path=self.base,
        )

        async def reap() -> None:
            if not process.ended.called:
                transport.signalProcess("KILL")
            await process.ended

        self.addCleanup(reap)
        self.pid = transport.pid
        return process

    async def test_agentLinksAndNotifyReadyReachesTheHost(self) -> None:
        await self.host.start()
        agent = self.spawn("--config-drive", self.drive, "--heartbeat", "30")
        agent_pid = self.pid
        await self.peer.wait_for(b"STARTED", since=0)
        connected = self.peer.wait_for(b"CONNECTED")
        self.connect_port.send(self.host.connect_line)
        await connected
        notify = self.spawn("notify", "ready", "--socket", self.socket)
        self.assertEqual((await notify.ended, notify.stderr), (0, b""))
        self.assertEqual(self.host.patches, ["Ready"])
        stopped = self.peer.wait_for(b"STOPPED")
        os.kill(agent_pid, signal.SIGTERM)
        await stopped
        self.assertEqual(await agent.ended, 0)
        log = agent.stderr.decode()
        self.assertIn(f"vmready-agent: serial port: {self.drive}/vp/{PORT_NAME}\n", log)
        self.assertIn("vmready-agent: connected to the host at ", log)
        self.assertIn("vmready-agent: the workload declared Ready\n", log)
        self.assertNotIn("Traceback", log)
