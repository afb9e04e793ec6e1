"""What the demo guest is made of: its packages, its kernel command line, its files, settings."""

from __future__ import annotations

# Bump when the builder makes a different image from the same inputs.
BUILDER_VERSION = 3


SUITE = "bookworm"


BUSYBOX_PACKAGE = "busybox-static"


ROOT_PACKAGES = ("systemd-sysv", "python3", "udev", "dbus", "iproute2", "kmod")


DISK_SIZE = "2G"


HOSTNAME = "vmready-demo"


# console=ttyS0: the VM's only console (QEMU runs with -nodefaults, and ttyS0 goes
# to the console log). quiet keeps the kernel's and systemd's chatter off the slow
# emulated serial line; errors still reach it. net.ifnames=0: the NIC stays eth0
# (the agent finds it by MAC anyway). tsc=reliable: the guest's clock is the TSC
# (read without leaving the vCPU), not the HPET (a device access each time, slow
# under TCG): QEMU keeps the vCPUs' TSCs in step, which the kernel cannot tell from
# the CPU model QEMU emulates. no_timer_check: no wait, as the kernel starts, for
# timer interrupts through QEMU's IO-APIC (a few ticks, some tens of ms under TCG).
# cgroup.memory=nokmem,nosocket: no kernel-memory or socket accounting per memory
# cgroup. systemd creates the first memory cgroups as it starts, which turns on
# both, and the kernel then patches its own code (static keys) while the agent,
# started by the initramfs, runs on the other vCPU: under TCG that left both vCPUs
# spinning in the patched allocator (a soft lockup, about 1 boot in 12).
KERNEL_APPEND = (
    "root=/dev/vda rw console=ttyS0 quiet net.ifnames=0 tsc=reliable no_timer_check"
    " cgroup.memory=nokmem,nosocket"
)


KERNEL_FILE = "vmlinuz"


PVH_KERNEL_FILE = "vmlinux"


# The kernel's whole .config, beside it: what the guest's kernel has built in.
KERNEL_CONFIG_FILE = "kernel.config"


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
    # The initramfs mounted the root disk read-write with fstab's options already.
    "systemd-remount-fs.service",
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
    # A login prompt on ttyS0 (root's password is locked: nobody logs in), started
    # while the agent starts.
    "systemd-getty-generator",
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
# /init of the vmready demo guest's initramfs (busybox): mount the root disk
# read-write, start the vmready agent and hand over to its init. The kernel has
# every driver the guest needs built in: there are no modules to load.
# Any failure says why on the console and powers the VM off: never a silent hang.
export PATH=/bin

say() {
    # /proc is the root disk's once it has been moved there.
    read -r up _ 2>/dev/null </proc/uptime || read -r up _ </newroot/proc/uptime || up=?
    echo "vmready-initramfs: [$up] $*"
}

fail() {
    echo "vmready-initramfs: error: $*"
    echo "vmready-initramfs: powering off"
    poweroff -f
    sleep 60
}

mount -t proc proc /proc || fail "cannot mount /proc"
say "started"
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

# The vmready agent, started here rather than by systemd (which takes seconds under
# emulation before it runs a unit): in the root disk, with /run a tmpfs that systemd
# keeps (mounted as systemd mounts it); systemd's vmready-agent.service adopts it.
# Without it, systemd starts the agent.
early=/usr/local/lib/vmready/vmready-agent-early
if [ ! -x "/newroot$early" ]; then
    early=
elif ! out=$(mount -t tmpfs -o mode=0755,nosuid,nodev,size=20%,nr_inodes=800k tmpfs \
    /newroot/run 2>&1); then
    say "warning: cannot mount /run ($out): systemd starts the vmready agent"
    early=
fi

say "mounted $root; starting $init"
for fs in dev proc sys; do
    mount -o move "/$fs" "/newroot/$fs" || fail "cannot move /$fs to the root disk"
done
if [ -n "$early" ]; then
    # Ahead of systemd for the CPU, as its unit would run it (Nice=-10).
    chroot /newroot nice -n -10 "$early" boot </dev/null &
    # It writes its PID once it runs from the root disk: switch_root empties this
    # initramfs, which it must have left by then. At most 2 s.
    pidfile=/newroot/run/vmready-agent.pid
    tries=0
    while [ ! -s "$pidfile" ] && [ "$tries" -lt 200 ]; do
        sleep 0.01
        tries=$((tries + 1))
    done
    if [ -s "$pidfile" ]; then
        say "the vmready agent starts ahead of $init as process $(cat "$pidfile")"
    else
        say "warning: the vmready agent did not start within 2 s: systemd starts it"
    fi
fi
exec switch_root /newroot "$init" "$@"
fail "switch_root to $root failed"
"""


BUSYBOX_APPLETS = (
    "cat",
    "chroot",
    "dmesg",
    "echo",
    "grep",
    "ls",
    "mkdir",
    "mount",
    "poweroff",
    "sh",
    "sleep",
    "switch_root",
    "tail",
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
# Read by the shell itself: every program started costs under emulation.
first=
read -r first <"$user_data" || true
case $first in
    '#!'*) ;;
    *)
        echo "vmready-user-data: the user-data does not begin with #!; not running it"
        exit 0
        ;;
esac
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
install -m 0700 "$user_data" "$script"
read -r up _ </proc/uptime
echo "vmready-user-data: [$up] running the instance's user-data"
exec "$script"
"""


USER_DATA_UNIT_NAME = "vmready-user-data.service"


USER_DATA_UNIT = f"""# vmready demo image: run the instance's user-data (stands in for cloud-init).
# Early, among systemd's first jobs (not at the end of boot as cloud-init's scripts
# run): the demo's workload declares Ready through the agent, which the initramfs
# started before systemd, and the runner waits for its socket. Not after
# local-fs.target either: the root disk, the demo guest's only local file system,
# was mounted read-write by the initramfs, and /run with it.
[Unit]
Description=vmready demo: run the instance's user-data script
DefaultDependencies=no
Conflicts=shutdown.target
Before=shutdown.target

[Service]
Type=simple
ExecStart={USER_DATA_RUNNER_PATH}
# Ahead of the rest of the boot (udev's coldplug, dbus, logind) for the CPU, as the
# agent is: the demo's workload is what declares the VM Ready. Its whole life.
Nice=-10
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""
