"""``-accel``: the accelerators QEMU 7.2 knows, tried in turn until one initializes.

Texts measured on QEMU 7.2.  fakeqemu runs no guest code; ``kvm`` only
needs its device to open, as QEMU's kvm_init does.
"""

from __future__ import annotations

import os

from fakeqemu._qemuopts import CommandLineError, program_name

_ACCELERATORS = ("kvm", "tcg", "qtest")


def kvm_available() -> bool:
    """Whether the KVM device opens, as QEMU's kvm accelerator needs."""
    device = os.environ.get("FAKEQEMU_KVM_DEVICE", "/dev/kvm")
    try:
        fd = os.open(device, os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


def choose_accelerator(
    accelerators: list[tuple[str, str, dict[str, str]]], warnings: list[str]
) -> str:
    """The first of ``(option value, name, properties)`` that initializes (tcg if none given).

    Each failure before it is added to ``warnings``, as QEMU prints them; if
    none initializes, the last failure is the error.
    """
    if not accelerators:
        return "tcg"
    failures: list[str] = []
    for value, accel, properties in accelerators:
        if accel not in _ACCELERATORS:
            failures.append(f"-accel {value}: invalid accelerator {accel}")
            continue
        for key in properties:
            # Setting a property that does not exist is fatal, not a reason to fall back.
            warnings.extend(failures)
            raise CommandLineError(f"-accel {value}: Property '{accel}-accel.{key}' not found")
        if accel == "kvm" and not kvm_available():
            # QEMU's kvm_init prints its first line without the program name.
            failures.append(
                "Could not access KVM kernel module: No such file or directory\n"
                f"{program_name()}: -accel {value}: failed to initialize kvm: "
                "No such file or directory"
            )
            continue
        if failures:
            warnings.extend([*failures, f"falling back to {accel}"])
        return accel
    warnings.extend(failures[:-1])
    raise CommandLineError(failures[-1])
