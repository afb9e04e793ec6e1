"""Built guests on disk: where a build lives, which are complete, the build lock, leftovers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator

import attrs

from vmready.hypervisor.guestimage.commands import CommandRunner, GuestImageError, run_step
from vmready.hypervisor.guestimage.content import (
    BUILD_PREFIX,
    IMAGE_FILE,
    INITRD_FILE,
    KERNEL_APPEND,
    KERNEL_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    PVH_KERNEL_FILE,
)

__all__ = [
    "CACHE_VARIABLE",
    "GuestImage",
    "build_lock",
    "default_cache_dir",
    "guest_image",
    "is_complete",
    "mounts_under",
    "newest_build",
    "remove_stale_builds",
    "remove_tree",
]


CACHE_VARIABLE = "VMREADY_GUEST_CACHE"


@attrs.frozen
class GuestImage:
    """A built demo guest: what ``vmready launch --image/--kernel/--initrd/--append`` takes."""

    kernel: str
    initrd: str
    image: str
    append: str
    key: str
    # The same kernel uncompressed, an ELF with a PVH entry point: QEMU boots it
    # without the bzImage's XZ decompression, seconds sooner under TCG.
    vmlinux: str = ""


def default_cache_dir() -> str:
    """``$VMREADY_GUEST_CACHE``, else ``~/.cache/vmready/guest``."""
    return os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.path.expanduser("~"), ".cache", "vmready", "guest"
    )


def guest_image(directory: str, key: str) -> GuestImage:
    """The artifacts of the build in ``directory``."""
    return GuestImage(
        kernel=os.path.join(directory, KERNEL_FILE),
        initrd=os.path.join(directory, INITRD_FILE),
        image=os.path.join(directory, IMAGE_FILE),
        append=KERNEL_APPEND,
        key=key,
        vmlinux=os.path.join(directory, PVH_KERNEL_FILE),
    )


def newest_build(cache_dir: str) -> str | None:
    """The most recently built complete guest in ``cache_dir``, if any."""
    builds = [
        os.path.join(cache_dir, name)
        for name in os.listdir(cache_dir)
        if not name.startswith(".") and is_complete(os.path.join(cache_dir, name))
    ]
    return max(builds, key=lambda path: os.stat(path).st_mtime, default=None)


def is_complete(directory: str) -> bool:
    return all(
        os.path.isfile(os.path.join(directory, name))
        for name in (KERNEL_FILE, PVH_KERNEL_FILE, INITRD_FILE, IMAGE_FILE, MANIFEST_FILE)
    )


@contextlib.contextmanager
def build_lock(cache_dir: str, log: Callable[[str], None]) -> Iterator[None]:
    """Hold ``cache_dir``'s build lock: one build at a time, across processes."""
    with open(os.path.join(cache_dir, LOCK_FILE), "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"guest image: waiting for another build in {cache_dir}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def mounts_under(path: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The mount points at or below ``path``, deepest first."""
    top = os.path.realpath(path)
    points = []
    with open(mountinfo, encoding="utf-8") as f:
        for line in f:
            # The mount point is the fifth field, with spaces and the like as \ooo.
            field = line.split()[4]
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
            if point == top or point.startswith(top + "/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def remove_tree(
    path: str,
    run: CommandRunner,
    log: Callable[[str], None],
    mountinfo: str = "/proc/self/mountinfo",
) -> None:
    """Remove a build's directory, unmounting first what a killed mmdebstrap left mounted in it.

    Never removes across a mount: the tree may hold the host's /dev nodes, /proc
    and /sys (cgroups among them) bind-mounted into the chroot.
    """
    for point in mounts_under(path, mountinfo):
        log(f"guest image: unmounting {point}, left mounted by an interrupted build")
        run_step(run, f"unmounting {point}", ["umount", "--lazy", point])
    left = mounts_under(path, mountinfo)
    if left:
        raise GuestImageError(
            f"removing {path} failed: {left[0]} is still mounted; unmount it "
            f"(umount --recursive {path}) and remove {path}"
        )
    if os.path.lexists(path):
        shutil.rmtree(path)


def remove_stale_builds(
    cache_dir: str,
    run: CommandRunner,
    log: Callable[[str], None],
    mountinfo: str = "/proc/self/mountinfo",
) -> None:
    """Remove what killed builds left (call with the lock held: no build is running)."""
    for name in sorted(os.listdir(cache_dir)):
        if name.startswith(BUILD_PREFIX):
            log(f"guest image: removing {name}, left by an interrupted build")
            remove_tree(os.path.join(cache_dir, name), run, log, mountinfo)
