"""The NoCloud seed: the read-only ``cidata`` volume a stock cloud image's cloud-init reads.

Every VM that boots a disk image gets, beside its config drive, a small ISO 9660
volume labelled ``cidata`` on a read-only virtio-blk disk, written before
every boot (``<run dir>/nocloud-seed.iso``).  cloud-init's NoCloud datasource
finds it by its label on any kernel (Debian's cloud kernel has ISO 9660 and
virtio-blk but no 9p) and reads::

    meta-data        instance-id (the instance's uuid), local-hostname, user.meta-data
    user-data        cloud-init.user-data (else user.user-data; empty when unset)
    vendor-data      vmready's boothook, and the instance's own vendor-data after it
    network-config   cloud-init.network-config (else user.network-config), when set
    vmready/         the config drive: the agent, its certificates and settings, the loader

The vendor-data's boothook (``vmready.guestfiles.boothook``) runs the loader's
``install.sh`` from ``vmready/`` at every boot, so an image with cloud-init and
nothing of vmready runs the agent with nothing done in it by hand.  cloud-init
merges vendor-data under the user's data: a user-data's cloud-config wins
over the instance's vendor cloud-config where they set the same keys, and
``vendor_data: {enabled: false}`` in it turns vendor-data (and the agent) off.
The boothook sets no keys, so nothing the user sets displaces it by accident.

The volume is written in-process with pycdlib (ISO 9660 with Rock Ridge and
Joliet names, as ``genisoimage -volid cidata -joliet -rock`` makes it): no
program to run on the daemon's reactor thread, a few milliseconds per boot,
and readable back by any ISO reader.  It is built whole in memory, then
written to a file beside the target and renamed into place, so QEMU never
opens half a seed.  Its data is bounded (``vmready.hypervisor.guestdata``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from email.parser import Parser

import attrs
import pycdlib

from vmready.guestfiles import boothook
from vmready.hypervisor.guestdata import GuestData

SEED_FILE = "nocloud-seed.iso"
SEED_LABEL = "cidata"
# Where the seed carries the config drive.
SEED_DIRECTORY = "vmready"
_BOUNDARY = "==vmready-vendor-data=="
_PARTIAL_SUFFIX = ".tmp"
_FILE = 0o100000
_DIRECTORY = 0o040000


def seed_path(config_drive: str) -> str:
    """Where the seed of the VM whose config drive is ``config_drive`` lives: beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(config_drive)), SEED_FILE)


def vendor_data(own: str = "") -> str:
    """The seed's vendor-data: vmready's boothook, then the instance's own vendor-data, if any.

    Alone, the boothook is the whole vendor-data; with the instance's own, a
    MIME multipart of both (a multipart of the instance's own is nested whole),
    which cloud-init takes apart.
    """
    hook = boothook().decode("utf-8")
    if not own:
        return hook
    message = MIMEMultipart(boundary=_BOUNDARY)
    message.attach(MIMEText(hook, "cloud-boothook", "utf-8"))
    if own.lstrip().lower().startswith(("content-type:", "mime-version:")):
        message.attach(Parser().parsestr(own))
    else:
        # text/plain: cloud-init tells the part's kind by its first line, as for user-data.
        message.attach(MIMEText(own, "plain", "utf-8"))
    return message.as_string()


@attrs.frozen
class SeedFile:
    """One file on the seed: its path there, its bytes and its mode."""

    path: str
    data: bytes
    mode: int = 0o644


def _drive_files(config_drive: str) -> list[SeedFile]:
    """Every regular file of the config drive, under ``vmready/``, with its mode."""
    found = []
    for directory, subdirectories, names in os.walk(config_drive):
        subdirectories.sort()
        for name in sorted(names):
            if name.endswith(_PARTIAL_SUFFIX):
                continue
            path = os.path.join(directory, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            relative = os.path.relpath(path, config_drive).replace(os.sep, "/")
            mode = os.stat(path).st_mode & 0o777
            found.append(SeedFile(f"{SEED_DIRECTORY}/{relative}", data, mode))
    return found


def seed_files(guest: GuestData, config_drive: str) -> list[SeedFile]:
    """What the seed of ``guest`` holds: the NoCloud files, then the config drive."""
    files = [
        SeedFile("meta-data", guest.meta_data.encode()),
        SeedFile("user-data", guest.user_data.encode(), 0o600),
        SeedFile("vendor-data", vendor_data(guest.vendor_data).encode(), 0o600),
    ]
    if guest.network_config:
        files.append(SeedFile("network-config", guest.network_config.encode()))
    return files + _drive_files(config_drive)


def _iso_name(name: str, taken: set[str], directory: bool) -> str:
    """An ISO 9660 (level 3) identifier for ``name``, unique among ``taken``: d-characters only.

    Readers use the Rock Ridge and Joliet names; this one only has to be valid.
    """
    stem, extension = (name, "") if directory or "." not in name else name.rsplit(".", 1)
    stem = re.sub(r"[^A-Z0-9_]", "_", stem.upper())[:24] or "_"
    extension = re.sub(r"[^A-Z0-9_]", "_", extension.upper())[:3]
    number = 0
    while True:
        candidate = stem if number == 0 else f"{stem[:20]}_{number}"
        identifier = candidate if directory else f"{candidate}.{extension}"
        if identifier not in taken:
            taken.add(identifier)
            return identifier
        number += 1


def seed_image(files: list[SeedFile]) -> bytes:
    """The ISO 9660 volume (label ``cidata``, Rock Ridge and Joliet) holding ``files``."""
    iso = pycdlib.PyCdlib()
    iso.new(
        interchange_level=3,
        vol_ident=SEED_LABEL,
        app_ident_str="VMREADY NOCLOUD SEED",
        joliet=3,
        rock_ridge="1.09",
    )
    iso_paths: dict[str, str] = {"": ""}
    taken: dict[str, set[str]] = {"": set()}
    try:
        for seed_file in files:
            parts = seed_file.path.split("/")
            parent = ""
            for index, part in enumerate(parts):
                here = "/".join(parts[: index + 1])
                last = index == len(parts) - 1
                if not last and here in iso_paths:
                    parent = here
                    continue
                name = _iso_name(part, taken.setdefault(parent, set()), not last)
                iso_path = f"{iso_paths[parent]}/{name}"
                if last:
                    iso.add_fp(
                        io.BytesIO(seed_file.data),
                        len(seed_file.data),
                        iso_path=iso_path + ";1",
                        rr_name=part,
                        joliet_path="/" + here,
                        file_mode=_FILE | seed_file.mode,
                    )
                else:
                    iso.add_directory(
                        iso_path=iso_path,
                        rr_name=part,
                        joliet_path="/" + here,
                        file_mode=_DIRECTORY | 0o755,
                    )
                    iso_paths[here] = iso_path
                    parent = here
        image = io.BytesIO()
        iso.write_fp(image)
    finally:
        iso.close()
    return image.getvalue()


def write_seed(path: str, guest: GuestData, config_drive: str) -> None:
    """Write ``guest``'s seed to ``path`` (0600), whole, from its data and its config drive.

    The data is the caller's to bound (``GuestData.problem``).
    """
    image = seed_image(seed_files(guest, config_drive))
    partial = path + _PARTIAL_SUFFIX
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(image)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
