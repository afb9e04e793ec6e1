"""The cluster harnesses run end to end in a short form, so that they cannot rot.

``benchmarks/cluster_faults.py`` with four faults (seed 40: one of each kind,
the freeze with a takeover) and ``benchmarks/api_load.py`` with a few seconds
of load on one daemon and on three members, each as a process of its own.

What these tests assert: the harness exits 0, did what it was asked (the
faults, one line each; clients and requests), and ends with its one line,
which is parsed and whose counts of what went wrong are zero: nothing lost,
stuck, inconsistent or run by two masters, no error answer; the fault
harness' verdict is the checker's over the history it recorded (read back
from ``--history`` and checked again).  Not asserted: any figure of time or
memory (benchmarks print figures; tests do not judge speed).

Both need PostgreSQL (the cluster), as ``tests.postgres``: skipped without it
unless ``VMREADY_REQUIRE_POSTGRES=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from benchmarks._history import check, history_from_json
from tests.postgres import require_postgres

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Generous: these start PostgreSQL, three daemons and their VMs on a machine that may be busy.
_DEADLINE = 1200


def _run(script: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, os.path.join(_ROOT, "benchmarks", script), *arguments],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": _ROOT},
        cwd=_ROOT,
        timeout=_DEADLINE,
    )


def _last_line(case: SynchronousTestCase, done: subprocess.CompletedProcess[str]) -> str:
    case.assertEqual(done.returncode, 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = done.stdout.splitlines()
    case.assertTrue(lines, done.stderr[-3000:])
    return lines[-1]


def _last_line_matching(
    case: SynchronousTestCase, done: subprocess.CompletedProcess[str], pattern: str
) -> re.Match[str]:
    """The match of the run's last line against pattern, which it must match whole."""
    last = _last_line(case, done)
    match = re.fullmatch(pattern, last)
    case.assertIsNotNone(match, last)
    assert match is not None
    return match


class ClusterFaultsTests(SynchronousTestCase):
    def test_fourFaultsOfEveryKindAreInjectedAndTheHistoryChecked(self) -> None:
        require_postgres()
        recorded = os.path.abspath(self.mktemp())
        done = _run(
            "cluster_faults.py",
            *("--faults", "4", "--seed", "40", "--gap", "1", "--instances", "4"),
            *("--clients", "2", "--settle", "60", "--history", recorded),
        )
        verdict = _last_line_matching(
            self,
            done,
            r"faults=4 actions=(\d+) lost=(\d+) stuck=(\d+) inconsistent=(\d+) "
            r"double_master=(\d+)",
        )
        last = verdict.group(0)
        self.assertGreater(int(verdict.group(1)), 0)
        self.assertEqual(verdict.groups()[1:], ("0", "0", "0", "0"), done.stdout[-3000:])
        faults = [line for line in done.stdout.splitlines() if line.startswith("fault ")]
        kinds = [line.split(": ")[1] for line in faults]
        self.assertEqual(sorted(kinds), ["freeze", "kill", "partition", "postgres"], faults)
        self.assertIn("taken over by m3#2", "\n".join(faults))
        with open(recorded) as f:
            document = json.load(f)
        self.assertEqual(document["seed"], 40)
        again = check(history_from_json(document["history"]))
        self.assertEqual(
            f"faults=4 actions={len(document['history']['ops'])} {again.summary()}", last
        )


class APILoadTests(SynchronousTestCase):
    def assertLoadLine(self, done: subprocess.CompletedProcess[str], clients: int) -> None:
        figures = _last_line_matching(
            self,
            done,
            rf"clients={clients} rps=([\d.]+) p50_ms=([\d.]+) p99_ms=([\d.]+) "
            r"errors=(\d+) rss_mb=([\d.]+)",
        )
        self.assertEqual(figures.group(4), "0", done.stdout[-3000:])
        kinds = [line.split(":")[0] for line in done.stdout.splitlines()]
        for kind in ("get", "list", "state"):
            self.assertIn(kind, kinds)

    def load(self, members: int) -> subprocess.CompletedProcess[str]:
        """Ten clients for five seconds on four instances."""
        return _run(
            "api_load.py",
            *("--clients", "10", "--seconds", "5", "--instances", "4"),
            *("--members", str(members)),
        )

    def test_aShortLoadOnOneDaemon(self) -> None:
        self.assertLoadLine(self.load(members=1), 10)

    def test_aShortLoadOnThreeMembers(self) -> None:
        require_postgres()
        self.assertLoadLine(self.load(members=3), 10)
