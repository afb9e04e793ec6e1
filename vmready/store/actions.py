"""Action history: each action on an instance and its steps, kept after the instance is gone."""

from __future__ import annotations

import sqlite3
from typing import Any

from vmready.domain.model import ActionRecord, ActionStep, NotFound
from vmready.store.database import Database

__all__ = ["RESULTS", "ActionHistory"]

# The results an action or a step may finish with (Nova's "Success" / "Error").
RESULTS = frozenset({"success", "error"})

_ACTION_COLUMNS = "id, instance, action, request_id, started_at, finished_at, result, error"
_STEP_COLUMNS = "action_id, name, started_at, finished_at, result, error"


class ActionHistory:
    """The ``actions`` and ``steps`` tables."""

    def __init__(self, database: Database) -> None:
        self._database = database

    def start_action(self, name: str, action: str, request_id: str) -> int:
        """Record the start of an action on instance name (kept by its uuid); return its id."""
        cursor = self._database.db.execute(
            "INSERT INTO actions (instance, instance_uuid, action, request_id, started_at)"
            " VALUES (?, (SELECT uuid FROM instances WHERE name = ?), ?, ?, ?)",
            (name, name, action, request_id, self._database.clock()),
        )
        return _row_id(cursor)

    def start_step(self, action_id: int, step: str) -> int:
        """Record the start of a step of an action; return its id."""
        try:
            cursor = self._database.db.execute(
                "INSERT INTO steps (action_id, name, started_at) VALUES (?, ?, ?)",
                (action_id, step, self._database.clock()),
            )
        except sqlite3.IntegrityError:
            raise NotFound(f"Action {action_id} not found") from None
        return _row_id(cursor)

    def finish_step(self, step_id: int, result: str, error: str | None = None) -> None:
        """Record how a step ended ("success" or "error")."""
        _check_result(result)
        finished = self._database.db.execute(
            "UPDATE steps SET finished_at = ?, result = ?, error = ? WHERE id = ?",
            (self._database.clock(), result, error, step_id),
        ).rowcount
        if not finished:
            raise NotFound(f"Action step {step_id} not found")

    def add_step(self, action_id: int, step: str, result: str, error: str | None = None) -> None:
        """Record a step that started and ended at once."""
        _check_result(result)
        now = self._database.clock()
        try:
            self._database.db.execute(
                "INSERT INTO steps (action_id, name, started_at, finished_at, result, error)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (action_id, step, now, now, result, error),
            )
        except sqlite3.IntegrityError:
            raise NotFound(f"Action {action_id} not found") from None

    def finish_action(self, action_id: int, result: str, error: str | None = None) -> None:
        """Record how an action ended ("success" or "error")."""
        _check_result(result)
        finished = self._database.db.execute(
            "UPDATE actions SET finished_at = ?, result = ?, error = ? WHERE id = ?",
            (self._database.clock(), result, error, action_id),
        ).rowcount
        if not finished:
            raise NotFound(f"Action {action_id} not found")

    def list_actions(self, name: str) -> list[ActionRecord]:
        """The action history of instance name (kept after delete), newest first.

        The instance called name now, by its uuid; for a name no instance has, the
        last instance that had it.  A name deleted and created again starts afresh.
        """
        db = self._database.db
        with self._database.transaction(immediate=False):
            row = db.execute("SELECT uuid FROM instances WHERE name = ?", (name,)).fetchone()
            if row is None:
                row = db.execute(
                    "SELECT instance_uuid FROM actions WHERE instance = ?"
                    " ORDER BY started_at DESC, id DESC LIMIT 1",
                    (name,),
                ).fetchone()
                if row is None:
                    return []
        order = "started_at DESC, id DESC"
        if row[0] is None:  # from before histories were kept by uuid
            return self._actions("instance = ? AND instance_uuid IS NULL", (name,), order)
        return self._actions("instance_uuid = ?", (row[0],), order)

    def unfinished_actions(self) -> list[ActionRecord]:
        """Actions that never finished (the daemon died during them), oldest first."""
        return self._actions("finished_at IS NULL", (), "id")

    def _actions(self, where: str, values: tuple[Any, ...], order: str) -> list[ActionRecord]:
        with self._database.transaction(immediate=False):
            actions = self._database.db.execute(
                f"SELECT {_ACTION_COLUMNS} FROM actions WHERE {where} ORDER BY {order}", values
            ).fetchall()
            steps = self._database.db.execute(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE action_id IN"
                f" (SELECT id FROM actions WHERE {where}) ORDER BY id",
                values,
            ).fetchall()
        by_action: dict[int, list[ActionStep]] = {row["id"]: [] for row in actions}
        for step in steps:
            by_action[step["action_id"]].append(
                ActionStep(
                    name=step["name"],
                    started_at=step["started_at"],
                    finished_at=step["finished_at"],
                    result=step["result"],
                    error=step["error"],
                )
            )
        return [
            ActionRecord(
                id=row["id"],
                instance=row["instance"],
                action=row["action"],
                request_id=row["request_id"],
                started_at=row["started_at"],
                finished_at=row["finished_at"],
                result=row["result"],
                error=row["error"],
                steps=tuple(by_action[row["id"]]),
            )
            for row in actions
        ]


def _check_result(result: str) -> None:
    if result not in RESULTS:
        raise ValueError(f"result must be 'success' or 'error', not {result!r}")


def _row_id(cursor: sqlite3.Cursor) -> int:
    row_id = cursor.lastrowid
    assert row_id is not None, "an INSERT always sets lastrowid"
    return row_id
