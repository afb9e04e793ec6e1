"""The demo guest's kernel configuration: tinyconfig, plus what the guest uses, all built in.

Debian's generic kernel takes about 1.5 s under TCG from its first
instruction to the initramfs, and the initramfs another 0.55 s to load the
29 modules the guest needs: most of it is work for hardware and features a
vmready VM never has (thousands of call sites patched for ftrace and the CPU
mitigations, hundreds of drivers' init calls, module signatures).  The demo
guest's kernel is instead built from Debian's own source (``linux-source-6.1``)
as ``make tinyconfig`` plus the lines below, with no modules: it reaches the
initramfs in about 0.8 s and the root disk is mounted 0.08 s later.

Each line is checked in the resulting ``.config`` (``config_problems``): a
line that did not take — a dependency missing, a symbol renamed in a newer
source — fails the build by name instead of booting a guest without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# The lines appended to tinyconfig's .config before ``make olddefconfig``, by what needs them.
KERNEL_CONFIG = (
    # The machine: x86-64, several vCPUs, the PVH entry QEMU boots an ELF kernel by,
    # a guest of KVM where there is one; the clock from the CMOS RTC (TLS needs the date).
    "CONFIG_64BIT=y",
    "CONFIG_SMP=y",
    "CONFIG_NR_CPUS=64",
    "CONFIG_HYPERVISOR_GUEST=y",
    "CONFIG_PARAVIRT=y",
    "CONFIG_KVM_GUEST=y",
    "CONFIG_PVH=y",
    "CONFIG_NO_HZ_IDLE=y",
    "CONFIG_HIGH_RES_TIMERS=y",
    "CONFIG_PREEMPT_VOLUNTARY=y",
    "CONFIG_CC_OPTIMIZE_FOR_PERFORMANCE=y",
    "CONFIG_X86_PM_TIMER=y",
    "CONFIG_DMI=y",
    "CONFIG_DMIID=y",
    "CONFIG_RTC_CLASS=y",
    "CONFIG_RTC_HCTOSYS=y",
    "CONFIG_RTC_DRV_CMOS=y",
    # A VM that runs one workload, as the Debian guest ran with mitigations=off.
    "# CONFIG_CPU_MITIGATIONS is not set",
    'CONFIG_LOCALVERSION="-vmready"',
    "# CONFIG_LOCALVERSION_AUTO is not set",
    # The console: the first 16550 UART (ttyS0), its lines dated.
    "CONFIG_PRINTK=y",
    "CONFIG_PRINTK_TIME=y",
    "CONFIG_BUG=y",
    # /proc/sysrq-trigger (a workload may crash or power off the guest by it) and core dumps.
    "CONFIG_MAGIC_SYSRQ=y",
    "CONFIG_COREDUMP=y",
    "CONFIG_ELF_CORE=y",
    "CONFIG_TTY=y",
    "CONFIG_UNIX98_PTYS=y",
    # 256 BSD pty pairs made at boot (40 ms under TCG); Debian's kernel has none either.
    "# CONFIG_LEGACY_PTYS is not set",
    "CONFIG_SERIAL_8250=y",
    "CONFIG_SERIAL_8250_CONSOLE=y",
    "CONFIG_SERIAL_8250_NR_UARTS=1",
    "CONFIG_SERIAL_8250_RUNTIME_UARTS=1",
    "# CONFIG_VGA_CONSOLE is not set",
    "# CONFIG_VGA_ARB is not set",
    # What systemd, udev, dbus, logind and Python ask of a kernel.
    "CONFIG_MULTIUSER=y",
    "CONFIG_BASE_FULL=y",
    "CONFIG_FUTEX=y",
    "CONFIG_EPOLL=y",
    "CONFIG_SIGNALFD=y",
    "CONFIG_TIMERFD=y",
    "CONFIG_EVENTFD=y",
    "CONFIG_SHMEM=y",
    "CONFIG_AIO=y",
    "CONFIG_IO_URING=y",
    "CONFIG_ADVISE_SYSCALLS=y",
    "CONFIG_MEMBARRIER=y",
    "CONFIG_KALLSYMS=y",
    "CONFIG_FHANDLE=y",
    "CONFIG_POSIX_TIMERS=y",
    "CONFIG_FILE_LOCKING=y",
    "CONFIG_SYSVIPC=y",
    "CONFIG_POSIX_MQUEUE=y",
    "CONFIG_BINFMT_ELF=y",
    "CONFIG_BINFMT_SCRIPT=y",
    "CONFIG_PROC_FS=y",
    "CONFIG_PROC_SYSCTL=y",
    "CONFIG_SYSFS=y",
    "CONFIG_DEVTMPFS=y",
    "CONFIG_TMPFS=y",
    "CONFIG_TMPFS_POSIX_ACL=y",
    "CONFIG_TMPFS_XATTR=y",
    "CONFIG_INOTIFY_USER=y",
    "CONFIG_AUTOFS_FS=y",
    "CONFIG_CGROUPS=y",
    "CONFIG_CGROUP_SCHED=y",
    "CONFIG_CGROUP_PIDS=y",
    "CONFIG_MEMCG=y",
    "CONFIG_CGROUP_BPF=y",
    "CONFIG_BPF_SYSCALL=y",
    "CONFIG_NAMESPACES=y",
    "CONFIG_UTS_NS=y",
    "CONFIG_IPC_NS=y",
    "CONFIG_PID_NS=y",
    "CONFIG_NET_NS=y",
    "CONFIG_USER_NS=y",
    "CONFIG_SECCOMP=y",
    "CONFIG_SECCOMP_FILTER=y",
    # The initramfs, uncompressed (the kernel copies it instead of inflating it).
    "CONFIG_BLK_DEV_INITRD=y",
    "# CONFIG_RD_GZIP is not set",
    "# CONFIG_RD_BZIP2 is not set",
    "# CONFIG_RD_LZMA is not set",
    "# CONFIG_RD_XZ is not set",
    "# CONFIG_RD_LZO is not set",
    "# CONFIG_RD_LZ4 is not set",
    "# CONFIG_RD_ZSTD is not set",
    # No modules: everything below is built in, and nothing loads at boot.
    "# CONFIG_MODULES is not set",
    # The devices vmready gives a VM: virtio-pci disks, serial ports, rng, NIC and vsock,
    # the 9p config drive, the ACPI power button, the pvpanic device.
    "CONFIG_PCI=y",
    "CONFIG_PCI_MSI=y",
    "CONFIG_ACPI=y",
    "CONFIG_ACPI_BUTTON=y",
    "CONFIG_INPUT=y",
    "CONFIG_INPUT_EVDEV=y",
    "# CONFIG_INPUT_KEYBOARD is not set",
    "# CONFIG_INPUT_MOUSE is not set",
    "# CONFIG_SERIO is not set",
    "CONFIG_BLOCK=y",
    "CONFIG_BLK_DEV=y",
    "CONFIG_VIRTIO_MENU=y",
    "CONFIG_VIRTIO_PCI=y",
    "CONFIG_VIRTIO_BLK=y",
    "CONFIG_VIRTIO_CONSOLE=y",
    "CONFIG_HW_RANDOM=y",
    "CONFIG_HW_RANDOM_VIRTIO=y",
    "CONFIG_PVPANIC=y",
    "CONFIG_PVPANIC_MMIO=y",
    "CONFIG_NET=y",
    "CONFIG_UNIX=y",
    "CONFIG_INET=y",
    "# CONFIG_IPV6 is not set",
    "CONFIG_NETDEVICES=y",
    "CONFIG_NET_CORE=y",
    "CONFIG_VIRTIO_NET=y",
    "CONFIG_VSOCKETS=y",
    "CONFIG_VIRTIO_VSOCKETS=y",
    "CONFIG_NET_9P=y",
    "CONFIG_NET_9P_VIRTIO=y",
    "CONFIG_NETWORK_FILESYSTEMS=y",
    "CONFIG_9P_FS=y",
    "CONFIG_9P_FS_POSIX_ACL=y",
    # The root disk.
    "CONFIG_EXT4_FS=y",
    "CONFIG_EXT4_FS_POSIX_ACL=y",
    "CONFIG_EXT4_FS_SECURITY=y",
)


_SET = re.compile(r"^(CONFIG_\w+)=(.*)$")
_UNSET = re.compile(r"^# (CONFIG_\w+) is not set$")


def config_values(text: str) -> dict[str, str]:
    """A ``.config``'s symbols: ``value`` for ``CONFIG_X=value``, ``"n"`` for ``is not set``."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        set_to = _SET.match(line)
        if set_to:
            values[set_to.group(1)] = set_to.group(2)
            continue
        unset = _UNSET.match(line)
        if unset:
            values[unset.group(1)] = "n"
    return values


def config_problems(text: str, wanted: Iterable[str] = KERNEL_CONFIG) -> list[str]:
    """The ``wanted`` lines the ``.config`` ``text`` does not hold (a missing symbol is unset)."""
    have = config_values(text)
    problems = []
    for line in wanted:
        want = config_values(line)
        if not want:
            raise ValueError(f"not a kernel configuration line: {line!r}")
        for symbol, value in want.items():
            got = have.get(symbol, "n")
            if got != value:
                shown = "not set" if got == "n" else got
                problems.append(f"{line} (the kernel's configuration has it {shown})")
    return problems
