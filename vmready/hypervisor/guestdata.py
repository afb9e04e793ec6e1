"""What a guest is told about itself at boot: meta-data, its guest-visible config, its devices.

The same data reaches the guest three ways, all written before every boot:
the config drive's ``guest-api.json`` (the agent answers ``/dev/lxd/sock``'s
``GET /1.0/meta-data``, ``/1.0/config``, ``/1.0/config/<key>`` and
``/1.0/devices`` from it until it has a link to the host), the drive's
``cloud-init/`` files (the demo image's stand-in for cloud-init reads them),
and the NoCloud seed's ``meta-data``, ``user-data``, ``network-config``
(``vmready.hypervisor.nocloud``), which a stock image's cloud-init reads.
cloud-init's rules pick the user-data, vendor-data and network config: a
``cloud-init.*`` key wins over its older ``user.*`` alias, as in LXD's
datasource; ``user.meta-data`` follows the instance's own meta-data.

How much of it a guest may be given is bounded (``MAX_GUEST_DATA``): the data
is copied into every boot's seed and drive, and read into memory by the
agent and cloud-init.  A launch or config change past the bound is refused
with one line, before anything is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from vmready.domain import BadRequest, InstanceRecord
from vmready.hypervisor.bootsource import BootSource

# The config keys a guest may read (LXD's rule).
GUEST_PREFIXES = ("user.", "cloud-init.")
# At most this many bytes of guest-visible keys and values: ten times what clouds allow
# for user-data (EC2 16 KiB, Azure 64 KiB, GCE 256 KiB), four times a request body.
MAX_GUEST_DATA = 4 * 1024 * 1024
USER_META_DATA_KEY = "user.meta-data"


def meta_data(instance_uuid: str, name: str, extra: str = "") -> str:
    """cloud-init's meta-data (the guest API's ``/1.0/meta-data``): uuid, name, user.meta-data."""
    return f"instance-id: {instance_uuid}\nlocal-hostname: {name}\n{extra}"


def _visible(config: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in config.items() if key.startswith(GUEST_PREFIXES)}


def _size(config: Mapping[str, str]) -> int:
    """The guest-visible keys and values of ``config``, in bytes (UTF-8)."""
    return sum(len(key.encode()) + len(value.encode()) for key, value in _visible(config).items())


def guest_data_problem(config: Mapping[str, str]) -> str | None:
    """Why a guest could not be given ``config``'s data (None: it can)."""
    size = _size(config)
    if size <= MAX_GUEST_DATA:
        return None
    # Rounded up: a size just past the bound never reads as the bound itself.
    mebibytes = math.ceil(size * 10 / 1048576) / 10
    return (
        f"the instance's user.* and cloud-init.* keys come to {mebibytes:.1f} MiB, "
        f"more than the {MAX_GUEST_DATA // 1048576} MiB a guest is given at boot "
        "(its NoCloud seed and config drive); make them smaller"
    )


def check_guest_data(config: Mapping[str, str]) -> None:
    """BadRequest (one line) when ``config`` holds more guest data than a guest is given."""
    problem = guest_data_problem(config)
    if problem is not None:
        raise BadRequest(f"Invalid config: {problem}")


@attrs.frozen
class GuestData:
    """One instance's data for its next boot, as the guest API would serve it."""

    instance_uuid: str
    name: str
    # Its user.* and cloud-init.* keys.
    config: Mapping[str, str] = attrs.field(factory=dict)
    devices: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    # Whether it boots a disk image: such a VM gets a NoCloud seed besides its drive.
    image: bool = False

    def _pick(self, name: str) -> str:
        """``cloud-init.<name>``, else ``user.<name>``, else empty: LXD's datasource's rule."""
        return self.config.get(f"cloud-init.{name}") or self.config.get(f"user.{name}") or ""

    @property
    def meta_data(self) -> str:
        """``/1.0/meta-data`` and the seed's ``meta-data``."""
        return meta_data(self.instance_uuid, self.name, self.config.get(USER_META_DATA_KEY, ""))

    @property
    def user_data(self) -> str:
        """The user-data cloud-init applies (empty: none)."""
        return self._pick("user-data")

    @property
    def vendor_data(self) -> str:
        """The instance's own vendor-data (empty: none)."""
        return self._pick("vendor-data")

    @property
    def network_config(self) -> str:
        """The network config cloud-init applies (empty: cloud-init's default)."""
        return self._pick("network-config")

    def guest_api(self) -> bytes:
        """``guest-api.json``: what the agent answers before its link to the host is up."""
        document: dict[str, Any] = {
            "meta-data": self.meta_data,
            "config": dict(sorted(self.config.items())),
            "devices": {name: dict(device) for name, device in sorted(self.devices.items())},
        }
        return json.dumps(document, indent=1, ensure_ascii=False).encode() + b"\n"

    def problem(self) -> str | None:
        """Why this data cannot be given to the guest (None: it can)."""
        return guest_data_problem(self.config)


def guest_data(record: InstanceRecord) -> GuestData:
    """The data ``record``'s guest is given at its next boot."""
    return GuestData(
        record.uuid,
        record.name,
        _visible(record.config),
        record.devices,
        BootSource.from_config(record.config).image is not None,
    )
