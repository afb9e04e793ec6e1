"""Built guests on disk: where a build lives, which are complete, the build lock, leftovers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

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


def newest_build(cache_dir: str, complete: Callable[[str], bool] | None = None) -> str | None:
    """The most recently built complete guest in ``cache_dir`` (by ``complete``), if any."""
    complete = complete or is_complete
    builds = [
        os.path.join(cache_dir, name)
        for name in os.listdir(cache_dir)
        if not name.startswith(".") and complete(os.path.join(cache_dir, name))
    ]
    return max(builds, key=lambda path: os.stat(path).st_mtime, default=None)


def is_complete(directory: str) -> bool:
    """Whether ``directory`` holds a whole demo guest."""
    return has_files(
        directory, (KERNEL_FILE, PVH_KERNEL_FILE, INITRD_FILE, IMAGE_FILE, MANIFEST_FILE)
    )


def has_files(directory: str, names: Iterable[str]) -> bool:
    """Whether every one of ``names`` is a file in ``directory``."""
    return all(os.path.isfile(os.path.join(directory, name)) for name in names)


def cached_build(
    cache_dir: str,
    key: str,
    complete: Callable[[str], bool],
    build: Callable[[str], None],
    run: CommandRunner,
    log: Callable[[str], None],
) -> str:
    """``cache_dir/key``, built first by ``build(workdir)`` unless ``complete`` already.

    The build runs in a temporary directory beside it, under the cache's lock,
    and is renamed into place whole: a failed, interrupted or concurrent build
    never leaves anything that looks cached.
    """
    final = os.path.join(cache_dir, key)
    if complete(final):
        return final
    with build_lock(cache_dir, log):
        if complete(final):
            return final
        remove_stale_builds(cache_dir, run, log)
        if os.path.exists(final):
            log(f"guest image: {final} is incomplete; building it again")
            remove_tree(final, run, log)
        workdir = tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{key}-", dir=cache_dir)
        started = time.monotonic()
        log(f"guest image: building {key} in {workdir}")
        try:
            build(workdir)
            # mkdtemp made it private; QEMU may run as another user than the build.
            os.chmod(workdir, 0o755)
            os.rename(workdir, final)
        except BaseException:
            with contextlib.suppress(GuestImageError, OSError):
                remove_tree(workdir, run, log)
            raise
        log(f"guest image: built {final} in {time.monotonic() - started:.0f}s")
    return final


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
