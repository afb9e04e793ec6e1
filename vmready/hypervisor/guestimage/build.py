"""Building the demo guest step by step, and ``ensure_guest``: the cached build for the inputs."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Callable, Iterator, Sequence

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
    INITRAMFS_MODULES,
    INITRD_FILE,
    KERNEL_FILE,
    MANIFEST_FILE,
    PVH_KERNEL_FILE,
    ROOT_PACKAGES,
    SUITE,
)
from vmready.hypervisor.guestimage.initramfs import (
    initramfs_entries,
    is_bzimage,
    kernel_modules,
    load_order,
    module_dependencies,
    newc_archive,
    read_module,
    uncompressed_kernel,
)
from vmready.hypervisor.guestimage.inputs import GuestInputs, Package, resolve_inputs
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


def fetch_packages(
    packages: Sequence[Package], workdir: str, run: CommandRunner
) -> dict[str, str]:
    """``apt-get download`` and ``dpkg -x`` each package: where each one's files are."""
    downloads = os.path.join(workdir, "downloads")
    os.makedirs(downloads)
    # apt's download sandbox user must be able to write here.
    os.chmod(downloads, 0o755)
    names = ", ".join(p.name for p in packages)
    wanted = [f"{p.name}={p.version}" for p in packages]
    run_step(run, f"downloading {names}", ["apt-get", "download", "-q", *wanted], downloads)
    unpacked = {}
    for package in packages:
        debs = [n for n in os.listdir(downloads) if n.startswith(package.name + "_")]
        if len(debs) != 1:
            raise GuestImageError(
                f"downloading {package.name} failed: expected one {package.name}_*.deb, "
                f"found {debs or 'none'}"
            )
        where = os.path.join(workdir, "unpacked", package.name)
        os.makedirs(where)
        deb = os.path.join(downloads, debs[0])
        run_step(run, f"unpacking {package.name}", ["dpkg", "-x", deb, where])
        unpacked[package.name] = where
    shutil.rmtree(downloads)
    return unpacked


def take_kernel(inputs: GuestInputs, kernel_root: str, workdir: str) -> None:
    """Copy the package's bzImage, and write it uncompressed beside it."""
    source = os.path.join(kernel_root, "boot", f"vmlinuz-{inputs.kernel_release}")
    kernel = _read(source, "taking the kernel")
    if not is_bzimage(kernel):
        raise GuestImageError(f"taking the kernel failed: {source} is not a bzImage")
    _write(os.path.join(workdir, KERNEL_FILE), kernel)
    _write(os.path.join(workdir, PVH_KERNEL_FILE), uncompressed_kernel(kernel, source))


def make_initramfs(
    inputs: GuestInputs, kernel_root: str, busybox_root: str, workdir: str
) -> list[str]:
    """Write the initramfs; the modules it loads, in order."""
    step = "making the initramfs"
    modules_dir = os.path.join(kernel_root, "lib", "modules", inputs.kernel_release)
    files, builtin = kernel_modules(modules_dir)
    if not files:
        raise GuestImageError(f"{step} failed: no kernel modules in {modules_dir}")

    def dependencies(name: str) -> list[str]:
        return module_dependencies(read_module(files[name]), os.path.basename(files[name]))

    order = load_order(INITRAMFS_MODULES, dependencies, files, builtin)
    modules = [(name, read_module(files[name])) for name in order]
    busybox = _read(os.path.join(busybox_root, "bin", "busybox"), step)
    archive = newc_archive(initramfs_entries(busybox, modules))
    # Uncompressed: the kernel copies it instead of inflating it, which under TCG
    # costs a share of a second; QEMU loads the few more megabytes at once.
    _write(os.path.join(workdir, INITRD_FILE), archive)
    return order


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
    inputs: GuestInputs, workdir: str, run: CommandRunner, log: Callable[[str], None]
) -> None:
    """Build the guest's artifacts into the empty directory ``workdir``."""
    if os.geteuid() != 0:
        cache_dir = os.path.dirname(workdir)
        raise GuestImageError(
            "building the demo guest failed: it needs root (mmdebstrap and mkfs.ext4 -d make "
            "a root-owned tree); build it as root once: "
            f"sudo python3 -m vmready.hypervisor.guestimage --cache {cache_dir}"
        )
    packages = (inputs.kernel, inputs.busybox)
    with _phase(log, "downloading " + ", ".join(f"{p.name} {p.version}" for p in packages)):
        unpacked = fetch_packages(packages, workdir, run)
    kernel_root = unpacked[inputs.kernel.name]
    take_kernel(inputs, kernel_root, workdir)
    with _phase(log, "making the initramfs"):
        order = make_initramfs(inputs, kernel_root, unpacked[inputs.busybox.name], workdir)
    log(f"guest image: the initramfs loads {len(order)} modules: {' '.join(order)}")
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
