"""``twistd vmready`` as a real process: startup refusals, and surviving kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.processes import kill_if_named
from vmready.daemon.preflight import check_guest_listen_address, check_listen_address
from vmready.lifecycle.specs import run_dir_name
from vmready.store.sqlite import Store

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
DEADLINE = 60.0


def twistd(data_dir: str, *extra: str) -> list[str]:
    """The daemon's command line, in the foreground, without a pidfile."""
    # --config "": whatever /etc/vmready/vmready.yaml the host has does not apply.
    head = [TWISTD, "-n", "--pidfile", "", "vmready", "--config", ""]
    return [*head, "--data-dir", data_dir, *extra]


def api_answers(socket_path: str) -> bool:
    """Whether the operator API on ``socket_path`` answers a request now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path)
        probe.sendall(b"GET /1.0 HTTP/1.0\r\n\r\n")
        return probe.recv(64).startswith(b"HTTP/1.0 200")
    except OSError:
        return False
    finally:
        probe.close()


def wait_for_api(
    case: SynchronousTestCase, daemon: subprocess.Popen[bytes], socket_path: str
) -> None:
    """Once ``daemon``'s operator API answers on ``socket_path``; fails if it exits first."""
    deadline = time.monotonic() + DEADLINE
    while not api_answers(socket_path):
        case.assertIsNone(daemon.poll())
        case.assertLess(time.monotonic(), deadline)
        time.sleep(0.1)


def taken_tcp_endpoint(case: SynchronousTestCase) -> str:
    """The endpoint of a loopback TCP port another socket listens on for the test's length."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    case.addCleanup(listener.close)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    return f"tcp:{listener.getsockname()[1]}:interface=127.0.0.1"


class StartupRefusalTests(SynchronousTestCase):
    """The daemon refuses to start with one line naming the reason, and exits 1."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-d-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def refusal(self, *args: str) -> str:
        result = subprocess.run(
            args, capture_output=True, text=True, timeout=DEADLINE, check=False
        )
        self.assertEqual(result.returncode, 1, result.stderr)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        self.assertEqual(len(lines), 1, result.stderr)
        return lines[0]

    def test_unwritableDataDir(self) -> None:
        blocker = os.path.join(self.directory, "file")
        open(blocker, "w").close()
        line = self.refusal(*twistd(os.path.join(blocker, "sub")))
        self.assertEqual(line, f"vmready: data dir {blocker}/sub is not writable: Not a directory")

    def test_storeFromANewerVmready(self) -> None:
        path = os.path.join(self.directory, "vmready.sqlite")
        Store.open(path).close()
        with sqlite3.connect(path) as connection:
            connection.execute("INSERT INTO vmready_schema(version, applied_at) VALUES (99, 0)")
        line = self.refusal(*twistd(self.directory))
        self.assertEqual(
            line,
            f"vmready: store {path} has schema version 99, newer than this vmready "
            f"understands ({Store.SCHEMA_VERSION}); upgrade vmready",
        )

    def test_serverKeyMissingIsRefusedNotReplaced(self) -> None:
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from vmready.trust.certs import ensure_server_certificate as e; "
                f"e({self.directory!r})",
            ],
            check=True,
        )
        key = os.path.join(self.directory, "server.key")
        os.unlink(key)
        line = self.refusal(*twistd(self.directory))
        cert = os.path.join(self.directory, "server.crt")
        self.assertEqual(
            line,
            f"vmready: {cert} exists but {key} is missing: restore it (every agent pins this "
            f"certificate), or remove {cert} too to issue a new pair",
        )
        self.assertFalse(os.path.exists(key))

    def test_addressInUse(self) -> None:
        path = os.path.join(self.directory, "taken.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self.addCleanup(listener.close)
        line = self.refusal(*twistd(self.directory, "--listen", f"unix:{path}"))
        self.assertEqual(
            line,
            f"vmready: address unix:{path} is in use: another vmready daemon is listening there",
        )

    def test_tcpPortInUse(self) -> None:
        endpoint = taken_tcp_endpoint(self)
        line = self.refusal(*twistd(self.directory, "--listen", endpoint))
        self.assertEqual(line, f"vmready: cannot listen on {endpoint}: Address already in use")

    def test_tcpPortOutOfRange(self) -> None:
        line = self.refusal(*twistd(self.directory, "--listen", "tcp:99999"))
        self.assertEqual(line, "vmready: cannot listen on tcp:99999: port 99999 is not in 0-65535")

    def test_socketLockHeldByALiveProcess(self) -> None:
        path = os.path.join(self.directory, "vmready.sock")
        os.symlink(str(os.getpid()), path + ".lock")  # Twisted's lock: a symlink to a pid
        line = self.refusal(*twistd(self.directory))
        self.assertEqual(
            line,
            f"vmready: address unix:{path} is locked by process {os.getpid()} ({path}.lock); "
            "another vmready daemon is starting or running there",
        )

    def test_unixEndpointWithAClientOnlyOption(self) -> None:
        endpoint = f"unix:path={self.directory}/api.sock"
        line = self.refusal(*twistd(self.directory, "--listen", endpoint))
        self.assertTrue(
            line.startswith(f"vmready: --listen {endpoint} is not a usable endpoint string: "),
            line,
        )
        self.assertIn("'path'", line)

    def test_unknownEndpointType(self) -> None:
        line = self.refusal(*twistd(self.directory, "--listen", "bogus:x"))
        self.assertEqual(
            line,
            "vmready: --listen bogus:x is not a usable endpoint string: "
            "Unknown endpoint type: 'bogus'",
        )

    def test_fileAtTheSocketPathIsKept(self) -> None:
        path = os.path.join(self.directory, "important.txt")
        with open(path, "w") as f:
            f.write("keep me")
        line = self.refusal(*twistd(self.directory, "--listen", f"unix:{path}"))
        self.assertEqual(
            line,
            f"vmready: --listen unix:{path}: {path} exists and is not a socket; not replacing it",
        )
        with open(path) as f:
            self.assertEqual(f.read(), "keep me")


class AddressCheckTestCase(SynchronousTestCase):
    """A directory of its own, and what the subclass's ``check`` says of an address it refuses."""

    # The check under test, set by each subclass's setUp.
    check: Callable[[str], None]

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-dl-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def refusal(self, listen: str) -> str:
        with self.assertRaises(SystemExit) as caught:
            self.check(listen)
        return str(caught.exception.code)


class GuestListenAddressTests(AddressCheckTestCase):
    """check_guest_listen_address: the guest API listens on vsock or hybrid vsock, or nowhere."""

    def setUp(self) -> None:
        super().setUp()
        self.check = check_guest_listen_address

    def test_tcpIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("tcp:0"),
            "vmready: --guest-listen tcp:0: the guest API listens on vsock: or hvsock: only",
        )

    def test_unparseableIsRefused(self) -> None:
        line = self.refusal("hvsock:path=/x:port=many")
        self.assertTrue(
            line.startswith(
                "vmready: --guest-listen hvsock:path=/x:port=many is not a usable endpoint string:"
            ),
            line,
        )

    def test_missingDirectoryIsRefused(self) -> None:
        base = os.path.join(self.directory, "nowhere", "guest")
        self.assertEqual(
            self.refusal(f"hvsock:path={base}"),
            f"vmready: --guest-listen hvsock:path={base}: "
            f"directory {os.path.dirname(base)} does not exist",
        )

    def test_pathTooLongForItsPortSuffixIsRefused(self) -> None:
        base = os.path.join(self.directory, "g" * 90)
        line = self.refusal(f"hvsock:path={base}")
        self.assertIn("would be longer than 107 bytes; choose a shorter path=", line)

    def test_hybridVsockInAnExistingDirectoryIsAccepted(self) -> None:
        check_guest_listen_address(f"hvsock:path={self.directory}/guest-api.sock")
        check_guest_listen_address("vsock:port=0")

    def refused(self, *options: str) -> str:
        """What twistd says when it refuses ``options`` (it must refuse them, in one line)."""
        result = subprocess.run(
            twistd(self.directory, *options),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        self.assertNotEqual(result.returncode, 0)
        said = result.stdout + result.stderr  # twistd prints its usage text on stdout
        self.assertNotIn("Traceback", said)
        return said

    def test_reopenGraceMustOutlastQEMUsEventPeriod(self) -> None:
        said = self.refused("--agent-reopen-grace", "1")
        self.assertIn("--agent-reopen-grace must be more than 1 second", said)

    def test_gcSweepIntervalMustBeANumber(self) -> None:
        said = self.refused("--gc-sweep-interval", "often")
        self.assertIn("--gc-sweep-interval must be a number of seconds", said)

    def test_pollIntervalMustBePositive(self) -> None:
        said = self.refused("--agent-poll-safety", "0")
        self.assertIn("--agent-poll-safety must be more than 0 and at most 3600 seconds", said)


class ListenAddressTests(AddressCheckTestCase):
    """check_listen_address: what makeService refuses before twistd starts, and what it clears."""

    def setUp(self) -> None:
        super().setUp()
        self.check = check_listen_address

    def test_staleSocketIsRemoved(self) -> None:
        path = os.path.join(self.directory, "stale.sock")
        left_behind = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        left_behind.bind(path)
        left_behind.close()  # bound, never listened: a connect is refused, as after kill -9
        check_listen_address(f"unix:{path}")
        self.assertFalse(os.path.exists(path))

    def test_ordinaryFileIsRefusedAndKept(self) -> None:
        path = os.path.join(self.directory, "important.txt")
        with open(path, "w") as f:
            f.write("keep me")
        self.assertEqual(
            self.refusal(f"unix:{path}"),
            f"vmready: --listen unix:{path}: {path} exists and is not a socket; not replacing it",
        )
        with open(path) as f:
            self.assertEqual(f.read(), "keep me")

    def test_symlinkIsRefusedAndKept(self) -> None:
        target = os.path.join(self.directory, "target.txt")
        open(target, "w").close()
        path = os.path.join(self.directory, "link.sock")
        os.symlink(target, path)
        self.assertIn("is not a socket", self.refusal(f"unix:{path}"))
        self.assertTrue(os.path.islink(path))

    def test_missingDirectoryIsRefused(self) -> None:
        path = os.path.join(self.directory, "nowhere", "api.sock")
        self.assertEqual(
            self.refusal(f"unix:{path}"),
            f"vmready: --listen unix:{path}: directory {os.path.dirname(path)} does not exist",
        )

    def test_overlongSocketPathIsRefused(self) -> None:
        path = os.path.join(self.directory, "s" * 120)
        self.assertEqual(
            self.refusal(f"unix:{path}"),
            f"vmready: --listen unix:{path}: socket path is longer than 107 bytes",
        )

    def test_escapedColonInASocketPath(self) -> None:
        path = os.path.join(self.directory, "a:b.sock")
        open(path, "w").close()
        listen = "unix:" + path.replace(":", "\\:")
        self.assertEqual(
            self.refusal(listen),
            f"vmready: --listen {listen}: {path} exists and is not a socket; not replacing it",
        )

    def test_takenTcpPortIsRefused(self) -> None:
        listen = taken_tcp_endpoint(self)
        self.assertEqual(
            self.refusal(listen), f"vmready: cannot listen on {listen}: Address already in use"
        )

    def test_freeTcpPortIsAcceptedAndLeftFree(self) -> None:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        check_listen_address(f"tcp:{port}:interface=127.0.0.1")
        again = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(again.close)
        again.bind(("127.0.0.1", port))
        again.listen(1)

    def test_unparseableEndpointIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("tcp:http"),
            "vmready: --listen tcp:http is not a usable endpoint string: "
            "invalid literal for int() with base 10: 'http'",
        )


class DaemonProcessTests(SynchronousTestCase):
    """The daemon with the CLI, killed with SIGKILL and started again."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-d-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.socket_path = os.path.join(self.directory, "vmready.sock")
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.addCleanup(self._stop_all)

    def _stop_all(self) -> None:
        if self.daemons and self.daemons[-1].poll() is None:
            self.cli("delete", "demo", "--force", check=False)
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait(timeout=DEADLINE)
        run = os.path.join(self.directory, "run")
        for root, _, files in os.walk(run):
            if "vm.pid" in files:
                with open(os.path.join(root, "vm.pid")) as f:
                    try:
                        kill_if_named(int(f.read().strip()), self.directory)
                    except (OSError, ValueError):
                        continue

    def start_daemon(self) -> subprocess.Popen[bytes]:
        daemon = subprocess.Popen(
            twistd(self.directory, "--power-sync-interval", "0.5", "--stop-timeout", "1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.daemons.append(daemon)
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                self.fail(f"daemon exited with {daemon.returncode}")
            if self.cli("list", check=False).returncode == 0:
                return daemon
            time.sleep(0.1)
        self.fail("daemon did not answer")

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "vmready.cli.main", "--socket", self.socket_path, *args],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        if check:
            self.assertEqual(result.returncode, 0, result.stderr)
        return result

    def info(self, name: str) -> dict[str, Any]:
        result = self.cli("info", name, "--format", "json")
        document: dict[str, Any] = json.loads(result.stdout)
        return document

    def test_killedDaemonLosesNothingAndReadoptsTheVM(self) -> None:
        daemon = self.start_daemon()
        self.cli("launch", "demo", "--memory", "128")
        self.cli("wait", "demo", "status=running", "--timeout", "60")
        before = self.info("demo")
        pidfile = os.path.join(self.directory, "run", run_dir_name(before["uuid"]), "vm.pid")
        with open(pidfile) as f:
            vm_pid = int(f.read())
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=DEADLINE)
        os.kill(vm_pid, 0)  # the VM outlived its daemon
        self.start_daemon()
        after = self.info("demo")
        self.assertEqual((after["uuid"], after["status"]), (before["uuid"], "Running"))
        with open(pidfile) as f:
            self.assertEqual(int(f.read()), vm_pid)
        listing = self.cli("list").stdout
        self.assertIn("RUNNING", listing)
        self.assertIn("demo", listing)

    def test_daemonNotRunningIsOneClearLine(self) -> None:
        result = self.cli("list", check=False)
        self.assertEqual(result.returncode, 1)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1)
        self.assertIn(self.socket_path, lines[0])
        self.assertIn("is it running?", lines[0])


class FileLimitTests(SynchronousTestCase):
    """A daemon with a thousand VMs needs a thousand descriptors for their monitors."""

    def test_softLimitIsRaisedToTheHardLimit(self) -> None:
        script = (
            "import resource\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "from vmready.domain.limits import raise_file_limit\n"
            "raise_file_limit()\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        )
        soft, hard = result.stdout.split()
        self.assertEqual(soft, hard)
