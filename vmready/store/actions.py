"""Action history: each action on an instance and its steps, kept after the instance is gone."""

from __future__ import annotations

from typing import Any

from vmready.domain import ActionRecord, ActionStep, NotFound
from vmready.store.table import M, Table, operation

# The results an action or a step may finish with (Nova's "Success" / "Error").
RESULTS = frozenset({"success", "error"})

_ACTION_COLUMNS = "id, instance, action, request_id, started_at, finished_at, result, error"
_STEP_COLUMNS = "action_id, name, started_at, finished_at, result, error"


class ActionHistory(Table[M]):
    """The ``actions`` and ``steps`` tables."""

    @operation
    def start_action(self, name: str, action: str, request_id: str) -> int:
        """Record the start of an action on instance name (kept by its uuid); return its id."""
        # Which member wrote it, under which lease (the fence): "" and 0 for a single host.
        member, epoch = self._database.fence or ("", 0)
        with self._database.transaction():
            return self._database.insert(
                "INSERT INTO actions"
                " (instance, instance_uuid, action, request_id, started_at, member, epoch)"
                " VALUES (?, (SELECT uuid FROM instances WHERE name = ?), ?, ?, ?, ?, ?)",
                (name, name, action, request_id, self._database.clock(), member, epoch),
            )

    @operation
    def start_step(self, action_id: int, step: str) -> int:
        """Record the start of a step of an action; return its id."""
        with self._database.transaction():
            try:
                return self._database.insert(
                    "INSERT INTO steps (action_id, name, started_at) VALUES (?, ?, ?)",
                    (action_id, step, self._database.clock()),
                )
            except self._database.integrity_errors:
                raise NotFound(f"Action {action_id} not found") from None

    @operation
    def finish_step(self, step_id: int, result: str, error: str | None = None) -> None:
        """Record how a step ended ("success" or "error")."""
        with self._database.transaction():
            _check_result(result)
            finished = self._database.db.execute(
                "UPDATE steps SET finished_at = ?, result = ?, error = ? WHERE id = ?",
                (self._database.clock(), result, error, step_id),
            ).rowcount
            if not finished:
                raise NotFound(f"Action step {step_id} not found")

    @operation
    def add_step(self, action_id: int, step: str, result: str, error: str | None = None) -> None:
        """Record a step that started and ended at once."""
        with self._database.transaction():
            _check_result(result)
            now = self._database.clock()
            try:
                self._database.db.execute(
                    "INSERT INTO steps (action_id, name, started_at, finished_at, result, error)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (action_id, step, now, now, result, error),
                )
            except self._database.integrity_errors:
                raise NotFound(f"Action {action_id} not found") from None

    @operation
    def finish_action(self, action_id: int, result: str, error: str | None = None) -> None:
        """Record how an action ended ("success" or "error")."""
        with self._database.transaction():
            _check_result(result)
            finished = self._database.db.execute(
                "UPDATE actions SET finished_at = ?, result = ?, error = ? WHERE id = ?",
                (self._database.clock(), result, error, action_id),
            ).rowcount
            if not finished:
                raise NotFound(f"Action {action_id} not found")

    @operation
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

    @operation
    def unfinished_actions(self, member: str | None = None) -> list[ActionRecord]:
        """Actions that never finished (the daemon died during them), oldest first.

        ``member``: only those on the instances that member runs, and on
        instances no longer in the store (no member will ever finish those);
        another member's are its own to close when it starts.  None: those of
        the member the store acts as (all, where it acts as none).
        """
        member = self._member if member is None else member
        if member is None:
            return self._actions("finished_at IS NULL", (), "id")
        return self._actions(
            "finished_at IS NULL AND (instance_uuid IS NULL"
            " OR instance_uuid NOT IN (SELECT uuid FROM instances WHERE member <> ?))",
            (member,),
            "id",
        )

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
        # Rows by position, in the order of _ACTION_COLUMNS and _STEP_COLUMNS.
        by_action: dict[int, list[ActionStep]] = {row[0]: [] for row in actions}
        for action_id, name, started, finished, result, error in steps:
            by_action[action_id].append(ActionStep(name, started, finished, result, error))
        return [
            ActionRecord(
                id=row[0],
                instance=row[1],
                action=row[2],
                request_id=row[3],
                started_at=row[4],
                finished_at=row[5],
                result=row[6],
                error=row[7],
                steps=tuple(by_action[row[0]]),
            )
            for row in actions
        ]


def _check_result(result: str) -> None:
    if result not in RESULTS:
        raise ValueError(f"result must be 'success' or 'error', not {result!r}")
