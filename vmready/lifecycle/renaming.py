"""Renaming an instance: LXD's ``POST /1.0/instances/<name> {"name": NEW}``.

Everything an instance keeps on disk is named after its uuid, not its name:
its run directory (config drive, console log, sockets), its root-disk
overlay, its snapshot files.  Its action history is kept by uuid too.  What
carries the name is in the store (the instance row, its snapshot rows, its
agent certificate's row), and ``Store.rename_instance`` changes those in one
transaction, with the history record: a daemon killed at any point leaves the
old name or the new one, so there is no ``renaming`` task for recovery to
finish.  What the daemon keeps in memory by name (the agent's last status, a
certificate fault, the fault log, via the ``instance-renamed`` event) moves
once the store committed.  The agent's certificate stays valid: the guest API
knows an agent by its certificate's fingerprint, and the config drive is
rewritten with the new name when the instance next starts.
"""

from __future__ import annotations

import uuid

import attrs
from twisted.logger import Logger

from vmready.domain import (
    Conflict,
    InstanceRecord,
    VMState,
    describe_state,
    task_conflict,
    validate_name,
)
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.operations import Operation, Operations
from vmready.lifecycle.recovery import Recovery
from vmready.lifecycle.running import RunningVMs
from vmready.store import AsyncStore

# LXD renames only a stopped instance: a running VM was started under its old name.
RENAMABLE = frozenset({VMState.STOPPED})


@attrs.define(kw_only=True, eq=False)
class Renaming:
    """Renames stopped instances."""

    log = Logger()

    store: AsyncStore
    events: EventBus
    journal: Journal
    operations: Operations
    running: RunningVMs
    recovery: Recovery
    guestside: GuestSide

    def check(self, name: str, new_name: str) -> InstanceRecord:
        """The 400, 404 or 409 a rename gets before any operation exists; else the instance."""
        record = self.store.view.get_instance(name)
        validate_name(new_name)
        if new_name == name:
            raise Conflict(f"Cannot rename instance {name}: it is called {new_name} already")
        if record.task_state is not None:
            raise task_conflict("rename", name, record.task_state, record.vm_state)
        if record.vm_state not in RENAMABLE or self.running.has_vm(name):
            raise Conflict(
                f"Cannot rename instance {name}: it is "
                f"{describe_state(record.vm_state, None)}; only a stopped instance can be renamed"
            )
        if self.store.view.find_instance(new_name) is not None:
            raise Conflict(f"Cannot rename {name} to {new_name}: instance {new_name} exists")
        return record

    async def rename(self, name: str, new_name: str) -> Operation:
        """Rename a stopped instance; checked before its operation, done in one transaction."""
        self.check(name, new_name)
        # Not while the daemon's start-up reconciliation of the instance runs.
        await self.recovery.reconciled(name)
        self.check(name, new_name)

        async def work() -> None:
            record = await self.store.instances.rename_instance(
                name, new_name, RENAMABLE, str(uuid.uuid4())
            )
            self._moved(name, record)

        return self.operations.run(f"Renaming instance {name} to {new_name}", name, work)

    def _moved(self, name: str, record: InstanceRecord) -> None:
        """The store committed: what the daemon holds by name follows, then it is announced."""
        self.running.renamed(name, record.name)
        self.guestside.renamed(name, record.name)
        self.log.info("renamed instance {name} to {new_name}", name=name, new_name=record.name)
        self.events.lifecycle("instance-renamed", record.name, {"old_name": name})
        self.journal.publish_state(record)
