"""``-fsdev local`` exports and the ``virtio-9p-pci`` devices that share them.

QEMU checks an ``-fsdev`` in three places: its option loop (keys, typed values,
IDs), the backend creation after it (driver, security model, path given), and
the 9p device's realization (the fsdev exists, a mount tag, the directory
opens).  A missing export directory is therefore only an error once a device
uses it.  Every text here was measured on QEMU 7.2.

fakeqemu runs no guest, so it has no 9p server: it shows a fake guest the
export as ``<guest dir>/9p/<mount tag>``, a symlink to the host directory.
"""

from __future__ import annotations

import os

import attrs

from fakeqemu._qemuopts import CommandLineError, parse_bool, parse_c_integer

SECURITY_MODEL_HINT = (
    "Valid options are: security_model=[passthrough|mapped-xattr|mapped-file|none]"
)
MAX_MOUNT_TAG_BYTES = 31
# The keys of QEMU 7.2's -fsdev QemuOpts (the option loop refuses others).
_FSDEV_KEYS = frozenset(
    {
        "fsdriver",
        "id",
        "path",
        "security_model",
        "writeout",
        "readonly",
        "socket",
        "sock_fd",
        "fmode",
        "dmode",
        "multidevs",
    }
)
# What the local driver accepts (fsdev/qemu-fsdev.c); throttling.* are its too.
_LOCAL_KEYS = frozenset(
    {
        "id",
        "fsdriver",
        "readonly",
        "security_model",
        "path",
        "writeout",
        "fmode",
        "dmode",
        "multidevs",
    }
)
_SECURITY_MODELS = frozenset({"passthrough", "mapped", "mapped-xattr", "mapped-file", "none"})
_MULTIDEVS = frozenset({"remap", "forbid", "warn"})


@attrs.frozen
class FsdevSpec:
    """``-fsdev local,id=ID,path=P,…``: a host directory a 9p device may export."""

    id: str
    path: str
    readonly: bool


@attrs.frozen
class ShareSpec:
    """``-device virtio-9p-pci,fsdev=ID,mount_tag=TAG``: an export the guest can mount."""

    mount_tag: str
    fsdev: FsdevSpec


def check_fsdev_option(opts: dict[str, str]) -> None:
    """The option loop's checks of one ``-fsdev``: known keys, boolean and number values."""
    for key, value in opts.items():
        if key not in _FSDEV_KEYS and not key.startswith("throttling."):
            raise CommandLineError(f"Invalid parameter '{key}'")
        if key == "readonly":
            parse_bool(key, value)
        if key in ("sock_fd", "fmode", "dmode"):
            try:
                parse_c_integer(value)
            except ValueError:
                raise CommandLineError(f"Parameter '{key}' expects a number") from None


def create_fsdev(opts: dict[str, str]) -> FsdevSpec:
    """Create the fsdev backend as QEMU does after its option loop (no file access yet)."""
    fsdev_id = opts.get("id")
    if fsdev_id is None:
        raise CommandLineError("fsdev: No id specified")
    driver = opts.get("fsdriver")
    if driver is None:
        raise CommandLineError("fsdev: No fsdriver specified")
    if driver in ("proxy", "synth"):
        raise CommandLineError(f"fakeqemu does not emulate the '{driver}' fsdriver")
    if driver != "local":
        raise CommandLineError(f"fsdev: fsdriver {driver} not found")
    for key in opts:
        if key not in _LOCAL_KEYS and not key.startswith("throttling."):
            raise CommandLineError(f"'{key}' is invalid for fsdriver 'local'")
    model = opts.get("security_model")
    if model is None:
        raise CommandLineError(f"security_model property not set\n{SECURITY_MODEL_HINT}")
    if model not in _SECURITY_MODELS:
        raise CommandLineError(f"invalid security_model property '{model}'\n{SECURITY_MODEL_HINT}")
    multidevs = opts.get("multidevs")
    if multidevs is not None and multidevs not in _MULTIDEVS:
        raise CommandLineError(
            f"invalid multidevs property '{multidevs}'\n"
            "Valid options are: multidevs=[remap|forbid|warn]"
        )
    path = opts.get("path")
    if path is None:
        raise CommandLineError("path property not set")
    if any(key.startswith("throttling.") for key in opts):
        raise CommandLineError("fakeqemu does not emulate 9p throttling")
    if model != "mapped-file":
        for key in ("fmode", "dmode"):
            if key in opts:
                raise CommandLineError(f"{key} is only valid for mapped security modes")
    readonly = parse_bool("readonly", opts["readonly"]) if "readonly" in opts else False
    return FsdevSpec(fsdev_id, path, readonly)


def realize_9p_device(opts: dict[str, str], fsdevs: dict[str, FsdevSpec], cwd: str) -> ShareSpec:
    """Realize ``virtio-9p-pci`` as QEMU does: find the fsdev, check the tag, open the export."""
    fsdev_id = opts.get("fsdev")
    fsdev = fsdevs.get(fsdev_id) if fsdev_id is not None else None
    if fsdev is None:
        raise CommandLineError(
            f"9pfs device couldn't find fsdev with the id = {fsdev_id or 'NULL'}"
        )
    tag = opts.get("mount_tag")
    if tag is None:
        raise CommandLineError(f"fsdev with id {fsdev.id} needs mount_tag arguments")
    size = len(tag.encode())
    if size > MAX_MOUNT_TAG_BYTES:
        raise CommandLineError(
            f"mount tag '{tag}' ({size} bytes) is longer than maximum "
            f"({MAX_MOUNT_TAG_BYTES} bytes)"
        )
    try:
        fd = os.open(os.path.join(cwd, fsdev.path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise CommandLineError(
            f"cannot initialize fsdev '{fsdev.id}': failed to open '{fsdev.path}': {e.strerror}"
        ) from None
    os.close(fd)
    if "/" in tag or tag in (".", ".."):
        raise CommandLineError(
            f"fakeqemu shows a 9p export as a file named after its mount tag; "
            f"'{tag}' cannot be one"
        )
    return ShareSpec(tag, fsdev)
