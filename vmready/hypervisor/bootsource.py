"""What an instance boots: a disk image (through its own qcow2 overlay) and/or a Linux kernel.

The source is four config keys, set at launch and kept with the instance:
``boot.image`` (a qcow2 or raw disk image), ``boot.kernel`` (a bzImage),
``boot.initrd`` and ``boot.append`` (need a kernel).  Paths are absolute: the
daemon does not share the CLI's working directory.

The image is never written.  Each instance boots its own qcow2 overlay backed
by it, made with ``qemu-img create`` in the daemon's data dir, checked with
``qemu-img info`` and removed when the instance is deleted; a rebuild makes a
fresh one.  Everything that can be known about the files is checked before an
instance exists, so a launch from a missing, unreadable or non-image file, a
backing chain that cannot be followed, or a kernel that is not a kernel fails
with one clear message and leaves nothing behind.

The files are checked by their first bytes (``bootfiles``); ``qemu-img`` runs
through the reactor (``imagetool``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from vmready.domain import APPEND_KEY, IMAGE_KEY, INITRD_KEY, KERNEL_KEY, BadRequest

BOOT_KEYS = (IMAGE_KEY, KERNEL_KEY, INITRD_KEY, APPEND_KEY)
# x86's COMMAND_LINE_SIZE is 2048 bytes, the terminating NUL included.
MAX_APPEND_BYTES = 2047


@attrs.frozen
class BootSource:
    """An instance's boot source as its config keys hold it (every part optional)."""

    image: str | None = None
    kernel: str | None = None
    initrd: str | None = None
    append: str | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, str]) -> BootSource:
        """The boot source recorded in an instance's config."""
        return cls(
            image=config.get(IMAGE_KEY) or None,
            kernel=config.get(KERNEL_KEY) or None,
            initrd=config.get(INITRD_KEY) or None,
            append=config.get(APPEND_KEY) or None,
        )

    @property
    def empty(self) -> bool:
        """Nothing to boot: the VM runs its firmware and finds no disk."""
        return self.image is None and self.kernel is None

    def config(self) -> dict[str, str]:
        """The config keys that record this source."""
        values = {
            IMAGE_KEY: self.image,
            KERNEL_KEY: self.kernel,
            INITRD_KEY: self.initrd,
            APPEND_KEY: self.append,
        }
        return {key: value for key, value in values.items() if value is not None}

    def describe(self) -> str:
        """One line for people: ``image /x.qcow2, kernel /vmlinuz`` or ``nothing``."""
        parts = []
        if self.image is not None:
            parts.append(f"image {self.image}")
        if self.kernel is not None:
            parts.append(f"kernel {self.kernel}")
        if self.initrd is not None:
            parts.append(f"initrd {self.initrd}")
        if self.append is not None:
            parts.append(f"append {self.append!r}")
        return ", ".join(parts) if parts else "nothing (no image, no kernel)"

    def check_shape(self) -> None:
        """What can be said without opening a file: absolute paths, an initrd needs a kernel."""
        for key, value in (
            (IMAGE_KEY, self.image),
            (KERNEL_KEY, self.kernel),
            (INITRD_KEY, self.initrd),
        ):
            if value is None:
                continue
            if "\0" in value or not os.path.isabs(value):
                raise BadRequest(f"Invalid {key} {value!r}: expected an absolute path")
        if self.kernel is None:
            for key, value in ((INITRD_KEY, self.initrd), (APPEND_KEY, self.append)):
                if value is not None:
                    raise BadRequest(f"Invalid {key}: it needs {KERNEL_KEY} (a kernel to boot)")
        if self.append is not None:
            if "\0" in self.append or "\n" in self.append:
                raise BadRequest(f"Invalid {APPEND_KEY}: a kernel command line is one line")
            size = len(self.append.encode("utf-8"))
            if size > MAX_APPEND_BYTES:
                raise BadRequest(
                    f"Invalid {APPEND_KEY}: {size} bytes; a kernel command line holds at "
                    f"most {MAX_APPEND_BYTES}"
                )
