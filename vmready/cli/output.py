"""Where and how a command prints: stdout and stderr, as a table, JSON, YAML or CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from typing import IO, Any

import yaml

FORMATS = ("table", "json", "yaml", "csv")

# Headers and rows of cells; None is an empty cell.
Rows = tuple[Sequence[str], Sequence[Sequence[str | None]]]


def to_yaml(value: Any) -> str:
    """JSON data as block-style YAML, keys in their order, no line folding."""
    text: str = yaml.safe_dump(
        value,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=math.inf,
    )
    return text


def _cell(value: Any) -> str:
    """One JSON value as a CSV cell: null empty, booleans as JSON writes them, lists as JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """A JSON object as one CSV row: nested objects' keys joined with dots.

    ``{"limits": {"cpus": 1}}`` is ``{"limits.cpus": "1"}``; an empty object
    has no column; a list is one cell holding its compact JSON.
    """
    if not isinstance(value, dict):
        return {prefix or "value": _cell(value)}
    row: dict[str, str] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict):
            row.update(flatten(item, f"{name}."))
        else:
            row[name] = _cell(item)
    return row


def _csv_lines(rows: Sequence[Sequence[str | None]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([["" if cell is None else cell for cell in row] for row in rows])
    return buffer.getvalue()


def _csv_text(headers: Sequence[str], rows: Sequence[Sequence[str | None]]) -> str:
    return _csv_lines([headers, *rows])


class EventCSV:
    """``monitor --format csv``: a header row with the first event, then one row an event.

    Events differ in their metadata, so it stays one cell of compact JSON.
    """

    HEADERS = ("timestamp", "type", "metadata")

    def __init__(self) -> None:
        self._headed = False

    def row(self, event: dict[str, Any]) -> str:
        """The CSV text for ``event`` (with the header row the first time)."""
        row = [_cell(event.get(key)) for key in self.HEADERS]
        rows: list[Sequence[str | None]] = [row] if self._headed else [self.HEADERS, row]
        self._headed = True
        return _csv_lines(rows)


def to_csv(value: Any) -> str:
    """JSON data as CSV: a header row, then one row an object (a list) or one row (an object).

    The columns are every flattened key, in the order first seen; a row
    without one leaves its cell empty.  An empty list is no output at all.
    """
    records = value if isinstance(value, list) else [value]
    flat = [flatten(record) for record in records]
    if not flat:
        return ""
    headers = list(dict.fromkeys(key for row in flat for key in row))
    return _csv_text(headers, [[row.get(key) for key in headers] for row in flat])


def _write(stream: IO[str], text: str) -> None:
    """Write and flush ``text``; what the stream cannot encode is written as escapes."""
    # JSON may decode to lone surrogates (a "\ud800" escape), argv holds undecodable bytes
    # as surrogates, and stdout may not be UTF-8: none of that may crash the output.
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
    stream.flush()


class Output:
    """Where and how a command prints: stdout/stderr and the chosen format."""

    def __init__(self, out: IO[str], err: IO[str], format: str) -> None:
        self.out = out
        self.err = err
        self.format = format

    def text(self, text: str) -> None:
        """Text on stdout, as is."""
        _write(self.out, text)

    def line(self, text: str) -> None:
        """One line on stdout."""
        self.text(text + "\n")

    @property
    def is_table(self) -> bool:
        """Whether the output is for people (the table format) rather than for programs."""
        return self.format not in ("json", "yaml", "csv")

    def data(
        self,
        value: Any,
        table: Callable[[Any], str],
        rows: Callable[[Any], Rows] | None = None,
    ) -> None:
        """Data in the chosen format; ``table`` renders the table format.

        CSV is ``rows`` (the table's own columns) where given, else ``value``
        flattened (see ``to_csv``).
        """
        if self.is_table:
            self.text(table(value))
        elif self.format == "csv" and rows is not None:
            self.text(_csv_text(*rows(value)))
        else:
            self.result(value)

    def result(self, value: Any) -> None:
        """Data for programs: JSON (indented), YAML, or CSV flattened; never the table."""
        if self.format == "yaml":
            self.text(to_yaml(value))
        elif self.format == "csv":
            self.text(to_csv(value))
        else:
            self.text(json.dumps(value, indent=2) + "\n")

    def raw(self, data: bytes) -> None:
        """Bytes on stdout, as the guest wrote them (through the text stream where it has none)."""
        buffer = getattr(self.out, "buffer", None)
        if buffer is None:
            self.text(data.decode("utf-8", "replace"))
            return
        self.out.flush()
        buffer.write(data)
        buffer.flush()

    def usage(self, usage: str) -> None:
        """A usage line on stderr, as is."""
        _write(self.err, usage)

    def error(self, message: str) -> None:
        """One line on stderr, prefixed ``vmready:``."""
        _write(self.err, f"vmready: {message}\n")
