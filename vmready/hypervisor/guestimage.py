"""The demo guest: a small Debian VM with the vmready loader, built from Debian packages, cached.

``ensure_guest(cache_dir)`` returns a kernel, an initramfs, a qcow2 root disk and
the kernel command line to boot them with, building them first when the cache
has no build for the current inputs:

- the kernel is Debian's (``linux-image-amd64``'s current ``linux-image-<ver>-amd64``,
  fetched with ``apt-get download``);
- the initramfs is ``busybox-static`` plus only the kernel modules the guest
  needs (virtio disk, console, 9p, network, vsock, pvpanic), loaded in the order
  their own ``.modinfo`` gives; it mounts ``/dev/vda`` and hands over to systemd;
- the root disk is a Debian bookworm ``minbase`` (``mmdebstrap``) with systemd,
  python3, udev and dbus, the vmready loader pre-installed by its own
  ``install.sh --root``, a stand-in for cloud-init that runs the instance's
  ``user-data`` script, and the units that only slow a VM's boot masked.

A build lives in ``<cache_dir>/<key>/``, where the key hashes every input (the
packages' versions, the files put into the image, this builder's version). It
is built in a temporary directory and renamed into place, under a lock, so a
failed, interrupted or concurrent build never leaves anything that looks cached.

This runs before or outside the daemon's reactor (a CLI, a test's setup), so it
uses blocking subprocesses. ``python -m vmready.hypervisor.guestimage`` builds from a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs

from vmready.guestfiles import executable, loader_files
from vmready.hypervisor.bootfiles import has_pvh_entry

__all__ = [
    "CACHE_VARIABLE",
    "CommandResult",
    "CommandRunner",
    "GuestImage",
    "GuestImageError",
    "default_cache_dir",
    "ensure_guest",
    "launch_command",
    "run_command",
]

# Bump when the builder makes a different image from the same inputs.
BUILDER_VERSION = 1
SUITE = "bookworm"
KERNEL_METAPACKAGE = "linux-image-amd64"
BUSYBOX_PACKAGE = "busybox-static"
ROOT_PACKAGES = ("systemd-sysv", "python3", "udev", "dbus", "iproute2", "kmod")
DISK_SIZE = "2G"
HOSTNAME = "vmready-demo"
CACHE_VARIABLE = "VMREADY_GUEST_CACHE"
# How long an interrupted command gets to clean up after SIGTERM.
STOP_GRACE = 60.0

# What the initramfs loads, in this order after each module's own dependencies.
# crc32c_generic must come before ext4, which asks the crypto API for "crc32c"
# (a soft dependency no depends= names) and otherwise fails: "Cannot load crc32c driver".
INITRAMFS_MODULES = (
    "virtio_pci",
    # Only when the VM has a virtio-rng device: it makes the kernel's RNG ready at
    # once, instead of seconds into the boot (Python's ssl waits for it).
    "virtio_rng",
    "virtio_blk",
    "crc32c_generic",
    "ext4",
    "virtio_console",
    "9pnet_virtio",
    "9p",
    "virtio_net",
    "vmw_vsock_virtio_transport",
    "pvpanic_mmio",
    # The ACPI power button and its input events: logind powers off on system_powerdown.
    "button",
    "evdev",
    # systemd mounts autofs points (binfmt_misc) and complains without it.
    "autofs4",
)

# console=ttyS0: the VM's only console (QEMU runs with -nodefaults, and ttyS0 goes
# to the console log). quiet keeps the kernel's and systemd's chatter off the slow
# emulated serial line; errors still reach it. net.ifnames=0: the NIC stays eth0
# (the agent finds it by MAC anyway). mitigations=off: the demo guest runs one
# workload, and the CPU vulnerability mitigations cost seconds of boot under TCG.
KERNEL_APPEND = "root=/dev/vda rw console=ttyS0 quiet net.ifnames=0 mitigations=off"

KERNEL_FILE = "vmlinuz"
PVH_KERNEL_FILE = "vmlinux"
INITRD_FILE = "initrd.img"
IMAGE_FILE = "disk.qcow2"
MANIFEST_FILE = "guest.json"
LOCK_FILE = ".lock"
BUILD_PREFIX = ".build-"

# Units a minimal VM does not need and that cost seconds under TCG.
MASKED_UNITS = (
    "getty@tty1.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "man-db.timer",
    "systemd-timesyncd.service",
    "systemd-hwdb-update.service",
    "ldconfig.service",
    "systemd-journal-catalog-update.service",
    "systemd-update-done.service",
    # The image's system users exist already: made when it was built.
    "systemd-sysusers.service",
    # Bookkeeping that competes with the agent for the CPU while the VM boots:
    # the journal stays in /run (journald.conf.d below), no utmp records, and
    # no random seed file (it would not make the kernel's RNG ready sooner).
    "systemd-journal-flush.service",
    "systemd-update-utmp.service",
    "systemd-update-utmp-runlevel.service",
    "systemd-random-seed.service",
    # The rootfs has no kernel modules (the initramfs loaded what the guest needs).
    "modprobe@configfs.service",
    "modprobe@dm_mod.service",
    "modprobe@drm.service",
    "modprobe@efi_pstore.service",
    "modprobe@fuse.service",
    "modprobe@loop.service",
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    # Kernel debugging and tuning filesystems nothing in the guest uses.
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-kernel-config.mount",
    "sys-fs-fuse-connections.mount",
    "dev-hugepages.mount",
    "dev-mqueue.mount",
    "systemd-pstore.service",
    # binfmt_misc is a module the rootfs does not have.
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "systemd-binfmt.service",
)

# Generators that look for disks and devices this VM never has; each costs a
# process at every boot (and again on every daemon-reload).
MASKED_GENERATORS = (
    "systemd-cryptsetup-generator",
    "systemd-gpt-auto-generator",
    "systemd-hibernate-resume-generator",
    "systemd-integritysetup-generator",
    "systemd-veritysetup-generator",
    "systemd-rc-local-generator",
    "systemd-run-generator",
    "systemd-system-update-generator",
    # Every service in the image has a systemd unit; no SysV init scripts to wrap.
    "systemd-sysv-generator",
)

INIT_SCRIPT = r"""#!/bin/sh
# /init of the vmready demo guest's initramfs (busybox): load the kernel modules
# the guest needs, mount the root disk read-write and hand over to its init.
# Any failure says why on the console and powers the VM off: never a silent hang.
export PATH=/bin

say() {
    read -r up _ </proc/uptime || up=?
    echo "vmready-initramfs: [$up] $*"
}

fail() {
    echo "vmready-initramfs: error: $*"
    echo "vmready-initramfs: powering off"
    poweroff -f
    sleep 60
}

mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sysfs /sys || fail "cannot mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "cannot mount /dev (devtmpfs)"
exec </dev/console >/dev/console 2>&1

root=/dev/vda
init=/sbin/init
for arg in $(cat /proc/cmdline); do
    case $arg in
        root=*) root=${arg#root=} ;;
        init=*) init=${arg#init=} ;;
    esac
done
case $root in
    /dev/*) ;;
    *) fail "root=$root: this initramfs mounts a device path such as /dev/vda" ;;
esac

say "loading $(wc -l </lib/modules/load-order) kernel modules"
while read -r module; do
    out=$(insmod "/lib/modules/$module.ko" 2>&1) ||
        fail "cannot load the kernel module $module: $out $(dmesg | tail -n 2)"
done </lib/modules/load-order

tries=0
while [ ! -b "$root" ]; do
    tries=$((tries + 1))
    [ "$tries" -le 100 ] ||
        fail "the root disk $root did not appear in 10 s (block devices: $(ls /sys/class/block))"
    sleep 0.1
done
mkdir -p /newroot
out=$(mount -t ext4 -o rw "$root" /newroot 2>&1) || {
    why=$(dmesg | grep -i -e ext4 -e "${root#/dev/}" | tail -n 2)
    fail "cannot mount $root read-write as ext4: $out $why"
}
[ -e "/newroot$init" ] || [ -L "/newroot$init" ] || fail "the root disk $root has no $init"

say "mounted $root; starting $init"
for fs in dev proc sys; do
    mount -o move "/$fs" "/newroot/$fs" || fail "cannot move /$fs to the root disk"
done
exec switch_root /newroot "$init" "$@"
fail "switch_root to $root failed"
"""

BUSYBOX_APPLETS = (
    "cat",
    "dmesg",
    "echo",
    "grep",
    "insmod",
    "ls",
    "mkdir",
    "mount",
    "poweroff",
    "sh",
    "sleep",
    "switch_root",
    "tail",
    "wc",
)

# The demo image's stand-in for cloud-init; not part of the product's loader.
USER_DATA_RUNNER_PATH = "/usr/local/lib/vmready-demo/run-user-data"
USER_DATA_RUNNER = """#!/bin/sh
# vmready demo image: run the instance's user-data once per boot when it is a
# script (begins with #!). A small stand-in for cloud-init.
user_data=/run/vmready-agent/cloud-init/user-data
if [ ! -s "$user_data" ]; then
    echo "vmready-user-data: no user-data in the config drive; nothing to run"
    exit 0
fi
if [ "$(head -c 2 "$user_data")" != "#!" ]; then
    echo "vmready-user-data: the user-data does not begin with #!; not running it"
    exit 0
fi
# The workload talks to the agent: wait until it serves the guest API (starting
# sooner only takes the CPU from the agent's own start), at most 60 s.
tries=0
while [ ! -S /dev/lxd/sock ] && [ "$tries" -lt 300 ]; do
    sleep 0.2
    tries=$((tries + 1))
done
if [ ! -S /dev/lxd/sock ]; then
    echo "vmready-user-data: the agent does not serve /dev/lxd/sock after 60 s; running anyway"
fi
script=/run/vmready-user-data
cp "$user_data" "$script"
chmod 0700 "$script"
echo "vmready-user-data: running the instance's user-data"
exec "$script"
"""
USER_DATA_UNIT_NAME = "vmready-user-data.service"
USER_DATA_UNIT = f"""# vmready demo image: run the instance's user-data (stands in for cloud-init).
# Early, as soon as the agent has started (not at the end of boot as cloud-init's
# scripts run): the demo's workload declares Ready through the agent.
[Unit]
Description=vmready demo: run the instance's user-data script
DefaultDependencies=no
After=vmready-agent.service local-fs.target
Conflicts=shutdown.target
Before=shutdown.target

[Service]
Type=simple
ExecStart={USER_DATA_RUNNER_PATH}
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""

# What a missing command is installed with on Debian.
_DEBIAN_PACKAGE_OF = {
    "apt-cache": "apt",
    "apt-get": "apt",
    "dpkg": "dpkg",
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "qemu-img": "qemu-utils",
    "sh": "dash",
}


class GuestImageError(Exception):
    """The demo guest could not be built or found: one line naming the failed step and why."""


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


@attrs.frozen
class CommandResult:
    """What a finished command left: its exit status and its output."""

    returncode: int
    stdout: bytes
    stderr: bytes


# The seam to the world: runs argv (in cwd) to completion. OSError if it cannot start.
CommandRunner = Callable[[Sequence[str], str | None], CommandResult]


def run_command(argv: Sequence[str], cwd: str | None = None) -> CommandResult:
    """Run ``argv`` to completion with no input, capturing its output.

    Interrupted (Ctrl-C, an exception in another thread's signal handler), it
    asks the command to stop with SIGTERM and waits for it: mmdebstrap then
    unmounts what it mounted in the tree before the tree is removed.
    """
    env = dict(os.environ, LC_ALL="C.UTF-8", DEBIAN_FRONTEND="noninteractive")
    process = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = process.communicate()
    except BaseException:
        process.terminate()
        try:
            process.communicate(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        raise
    return CommandResult(process.returncode, stdout, stderr)


def default_cache_dir() -> str:
    """``$VMREADY_GUEST_CACHE``, else ``~/.cache/vmready/guest``."""
    return os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.path.expanduser("~"), ".cache", "vmready", "guest"
    )


def _tail(output: bytes, lines: int = 3, limit: int = 400) -> str:
    """The last few non-empty lines of ``output`` on one line."""
    text = output.decode("utf-8", "replace")
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    joined = " / ".join(kept)
    return joined if len(joined) <= limit else "…" + joined[-limit:]


def _step(run: CommandRunner, step: str, argv: Sequence[str], cwd: str | None = None) -> bytes:
    """Run one build step's command; its stdout, or GuestImageError naming ``step``."""
    try:
        result = run(argv, cwd)
    except OSError as e:
        package = _DEBIAN_PACKAGE_OF.get(argv[0])
        hint = f" (Debian: apt-get install {package})" if package else ""
        raise GuestImageError(f"{step} failed: cannot run {argv[0]}: {e.strerror}{hint}") from e
    if result.returncode != 0:
        why = _tail(result.stderr) or _tail(result.stdout) or "no output"
        raise GuestImageError(
            f"{step} failed: {shlex.join(argv[:2])} exited with status {result.returncode}: {why}"
        )
    return result.stdout


# --- What a build is made of -------------------------------------------------------------


@attrs.frozen
class Package:
    """A Debian package at the version apt would fetch."""

    name: str
    version: str


@attrs.frozen
class GuestInputs:
    """Everything a build depends on; its hash is the cache key."""

    kernel: Package
    kernel_release: str
    busybox: Package
    root_packages: tuple[Package, ...]
    files: Mapping[str, bytes]

    def description(self) -> dict[str, object]:
        """A JSON-able record of the inputs (the manifest, and what the key hashes)."""
        return {
            "builder": BUILDER_VERSION,
            "suite": SUITE,
            "kernel": [self.kernel.name, self.kernel.version],
            "kernel_release": self.kernel_release,
            "busybox": [self.busybox.name, self.busybox.version],
            "root_packages": [[p.name, p.version] for p in self.root_packages],
            "modules": list(INITRAMFS_MODULES),
            "masked_units": list(MASKED_UNITS),
            "masked_generators": list(MASKED_GENERATORS),
            "append": KERNEL_APPEND,
            "disk_size": DISK_SIZE,
            "hostname": HOSTNAME,
            "files": {
                name: hashlib.sha256(data).hexdigest() for name, data in sorted(self.files.items())
            },
        }

    @property
    def key(self) -> str:
        """16 hex digits that change whenever any input changes."""
        encoded = json.dumps(self.description(), sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]


def image_files() -> dict[str, bytes]:
    """The files the builder puts into the guest, by a name: the loader's and the demo's own."""
    files = {f"loader/{name}": data for name, data in loader_files().items()}
    files["initramfs/init"] = INIT_SCRIPT.encode()
    files["demo/run-user-data"] = USER_DATA_RUNNER.encode()
    files[f"demo/{USER_DATA_UNIT_NAME}"] = USER_DATA_UNIT.encode()
    return files


def parse_apt_show(text: str) -> dict[str, dict[str, str]]:
    """``apt-cache show`` stanzas, keyed by package name (the first stanza of each wins)."""
    packages: dict[str, dict[str, str]] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        last = None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and last is not None:
                fields[last] += "\n" + line.strip()
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        if "Package" in fields:
            packages.setdefault(fields["Package"], fields)
    return packages


def kernel_package_of(depends: str) -> str:
    """The ``linux-image-<ver>-amd64`` that ``linux-image-amd64``'s Depends names."""
    for alternative in depends.replace("|", ",").split(","):
        name = alternative.strip().split(" ", 1)[0]
        if name.startswith("linux-image-") and name != KERNEL_METAPACKAGE:
            return name
    raise GuestImageError(
        f"resolving the kernel package failed: {KERNEL_METAPACKAGE} depends on no "
        f"linux-image-<version> package (Depends: {depends!r})"
    )


def resolve_inputs(run: CommandRunner = run_command) -> GuestInputs:
    """Ask apt which versions a build would use now (no download; apt's lists must be current)."""
    step = "resolving the kernel package"
    shown = parse_apt_show(
        _step(run, step, ["apt-cache", "show", "--no-all-versions", KERNEL_METAPACKAGE]).decode()
    )
    if KERNEL_METAPACKAGE not in shown:
        raise GuestImageError(
            f"{step} failed: apt knows no {KERNEL_METAPACKAGE} (apt-get update?)"
        )
    kernel_name = kernel_package_of(shown[KERNEL_METAPACKAGE].get("Depends", ""))
    names = [kernel_name, BUSYBOX_PACKAGE, *ROOT_PACKAGES]
    step = "resolving the guest's packages"
    shown = parse_apt_show(
        _step(run, step, ["apt-cache", "show", "--no-all-versions", *names]).decode()
    )
    missing = [name for name in names if name not in shown]
    if missing:
        raise GuestImageError(
            f"{step} failed: apt knows no {', '.join(missing)} (apt-get update, or add Debian "
            f"{SUITE} to apt's sources)"
        )
    packages = {name: Package(name, shown[name]["Version"]) for name in names}
    return GuestInputs(
        kernel=packages[kernel_name],
        kernel_release=kernel_name.removeprefix("linux-image-"),
        busybox=packages[BUSYBOX_PACKAGE],
        root_packages=tuple(packages[name] for name in ROOT_PACKAGES),
        files=image_files(),
    )


# --- Kernel modules ----------------------------------------------------------------------


def module_name(filename: str) -> str:
    """The kernel's name for a module file: ``pvpanic-mmio.ko`` -> ``pvpanic_mmio``."""
    base = os.path.basename(filename)
    for suffix in (".ko.xz", ".ko"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def modinfo(module: bytes, what: str = "module") -> dict[str, list[str]]:
    """The ``key=value`` strings of a module's ``.modinfo`` ELF section, by key."""
    if module[:4] != b"\x7fELF" or module[4:6] != b"\x02\x01":
        raise GuestImageError(f"reading {what} failed: not a 64-bit little-endian ELF module")
    try:
        (section_offset,) = struct.unpack_from("<Q", module, 0x28)
        entry_size, count, names_index = struct.unpack_from("<HHH", module, 0x3A)
        headers = [
            struct.unpack_from("<IIQQQQ", module, section_offset + i * entry_size)
            for i in range(count)
        ]
        names_offset, names_size = headers[names_index][4], headers[names_index][5]
        names = module[names_offset : names_offset + names_size]
        for name_offset, _type, _flags, _addr, offset, size in headers:
            name = names[name_offset : names.index(b"\0", name_offset)]
            if name == b".modinfo":
                info: dict[str, list[str]] = {}
                for entry in module[offset : offset + size].split(b"\0"):
                    key, sep, value = entry.decode("utf-8", "replace").partition("=")
                    if sep:
                        info.setdefault(key, []).append(value)
                return info
    except (struct.error, IndexError, ValueError) as e:
        raise GuestImageError(f"reading {what} failed: a malformed ELF file ({e})") from e
    raise GuestImageError(f"reading {what} failed: it has no .modinfo section")


def module_dependencies(module: bytes, what: str = "module") -> list[str]:
    """The modules a module's ``depends=`` names, by their module names."""
    depends = ",".join(modinfo(module, what).get("depends", []))
    return [module_name(name) for name in depends.split(",") if name]


def load_order(
    wanted: Sequence[str],
    dependencies: Callable[[str], Sequence[str]],
    available: Iterable[str],
    builtin: Iterable[str] = (),
) -> list[str]:
    """The modules to insmod, each after its dependencies, else in ``wanted``'s order.

    ``available`` are the kernel's loadable modules, ``builtin`` those compiled in
    (never loaded); ``dependencies(name)`` reads one module's ``depends=``.
    """
    loadable = set(available)
    compiled_in = set(builtin)
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str, needed_by: str | None) -> None:
        if name in order or name in compiled_in:
            return
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name) :], name])
            raise GuestImageError(
                f"ordering the kernel modules failed: a dependency cycle {cycle}"
            )
        if name not in loadable:
            by = f" (needed by {needed_by})" if needed_by else ""
            raise GuestImageError(
                f"ordering the kernel modules failed: the kernel has no module {name}{by}, "
                "neither loadable nor built in"
            )
        visiting.append(name)
        for dependency in dependencies(name):
            visit(dependency, name)
        visiting.pop()
        order.append(name)

    for name in wanted:
        visit(module_name(name), None)
    return order


def read_module(path: str) -> bytes:
    """A module file's ELF bytes (``.ko``, or ``.ko.xz`` decompressed)."""
    with open(path, "rb") as f:
        data = f.read()
    return lzma.decompress(data) if path.endswith(".xz") else data


def kernel_modules(modules_dir: str) -> tuple[dict[str, str], set[str]]:
    """A kernel's loadable modules (name -> file) and built-in ones, from ``lib/modules/<rel>``."""
    files: dict[str, str] = {}
    for directory, _dirs, names in os.walk(os.path.join(modules_dir, "kernel")):
        for name in names:
            if name.endswith((".ko", ".ko.xz")):
                files[module_name(name)] = os.path.join(directory, name)
    builtin: set[str] = set()
    listed = os.path.join(modules_dir, "modules.builtin")
    with contextlib.suppress(FileNotFoundError), open(listed, encoding="utf-8") as f:
        builtin = {module_name(line.strip()) for line in f if line.strip()}
    return files, builtin


# --- The initramfs -----------------------------------------------------------------------


@attrs.frozen
class ArchiveEntry:
    """One member of a newc cpio archive."""

    path: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def newc_archive(entries: Iterable[ArchiveEntry]) -> bytes:
    """A ``newc`` (SVR4, no CRC) cpio archive, as the kernel unpacks an initramfs."""
    out = bytearray()

    def member(inode: int, entry: ArchiveEntry) -> None:
        name = entry.path.encode() + b"\0"
        nlink = 2 if stat.S_ISDIR(entry.mode) else 1
        fields = (inode, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.rdev)
        out.extend(b"070701" + b"".join(b"%08X" % v for v in fields))
        out.extend(b"%08X%08X" % (len(name), 0))
        out.extend(name)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(entry.data)
        out.extend(b"\0" * (-len(out) % 4))

    inode = 0
    for inode, entry in enumerate(entries, start=1):
        member(inode, entry)
    member(inode + 1, ArchiveEntry("TRAILER!!!", 0))
    out.extend(b"\0" * (-len(out) % 512))
    return bytes(out)


def initramfs_entries(
    busybox: bytes, modules: Sequence[tuple[str, bytes]], init: str = INIT_SCRIPT
) -> list[ArchiveEntry]:
    """The initramfs: busybox and its applets, ``/init``, and ``modules`` in load order."""
    directory, regular, link = stat.S_IFDIR | 0o755, stat.S_IFREG, stat.S_IFLNK | 0o777
    entries = [
        ArchiveEntry(name, directory)
        for name in ("bin", "dev", "lib", "lib/modules", "newroot", "proc", "sys")
    ]
    entries.append(ArchiveEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    entries.append(ArchiveEntry("bin/busybox", regular | 0o755, busybox))
    entries.extend(ArchiveEntry(f"bin/{applet}", link, b"busybox") for applet in BUSYBOX_APPLETS)
    entries.append(ArchiveEntry("init", regular | 0o755, init.encode()))
    order = "".join(f"{name}\n" for name, _ in modules).encode()
    entries.append(ArchiveEntry("lib/modules/load-order", regular | 0o644, order))
    entries.extend(
        ArchiveEntry(f"lib/modules/{name}.ko", regular | 0o644, data) for name, data in modules
    )
    return entries


def gzip_bytes(data: bytes) -> bytes:
    """``data`` gzipped reproducibly (no name, no timestamp)."""
    return gzip.compress(data, compresslevel=9, mtime=0)


# --- The root filesystem -----------------------------------------------------------------


def host_apt_sources(suite: str = SUITE, etc: str = "/etc/apt") -> list[str]:
    """The host's apt source files that serve ``suite`` (mmdebstrap pastes them into the guest)."""
    candidates = [os.path.join(etc, "sources.list")]
    with contextlib.suppress(FileNotFoundError):
        parts = os.path.join(etc, "sources.list.d")
        candidates += sorted(
            os.path.join(parts, name)
            for name in os.listdir(parts)
            if name.endswith((".list", ".sources"))
        )
    found = []
    for path in candidates:
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as f:
                lines = [line.split("#", 1)[0] for line in f]
            if any(suite in line.split() for line in lines) and any(
                "debian" in line for line in lines
            ):
                found.append(path)
    return found


def customize_root(root: str, run: CommandRunner, loader_dir: str) -> None:
    """Make the bootstrapped tree ``root`` the demo guest: loader, user-data runner, settings."""
    _step(
        run,
        "installing the vmready loader",
        ["sh", os.path.join(loader_dir, "install.sh"), "--root", root],
    )

    def write(path: str, content: str, mode: int = 0o644) -> None:
        target = os.path.join(root, path.lstrip("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        with open(target, "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(target, mode)

    def link(path: str, target: str) -> None:
        where = os.path.join(root, path.lstrip("/"))
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where)
        os.symlink(target, where)

    write(USER_DATA_RUNNER_PATH, USER_DATA_RUNNER, 0o755)
    unit = f"/etc/systemd/system/{USER_DATA_UNIT_NAME}"
    write(unit, USER_DATA_UNIT)
    link(f"/etc/systemd/system/multi-user.target.wants/{USER_DATA_UNIT_NAME}", unit)
    write("/etc/hostname", HOSTNAME + "\n")
    write("/etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n")
    write("/etc/fstab", "# The demo guest's one disk.\n/dev/vda / ext4 rw 0 1\n")
    write("/etc/systemd/journald.conf.d/vmready-demo.conf", "[Journal]\nStorage=volatile\n")
    for name in MASKED_UNITS:
        link(f"/etc/systemd/system/{name}", "/dev/null")
    for name in MASKED_GENERATORS:
        link(f"/etc/systemd/system-generators/{name}", "/dev/null")
    lock_root_password(os.path.join(root, "etc/shadow"))
    # mmdebstrap copied the build host's; the guest has no DNS server to ask.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, "etc/resolv.conf"))


def lock_root_password(shadow: str) -> None:
    """Lock root's password in a shadow file (as ``passwd -l root``): nobody logs in as root."""
    with open(shadow, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if fields[0] == "root" and len(fields) > 1 and not fields[1].startswith("!"):
            fields[1] = "!" + fields[1]
            lines[i] = ":".join(fields)
    with open(shadow, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


# --- Building and caching ----------------------------------------------------------------


def is_bzimage(kernel: bytes) -> bool:
    """Whether ``kernel`` starts like an x86 Linux bzImage (the ``HdrS`` boot header)."""
    return kernel[0x202:0x206] == b"HdrS"


def uncompressed_kernel(bzimage: bytes, what: str = "the kernel") -> bytes:
    """The ELF kernel a bzImage carries (its XZ or gzip payload), which must have a PVH entry."""
    step = f"uncompressing {what}"
    if not is_bzimage(bzimage) or struct.unpack_from("<H", bzimage, 0x206)[0] < 0x208:
        raise GuestImageError(f"{step} failed: not a bzImage of boot protocol 2.08 or newer")
    setup_sectors = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sectors + 1) * 512 + offset
    payload = bzimage[start : start + length]
    try:
        if payload.startswith(b"\xfd7zXZ\x00"):
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
        elif payload.startswith(b"\x1f\x8b"):
            elf = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
        else:
            raise GuestImageError(
                f"{step} failed: its payload is compressed with a method other than XZ or gzip "
                f"(starts {payload[:4].hex()})"
            )
    except (lzma.LZMAError, zlib.error) as e:
        raise GuestImageError(f"{step} failed: its payload does not decompress ({e})") from e
    if not has_pvh_entry(io.BytesIO(elf)):
        raise GuestImageError(f"{step} failed: the kernel has no PVH entry point (CONFIG_PVH)")
    return elf


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
        if not name.startswith(".") and _complete(os.path.join(cache_dir, name))
    ]
    return max(builds, key=lambda path: os.stat(path).st_mtime, default=None)


def _complete(directory: str) -> bool:
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
        _step(run, f"unmounting {point}", ["umount", "--lazy", point])
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
    _step(run, f"downloading {names}", ["apt-get", "download", "-q", *wanted], downloads)
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
        _step(run, f"unpacking {package.name}", ["dpkg", "-x", deb, where])
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
    _write(os.path.join(workdir, INITRD_FILE), gzip_bytes(archive))
    return order


def make_root_disk(workdir: str, run: CommandRunner, log: Callable[[str], None]) -> None:
    """Bootstrap Debian, make it the demo guest, and write it as an ext4 qcow2 disk."""
    root = os.path.join(workdir, "root")
    loader_dir = os.path.join(workdir, "loader")
    for name, data in loader_files().items():
        _write(os.path.join(loader_dir, name), data, 0o755 if executable(name) else 0o644)
    with _phase(log, f"bootstrapping Debian {SUITE} with {', '.join(ROOT_PACKAGES)}"):
        _step(
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
        _step(run, "making the root filesystem (mkfs.ext4)", [*mkfs, raw, DISK_SIZE])
        convert = ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, image]
        _step(run, "converting the root disk to qcow2", convert)
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
    key = inputs.key
    final = os.path.join(cache_dir, key)
    if _complete(final):
        return guest_image(final, key)
    with build_lock(cache_dir, log):
        if _complete(final):
            return guest_image(final, key)
        remove_stale_builds(cache_dir, run, log)
        if os.path.exists(final):
            log(f"guest image: {final} is incomplete; building it again")
            remove_tree(final, run, log)
        workdir = tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{key}-", dir=cache_dir)
        started = time.monotonic()
        log(f"guest image: building {key} in {workdir}")
        try:
            builder(inputs, workdir, run, log)
            # mkdtemp made it private; QEMU may run as another user than the build.
            os.chmod(workdir, 0o755)
            os.rename(workdir, final)
        except BaseException:
            with contextlib.suppress(GuestImageError, OSError):
                remove_tree(workdir, run, log)
            raise
        log(f"guest image: built {final} in {time.monotonic() - started:.0f}s")
    return guest_image(final, key)


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


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m vmready.hypervisor.guestimage``: build or reuse the demo guest."""
    parser = argparse.ArgumentParser(
        prog="python -m vmready.hypervisor.guestimage",
        description="Build (or reuse) the demo guest: a Debian kernel, a busybox initramfs and a "
        "qcow2 root disk with the vmready loader.",
    )
    parser.add_argument(
        "--cache",
        default=None,
        help=f"cache directory (default: ${CACHE_VARIABLE}, else ~/.cache/vmready/guest)",
    )
    options = parser.parse_args(argv)
    cache = options.cache or default_cache_dir()

    def stop(signum: int, frame: object) -> None:
        # Unwind like Ctrl-C: the running command is stopped, the build removed.
        raise SystemExit(
            f"vmready.hypervisor.guestimage: stopped by signal {signum}; nothing was cached"
        )

    signal.signal(signal.SIGTERM, stop)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        guest = ensure_guest(cache, log)
    except GuestImageError as e:
        print(f"vmready.hypervisor.guestimage: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"kernel: {guest.kernel}")
    print(f"vmlinux: {guest.vmlinux} (the same kernel uncompressed: boots sooner where accepted)")
    print(f"initrd: {guest.initrd}")
    print(f"image:  {guest.image}")
    print(f"append: {guest.append}")
    print(launch_command(guest))


if __name__ == "__main__":
    main()
