"""Registers ``twistd fakeqemu-host``."""

from twisted.application.service import ServiceMaker

fakeqemu_host = ServiceMaker(
    "fakeqemu host", "fakeqemu.host_tap", "Host many fakeqemu VMs in one process.", "fakeqemu-host"
)
