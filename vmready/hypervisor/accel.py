"""Which accelerator a VM runs under, chosen explicitly, and what this host taught us about KVM.

An instance asks for ``kvm``, ``tcg`` or ``auto`` (``boot.accel``, default
auto).  ``auto`` means KVM where ``/dev/kvm`` opens *and a guest makes
progress*, else TCG.  A device that opens is not proof: under nested
virtualisation QEMU may abort at start under KVM, or start a guest that
never runs.  So the first KVM boot of a guest is watched: QEMU failing at
once, or a guest with no sign of life within the probe time (nothing on its
console, no word from its agent), is a verdict against KVM on this host, and
the VM is started again under TCG, saying so.  A guest that shows life is a
verdict for it.  Verdicts are kept in the data dir per QEMU build and host
kernel, so later boots go straight to what works, without waiting again.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable

import attrs
from twisted.logger import Logger

from vmready.hypervisor.cmdline import device_problem

CURRENT_ACCEL_KEY = "volatile.accel"
ACCEL_REASON_KEY = "volatile.accel.reason"


@attrs.frozen
class KVMVerdict:
    """What a KVM boot on this host showed: whether guests run, and why we think so."""

    works: bool
    reason: str
    at: float


@attrs.frozen
class AccelChoice:
    """The accelerator to start a VM with, whether to watch it for life, and why."""

    accel: str
    probe: bool
    reason: str


def kvm_device_problem(device: str = "/dev/kvm") -> str | None:
    """Why KVM cannot be used here (``/dev/kvm`` does not open read-write), or None."""
    return device_problem(device)


def accelerators_for_host(device: str = "/dev/kvm") -> list[str]:
    """``["kvm", "tcg"]`` where the KVM device opens for reading and writing, else ``["tcg"]``."""
    return ["tcg"] if kvm_device_problem(device) else ["kvm", "tcg"]


def choose_accel(
    requested: str, kvm_problem: str | None, verdict: KVMVerdict | None
) -> AccelChoice:
    """The accelerator for ``requested`` given the KVM device's state and the host's verdict."""
    if requested == "tcg":
        return AccelChoice("tcg", False, "TCG, as the instance asks (boot.accel=tcg)")
    if requested == "kvm":
        return AccelChoice("kvm", False, "KVM, as the instance asks (boot.accel=kvm)")
    if requested != "auto":
        raise ValueError(f"unknown accelerator {requested!r}")
    if kvm_problem is not None:
        return AccelChoice("tcg", False, f"TCG: KVM is not available ({kvm_problem})")
    if verdict is None:
        return AccelChoice("kvm", True, "KVM, on trial: no guest has run under KVM here yet")
    if verdict.works:
        return AccelChoice("kvm", False, f"KVM: {verdict.reason}")
    return AccelChoice(
        "tcg", False, f"TCG: KVM does not run guests on this host ({verdict.reason})"
    )


class KVMVerdicts:
    """The verdict on KVM for this host, kept in a small JSON file.

    The verdict belongs to a host kernel and a QEMU build (``key``): after an
    upgrade of either, KVM is tried again.
    """

    log = Logger()

    def __init__(self, path: str, key: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.key = key
        self.clock = clock
        self._verdict = self._load()

    def _load(self) -> KVMVerdict | None:
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.log.warn(
                "ignoring unreadable KVM verdict {path}: {error}", path=self.path, error=e
            )
            return None
        if not isinstance(saved, dict):
            self.log.warn("ignoring KVM verdicts {path}: not a JSON object", path=self.path)
            return None
        entry = saved.get(self.key)
        if entry is None:
            return None
        works = entry.get("works") if isinstance(entry, dict) else None
        reason = entry.get("reason") if isinstance(entry, dict) else None
        at = entry.get("at") if isinstance(entry, dict) else None
        if (
            not isinstance(works, bool)
            or not isinstance(reason, str)
            or not isinstance(at, int | float)
            or isinstance(at, bool)
        ):
            self.log.warn(
                "ignoring the KVM verdict for {key} in {path}: not a verdict ({entry!r})",
                key=self.key,
                path=self.path,
                entry=entry,
            )
            return None
        return KVMVerdict(works, reason, float(at))

    @property
    def verdict(self) -> KVMVerdict | None:
        """What is known of KVM here (None: untried)."""
        return self._verdict

    def record(self, works: bool, reason: str) -> KVMVerdict:
        """Keep a new verdict (and write it down for the next daemon)."""
        verdict = self._verdict = KVMVerdict(works, reason, self.clock())
        try:
            with open(self.path) as f:
                saved = json.load(f)
            if not isinstance(saved, dict):
                saved = {}
        except (OSError, ValueError):
            saved = {}
        saved[self.key] = attrs.asdict(verdict)
        partial = self.path + ".tmp"
        try:
            with open(partial, "w") as f:
                json.dump(saved, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(partial, self.path)
        except OSError as e:
            self.log.warn(
                "cannot save the KVM verdict to {path}: {error}", path=self.path, error=e
            )
            with contextlib.suppress(OSError):
                os.unlink(partial)
        return verdict
