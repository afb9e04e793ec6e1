"""``benchmarks/fuzz.py`` itself, on a tiny budget: its output and its ``--jobs``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "benchmarks", "fuzz.py")


def _fuzz(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": _ROOT}
    return subprocess.run(
        [sys.executable, _SCRIPT, *arguments],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
        cwd=_ROOT,
        timeout=300,
    )


class FuzzBenchmarkTests(SynchronousTestCase):
    """Each target in a child; the lines in the targets' order, however many run at once."""

    def test_jobsKeepTheTargetsOrder(self) -> None:
        """With ``--jobs 2`` the targets' lines are sorted by name, then the totals line."""
        done = _fuzz(
            "--budget", "5", "--jobs", "2", "--target", "ring-reader", "--target", "connect-line"
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        lines = done.stdout.splitlines()
        self.assertEqual(len(lines), 3, lines)
        names = [re.match(r"target=(\S+) inputs=(\d+) crashes=0 ", line) for line in lines[:2]]
        self.assertEqual(
            [m.group(1) if m else None for m in names], ["connect-line", "ring-reader"]
        )
        inputs = sum(int(m.group(2)) for m in names if m)
        self.assertEqual(lines[2], f"targets=2 inputs={inputs} crashes=0")
        self.assertGreater(inputs, 0)

    def test_jobsMustBePositive(self) -> None:
        """``--jobs 0`` is refused with a usage error, before any child runs."""
        done = _fuzz("--jobs", "0")
        self.assertEqual(done.returncode, 2)
        self.assertIn("--jobs must be at least 1, not 0", done.stderr)
        self.assertEqual(done.stdout, "")
