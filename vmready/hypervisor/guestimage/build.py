"""Building the demo guest step by step, and ``ensure_guest``: the cached build for the inputs."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Callable, Iterator

from vmready.guestfiles import executable, loader_files
from vmready.hypervisor.guestimage.cache import (
    GuestImage,
    cached_build,
    guest_image,
    is_complete,
    newest_build,
    remove_tree,
)
from vmready.hypervisor.guestimage.commands import (
    CommandRunner,
    GuestImageError,
    run_command,
    run_step,
)
from vmready.hypervisor.guestimage.content import (
    DISK_SIZE,
    IMAGE_FILE,
    INITRD_FILE,
    KERNEL_CONFIG_FILE,
    KERNEL_FILE,
    MANIFEST_FILE,
    PVH_KERNEL_FILE,
    ROOT_PACKAGES,
    SUITE,
)
from vmready.hypervisor.guestimage.fetch import fetch_packages
from vmready.hypervisor.guestimage.initramfs import initramfs_entries, newc_archive
from vmready.hypervisor.guestimage.inputs import GuestInputs, resolve_inputs
from vmready.hypervisor.guestimage.kernel import GuestKernel, KernelProvider, ensure_kernel
from vmready.hypervisor.guestimage.rootfs import customize_root, host_apt_sources


@contextlib.contextmanager
def _phase(log: Callable[[str], None], what: str) -> Iterator[None]:
    """Log a build phase and how long it took."""
    log(f"guest image: {what}")
    started = time.monotonic()
    yield
    log(f"guest image: {what}: done in {time.monotonic() - started:.1f}s")


def _read(path: str, step: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise GuestImageError(f"{step} failed: cannot read {path}: {e.strerror}") from e


def _write(path: str, data: bytes, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def take_kernel(kernel: GuestKernel, workdir: str) -> None:
    """Copy the built kernel into the guest: its bzImage, the same as a PVH ELF, its .config."""
    shutil.copyfile(kernel.bzimage, os.path.join(workdir, KERNEL_FILE))
    shutil.copyfile(kernel.vmlinux, os.path.join(workdir, PVH_KERNEL_FILE))
    shutil.copyfile(kernel.config, os.path.join(workdir, KERNEL_CONFIG_FILE))


def make_initramfs(busybox_root: str, workdir: str) -> None:
    """Write the initramfs: busybox and ``/init`` (the kernel has every driver built in)."""
    busybox = _read(os.path.join(busybox_root, "bin", "busybox"), "making the initramfs")
    archive = newc_archive(initramfs_entries(busybox))
    # Uncompressed: the kernel copies it instead of inflating it, which under TCG
    # costs a share of a second; QEMU loads the few more megabytes at once.
    _write(os.path.join(workdir, INITRD_FILE), archive)


def make_root_disk(workdir: str, run: CommandRunner, log: Callable[[str], None]) -> None:
    """Bootstrap Debian, make it the demo guest, and write it as an ext4 qcow2 disk."""
    root = os.path.join(workdir, "root")
    loader_dir = os.path.join(workdir, "loader")
    for name, data in loader_files().items():
        _write(os.path.join(loader_dir, name), data, 0o755 if executable(name) else 0o644)
    with _phase(log, f"bootstrapping Debian {SUITE} with {', '.join(ROOT_PACKAGES)}"):
        run_step(
            run,
            "bootstrapping the root filesystem (mmdebstrap)",
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                "--include=" + ",".join(ROOT_PACKAGES),
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/info/*",
                SUITE,
                root,
                *host_apt_sources(),
            ],
        )
        customize_root(root, run, loader_dir)
    raw = os.path.join(workdir, "disk.raw")
    image = os.path.join(workdir, IMAGE_FILE)
    with _phase(log, f"making the {DISK_SIZE} ext4 root disk"):
        mkfs = ["mkfs.ext4", "-q", "-F", "-L", "vmready-root", "-m", "0", "-d", root]
        run_step(run, "making the root filesystem (mkfs.ext4)", [*mkfs, raw, DISK_SIZE])
        convert = ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, image]
        run_step(run, "converting the root disk to qcow2", convert)
    os.unlink(raw)
    remove_tree(root, run, log)
    shutil.rmtree(loader_dir)


def build(
    inputs: GuestInputs,
    workdir: str,
    run: CommandRunner,
    log: Callable[[str], None],
    kernels: KernelProvider = ensure_kernel,
) -> None:
    """Build the guest's artifacts into the empty directory ``workdir``.

    The kernel comes from ``kernels`` (its own cache, built there first if needed).
    """
    if os.geteuid() != 0:
        cache_dir = os.path.dirname(workdir)
        raise GuestImageError(
            "building the demo guest failed: it needs root (mmdebstrap and mkfs.ext4 -d make "
            "a root-owned tree); build it as root once: "
            f"sudo python3 -m vmready.hypervisor.guestimage --cache {cache_dir}"
        )
    with _phase(log, f"the kernel from {inputs.kernel.name} {inputs.kernel.version}"):
        take_kernel(kernels(inputs.kernel, run, log), workdir)
    with _phase(log, f"downloading {inputs.busybox.name} {inputs.busybox.version}"):
        unpacked = fetch_packages([inputs.busybox], workdir, run)
    with _phase(log, "making the initramfs"):
        make_initramfs(unpacked[inputs.busybox.name], workdir)
    shutil.rmtree(os.path.join(workdir, "unpacked"))
    make_root_disk(workdir, run, log)
    manifest = json.dumps(dict(inputs.description(), key=inputs.key), indent=2, sort_keys=True)
    _write(os.path.join(workdir, MANIFEST_FILE), manifest.encode() + b"\n")


def ensure_guest(
    cache_dir: str,
    log: Callable[[str], None] = print,
    run: CommandRunner = run_command,
    builder: Callable[[GuestInputs, str, CommandRunner, Callable[[str], None]], None] = build,
) -> GuestImage:
    """The demo guest for the current inputs, from ``cache_dir`` or built into it first."""
    os.makedirs(cache_dir, exist_ok=True)
    try:
        inputs = resolve_inputs(run)
    except GuestImageError as e:
        cached = newest_build(cache_dir)
        if cached is None:
            raise
        log(f"guest image: warning: {e}; using the newest cached build, {cached}")
        return guest_image(cached, os.path.basename(cached))
    final = cached_build(
        cache_dir,
        inputs.key,
        is_complete,
        lambda workdir: builder(inputs, workdir, run, log),
        run,
        log,
    )
    return guest_image(final, inputs.key)


def launch_command(guest: GuestImage, name: str = "demo") -> str:
    """The ``vmready launch`` command line that boots ``guest``."""
    return shlex.join(
        [
            "vmready",
            "launch",
            name,
            "--image",
            guest.image,
            "--kernel",
            guest.kernel,
            "--initrd",
            guest.initrd,
            "--append",
            guest.append,
        ]
    )
