"""A stock-like cloud image for tests: Debian's cloud kernel, cloud-init, systemd; no vmready.

``ensure_stock_guest(cache_dir)`` returns the disks and kernel of a Debian
bookworm built from Debian's packages alone, as a cloud image is: ``minbase``
with ``linux-image-cloud-amd64`` (no 9p), ``cloud-init`` in Debian's default
configuration, ``systemd`` and ``udev`` (and ``dbus``, so an ACPI power-off
reaches logind), its root file system on the whole disk so it boots directly
with the image's own kernel and the initramfs ``initramfs-tools`` made for it.
Three disks come from that one tree:

- ``stock.qcow2``: the tree as the packages installed it; only its fstab (the
  root file system on ``/dev/vda``) is written.  Nothing of vmready.
- ``loader.qcow2``: the same with the vmready loader baked in by its own
  ``install.sh --root``, as LXD images carry ``lxd-agent-loader``, and
  cloud-init told to use the LXD datasource alone
  (``datasource_list: [ LXD, None ]``): its data comes from ``/dev/lxd/sock``.
- ``manual.qcow2``: the same as ``stock`` but with cloud-init disabled and a
  first-boot unit that runs exactly the documented loader install
  (``mount -t 9p … config /mnt && /mnt/install.sh && umount /mnt``) and says on
  the console how it ended.  It needs a kernel with 9p: boot it with the demo
  guest's kernel and initramfs.

A build lives in ``<cache_dir>/<key>/``, where the key hashes the packages'
versions and the files put in; it is built beside the cache and renamed into
place under the cache's lock, as the demo guest is (``cache.cached_build``).
The default cache is ``stock`` beside the demo guest's.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping

import attrs

from vmready.guestfiles import executable, loader_files
from vmready.hypervisor.guestimage.cache import (
    cached_build,
    default_cache_dir,
    has_files,
    newest_build,
    remove_tree,
)
from vmready.hypervisor.guestimage.commands import (
    CommandRunner,
    GuestImageError,
    run_command,
    run_step,
)
from vmready.hypervisor.guestimage.content import SUITE
from vmready.hypervisor.guestimage.fetch import Package
from vmready.hypervisor.guestimage.inputs import (
    apt_show_metapackage,
    kernel_package_of,
    parse_apt_show,
)
from vmready.hypervisor.guestimage.rootfs import host_apt_sources

# Bump when the builder makes different disks from the same inputs.
BUILDER_VERSION = 1
KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
PACKAGES = ("cloud-init", "systemd-sysv", "udev", "dbus")
DISK_SIZE = "3G"
# As a cloud image's command line, with the root file system on the whole disk.
STOCK_APPEND = "root=/dev/vda ro console=ttyS0"
KERNEL_FILE = "vmlinuz"
INITRD_FILE = "initrd.img"
STOCK_IMAGE = "stock.qcow2"
LOADER_IMAGE = "loader.qcow2"
MANUAL_IMAGE = "manual.qcow2"
MANIFEST_FILE = "stock.json"
_ARTIFACTS = (KERNEL_FILE, INITRD_FILE, STOCK_IMAGE, LOADER_IMAGE, MANUAL_IMAGE, MANIFEST_FILE)

FSTAB = (
    "# The root file system on the whole first disk.\n/dev/vda / ext4 rw,errors=remount-ro 0 1\n"
)
LXD_DATASOURCE = "datasource_list: [ LXD, None ]\n"
# The commands docs/real-guests.md gives an operator, word for word.
DOCUMENTED_INSTALL = (
    "mount -t 9p -o trans=virtio,version=9p2000.L,ro config /mnt && /mnt/install.sh && umount /mnt"
)
MANUAL_UNIT_NAME = "vmready-documented-install.service"
MANUAL_SCRIPT = f"""#!/bin/sh
# The vmready loader installed at first boot exactly as its docs tell an operator to.
{DOCUMENTED_INSTALL}
status=$?
echo "DOCUMENTED-INSTALL: exit $status"
if grep -q " /mnt " /proc/mounts; then
    echo "DOCUMENTED-INSTALL: /mnt is still mounted"
else
    echo "DOCUMENTED-INSTALL: nothing left mounted"
fi
"""
MANUAL_UNIT = """[Unit]
Description=vmready test image: the loader installed as the docs say, once
After=multi-user.target
ConditionPathExists=!/usr/local/bin/vmready-agent

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/vmready-documented-install
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""


@attrs.frozen
class StockGuest:
    """A built stock-like image: its kernel and initramfs, and its three disks."""

    kernel: str
    initrd: str
    stock: str
    loader: str
    manual: str
    append: str = STOCK_APPEND


@attrs.frozen
class StockInputs:
    """What a build depends on; its hash is the cache key."""

    kernel: Package
    packages: tuple[Package, ...]
    files: Mapping[str, bytes]

    def description(self) -> dict[str, object]:
        return {
            "builder": BUILDER_VERSION,
            "suite": SUITE,
            "kernel": [self.kernel.name, self.kernel.version],
            "packages": [[p.name, p.version] for p in self.packages],
            "disk_size": DISK_SIZE,
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in self.files.items()},
        }

    @property
    def key(self) -> str:
        encoded = json.dumps(self.description(), sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]


def stock_cache_dir() -> str:
    """``stock`` beside the demo guest's cache."""
    return os.path.join(os.path.dirname(default_cache_dir()), "stock")


def stock_files() -> dict[str, bytes]:
    """The files the builder puts into the disks, by a name."""
    files = {f"loader/{name}": data for name, data in sorted(loader_files().items())}
    files["fstab"] = FSTAB.encode()
    files["lxd-datasource"] = LXD_DATASOURCE.encode()
    files["manual/script"] = MANUAL_SCRIPT.encode()
    files["manual/unit"] = MANUAL_UNIT.encode()
    return files


def resolve_stock_inputs(run: CommandRunner = run_command) -> StockInputs:
    """Ask apt which versions a build would use now."""
    step = "resolving the stock image's packages"
    shown = apt_show_metapackage(run, step, KERNEL_METAPACKAGE)
    kernel = kernel_package_of(shown[KERNEL_METAPACKAGE].get("Depends", ""), KERNEL_METAPACKAGE)
    names = [kernel, *PACKAGES]
    shown = parse_apt_show(
        run_step(run, step, ["apt-cache", "show", "--no-all-versions", *names]).decode()
    )
    missing = [name for name in names if name not in shown]
    if missing:
        raise GuestImageError(f"{step} failed: apt knows no {', '.join(missing)}")
    packages = tuple(Package(name, shown[name]["Version"]) for name in names)
    return StockInputs(packages[0], packages[1:], stock_files())


def _write(root: str, path: str, data: bytes, mode: int = 0o644) -> None:
    target = os.path.join(root, path.lstrip("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.lexists(target):
        os.unlink(target)
    with open(target, "wb") as f:
        f.write(data)
    os.chmod(target, mode)


def _link(root: str, path: str, target: str) -> None:
    where = os.path.join(root, path.lstrip("/"))
    os.makedirs(os.path.dirname(where), exist_ok=True)
    if os.path.lexists(where):
        os.unlink(where)
    os.symlink(target, where)


def _disk(root: str, image: str, workdir: str, run: CommandRunner) -> None:
    """``root`` as an ext4 file system filling a qcow2 disk."""
    raw = os.path.join(workdir, "disk.raw")
    mkfs = ["mkfs.ext4", "-q", "-F", "-L", "cloudimg-rootfs", "-m", "0", "-d", root]
    run_step(run, f"making {os.path.basename(image)} (mkfs.ext4)", [*mkfs, raw, DISK_SIZE])
    convert = ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, image]
    run_step(run, f"converting {os.path.basename(image)} to qcow2", convert)
    os.unlink(raw)


def _take_boot_files(root: str, workdir: str) -> None:
    """The image's own kernel and the initramfs initramfs-tools made for it."""
    for pattern, name in (("vmlinuz-*-cloud-amd64", KERNEL_FILE), ("initrd.img-*", INITRD_FILE)):
        found = sorted(glob.glob(os.path.join(root, "boot", pattern)))
        if len(found) != 1:
            raise GuestImageError(
                f"taking the stock image's {name} failed: expected one /boot/{pattern}, "
                f"found {len(found)}"
            )
        shutil.copyfile(found[0], os.path.join(workdir, name))


def _manual_disk(root: str, workdir: str, run: CommandRunner) -> None:
    """The documented install at first boot, cloud-init out of its way; then back to stock."""
    manual = {
        "/etc/cloud/cloud-init.disabled": (b"", 0o644),
        "/usr/local/sbin/vmready-documented-install": (MANUAL_SCRIPT.encode(), 0o755),
        f"/etc/systemd/system/{MANUAL_UNIT_NAME}": (MANUAL_UNIT.encode(), 0o644),
    }
    for path, (data, mode) in manual.items():
        _write(root, path, data, mode)
    wants = f"/etc/systemd/system/multi-user.target.wants/{MANUAL_UNIT_NAME}"
    _link(root, wants, f"/etc/systemd/system/{MANUAL_UNIT_NAME}")
    _disk(root, os.path.join(workdir, MANUAL_IMAGE), workdir, run)
    for path in [*manual, wants]:
        os.unlink(os.path.join(root, path.lstrip("/")))


def build_stock(
    inputs: StockInputs, workdir: str, run: CommandRunner, log: Callable[[str], None]
) -> None:
    """Bootstrap the tree once, then write its three disks into the empty ``workdir``."""
    if os.geteuid() != 0:
        raise GuestImageError(
            "building the stock image failed: it needs root (mmdebstrap and mkfs.ext4 -d make "
            "a root-owned tree)"
        )
    root = os.path.join(workdir, "root")
    names = [KERNEL_METAPACKAGE, *PACKAGES]
    log(f"guest image: bootstrapping Debian {SUITE} with {', '.join(names)}")
    run_step(
        run,
        "bootstrapping the stock image (mmdebstrap)",
        [
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            "--include=" + ",".join(names),
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            SUITE,
            root,
            *host_apt_sources(),
        ],
    )
    _take_boot_files(root, workdir)
    _write(root, "/etc/fstab", FSTAB.encode())
    # mmdebstrap copied the build host's; the guest has no DNS server to ask.
    if os.path.lexists(os.path.join(root, "etc/resolv.conf")):
        os.unlink(os.path.join(root, "etc/resolv.conf"))
    _disk(root, os.path.join(workdir, STOCK_IMAGE), workdir, run)

    _manual_disk(root, workdir, run)
    loader_dir = os.path.join(workdir, "loader")
    for name, data in loader_files().items():
        _write(loader_dir, name, data, 0o755 if executable(name) else 0o644)
    run_step(
        run,
        "installing the vmready loader",
        ["sh", os.path.join(loader_dir, "install.sh"), "--root", root],
    )
    _write(root, "/etc/cloud/cloud.cfg.d/90-vmready-lxd.cfg", LXD_DATASOURCE.encode())
    _disk(root, os.path.join(workdir, LOADER_IMAGE), workdir, run)

    remove_tree(root, run, log)
    shutil.rmtree(loader_dir)
    manifest = json.dumps(dict(inputs.description(), key=inputs.key), indent=2, sort_keys=True)
    _write(workdir, MANIFEST_FILE, manifest.encode() + b"\n")


def _complete(directory: str) -> bool:
    return has_files(directory, _ARTIFACTS)


def stock_guest(directory: str) -> StockGuest:
    """The artifacts of the build in ``directory``."""
    return StockGuest(
        kernel=os.path.join(directory, KERNEL_FILE),
        initrd=os.path.join(directory, INITRD_FILE),
        stock=os.path.join(directory, STOCK_IMAGE),
        loader=os.path.join(directory, LOADER_IMAGE),
        manual=os.path.join(directory, MANUAL_IMAGE),
    )


def ensure_stock_guest(
    cache_dir: str,
    log: Callable[[str], None] = print,
    run: CommandRunner = run_command,
    builder: Callable[
        [StockInputs, str, CommandRunner, Callable[[str], None]], None
    ] = build_stock,
) -> StockGuest:
    """The stock-like image for the current inputs, from ``cache_dir`` or built into it first."""
    os.makedirs(cache_dir, exist_ok=True)
    try:
        inputs = resolve_stock_inputs(run)
    except GuestImageError as e:
        cached = newest_build(cache_dir, _complete)
        if cached is None:
            raise
        log(f"guest image: warning: {e}; using the newest cached stock image, {cached}")
        return stock_guest(cached)
    final = cached_build(
        cache_dir,
        inputs.key,
        _complete,
        lambda workdir: builder(inputs, workdir, run, log),
        run,
        log,
    )
    return stock_guest(final)
