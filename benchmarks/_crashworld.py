"""What ``benchmarks/crash.py`` sees outside the daemon: the committed store, the VM
processes that really run, and the guests (one real agent per VM boot).

Everything here is read from the machine, never from the daemon: the store
through its own SQLite connection (committed rows only), the VMs from
``/proc`` (a fakeqemu VM is a process whose command line names its QMP socket
under the data dir's ``run/``), their size from the ``-m`` and ``-smp`` they
really run with.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from typing import IO, Any

import attrs

from vmready import fence
from vmready.fence import VMProcess
from vmready.hypervisor import AGENT_CONFIG, AGENT_ZIPAPP
from vmready.lifecycle import CONFIG_DRIVE, run_dir_name

PROBE_TIMEOUT = 3.0


@attrs.frozen
class Row:
    """One committed instance row."""

    name: str
    uuid: str
    vm_state: str
    task_state: str | None
    power_state: str


def committed_rows(database: str) -> dict[str, Row]:
    """The instance rows as committed, read by a connection of our own (read-only)."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT name, uuid, vm_state, task_state, power_state FROM instances"
        ).fetchall()
    return {name: Row(name, uuid, vm, task, power) for name, uuid, vm, task, power in rows}


def vm_processes(data_dir: str) -> dict[str, VMProcess]:
    """Every live VM process whose QMP socket is under ``data_dir/run``, by run dir."""
    return fence.vm_processes(os.path.join(data_dir, "run"))


def vm_answers(run_dir: str) -> bool:
    """The VM process serves: its QMP socket accepts, and its guest side answers a probe.

    The daemon holds the VM's one QMP session (QEMU serves monitor clients one
    after another), so the probe's answer comes from the guest's control socket:
    an unknown word, answered with an error line by the VM's own event loop.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as qmp:
            qmp.settimeout(PROBE_TIMEOUT)
            qmp.connect(os.path.join(run_dir, "qmp.sock"))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
            control.settimeout(PROBE_TIMEOUT)
            control.connect(os.path.join(run_dir, "qmp.sock.guest", "control"))
            control.sendall(b"probe\n")
            return control.recv(256).startswith(b"error: unknown action")
    except OSError:
        return False


def run_dir_of(data_dir: str, instance_uuid: str) -> str:
    """An instance's run dir."""
    return os.path.join(data_dir, "run", run_dir_name(instance_uuid))


class Guests:
    """The guests' side: one real agent process per VM boot, dying with its VM.

    A fakeqemu guest is a host process, so its agent is one too (the config
    drive's zipapp, as ``tests/system.py`` runs it).  ``sync`` starts an agent for
    each VM process that has none and kills the agent of a VM that is gone (a
    guest's processes die with it). Ready PATCHes are remembered per boot:
    ``attempted`` (sent to the agent) and ``acknowledged`` (answered 2xx).
    """

    def __init__(self, data_dir: str, log_dir: str) -> None:
        self.data_dir = data_dir
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        # run dir → (the VM pid it serves, the agent process)
        self.agents: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
        self.attempted: dict[str, int] = {}
        self.acknowledged: dict[str, int] = {}
        self._logs: list[IO[bytes]] = []

    def sync(self) -> None:
        """Agents for the VMs that run; none for those that do not."""
        vms = vm_processes(self.data_dir)
        for run_dir, (pid, agent) in list(self.agents.items()):
            vm = vms.get(run_dir)
            if vm is None or vm.pid != pid or agent.poll() is not None:
                self._kill(agent)
                del self.agents[run_dir]
        for run_dir, vm in vms.items():
            if run_dir in self.agents:
                continue
            drive = os.path.join(run_dir, CONFIG_DRIVE)
            ports = os.path.join(run_dir, "qmp.sock.guest", "virtio-ports")
            booted = all(
                os.path.exists(os.path.join(ports, port))
                for port in ("com.canonical.lxd", "vmready.connect")
            )
            if not booted or not os.path.exists(os.path.join(drive, AGENT_CONFIG)):
                continue  # the guest has not booted as far as its agent yet
            log = open(os.path.join(self.log_dir, f"agent-{vm.pid}.log"), "ab")  # noqa: SIM115
            self._logs.append(log)
            zipapp = os.path.join(drive, AGENT_ZIPAPP)
            argv = [sys.executable, "-S", "-I", zipapp, "--config-drive", drive]
            agent = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
            self.agents[run_dir] = (vm.pid, agent)

    def agent_pid_for(self, run_dir: str) -> int | None:
        """The VM pid whose agent runs for ``run_dir``, if one runs."""
        held = self.agents.get(run_dir)
        if held is None or held[1].poll() is not None:
            return None
        return held[0]

    def devlxd_socket(self, run_dir: str) -> str | None:
        """Where the agent of ``run_dir`` serves its guest programs."""
        try:
            with open(os.path.join(run_dir, CONFIG_DRIVE, AGENT_CONFIG)) as f:
                settings: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            return None
        return str(settings["devlxd_socket"])

    @staticmethod
    def _kill(agent: subprocess.Popen[bytes]) -> None:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                agent.send_signal(signal.SIGKILL)
            agent.wait()

    def stop(self) -> None:
        """Every agent killed, every log closed."""
        for _, agent in self.agents.values():
            self._kill(agent)
        self.agents.clear()
        for log in self._logs:
            log.close()


def kill_vms(data_dir: str) -> None:
    """At the end: every VM process left under the data dir, SIGKILLed."""
    fence.kill_vms(os.path.join(data_dir, "run"))
