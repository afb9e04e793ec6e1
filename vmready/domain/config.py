"""An instance's config rules: its name, the keys a user may set, memory and CPUs.

What the operator API accepts, the lifecycle applies and a snapshot keeps:
``validate_name``, ``validate_config`` (every value checked, written as text,
limits normalised), ``config_changes`` (an update, with keys removed), the
parsers of ``limits.memory`` and ``limits.cpu``, and which keys a snapshot
keeps and a restore brings back.
"""

from __future__ import annotations

import re
from typing import Any

from vmready.domain.model import BadRequest

MIN_MEMORY_MIB = 16
MAX_MEMORY_MIB = 1024 * 1024
MAX_CPUS = 64
# The accelerator an instance asks for at launch (``vmready.hypervisor.accel`` chooses).
ACCEL_KEY = "boot.accel"
ACCEL_CHOICES = ("auto", "kvm", "tcg")
# The boot source an instance asks for at launch (``vmready.hypervisor.bootsource``).
IMAGE_KEY = "boot.image"
KERNEL_KEY = "boot.kernel"
INITRD_KEY = "boot.initrd"
APPEND_KEY = "boot.append"
# The per-instance key that switches recording on or off ("true"/"false").
RECORD_KEY = "vmready.record"

_NAME = re.compile(r"[a-zA-Z][a-zA-Z0-9-]{0,62}")
_USER_KEYS = re.compile(r"(limits\.memory|limits\.cpu|user\..+|cloud-init\..+|vmready\.record)")
# Set at launch, kept with the instance; a rebuild boots the same source afresh.
_LAUNCH_KEYS = re.compile(r"boot\.(image|kernel|initrd|append|accel)")
# What removing a key is checked as: the key with a value that is always valid.
_REMOVAL_PROBE = {"limits.memory": str(MIN_MEMORY_MIB), "limits.cpu": "1", RECORD_KEY: "false"}
# More digits than any limit has: such a number is out of range, never converted.
_MAX_LIMIT_DIGITS = 12


def validate_name(name: str) -> None:
    """Instance names as LXD allows them: a letter, then letters, digits, hyphens; 63 at most."""
    if not _NAME.fullmatch(name) or name.endswith("-"):
        raise BadRequest(
            f"Invalid instance name {name!r}: use 1-63 letters, digits and hyphens, "
            "starting with a letter and not ending with a hyphen"
        )


def is_launch_key(key: str) -> bool:
    """Whether ``key`` is chosen at launch only (the boot source and the accelerator)."""
    return _LAUNCH_KEYS.fullmatch(key) is not None


def is_user_key(key: str) -> bool:
    """Whether a user sets ``key`` (and a snapshot keeps it): limits, user.*, cloud-init.*…"""
    return _USER_KEYS.fullmatch(key) is not None


def validate_config(config: dict[str, Any]) -> dict[str, str]:
    """Check user-settable keys and values; returns them as strings."""
    checked: dict[str, str] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not (is_user_key(key) or is_launch_key(key)):
            raise BadRequest(
                f"Invalid config key {key!r}: allowed are limits.memory, limits.cpu, user.*, "
                "cloud-init.*, vmready.record, and at launch boot.image, boot.kernel, "
                "boot.initrd, boot.append, boot.accel"
            )
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise BadRequest(f"Invalid value for {key}: expected a string")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"Invalid config key {key!r}: not valid Unicode text") from None
        text = _config_text(value, f"Invalid value for {key}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"Invalid value for {key}: not valid Unicode text") from None
        checked[key] = text
    if checked.get(ACCEL_KEY, "auto") not in ACCEL_CHOICES:
        raise BadRequest(
            f"Invalid value for {ACCEL_KEY}: {checked[ACCEL_KEY]!r}: expected "
            f"{', '.join(ACCEL_CHOICES)}"
        )
    if checked.get(RECORD_KEY, "false") not in ("true", "false"):
        raise BadRequest(
            f"Invalid value for {RECORD_KEY}: {checked[RECORD_KEY]!r}: expected true or false"
        )
    if "limits.memory" in checked:
        checked["limits.memory"] = str(parse_memory(checked["limits.memory"]))
    if "limits.cpu" in checked:
        checked["limits.cpu"] = str(parse_cpus(checked["limits.cpu"]))
    return checked


def config_changes(config: dict[str, Any]) -> dict[str, str | None]:
    """A config update as store changes: values validated, ``None`` (remove) for known keys."""
    setting = {key: value for key, value in config.items() if value is not None}
    changes: dict[str, str | None] = dict(validate_config(setting))
    for key, value in config.items():
        if value is None:
            # Removing a key is allowed exactly when setting it is: check the key alone.
            validate_config({key: _REMOVAL_PROBE.get(key, "")})
            changes[key] = None
    return changes


def _config_text(value: str | int, problem: str) -> str:
    """A config value as text: a number is written out (BadRequest when it has too many digits)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(f"{problem}: a number with too many digits") from None


def parse_memory(value: str | int) -> int:
    """limits.memory: MiB as a number, or with a MiB/GiB/MB/GB suffix; returns MiB.

    The number is ASCII digits (``\\d`` would take any script's digits).
    """
    text = _config_text(value, "Invalid limits.memory")
    match = re.fullmatch(r"\s*([0-9]+)\s*(MiB|GiB|MB|GB|M|G)?\s*", text)
    if match is None:
        raise BadRequest(f"Invalid limits.memory {text!r}: expected MiB, e.g. 512 or 2GiB")
    digits, unit = match.group(1).lstrip("0") or "0", match.group(2) or "MiB"
    number = int(digits) if len(digits) <= _MAX_LIMIT_DIGITS else MAX_MEMORY_MIB + 1
    mib = number * 1024 if unit in ("GiB", "GB", "G") else number
    if not MIN_MEMORY_MIB <= mib <= MAX_MEMORY_MIB:
        raise BadRequest(
            f"Invalid limits.memory {text!r}: must be {MIN_MEMORY_MIB} MiB to {MAX_MEMORY_MIB} MiB"
        )
    return mib


def parse_cpus(value: str | int) -> int:
    """limits.cpu: a count of vCPUs, in ASCII digits (``int()`` would take ``1_0`` or ``+1``)."""
    text = _config_text(value, "Invalid limits.cpu")
    digits = text.strip()
    if not re.fullmatch(r"-?[0-9]+", digits):
        raise BadRequest(f"Invalid limits.cpu {text!r}: expected a number of CPUs")
    cpus = int(digits) if len(digits.lstrip("-0")) <= _MAX_LIMIT_DIGITS else MAX_CPUS + 1
    if not 1 <= cpus <= MAX_CPUS:
        raise BadRequest(f"Invalid limits.cpu {text!r}: must be 1 to {MAX_CPUS}")
    return cpus


def snapshot_config(config: dict[str, str]) -> dict[str, str]:
    """The config a snapshot keeps and a restore brings back: what users set."""
    return {key: value for key, value in config.items() if is_user_key(key)}


def restored_config(current: dict[str, str], metadata: dict[str, Any]) -> dict[str, str]:
    """The config after restoring: the snapshot's user keys, the current volatile ones."""
    kept = {key: value for key, value in current.items() if not is_user_key(key)}
    saved = {str(key): str(value) for key, value in (metadata.get("config") or {}).items()}
    return {**kept, **snapshot_config(saved)}


def config_updates(before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
    """The store updates that turn ``before`` into ``after``."""
    updates: dict[str, str | None] = {key: None for key in before if key not in after}
    updates.update({key: value for key, value in after.items() if before.get(key) != value})
    return updates
