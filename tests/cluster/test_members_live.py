"""Two ``twistd vmready`` members on one real PostgreSQL database, with fakeqemu VMs.

Each member is a real daemon process with its own data dir, operator socket
and mutual-TLS API on 127.0.0.1 (a port the kernel picks: the member's
address is the one it bound), sharing the database that ``tests.postgres``
creates for the test.  Leases are short (``LEASE`` seconds) so that a member
killed with SIGKILL is seen unreachable soon; every wait is bounded by a
generous deadline and asserts nothing about how long anything took.

Without PostgreSQL these tests skip, saying why, unless
``VMREADY_REQUIRE_POSTGRES=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.postgres import postgres_location
from tests.system import DEADLINE, TWISTD, EventReader, System, eventually, unix_http

LEASE = "3"
NAME = "web1"


class Member:
    """One member: a ``System`` (data dir, daemon, CLI) whose store is the shared database."""

    def __init__(
        self, case: SynchronousTestCase, name: str, store: str, lease: str = LEASE
    ) -> None:
        self.name = name
        self.store = store
        self.lease = lease
        self.system = System(case)

    def options(self) -> list[str]:
        """This member's options to ``twistd vmready``."""
        return [
            "--store",
            self.store,
            "--member-name",
            self.name,
            "--https-address",
            "127.0.0.1:0",
            "--lease-seconds",
            self.lease,
        ]

    def start(self) -> None:
        """Start (or restart) the daemon; returns once its operator API answers."""
        self.system.start_daemon(*self.options())

    def refused(self) -> subprocess.CompletedProcess[str]:
        """Start the daemon as ``start`` does, expecting it to refuse: how it exited."""
        return subprocess.run(
            [
                TWISTD,
                "-n",
                "--pidfile",
                "",
                "vmready",
                "--config",
                "",
                "--data-dir",
                self.system.directory,
                *self.options(),
            ],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )

    def cli(self, *args: str, check: bool = True) -> Any:
        return self.system.cli(*args, check=check)

    def get(self, target: str) -> tuple[int, dict[str, Any]]:
        """``GET target`` on the member's operator socket: status and JSON body."""
        answer = unix_http(self.system.socket_path, "GET", target)
        return answer.status, json.loads(answer.body or b"{}")

    def instance(self, name: str) -> dict[str, Any] | None:
        """The instance as this member's API shows it (None: not listed)."""
        status, body = self.get(f"/1.0/instances/{name}")
        return body.get("metadata") if status == 200 else None

    def listed(self) -> dict[str, str]:
        """``vmready list`` here: each instance's STATUS column."""
        rows = {}
        for line in self.cli("list").stdout.splitlines()[1:]:
            words = line.split()
            if words:
                rows[words[0]] = words[1]
        return rows

    def events(self) -> EventReader:
        return self.system.events()


class TwoMemberTests(SynchronousTestCase):
    """Issue #16: two daemons on one database: list, act, events, CAS, a member killed."""

    def setUp(self) -> None:
        store = postgres_location(self)
        self.a = Member(self, "a", store)
        self.b = Member(self, "b", store)
        self.a.start()
        self.b.start()

    def test_anInstanceLaunchedOnAIsListedByBoth(self) -> None:
        self.a.cli("launch", NAME, "--memory", "128")
        self.assertEqual(self.a.listed().get(NAME), "RUNNING")
        eventually(lambda: self.b.listed().get(NAME) == "RUNNING", f"b listing {NAME} running")
        seen = self.b.instance(NAME)
        assert seen is not None
        self.assertEqual(seen["status"], "Running")

    def test_eventsOfAsInstanceAreSeenOnB(self) -> None:
        on_b = self.b.events()
        on_a = self.a.events()
        self.a.cli("launch", NAME, "--memory", "128")
        self.a.system.start_agent(NAME)
        self.a.cli("wait", NAME, "agent", "--timeout", "30")
        notified = self.a.system.notify(NAME)
        self.assertEqual(notified.returncode, 0, notified.stderr)
        ready = on_b.wait_for_action(NAME, "instance-ready")
        on_a.wait_for_action(NAME, "instance-ready")
        # The same events, in the same order, with A's times, and A named as their location.
        relayed = [e for e in on_b.events[: ready + 1] if _source(e) == NAME]
        local = [e for e in on_a.events if _source(e) == NAME][: len(relayed)]
        self.assertEqual(
            [(e["metadata"]["action"], e["timestamp"]) for e in relayed],
            [(e["metadata"]["action"], e["timestamp"]) for e in local],
        )
        self.assertEqual({e.get("location") for e in relayed}, {"a"})
        self.assertIn("instance-agent-connected", [e["metadata"]["action"] for e in relayed])
        # And B lists it Ready: its row was read again before the event was published there.
        seen = self.b.instance(NAME)
        assert seen is not None
        self.assertEqual(seen["status"], "Ready")

    def test_waitOnBForAsInstance(self) -> None:
        self.a.cli("launch", NAME, "--memory", "128")
        eventually(lambda: self.b.instance(NAME), f"b knowing {NAME}")
        waiting = self.b.system.cli_in_background("wait", NAME, "status=ready", "--timeout", "60")
        self.a.system.start_agent(NAME)
        self.a.cli("wait", NAME, "agent", "--timeout", "30")
        # The agent link is known on A alone; B asks A (its instance view is A's).
        self.b.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertIsNone(waiting.poll(), "wait on b returned before Ready")
        self.assertEqual(self.a.system.notify(NAME).returncode, 0)
        out, err = waiting.communicate(timeout=DEADLINE)
        self.assertEqual((waiting.returncode, out, err), (0, f"{NAME}: READY\n", ""))

    def test_actionsThroughBReachAsInstance(self) -> None:
        self.launch_on_a()
        # B forwards to A, the owner; the CLI follows the operation through B.
        self.b.cli("stop", NAME, "--force")
        self.assertEqual(self.a.listed().get(NAME), "STOPPED")
        eventually(lambda: self.b.listed().get(NAME) == "STOPPED", f"b listing {NAME} stopped")
        self.b.cli("start", NAME)
        self.assertEqual(self.a.listed().get(NAME), "RUNNING")
        eventually(lambda: self.b.listed().get(NAME) == "RUNNING", f"b listing {NAME} running")
        seen = self.b.instance(NAME)
        assert seen is not None
        self.assertEqual((seen["location"], seen["vm_state"]), ("a", "active"))
        # The VM runs on A alone: B started nothing.
        b_runs = os.path.join(self.b.system.directory, "run")
        self.assertEqual(os.listdir(b_runs) if os.path.isdir(b_runs) else [], [])

    def test_twoMembersActingAtOnceOneWinsTheOtherGets409(self) -> None:
        self.launch_on_a()
        body = json.dumps({"action": "stop", "force": True}).encode()
        target = f"/1.0/instances/{NAME}/state"
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(
                    lambda member: unix_http(member.system.socket_path, "PUT", target, body),
                    (self.a, self.b),
                )
            )
        codes = sorted(answer.status for answer in answers)
        self.assertEqual(codes, [202, 409], [answer.body for answer in answers])
        [lost] = [answer for answer in answers if answer.status == 409]
        self.assertIn(NAME, json.loads(lost.body)["error"])
        eventually(lambda: self.a.listed().get(NAME) == "STOPPED", f"{NAME} stopped once")

    def test_aKilledMemberIsUnreachableAndComesBack(self) -> None:
        self.launch_on_a()
        self.assertEqual(self.member_status(self.b, "a"), "Online")
        self.a.system.stop_daemon(signal.SIGKILL)
        # Within the lease (and a generous deadline): A unreachable, its instance of unknown
        # state on B: not lost, not stopped.
        eventually(lambda: self.member_status(self.b, "a") == "Unreachable", "a unreachable")
        eventually(lambda: self.b.listed().get(NAME) == "UNKNOWN", f"{NAME} unknown on b")
        self.assertEqual(self.cluster_list(self.b)["a"][1:], ["UNREACHABLE", "1"])
        seen = self.b.instance(NAME)
        assert seen is not None
        self.assertEqual((seen["status"], seen["vm_state"]), ("Unknown", "active"))
        self.assertIn("host unreachable", json.dumps(seen["faults"]))
        self.a.start()
        eventually(lambda: self.member_status(self.b, "a") == "Online", "a online again")
        eventually(lambda: self.b.listed().get(NAME) == "RUNNING", f"{NAME} running on b again")
        self.assertEqual(self.a.listed().get(NAME), "RUNNING")
        self.assertEqual(self.cluster_list(self.a)["a"][1:], ["ONLINE", "1"])
        # The VM outlived its daemon: A adopted it again, and acts on it through B too.
        self.b.cli("stop", NAME, "--force")
        eventually(lambda: self.b.listed().get(NAME) == "STOPPED", f"{NAME} stopped via b")

    def test_trustChangedThroughAReachesB(self) -> None:
        config = self.mktemp()

        def laptop(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "vmready.cli.main", *args],
                capture_output=True,
                text=True,
                timeout=DEADLINE,
                env={**os.environ, "VMREADY_CONFIG_DIR": config},
                check=False,
            )

        token = self.a.cli("config", "trust", "add", "laptop").stdout.splitlines()[1]
        added = laptop("remote", "add", "a", "--token", token)
        self.assertEqual(added.returncode, 0, added.stderr)
        address = self.cluster_list(self.a)["b"][0]
        _, member = self.b.get("/1.0/cluster/members/b")
        fingerprint = member["metadata"]["fingerprint"]
        # B trusts the client A trusted, without a restart.
        add_b = ("remote", "add", "b", f"https://{address}", "--fingerprint", fingerprint)
        eventually(lambda: laptop(*add_b).returncode == 0, "b trusting the laptop")
        self.assertEqual(laptop("list", "b:").returncode, 0)
        self.a.cli("config", "trust", "remove", "laptop")

        def refused() -> subprocess.CompletedProcess[str] | None:
            listed = laptop("list", "b:")
            return listed if listed.returncode else None

        self.assertIn(
            "is not trusted by the daemon", eventually(refused, "b refusing the laptop").stderr
        )

    def test_aStoppedMemberIsRemoved(self) -> None:
        online = self.a.cli("cluster", "remove", "b", check=False)
        self.assertEqual(online.returncode, 1)
        self.assertIn("cluster member b is online", online.stderr)
        address = self.cluster_list(self.a)["b"][0]
        self.b.system.stop_daemon()
        eventually(lambda: self.member_status(self.a, "b") == "Unreachable", "b unreachable")
        removed = self.a.cli("cluster", "remove", "b")
        self.assertEqual(removed.stdout, f"Removed cluster member b ({address})\n")
        self.assertEqual(list(self.cluster_list(self.a)), ["a"])

    def launch_on_a(self) -> None:
        """Launch NAME through A (the least loaded member on a tie: a), listed by both."""
        self.a.cli("launch", NAME, "--memory", "128")
        self.assertEqual(self.a.listed().get(NAME), "RUNNING")
        seen = eventually(lambda: self.b.instance(NAME), f"b knowing {NAME}")
        self.assertEqual(seen["location"], "a")
        eventually(lambda: self.b.listed().get(NAME) == "RUNNING", f"b listing {NAME} running")

    def cluster_list(self, via: Member) -> dict[str, list[str]]:
        """``vmready cluster list`` on ``via``: each member's ADDRESS, STATE and INSTANCES."""
        rows = [line.split() for line in via.cli("cluster", "list").stdout.splitlines()[1:]]
        return {row[0]: row[1:] for row in rows if row}

    def member_status(self, via: Member, name: str) -> str:
        status, body = via.get(f"/1.0/cluster/members/{name}")
        self.assertEqual(status, 200, body)
        return str(body["metadata"]["status"])


def _source(event: dict[str, Any]) -> str:
    return str(event.get("metadata", {}).get("source", "")).removeprefix("/1.0/instances/")


class JoiningTests(SynchronousTestCase):
    """A member that joins is known to the others at once, not at their next renewal."""

    def test_aMemberThatJustJoinedIsATargetAtOnce(self) -> None:
        store = postgres_location(self)
        # A lease of 10 minutes: A renews (and would read the members) every 200 s.
        a = Member(self, "a", store, lease="600")
        b = Member(self, "b", store, lease="600")
        a.start()
        b.start()
        # A read the members when it joined, before B existed; B's joining told it.
        a.cli("launch", NAME, "--memory", "128", "--target", "b")
        seen = b.instance(NAME)
        assert seen is not None
        self.assertEqual(seen["location"], "b")
        rows = [line.split() for line in a.cli("cluster", "list").stdout.splitlines()[1:]]
        self.assertEqual(
            {row[0]: row[2:] for row in rows if row}, {"a": ["ONLINE", "0"], "b": ["ONLINE", "1"]}
        )


class ToldViewLiveTests(SynchronousTestCase):
    """What only A knows of its instance (its agent link) reaches B with A's events."""

    def test_bAnswersForAsInstanceEvenWhileACannot(self) -> None:
        store = postgres_location(self)
        # Long leases: a frozen A stays online for the whole test.
        a = Member(self, "a", store, lease="60")
        b = Member(self, "b", store, lease="60")
        a.start()
        b.start()
        a.cli("launch", NAME, "--memory", "128")
        a.system.start_agent(NAME)
        a.cli("wait", NAME, "agent", "--timeout", "30")
        on_a = a.instance(NAME)
        assert on_a is not None
        self.assertEqual(on_a["agent"]["status"], "connected")
        eventually(lambda: b.instance(NAME) == on_a, "b showing the instance as a does")
        # A cannot answer now: B answers from the row and what A told, at once.
        assert a.system.daemon is not None
        a.system.daemon.send_signal(signal.SIGSTOP)
        self.addCleanup(a.system.daemon.send_signal, signal.SIGCONT)
        self.assertEqual(b.instance(NAME), on_a)


class SameNameTests(SynchronousTestCase):
    """Two daemons can never be one member: a second one given a held name is refused."""

    def test_aSecondDaemonWithTheSameNameIsRefusedAndTouchesNothing(self) -> None:
        store = postgres_location(self)
        a = Member(self, "a", store)
        a.start()
        a.cli("launch", NAME, "--memory", "128")
        a.system.start_agent(NAME)
        a.cli("wait", NAME, "agent", "--timeout", "30")
        self.assertEqual(a.system.notify(NAME).returncode, 0)
        self.assertEqual(a.listed().get(NAME), "READY")
        vm = a.system.vm_pid(NAME)
        before = [line.split() for line in a.cli("cluster", "list").stdout.splitlines()[1:]]
        # Another host (its own data dir, so its own certificate) told the same name.
        clone = Member(self, "a", store)
        result = clone.refused()
        self.assertEqual(result.returncode, 1, result.stderr)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        self.assertEqual(len(lines), 1, result.stderr)
        address = before[0][1]
        self.assertRegex(
            lines[0],
            rf"^vmready: member name a is held by another daemon at {re.escape(address)} "
            r"\(certificate [0-9a-f]{16}…\) until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ; "
            r"give this daemon another --member-name, or stop that one$",
        )
        # A's instance is untouched: still Ready (its key not cleared), its VM running, and
        # A is still the member, at its address.
        self.assertEqual(a.listed().get(NAME), "READY")
        os.kill(vm, 0)
        after = [line.split() for line in a.cli("cluster", "list").stdout.splitlines()[1:]]
        self.assertEqual(after, before)
        seen = a.instance(NAME)
        assert seen is not None
        self.assertEqual((seen["status"], seen["location"]), ("Ready", "a"))
