"""What this host taught earlier daemons about KVM, kept per kernel and hypervisor build."""

from __future__ import annotations

import os
import shutil

from twisted.internet.defer import Deferred
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import IVMReadyReactor
from vmready.hypervisor import HypervisorDriver, KVMVerdicts

KVM_VERDICT_FILE = "kvm-verdict.json"

log = Logger()


async def program_version(reactor: IVMReadyReactor, program: list[str]) -> str:
    """The hypervisor's ``--version`` line (what a KVM verdict is kept for).

    When it cannot be read, ``unknown`` with the reason, which is also logged:
    verdicts are then kept for that reason, not for a build.
    """
    executable = shutil.which(program[0])
    if executable is None:
        return _unknown(f"{program[0]} was not found")
    asked: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
        executable, [*program[1:], "--version"], env=dict(os.environ), reactor=reactor
    )
    try:
        out, err, code = await asked.addErrback(_signalled)
    except Exception as e:
        return _unknown(f"{executable} --version could not run: {e}")
    lines = out.decode("utf-8", "replace").splitlines()
    if code != 0:
        said = err.decode("utf-8", "replace").strip().splitlines()
        return _unknown(
            f"{executable} --version exited with status {code}" + (f": {said[0]}" if said else "")
        )
    if not lines:
        return _unknown(f"{executable} --version printed nothing")
    return lines[0].strip()


def _signalled(failure: Failure) -> Failure:
    """``getProcessOutputAndValue`` fails with a bare ``(out, err, signal)`` on a signal."""
    if isinstance(failure.value, tuple):
        return Failure(RuntimeError(f"killed by signal {failure.value[2]}"))
    return failure


def _unknown(reason: str) -> str:
    log.warn("cannot tell the hypervisor's version: {reason}", reason=reason)
    return f"unknown ({reason})"


async def load_kvm_verdicts(
    data_dir: str, driver: HypervisorDriver, version: Deferred[str]
) -> KVMVerdicts:
    """The verdicts kept in ``data_dir`` for this kernel and hypervisor build (logged if any)."""
    key = f"{os.uname().release}|{driver.program_name}|{await version}"
    verdicts = KVMVerdicts(os.path.join(data_dir, KVM_VERDICT_FILE), key)
    verdict = verdicts.verdict
    if verdict is not None:
        log.info(
            "KVM on this host: {works} ({reason})",
            works="runs guests" if verdict.works else "does not run guests",
            reason=verdict.reason,
        )
    return verdicts
