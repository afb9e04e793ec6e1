"""An operator's change of an instance's config: user keys any time, limits only while stopped."""

from __future__ import annotations

from typing import Any

import attrs

from vmready.domain import (
    RUNNING_VM_STATES,
    BadRequest,
    Conflict,
    InstanceRecord,
    config_changes,
    describe_state,
    is_launch_key,
    task_conflict,
)
from vmready.hypervisor import check_guest_data
from vmready.lifecycle.events import EventBus
from vmready.store import AsyncStore


@attrs.define(kw_only=True, eq=False)
class Configuring:
    """An operator's change of an instance's config (LXD's ``PUT``/``PATCH`` of an instance)."""

    store: AsyncStore
    events: EventBus

    async def update_config(self, name: str, config: dict[str, Any]) -> InstanceRecord:
        """Set user-settable keys (``None`` removes one); limits change only through resize."""
        changes = config_changes(config)
        launch_keys = sorted(key for key in changes if is_launch_key(key))
        if launch_keys:
            raise BadRequest(
                f"Cannot change {launch_keys[0]} of instance {name}: the boot source and "
                "accelerator are chosen at launch (launch a new instance to boot another)"
            )
        record = self.store.view.get_instance(name)
        if record.task_state is not None:
            raise task_conflict("update", name, record.task_state, record.vm_state)
        after = {**record.config, **changes}
        check_guest_data({key: value for key, value in after.items() if value is not None})
        limits = sorted(key for key in changes if key.startswith("limits."))
        if limits and record.vm_state in RUNNING_VM_STATES:
            # The VM would keep its old size while the config claimed the new one.
            raise Conflict(
                f"Cannot change {limits[0]} of instance {name} while it is "
                f"{describe_state(record.vm_state, None)}: use the resize action"
            )
        updated = await self.store.instances.update_config(name, changes)
        self.events.lifecycle("instance-updated", name, {"config": changes})
        return updated
