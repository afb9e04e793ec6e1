"""KVM's fate in well under a second: QEMU's own verdict, from a probe VM that needs no image.

Before a host's first guest is tried under KVM, vmready starts the hypervisor
once with nothing to boot: the same machine and CPU model a VM gets under KVM
(``-machine q35 -accel kvm -cpu host``), 16 MiB, no disk, no kernel, and one
device, the firmware's debug console (``isa-debugcon`` at port 0x402, which
SeaBIOS writes its banner to) on a file.  Three outcomes:

- QEMU exits (under nested virtualisation it can abort at once: ``failed to
  set MSR 0x10a``, an assertion, SIGABRT): KVM cannot run guests here, and
  QEMU said why.  Measured on such a host: 0.2 to 0.6 s.
- The firmware writes: QEMU runs guest code under KVM (tens of milliseconds).
- Neither within ``PROBE_WINDOW``: QEMU stays up but said nothing.

Only the first is a verdict.  Firmware that runs does not prove a kernel will
(the same nested host runs SeaBIOS under ``-cpu qemu64`` and then no kernel),
so in the other two cases the real guest's boot stays on trial, watched for
a sign of life as before.  ``judge`` is the rule, without I/O; ``probe_kvm``
runs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IReactorProcess, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from vmready.hypervisor.qemulog import OUTPUT_CAP, error_lines

# How long QEMU may stay silent before the probe stops waiting (a working KVM
# shows the firmware's banner in tens of milliseconds, a failing one exits).
PROBE_WINDOW = 2.0
_POLL = 0.02
FIRMWARE_LOG = "firmware.log"


@attrs.frozen
class KVMProbe:
    """What the probe VM showed: whether QEMU failed under KVM, and in words."""

    # False: QEMU cannot run a guest under KVM here (a verdict); True: it can start one.
    starts: bool
    reason: str


def probe_arguments(program: Sequence[str], firmware_log: str) -> list[str]:
    """The probe VM's command line: KVM, the host CPU, no image, the firmware's debug console."""
    return [
        *program,
        "-machine",
        "q35",
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-nodefaults",
        "-display",
        "none",
        "-m",
        "16M",
        "-chardev",
        f"file,id=firmware,path={firmware_log.replace(',', ',,')}",
        "-device",
        "isa-debugcon,iobase=0x402,chardev=firmware",
    ]


def judge(
    program_name: str,
    ended: tuple[int | None, int | None] | None,
    stderr: bytes,
    firmware: bytes,
    elapsed: float,
) -> KVMProbe:
    """The probe's outcome from how QEMU ``ended`` (exit status, signal; None: still up)."""
    if firmware.strip():
        return KVMProbe(True, f"a probe VM's firmware ran under KVM within {elapsed:.2f}s")
    if ended is None:
        return KVMProbe(
            True,
            f"{program_name} stayed up under KVM for {elapsed:.1f}s, though its firmware "
            "wrote nothing",
        )
    code, signal_number = ended
    said = error_lines(stderr.decode("utf-8", "replace"))
    how = f"signal {signal_number}" if signal_number is not None else f"status {code}"
    why = f": {said[0]}" if said else ""
    return KVMProbe(
        False,
        f"{program_name} fails under KVM on this host (a probe VM with no image ended "
        f"by {how} after {elapsed:.2f}s{why})",
    )


class _ProbeProcess(ProcessProtocol):
    def __init__(self) -> None:
        self.stderr = b""
        self.ended: tuple[int | None, int | None] | None = None
        self.reaped: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.closeStdin()

    def errReceived(self, data: bytes) -> None:
        self.stderr = (self.stderr + data)[:OUTPUT_CAP]

    def processEnded(self, reason: Failure) -> None:
        value = reason.value
        self.ended = (getattr(value, "exitCode", None), getattr(value, "signal", None))
        self.reaped.callback(None)


def _first_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:
        return b""


async def probe_kvm(
    reactor: IReactorProcess,
    clock: IReactorTime,
    program: Sequence[str],
    program_name: str,
    window: float = PROBE_WINDOW,
) -> KVMProbe:
    """Start the probe VM, wait for its first word (or its end, or ``window``), stop it."""
    executable = shutil.which(program[0])
    if executable is None:
        return KVMProbe(False, f"the hypervisor program {program[0]!r} is not installed")
    scratch = tempfile.mkdtemp(prefix="vmready-kvm-probe-")
    firmware_log = os.path.join(scratch, FIRMWARE_LOG)
    process = _ProbeProcess()
    started = clock.seconds()
    try:
        transport = reactor.spawnProcess(
            process, executable, probe_arguments(program, firmware_log), env=dict(os.environ)
        )
        while True:
            elapsed = clock.seconds() - started
            firmware = _first_bytes(firmware_log)
            if firmware.strip() or process.ended is not None or elapsed >= window:
                break
            await deferLater(clock, _POLL, lambda: None)
        verdict = judge(program_name, process.ended, process.stderr, firmware, elapsed)
        if process.ended is None:
            with contextlib.suppress(ProcessExitedAlready):
                transport.signalProcess("KILL")
            await process.reaped
        return verdict
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
