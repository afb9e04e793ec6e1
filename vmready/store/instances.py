"""Instance rows: creating them, their tasks (compare-and-swap), states and config.

Claiming a task is a compare-and-swap in a single ``UPDATE … WHERE task_state
IS NULL``, so the database, not the caller, decides which of two racing
actions wins (on PostgreSQL the second UPDATE waits for the first to commit,
then finds the task taken).  Every other write that reads the row before it
writes it reads with ``lock=True``: PostgreSQL's READ COMMITTED would
otherwise let two writers read the same row and the second overwrite the
first's change.

Each write notes the row as it leaves it (``Database.record``): what a
daemon's committed view in memory applies once the call has committed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from vmready.domain import (
    READY_KEY,
    BadRequest,
    Conflict,
    InstanceRecord,
    PowerState,
    TaskState,
    VMState,
    describe_state,
    task_conflict,
)
from vmready.store.database import (
    INSTANCE_COLUMNS,
    Database,
    dump,
    instance_from_row,
    instance_not_found,
)
from vmready.store.table import M, Table, operation


class Instances(Table[M]):
    """The ``instances`` table."""

    @operation
    def create_instance(
        self,
        name: str,
        config: dict[str, str],
        devices: dict[str, dict[str, str]],
        instance_uuid: str | None = None,
        member: str | None = None,
    ) -> InstanceRecord:
        """Add an instance, building with a spawning task; Conflict if the name is taken.

        ``instance_uuid``: this uuid instead of a new one (a replayed session's);
        ``member``: the cluster member whose host runs it (None: the one the
        store acts as; "" on a single host).
        """
        _check_config(config)
        _check_devices(devices)
        now = self._database.clock()
        with self._database.transaction():
            if self._database.find_instance(name) is not None:
                raise Conflict(f"Instance {name} already exists")
            _insert(
                self._database,
                name,
                (
                    name,
                    instance_uuid or str(uuid.uuid4()),
                    VMState.BUILDING.value,
                    TaskState.SPAWNING.value,
                    PowerState.NOSTATE.value,
                    dump(config),
                    dump(devices),
                    now,
                    now,
                    (self._member or "") if member is None else member,
                ),
            )
            return self._committed(self._database.get_instance(name))

    @operation
    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""
        return self._database.get_instance(name)

    @operation
    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""
        return self._database.find_instance(name)

    @operation
    def list_instances(self) -> list[InstanceRecord]:
        """Every instance, ordered by name."""
        rows = self._database.db.execute(f"SELECT {INSTANCE_COLUMNS} FROM instances ORDER BY name")
        return [instance_from_row(row) for row in rows]

    @operation
    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> InstanceRecord:
        """Start task if there is none and vm_state is in allowed_from; else the 409 saying why."""
        states = sorted(state.value for state in allowed_from)
        placeholders = ", ".join("?" for _ in states)
        with self._database.transaction():
            claimed = self._database.db.execute(
                "UPDATE instances SET task_state = ?, updated_at = ?"
                f" WHERE name = ? AND task_state IS NULL AND vm_state IN ({placeholders})",
                (task.value, self._database.clock(), name, *states),
            ).rowcount
            current = self._database.get_instance(name)
        if claimed:
            return self._committed(current)
        raise task_conflict(action, name, current.task_state, current.vm_state)

    @operation
    def advance_task(self, name: str, expected: TaskState, task: TaskState) -> InstanceRecord:
        """Move from task_state expected to task; Conflict if the instance is not in expected."""
        with self._database.transaction():
            advanced = self._database.db.execute(
                "UPDATE instances SET task_state = ?, updated_at = ?"
                " WHERE name = ? AND task_state = ?",
                (task.value, self._database.clock(), name, expected.value),
            ).rowcount
            current = self._database.get_instance(name)
        if advanced:
            return self._committed(current)
        raise _stale_task(name, expected, current)

    @operation
    def finish_task(
        self,
        name: str,
        expected: TaskState,
        vm_state: VMState,
        power_state: PowerState | None = None,
        config_updates: dict[str, str | None] | None = None,
    ) -> InstanceRecord:
        """End task expected: rest in vm_state, optionally set power_state and config; atomic."""
        with self._database.transaction():
            current = self._database.get_instance(name, lock=True)
            if current.task_state is not expected:
                raise _stale_task(name, expected, current)
            config = _updated(current.config, config_updates or {})
            error = current.error if vm_state is VMState.ERROR else None
            self._database.db.execute(
                "UPDATE instances SET task_state = NULL, vm_state = ?, power_state = ?,"
                " config = ?, error = ?, updated_at = ? WHERE name = ? AND task_state = ?",
                (
                    vm_state.value,
                    (power_state or current.power_state).value,
                    dump(config),
                    error,
                    self._database.clock(),
                    name,
                    expected.value,
                ),
            )
            return self._committed(self._database.get_instance(name))

    @operation
    def set_error(
        self, name: str, reason: str, power_state: PowerState | None = None
    ) -> InstanceRecord:
        """Put the instance in vm_state error with reason, ending any task."""
        with self._database.transaction():
            _update_existing(
                self._database,
                name,
                "vm_state = ?, task_state = NULL, error = ?,"
                " power_state = COALESCE(?, power_state), updated_at = ?",
                (
                    VMState.ERROR.value,
                    reason,
                    None if power_state is None else power_state.value,
                    self._database.clock(),
                ),
            )
            return self._committed(self._database.get_instance(name))

    @operation
    def set_power_state(self, name: str, power_state: PowerState) -> InstanceRecord:
        """Record what the hypervisor reports; an unchanged power state writes nothing."""
        with self._database.transaction():
            current = self._database.get_instance(name, lock=True)
            if current.power_state is power_state:
                return self._committed(current)
            _update_existing(
                self._database,
                name,
                "power_state = ?, updated_at = ?",
                (power_state.value, self._database.clock()),
            )
            return self._committed(self._database.get_instance(name))

    @operation
    def update_config(self, name: str, updates: dict[str, str | None]) -> InstanceRecord:
        """Set config keys (None deletes the key) in one read-modify-write transaction."""
        with self._database.transaction():
            current = self._database.get_instance(name, lock=True)
            config = _updated(current.config, updates)
            _update_existing(
                self._database,
                name,
                "config = ?, updated_at = ?",
                (dump(config), self._database.clock()),
            )
            return self._committed(self._database.get_instance(name))

    @operation
    def settle(
        self,
        name: str,
        allowed_from: frozenset[VMState],
        vm_state: VMState,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
        error: str | None = None,
    ) -> InstanceRecord | None:
        """Move an idle instance to ``vm_state`` without an action (a VM exited, the poller),
        with ``error`` (none: an error it had is cleared).

        One conditional ``UPDATE … WHERE task_state IS NULL AND vm_state IN (…)``:
        an instance with a task in progress (claimed since the caller read it,
        say), or in a state not listed (error, say), is left untouched and None
        is returned.
        """
        states = sorted(state.value for state in allowed_from)
        placeholders = ", ".join("?" for _ in states)
        with self._database.transaction():
            current = self._database.find_instance(name, lock=True)
            if current is None:
                return None
            config = _updated(current.config, config_updates or {})
            changed = self._database.db.execute(
                "UPDATE instances SET vm_state = ?, power_state = ?, config = ?, "
                "error = ?, updated_at = ? "
                f"WHERE name = ? AND task_state IS NULL AND vm_state IN ({placeholders})",
                (
                    vm_state.value,
                    power_state.value,
                    dump(config),
                    error,
                    self._database.clock(),
                    name,
                    *states,
                ),
            ).rowcount
            return self._committed(self._database.get_instance(name)) if changed else None

    @operation
    def clear_ready_everywhere(self, member: str | None = None) -> int:
        """Remove the ready key (daemon start); how many instances had it.

        ``member``: only from the instances that member runs (a cluster member
        starting clears its own, never another's); None: those of the member
        the store acts as (every instance, where it acts as none).  One
        statement for all of them (SQLite's JSON functions, no row decoded in
        Python): a daemon starting with thousands of instances waits for this
        before it serves.
        """
        member = self._member if member is None else member
        has_key, key = self._database.has_key(READY_KEY)
        without_key, key_again = self._database.without_key(READY_KEY)
        owned = "" if member is None else " AND member = ?"
        mine: tuple[str, ...] = () if member is None else (member,)
        with self._database.transaction():
            names = [
                row[0]
                for row in self._database.db.execute(
                    f"SELECT name FROM instances WHERE {has_key}{owned}"
                    f" ORDER BY name{self._database.LOCK_ROWS}",
                    (key, *mine),
                )
            ]
            now = self._database.clock()
            self._database.db.execute(
                f"UPDATE instances SET config = {without_key}, updated_at = ?"
                f" WHERE {has_key}{owned}",
                (key_again, now, key, *mine),
            )
        self._database.record(lambda rows: rows.ready_cleared(names, now))
        return len(names)

    @operation
    def rename_instance(
        self, name: str, new_name: str, allowed_from: frozenset[VMState], request_id: str
    ) -> InstanceRecord:
        """Call instance ``name`` ``new_name``, with its snapshots and agent certificate; atomic.

        Only an idle instance in one of ``allowed_from`` (else the 409 saying
        why); Conflict if ``new_name`` is taken.  Everything else an instance
        owns is keyed by its uuid (its directories, its history), so this one
        transaction is the whole rename: a crash leaves the old name or the new
        one, never half of each.  The rename is recorded in the action history
        in the same transaction.
        """
        with self._database.transaction():
            current = self._database.get_instance(name, lock=True)
            _check_renamable(current, allowed_from)
            if self._database.find_instance(new_name) is not None:
                raise Conflict(f"Cannot rename {name} to {new_name}: instance {new_name} exists")
            now = self._database.clock()
            _move_row(self._database, name, new_name, now)
            _record_rename(self._database, current.uuid, name, new_name, request_id, now)
            record = self._database.get_instance(new_name)
        self._database.record(lambda rows: rows.renamed(name, record))
        return record

    @operation
    def delete_instance(self, name: str) -> None:
        """Remove the instance and its snapshots; its action history stays."""
        with self._database.transaction():
            deleted = self._database.db.execute(
                "DELETE FROM instances WHERE name = ?", (name,)
            ).rowcount
            if not deleted:
                raise instance_not_found(name)
            self._database.record(lambda rows: rows.removed(name))

    def _committed(self, record: InstanceRecord) -> InstanceRecord:
        """``record``, the row as this call leaves it (noted for the rows kept in memory)."""
        self._database.record(lambda rows: rows.committed(record))
        return record


def _insert(database: Database, name: str, values: tuple[Any, ...]) -> None:
    """The INSERT of a new row; a writer that took the name since we looked: Conflict."""
    try:
        database.db.execute(
            f"INSERT INTO instances ({INSTANCE_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?)",
            values,
        )
    except database.integrity_errors:
        raise Conflict(f"Instance {name} already exists") from None


def _update_existing(
    database: Database, name: str, assignments: str, values: tuple[Any, ...]
) -> None:
    updated = database.db.execute(
        f"UPDATE instances SET {assignments} WHERE name = ?", (*values, name)
    ).rowcount
    if not updated:
        raise instance_not_found(name)


def _check_renamable(current: InstanceRecord, allowed_from: frozenset[VMState]) -> None:
    """The 409 for renaming an instance in a task, or in a state not in ``allowed_from``."""
    if current.task_state is not None:
        raise task_conflict("rename", current.name, current.task_state, current.vm_state)
    if current.vm_state not in allowed_from:
        raise Conflict(
            f"Cannot rename instance {current.name}: it is "
            f"{describe_state(current.vm_state, None)}; only a stopped instance "
            "can be renamed"
        )


def _move_row(database: Database, name: str, new_name: str, now: float) -> None:
    """Rename the row, its snapshots and agent certificate with it.

    Their rows reference the name without ``ON UPDATE CASCADE`` (the schema's
    first versions), so they are taken out and put back under the new name
    around the update.
    """
    db = database.db
    snapshots = db.execute(
        "SELECT id, name, stateful, created_at, metadata FROM snapshots"
        " WHERE instance = ? ORDER BY id",
        (name,),
    ).fetchall()
    certificate = db.execute(
        "SELECT fingerprint, issued_at FROM agent_certificates WHERE instance = ?", (name,)
    ).fetchone()
    db.execute("DELETE FROM snapshots WHERE instance = ?", (name,))
    db.execute("DELETE FROM agent_certificates WHERE instance = ?", (name,))
    try:
        db.execute(
            "UPDATE instances SET name = ?, updated_at = ? WHERE name = ?", (new_name, now, name)
        )
    except database.integrity_errors:
        raise Conflict(f"Cannot rename {name} to {new_name}: instance {new_name} exists") from None
    db.executemany(
        "INSERT INTO snapshots (id, instance, name, stateful, created_at, metadata)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        [(row[0], new_name, row[1], row[2], row[3], row[4]) for row in snapshots],
    )
    if certificate is not None:
        db.execute(
            "INSERT INTO agent_certificates (instance, fingerprint, issued_at) VALUES (?, ?, ?)",
            (new_name, certificate[0], certificate[1]),
        )


def _record_rename(
    database: Database, instance_uuid: str, name: str, new_name: str, request_id: str, now: float
) -> None:
    """The rename in the action history: one action of one step, both successful."""
    action_id = database.insert(
        "INSERT INTO actions (instance, instance_uuid, action, request_id, started_at,"
        " finished_at, result) VALUES (?, ?, 'rename', ?, ?, ?, 'success')",
        (new_name, instance_uuid, request_id, now, now),
    )
    database.db.execute(
        "INSERT INTO steps (action_id, name, started_at, finished_at, result)"
        " VALUES (?, ?, ?, ?, 'success')",
        (action_id, f"rename: {name} -> {new_name}", now, now),
    )


def _updated(config: dict[str, str], updates: Mapping[str, str | None]) -> dict[str, str]:
    """config with updates applied: a None value deletes the key."""
    result = dict(config)
    for key, value in updates.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    _check_config(result)
    return result


def _check_config(config: Mapping[str, Any]) -> None:
    for key, value in config.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BadRequest(f"Config key {key!r} must map to a string, not {value!r}")


def _check_devices(devices: Mapping[str, Any]) -> None:
    for device, settings in devices.items():
        if not isinstance(settings, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in settings.items()
        ):
            raise BadRequest(f"Device {device!r} must map names to strings")


def _stale_task(name: str, expected: TaskState, current: InstanceRecord) -> Conflict:
    """The 409 for a task step whose compare-and-swap found another task_state."""
    now = f"at step {current.task_state}" if current.task_state else "no longer in a task"
    return Conflict(f"Instance {name} moved on: it is {now}, not at step {expected}")
