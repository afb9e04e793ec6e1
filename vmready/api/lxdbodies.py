"""LXD's request bodies as vmready reads them: each field honoured, or refused saying why.

LXD's clients send every field of LXD's request objects (``lxc config set``
sends the whole instance back, ``lxc snapshot`` an ``expires_at``, ``lxc
rename`` the fields of a move).  A field is honoured where vmready has its
meaning; a field at LXD's default (``false``, ``null``, ``""``, the ``default``
profile) is accepted, since it asks for nothing; any other value is refused
with a 400 naming the field and saying what vmready does not do.  Pure
functions of the body (and the instance as it is): no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from typing import Any

import attrs

from vmready.api.requestbody import field
from vmready.api.views import ARCHITECTURE, PROFILES, ZERO_TIME
from vmready.domain import BadRequest, InstanceRecord, is_launch_key, is_user_key

_NOT_SUPPORTED = "not supported by vmready"
# LXD's ``InstancePut``: the fields an update may carry.
_WRITABLE = frozenset(
    {"architecture", "config", "devices", "ephemeral", "profiles", "stateful", "description"}
)


def instance_etag(view: dict[str, Any]) -> str:
    """The instance's ETag: a hash of its writable fields, as LXD computes one."""
    writable = [
        view.get("architecture"),
        view.get("config"),
        view.get("devices"),
        view.get("ephemeral"),
        view.get("profiles"),
        view.get("description"),
    ]
    return hashlib.sha256(json.dumps(writable, sort_keys=True).encode("utf-8")).hexdigest()


def _only_default(body: dict[str, Any], name: str, default: Any, why: str) -> None:
    """``body[name]`` absent or at LXD's default, else a 400 saying ``why``."""
    value = body.get(name)
    if value is None or value == default:
        return
    raise BadRequest(f"Invalid field {name!r}: {why} ({_NOT_SUPPORTED}), got {value!r}")


def _check_common(body: dict[str, Any], devices: dict[str, Any]) -> None:
    """The fields of an instance vmready has one value for: architecture, profiles…"""
    architecture = body.get("architecture")
    if architecture not in (None, "", ARCHITECTURE):
        raise BadRequest(
            f"Invalid field 'architecture': vmready runs {ARCHITECTURE} VMs only, "
            f"got {architecture!r}"
        )
    profiles = body.get("profiles")
    if profiles not in (None, [], PROFILES):
        raise BadRequest(
            f"Invalid field 'profiles': profiles other than an empty 'default' are "
            f"{_NOT_SUPPORTED}, got {profiles!r}"
        )
    _only_default(body, "ephemeral", False, "ephemeral instances")
    _only_default(body, "description", "", "descriptions")
    requested = field(body, "devices", dict, "an object")
    if requested is not None and requested != devices:
        raise BadRequest(
            f"Invalid field 'devices': devices are chosen by vmready ({_NOT_SUPPORTED}: "
            "adding, changing or removing one)"
        )


@attrs.frozen
class CreateRequest:
    """``POST /1.0/instances`` as vmready reads it."""

    name: str
    config: dict[str, Any]
    start: bool


def create_request(body: dict[str, Any]) -> CreateRequest:
    """LXD's ``InstancesPost``: the name, config, ``start``; the rest at LXD's defaults."""
    name = field(body, "name", str, "a string")
    if name is None:
        raise BadRequest("Invalid field 'name': an instance name is required")
    config = field(body, "config", dict, "an object") or {}
    kind = field(body, "type", str, "a string")
    if kind not in (None, "", "virtual-machine"):
        raise BadRequest(
            f"Invalid field 'type': only 'virtual-machine' is supported, not {kind!r}"
        )
    source = field(body, "source", dict, "an object") or {}
    if source.get("type") not in (None, "", "none"):
        raise BadRequest(
            f"Invalid field 'source': instances from {source.get('type')!r} sources (images, "
            f"copies, migrations) are {_NOT_SUPPORTED}; give the boot source in config "
            "(boot.image, boot.kernel…) with source type 'none' (lxc init --empty)"
        )
    _check_common(body, {})
    _only_default(body, "stateful", False, "stateful stops")
    _only_default(body, "instance_type", "", "instance types")
    start = field(body, "start", bool, "true or false")
    return CreateRequest(name, config, bool(start))


def put_changes(
    record: InstanceRecord, body: dict[str, Any], shown: Collection[str] = ()
) -> dict[str, str | None]:
    """LXD's ``InstancePut`` (not a restore): the config changes that make it so.

    ``shown``: the fields a GET of the instance shows; as LXD does, those
    that are read-only (``name``, ``status``, ``created_at``…) are ignored
    (pylxd sends them back), any other unknown field is refused.

    The config given replaces the instance's: keys set or changed are set, a
    user key left out is removed.  Keys the daemon keeps (``volatile.*``)
    and the boot source chosen at launch stay when left out.  Every other
    field must be as the instance has it.
    """
    unexpected = sorted(set(body) - _WRITABLE - set(shown))
    if unexpected:
        raise BadRequest(
            f"Invalid field {unexpected[0]!r}: expected {', '.join(sorted(_WRITABLE))}"
        )
    _check_common(body, {name: dict(device) for name, device in record.devices.items()})
    _only_default(body, "stateful", False, "stateful stops")
    config = field(body, "config", dict, "an object")
    if config is None:
        return {}
    changes: dict[str, str | None] = {
        key: value for key, value in config.items() if record.config.get(key) != value
    }
    for key in record.config:
        if key in config:
            continue
        if is_launch_key(key):
            raise BadRequest(
                f"Cannot remove {key} of instance {record.name}: the boot source is chosen "
                "at launch"
            )
        if is_user_key(key):
            changes[key] = None
    return changes


def rename_request(body: dict[str, Any]) -> str:
    """LXD's ``InstancePost`` as a rename: the new name; a move elsewhere is refused."""
    new_name = field(body, "name", str, "an instance name")
    if new_name is None:
        raise BadRequest("Invalid field 'name': the instance's new name is required")
    _only_default(body, "migration", False, "migrations")
    _only_default(body, "live", False, "live migrations")
    _only_default(body, "allow_inconsistent", False, "inconsistent copies")
    _only_default(body, "target", "", "moves to another cluster member")
    _only_default(body, "pool", "", "storage pools")
    if body.get("project") not in (None, "", "default"):
        raise BadRequest(
            f"Invalid field 'project': projects other than 'default' are {_NOT_SUPPORTED}"
        )
    for flag in ("instance_only", "container_only"):
        field(body, flag, bool, "true or false")  # a rename keeps the snapshots either way
    known = {"name", "migration", "live", "allow_inconsistent", "target", "pool", "project"}
    unexpected = sorted(set(body) - known - {"instance_only", "container_only"})
    if unexpected:
        raise BadRequest(f"Invalid field {unexpected[0]!r}: a rename takes no such field")
    return str(new_name)


def snapshot_request(body: dict[str, Any]) -> dict[str, Any]:
    """LXD's ``InstanceSnapshotsPost``: name, stateful; ``expires_at`` only as null."""
    unexpected = sorted(set(body) - {"name", "stateful", "expires_at"})
    if unexpected:
        raise BadRequest(f"Invalid field {unexpected[0]!r}: expected name, stateful, expires_at")
    snapshot = field(body, "name", str, "a snapshot name")
    if snapshot is None:
        raise BadRequest("Invalid field 'name': the snapshot's name is required")
    if body.get("expires_at") != ZERO_TIME:
        _only_default(body, "expires_at", "", "snapshot expiry")
    params: dict[str, Any] = {"snapshot": snapshot}
    stateful = field(body, "stateful", bool, "true or false")
    if stateful is not None:
        params["stateful"] = stateful
    return params
