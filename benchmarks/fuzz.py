"""Run every fuzz target for a long time: inputs tried, crashes, max RSS per target.

Each target runs in a child process of its own (this script, ``--child NAME``),
so that its maximum resident set size is its own: the child reports
``ru_maxrss`` of itself when done.  The child draws ``--budget`` inputs from
the target's hypothesis strategy (no database, no deadline, no shrinking) and
calls the target's ``check`` on each, catching whatever escapes it so the run
goes on: an ``AssertionError`` (a property broken) and any other exception (a
crash) both count as crashes, and the first few are shown with their input
and traceback.  Hypothesis may stop early when a strategy has nothing new to
give; the count shown is the count tried.

``--jobs N`` runs up to N children at once (each still a process of its own,
so each RSS is still its target's); the lines come out in the targets' order
all the same.

Output: one line per target, then
``targets=T inputs=… crashes=…``; exit status 1 if anything crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

from benchmarks._measure import report
from tests.fuzzing.registry import all_targets

SHOWN_CRASHES = 3
_RESULT = "fuzz-result "


def run_target(name: str, budget: int, chosen_seed: int) -> dict[str, Any]:
    """In this process: ``budget`` inputs for target ``name``; what happened."""
    target = all_targets()[name]
    tried = 0
    crashes: list[dict[str, str]] = []
    count = 0

    @seed(chosen_seed)
    @settings(
        max_examples=budget,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(target.inputs)
    def fuzz(example: Any) -> None:
        nonlocal tried, count
        tried += 1
        try:
            target.check(example)
        except Exception:
            count += 1
            if len(crashes) < SHOWN_CRASHES:
                crashes.append(
                    {"input": repr(example)[:2000], "traceback": traceback.format_exc()}
                )

    started = time.monotonic()
    fuzz()
    seconds = time.monotonic() - started
    max_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "target": name,
        "inputs": tried,
        "crashes": count,
        "max_rss_mb": max_rss_kib / 1024,
        "seconds": seconds,
        "shown": crashes,
    }


def run_child(name: str, budget: int, chosen_seed: int) -> dict[str, Any]:
    """Run one target in a child process; its result."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        name,
        "--budget",
        str(budget),
        "--seed",
        str(chosen_seed),
    ]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_RESULT):
            result: dict[str, Any] = json.loads(line[len(_RESULT) :])
            return result
    # The child died before reporting (killed, out of memory, an interpreter crash).
    return {
        "target": name,
        "inputs": 0,
        "crashes": 1,
        "max_rss_mb": 0.0,
        "seconds": 0.0,
        "shown": [{"input": "", "traceback": f"the child exited {done.returncode} unreported"}],
    }


def main(argv: list[str] | None = None) -> int:
    """Parse options; run the parent or the child."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=100_000, help="inputs per target")
    parser.add_argument(
        "--target", action="append", default=[], metavar="NAME", help="repeatable; default all"
    )
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="targets run at once (default 1)"
    )
    parser.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.jobs < 1:
        parser.error(f"--jobs must be at least 1, not {options.jobs}")
    if options.child:
        result = run_target(options.child, options.budget, options.seed)
        print(_RESULT + json.dumps(result), flush=True)
        return 0
    targets = all_targets()
    names = sorted(options.target or targets)
    unknown = [name for name in names if name not in targets]
    if unknown:
        parser.error(
            f"unknown target(s) {', '.join(unknown)}; known: {', '.join(sorted(targets))}"
        )
    total_inputs = total_crashes = 0
    # Threads only wait on the children; ``map`` gives each result in the targets'
    # order, as soon as it and those before it are done.
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        results = pool.map(lambda name: run_child(name, options.budget, options.seed), names)
        for name, result in zip(names, results, strict=True):
            total_inputs += result["inputs"]
            total_crashes += result["crashes"]
            for shown in result["shown"]:
                print(f"  {name} crash on input {shown['input']}", file=sys.stderr)
                print("  " + shown["traceback"].replace("\n", "\n  "), file=sys.stderr, flush=True)
            report(
                f"target={name} inputs={result['inputs']} crashes={result['crashes']} "
                f"max_rss_mb={result['max_rss_mb']:.1f} seconds={result['seconds']:.1f}"
            )
    report(f"targets={len(names)} inputs={total_inputs} crashes={total_crashes}")
    return 1 if total_crashes else 0


if __name__ == "__main__":
    sys.exit(main())
