"""The command lines fakeqemu's tests start their VMs with: a q35 machine, a monitor, the agent's
ring buffer wired to its port (as vmready wires it)."""

from __future__ import annotations

PORT = "com.canonical.lxd"
LEGACY_PORT = "org.linuxcontainers.lxd"
QMP_SOCKET = "/vm/qmp.sock"
RING = "vmready"
MACHINE = ["-machine", "q35", "-nodefaults", "-display", "none", "-m", "64"]


def qmp_option(path: str = QMP_SOCKET) -> list[str]:
    """``-qmp`` for a monitor socket the way vmready passes it."""
    return ["-qmp", f"unix:{path},server=on,wait=off"]


def agent_port(ring_size: int, port_id: str | None = None) -> list[str]:
    """A ``size``-byte ring buffer wired to the agent's port on the virtio-serial bus ``vs0``."""
    port = f"virtserialport,chardev={RING},name={PORT},bus=vs0.0"
    return [
        "-chardev",
        f"ringbuf,id={RING},size={ring_size}",
        "-device",
        "virtio-serial-pci,id=vs0",
        "-device",
        port if port_id is None else f"{port},id={port_id}",
    ]


def legacy_port() -> list[str]:
    """The legacy port, wired to nothing, on the same bus."""
    return ["-device", f"virtserialport,name={LEGACY_PORT},bus=vs0.0"]


FORWARD = "10.0.2.100:8443"


def guest_devices(directory: str, command: str, mac: str | None = None) -> list[str]:
    """The contract's other devices, their files in ``directory``: the serial console in
    ``console.log``, ``config-drive`` exported over 9p, one guestfwd rule to ``command``."""
    nic = "virtio-net-pci,netdev=n0" if mac is None else f"virtio-net-pci,netdev=n0,mac={mac}"
    return [
        "-chardev",
        f"file,id=console,path={directory}/console.log,append=on",
        "-serial",
        "chardev:console",
        "-fsdev",
        f"local,id=config,path={directory}/config-drive,security_model=none,readonly=on",
        "-device",
        "virtio-9p-pci,fsdev=config,mount_tag=config",
        "-netdev",
        f"user,id=n0,restrict=on,ipv6=off,guestfwd=tcp:{FORWARD}-cmd:{command}",
        "-device",
        nic,
    ]
