"""How long a real guest takes from launch to READY, phase by phase, under real QEMU.

Builds (or reuses) the guest, starts a fresh ``twistd -n vmready --hypervisor
qemu`` in a temporary data dir, then boots the guest ``--boots`` times, one
after the other.  ``--image demo`` (the default) is the demo guest
(``vmready.hypervisor.guestimage``: the loader baked in, a stand-in for
cloud-init); ``--image stock`` is the stock-like cloud image
(``vmready.hypervisor.guestimage.stock``: Debian's cloud kernel and cloud-init,
nothing of vmready), whose agent comes from the NoCloud seed's vendor-data and
whose cloud-config ``runcmd`` declares Ready.  Each boot is one
``POST /1.0/instances`` with the guest's image, kernel and initrd, and a
workload (its user-data) that declares Ready as soon as the agent takes it;
a ``vmready wait NAME status=ready`` client is started right after the POST.

Every lifecycle event (``/1.0/events``) and every line of the guest's console
log is stamped with this host's clock as it arrives; the guest's own times
(kernel timestamps, the demo initramfs's and the agent's dated lines) are put
on the same clock through the kernel's start (``_bootphases``).  Each boot's
milestones are printed, then per milestone the median time from the POST and
the median phase (from the milestone before).  ``--restarts N`` then restarts
the READY guest N times (``PUT …/state {"action": "restart"}``, what
``vmready restart`` sends) and dates each back to READY the same way.

Each instance is deleted before the next boot.  The accelerator is the
daemon's choice (``--accel auto``: KVM where a guest runs under it, else
TCG), and is printed with its reason.  Figures only: nothing here passes or
fails.  The last line is exactly ``connected_s=<median> ready_s=<median>
accel=<kvm|tcg> phases=<name>:<median phase>,…`` for the demo guest (and
``restart_s=<median>`` before ``accel`` with ``--restarts``),
``image=stock ready_s=<median> accel=<kvm|tcg> phases=…`` for the stock image.

    .venv/bin/python benchmarks/real_guest.py --boots 5 --restarts 1
    .venv/bin/python benchmarks/real_guest.py --image stock --boots 3
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from benchmarks._bootphases import (
    MILESTONES,
    ConsoleLine,
    medians,
    phase_durations,
    timeline,
)
from benchmarks._children import START_TIMEOUT, TWISTD
from vmready.hypervisor.guestimage import ensure_guest, ensure_stock_guest

BOOT_TIMEOUT = 600.0
# The host's milestones: the lifecycle event that dates each.
HOST_EVENTS = (
    ("started", "instance-agent-started"),
    ("connected", "instance-agent-connected"),
    ("ready", "instance-ready"),
)
POLL = 0.01
WORKLOAD = """#!/bin/sh
until vmready-agent notify ready --timeout 5; do sleep 0.1; done
"""
# The same, as a stock image's cloud-init runs it (in its last stage).
STOCK_WORKLOAD = """#cloud-config
runcmd:
  - [sh, -c, 'until vmready-agent notify ready --timeout 5; do sleep 0.1; done']
"""


@attrs.frozen
class BootFiles:
    """What a boot is launched from: image, kernel, initrd, command line, user-data, memory."""

    image: str
    kernel: str
    initrd: str
    append: str
    user_data: str
    memory_mib: int = 512


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("vmready", timeout=60)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.unix_path)


def request(socket_path: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    """One operator API request; its envelope."""
    connection = _UnixHTTP(socket_path)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=payload)
        answer: dict[str, Any] = json.loads(connection.getresponse().read())
        return answer
    finally:
        connection.close()


class Events:
    """The lifecycle event stream, each event stamped with when it arrived here (a thread)."""

    def __init__(self, socket_path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self.sock.sendall(b"GET /1.0/events?type=lifecycle HTTP/1.0\r\nHost: vmready\r\n\r\n")
        self.seen: list[tuple[float, str, str]] = []  # (arrival, action, instance name)
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += self.sock.recv(65536)
        buffer = buffer.partition(b"\r\n\r\n")[2]
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    metadata = json.loads(line).get("metadata") or {}
                    source = str(metadata.get("source", ""))
                    action = str(metadata.get("action", ""))
                    self.seen.append((time.monotonic(), action, source.rpartition("/")[2]))
            chunk = self.sock.recv(65536)
            if not chunk:
                self.closed = True
                return
            buffer += chunk

    def first(self, name: str, action: str, after: float, deadline: float) -> float:
        """When the first ``action`` about ``name`` since ``after`` arrived (waiting for it)."""
        while True:
            for arrived, seen_action, seen_name in list(self.seen):
                if arrived >= after and seen_action == action and seen_name == name:
                    return arrived
            if self.closed:
                raise SystemExit("the daemon closed the event stream")
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: no {action} within {BOOT_TIMEOUT:g}s")
            time.sleep(POLL)


class Consoles:
    """Every console log under the data dir, line by line, each stamped on arrival (a thread)."""

    def __init__(self, data_dir: str) -> None:
        self.pattern = os.path.join(data_dir, "run", "*", "console.log")
        self.lines: dict[str, list[ConsoleLine]] = {}
        self._read: dict[str, tuple[int, bytes]] = {}
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        while True:
            for path in glob.glob(self.pattern):
                offset, partial = self._read.get(path, (0, b""))
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except OSError:
                    continue
                now = time.monotonic()
                *complete, partial = (partial + data).split(b"\n")
                self.lines.setdefault(path, []).extend(
                    ConsoleLine(now, line.decode("utf-8", "replace").rstrip("\r"))
                    for line in complete
                )
                self._read[path] = (offset + len(data), partial)
            time.sleep(POLL)

    def since(self, name: str, after: float) -> list[ConsoleLine]:
        """``name``'s console lines that arrived after ``after``."""
        mark = f"--- vmready: starting {name}: "
        for lines in list(self.lines.values()):
            if any(line.text.startswith(mark) for line in lines):
                return [line for line in lines if line.arrived >= after]
        return []


def boot_files(image: str, cache: str) -> BootFiles:
    """Build or reuse ``image`` (demo or stock): what its boots are launched from."""
    if image == "stock":
        stock = ensure_stock_guest(
            os.path.join(os.path.dirname(cache), "stock"), lambda line: None
        )
        # cloud-init's Python runs in four stages: 1 GiB, as a cloud gives a small VM.
        return BootFiles(
            stock.stock, stock.kernel, stock.initrd, stock.append, STOCK_WORKLOAD, 1024
        )
    guest = ensure_guest(cache, log=lambda line: None)
    kernel = guest.vmlinux or guest.kernel
    return BootFiles(guest.image, kernel, guest.initrd, guest.append, WORKLOAD)


@attrs.frozen
class Bench:
    """The daemon under measurement: its socket, its event stream, its guests' consoles."""

    socket_path: str
    events: Events
    consoles: Consoles

    def cli(self, *args: str) -> list[str]:
        """A ``vmready`` command line against this daemon."""
        return [sys.executable, "-m", "vmready.cli.main", "--socket", self.socket_path, *args]

    def measure(self, name: str, since: float, woken: Callable[[], float | None]) -> Boot:
        """The boot of ``name`` that began at ``since``, once READY: its milestones."""
        deadline = since + BOOT_TIMEOUT
        host = {
            phase: self.events.first(name, action, since, deadline)
            for phase, action in HOST_EVENTS
        }
        woke = woken()
        if woke is not None:
            host["woken"] = woke
        time.sleep(0.5)  # the agent's dated lines reach the console through the journal
        found = timeline(self.consoles.since(name, since), host, since)
        instance = request(self.socket_path, "GET", f"/1.0/instances/{name}")["metadata"]
        accel = instance["boot"]["accel"]
        return Boot(found, accel["current"], accel.get("reason") or "")


@attrs.frozen
class Boot:
    """One boot's milestones (seconds from its start), its accelerator and why."""

    milestones: dict[str, float]
    accel: str
    reason: str

    def describe(self) -> str:
        return ", ".join(
            f"{m.name} {self.milestones[m.name]:.2f}s"
            for m in MILESTONES
            if m.name in self.milestones
        )


def boot_once(bench: Bench, name: str, guest: BootFiles) -> Boot:
    """Launch ``name`` and date its boot from the POST; it is left READY."""
    config = {
        "limits.memory": str(guest.memory_mib),
        "limits.cpu": "2",
        "boot.image": guest.image,
        "boot.kernel": guest.kernel,
        "boot.initrd": guest.initrd,
        "boot.append": guest.append,
        "cloud-init.user-data": guest.user_data,
    }
    sent = time.monotonic()
    answer = request(
        bench.socket_path,
        "POST",
        "/1.0/instances",
        {"name": name, "config": config, "start": True},
    )
    if answer.get("type") == "error":
        raise SystemExit(f"launch {name}: {answer.get('error')}")
    waiter = subprocess.Popen(
        bench.cli("wait", name, "status=ready", "--timeout", str(int(BOOT_TIMEOUT))),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    woke: list[float] = []

    def wait_for_waiter() -> None:
        waiter.wait()
        woke.append(time.monotonic())

    watcher = threading.Thread(target=wait_for_waiter, daemon=True)
    watcher.start()

    def woken() -> float | None:
        watcher.join(BOOT_TIMEOUT)
        return woke[0] if woke and waiter.returncode == 0 else None

    return bench.measure(name, sent, woken)


def restart_once(bench: Bench, name: str) -> Boot:
    """Restart the READY ``name`` as ``vmready restart`` does, and date it back to READY."""
    sent = time.monotonic()
    answer = request(
        bench.socket_path, "PUT", f"/1.0/instances/{name}/state", {"action": "restart"}
    )
    if answer.get("type") == "error":
        raise SystemExit(f"restart {name}: {answer.get('error')}")
    return bench.measure(name, sent, lambda: None)


def delete(bench: Bench, name: str, keep: str | None) -> None:
    """Delete ``name``; with ``keep``, its console's lines first, as they arrived."""
    if keep is not None:
        with open(os.path.join(keep, f"console-{name}.txt"), "w") as f:
            f.writelines(
                f"{line.arrived:.3f} {line.text}\n" for line in bench.consoles.since(name, 0)
            )
    subprocess.run(bench.cli("delete", name, "--force"), check=True, capture_output=True)


def report(title: str, boots: list[Boot]) -> dict[str, float]:
    """The per-milestone medians of ``boots`` as a table; the median phases."""
    at = medians([boot.milestones for boot in boots])
    phases = medians([phase_durations(boot.milestones) for boot in boots])
    print()
    print(f"{title} ({len(boots)}): milestone    from start (median)   phase (median)")
    for milestone in MILESTONES:
        name = milestone.name
        if name in at:
            print(f"  {name:<10} {at[name]:9.2f}s {phases[name]:16.2f}s   {milestone.what}")
    return phases


def run(bench: Bench, guest: BootFiles, boots: int, restarts: int, keep: str | None) -> str:
    """Boot (and restart) the guest; the summary line."""
    cold: list[Boot] = []
    warm: list[Boot] = []
    for number in range(boots):
        name = f"bench{number}"
        boot = boot_once(bench, name, guest)
        cold.append(boot)
        print(f"boot {number + 1}/{boots} ({boot.accel}): {boot.describe()}", flush=True)
        if number == 0:
            print(f"  accelerator: {boot.accel} ({boot.reason})", flush=True)
        for again in range(restarts):
            warm.append(restart_once(bench, name))
            print(f"  restart {again + 1}/{restarts}: {warm[-1].describe()}", flush=True)
        delete(bench, name, keep)
    phases = report("cold boots", cold)
    if warm:
        report("restarts of a READY guest", warm)
    print(f"load average after the runs: {os.getloadavg()[0]:.2f}")
    accel = "kvm" if all(boot.accel == "kvm" for boot in cold) else "tcg"
    connected = statistics.median(boot.milestones["connected"] for boot in cold)
    ready = statistics.median(boot.milestones["ready"] for boot in cold)
    compact = ",".join(f"{name}:{value:.2f}" for name, value in phases.items())
    restart = ""
    if warm:
        restart = f" restart_s={statistics.median(b.milestones['ready'] for b in warm):.2f}"
    if guest.user_data == STOCK_WORKLOAD:
        return f"image=stock ready_s={ready:.2f}{restart} accel={accel} phases={compact}"
    return (
        f"connected_s={connected:.2f} ready_s={ready:.2f}{restart} accel={accel} phases={compact}"
    )


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--boots", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=0, help="restarts of each READY guest")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/vmready/guest"))
    parser.add_argument("--image", choices=("demo", "stock"), default="demo")
    parser.add_argument(
        "--keep", action="store_true", help="keep the data dir, the log and each boot's console"
    )
    args = parser.parse_args()
    print(f"building or reusing the {args.image} guest…", flush=True)
    guest = boot_files(args.image, args.cache)
    print(f"load average before the runs: {os.getloadavg()[0]:.2f}", flush=True)
    data_dir = tempfile.mkdtemp(prefix="vmr-bench-", dir="/tmp")
    socket_path = os.path.join(data_dir, "vmready.sock")
    command = [TWISTD, "-n", "--pidfile", "", "--logfile", os.path.join(data_dir, "log")]
    command += ["vmready", "--config", "", "--data-dir", data_dir, "--hypervisor", "qemu"]
    daemon = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(socket_path):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start; see {data_dir}/log")
            time.sleep(0.1)
        bench = Bench(socket_path, Events(socket_path), Consoles(data_dir))
        print(run(bench, guest, args.boots, args.restarts, data_dir if args.keep else None))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        kill_strays(data_dir)
        if args.keep:
            print(f"kept {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)


def kill_strays(data_dir: str) -> None:
    """VMs a failed run left behind: every process whose command line names the data dir."""
    needle = os.fsencode(data_dir + "/")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue


if __name__ == "__main__":
    main()
