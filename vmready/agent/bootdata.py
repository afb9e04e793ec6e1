"""This boot's data from the config drive: what the guest API answers before the host link is up.

Before every boot the host writes ``guest-api.json`` on the instance's config
drive: its meta-data, its guest-visible config (the ``user.*`` and
``cloud-init.*`` keys) and its devices, exactly what ``GET /1.0/meta-data``,
``/1.0/config``, ``/1.0/config/<key>`` and ``/1.0/devices`` return::

    {"meta-data": "instance-id: …\\nlocal-hostname: web1\\n",
     "config": {"cloud-init.user-data": "#cloud-config\\n…", "user.role": "web"},
     "devices": {}}

cloud-init's LXD datasource reads those four, once, in the guest's first
seconds: before the agent has found its serial port, long before the host has
told it where to dial.  While the link is down the agent answers them from this
file, as the host would (the same bodies, types and errors); once the link is
up every request goes to the host, whose answer may be newer.  Sans-I/O but for
``load_boot_data``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from vmready.agent.answers import Answer, metadata_answer, plain
from vmready.agent.logs import logger

BOOT_DATA = "guest-api.json"
META_DATA_PATH = "/1.0/meta-data"
CONFIG_PATH = "/1.0/config"
DEVICES_PATH = "/1.0/devices"
# The config keys a guest may read (LXD's rule, as the host applies it).
_GUEST_PREFIXES = ("user.", "cloud-init.")

log = logger(__name__)


@dataclass(frozen=True)
class BootData:
    """The instance's meta-data, guest-visible config and devices, as the host wrote them."""

    meta_data: str
    config: Mapping[str, str] = field(default_factory=dict)
    devices: Mapping[str, Any] = field(default_factory=dict)

    def answer(self, method: str, path: str) -> Answer | None:
        """The host's answer to ``method path`` if this data holds it (None: the host's alone)."""
        if method != "GET":
            return None
        if path == META_DATA_PATH:
            return metadata_answer(200, self.meta_data)
        if path == CONFIG_PATH:
            keys = sorted(key for key in self.config if key.startswith(_GUEST_PREFIXES))
            return metadata_answer(200, [f"{CONFIG_PATH}/{key}" for key in keys])
        if path.startswith(CONFIG_PATH + "/"):
            key = unquote(path[len(CONFIG_PATH) + 1 :])
            if not key.startswith(_GUEST_PREFIXES):
                return plain(403, "not authorized")
            value = self.config.get(key, "")
            return metadata_answer(200, value) if value else plain(404, "not found")
        if path == DEVICES_PATH:
            return metadata_answer(200, dict(self.devices))
        return None


def parse_boot_data(raw: bytes) -> BootData:
    """``guest-api.json``'s bytes as BootData; ValueError saying what is wrong."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    meta_data = data.get("meta-data")
    config = data.get("config", {})
    devices = data.get("devices", {})
    if not isinstance(meta_data, str):
        raise ValueError("its meta-data is not a string")
    if not isinstance(config, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in config.items()
    ):
        raise ValueError("its config is not an object of strings")
    if not isinstance(devices, dict):
        raise ValueError("its devices are not an object")
    return BootData(meta_data, config, devices)


def load_boot_data(drive: str) -> BootData | None:
    """The config drive's ``guest-api.json``; None (said once, in the log) if absent or unusable.

    Without it the agent still runs: requests wait for the host link, as before.
    """
    path = os.path.join(drive, BOOT_DATA)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("ignoring %s: %s", path, e.strerror or e)
        return None
    try:
        return parse_boot_data(raw)
    except ValueError as e:
        log.warning("ignoring %s: %s", path, e)
        return None
