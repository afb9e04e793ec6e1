"""Turn trial's closing line into the plain 'N passed, N failed, N skipped' summary.

Usage: ``python -m tests.summary TRIAL_LOG``.  Exits 1 if trial failed, ran
nothing, or its closing line is missing.
"""

from __future__ import annotations

import re
import sys

_CLOSING = re.compile(r"^(PASSED|FAILED) \((.*)\)\s*$")


def summarize(log: str) -> tuple[str, bool]:
    """The summary line for a trial log, and whether the run was a success."""
    closing = [m for m in map(_CLOSING.match, log.splitlines()) if m]
    if not closing:
        return "tests: 0 passed, 1 failed (trial printed no result)", False
    verdict, details = closing[-1].groups()
    counts = {k.strip(): int(v) for k, v in (item.split("=") for item in details.split(","))}
    passed = counts.get("successes", 0)
    failed = sum(counts.get(k, 0) for k in ("failures", "errors", "unexpectedSuccesses"))
    skipped = counts.get("skips", 0)
    ok = verdict == "PASSED" and passed > 0
    return f"tests: {passed} passed, {failed} failed, {skipped} skipped", ok


def main() -> None:
    """Print the summary of the trial log named on the command line."""
    with open(sys.argv[1], encoding="utf-8", errors="replace") as f:
        line, ok = summarize(f.read())
    print(line)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
