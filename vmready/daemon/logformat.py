"""``--log-format json``: each log event as one JSON object on one line, for journald and Loki.

    {"time": "2026-11-25T13:23:20.123456Z", "level": "info",
     "namespace": "vmready.daemon.service.VMReadyService",
     "message": "recovered 3 instances", "fields": {"count": 3}}

``time`` is RFC 3339 in UTC; ``level`` is Twisted's (debug, info, warn,
error, critical); ``message`` the event rendered as the text format would;
``fields`` the event's own keys whose values JSON can hold (the others are
left out rather than turned into text no one can query); a failure adds
``error`` (its message) and ``traceback``.  Not Twisted's
``jsonFileLogObserver``: its records are separated by RS bytes (RFC 7464)
and carry Twisted's internals (``log_format``, ``log_logger``...), which a
line-oriented collector does not want.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from twisted.logger import FileLogObserver, ILogObserver, LogEvent, formatEvent
from twisted.python import usage
from twisted.python.failure import Failure

FORMATS = ("text", "json")
# Where twistd finds the observer factory (its --logger option names it).
TWISTD_OBSERVER = f"{__name__}.twistd_observer"
# Keys of legacy (twisted.python.log) events that restate what the record already says.
_LEGACY_KEYS = frozenset({"message", "format", "isError", "time", "system", "failure", "why"})


def json_record(event: LogEvent) -> dict[str, Any]:
    """The JSON object for one event."""
    record: dict[str, Any] = {
        "time": rfc3339(event.get("log_time")),
        "level": getattr(event.get("log_level"), "name", "info"),
        "namespace": event.get("log_namespace", "-"),
        "message": formatEvent(event),
    }
    fields = {
        key: value
        for key, value in event.items()
        if isinstance(key, str)
        and not key.startswith("log_")
        and key not in _LEGACY_KEYS
        and _serialisable(value)
    }
    if fields:
        record["fields"] = fields
    failure = event.get("log_failure")
    if isinstance(failure, Failure):
        record["error"] = failure.getErrorMessage()
        record["traceback"] = failure.getTraceback()
    return record


def json_line(event: LogEvent) -> str:
    """One event as one line of JSON (newlines inside values are escaped by JSON)."""
    return json.dumps(json_record(event)) + "\n"


def rfc3339(timestamp: object) -> str:
    """A POSIX time as RFC 3339, UTC, to the microsecond."""
    seconds = float(timestamp) if isinstance(timestamp, int | float) else 0.0
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def json_observer(out: Any) -> ILogObserver:
    """An observer writing JSON lines to the text file ``out``."""
    return FileLogObserver(out, json_line)


def twistd_observer() -> ILogObserver:
    """twistd's ``--logger``: JSON lines on standard output (taken before twistd redirects it)."""
    return json_observer(sys.stdout)


def choose_log_format(log_format: str, twistd: usage.Options | None) -> None:
    """``--log-format``: json makes twistd's log observer ``twistd_observer``.

    twistd reads its ``--logger`` after the plugin's options are parsed, and
    builds the observer before it starts logging (and before it redirects
    stdout into the log): the observer writes to the real standard output.
    """
    if log_format not in FORMATS:
        raise usage.UsageError(f"--log-format must be one of {', '.join(FORMATS)}")
    if log_format != "json" or twistd is None:
        return
    if not twistd.get("nodaemon") or twistd.get("logfile") not in (None, "-"):
        raise usage.UsageError(
            "--log-format json writes to standard output: run twistd with --nodaemon "
            "and without --logfile (as the systemd unit does)"
        )
    if twistd.get("syslog") or twistd.get("logger"):
        raise usage.UsageError(
            "--log-format json chooses twistd's log observer: not with --syslog or --logger"
        )
    twistd["logger"] = TWISTD_OBSERVER  # a name: twistd imports it itself


def _serialisable(value: object) -> bool:
    """Whether JSON can hold ``value`` as it is."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
