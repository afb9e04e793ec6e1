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
workload (its user-data) that declares Ready as soon as the agent takes it.
From the moment the POST is sent (the daemon makes the overlay and starts
QEMU at once), the ``/1.0/events`` stream dates each phase:

- **qemu**: QEMU runs and answers on its monitor (``instance-started``);
- **started**: the agent said STARTED on its serial port (``instance-agent-started``);
- **connected**: the agent reached the guest API over mutual TLS (``instance-agent-connected``);
- **ready**: the workload's Ready reached the daemon (``instance-ready``).

Each instance is deleted before the next boot.  The accelerator is the
daemon's choice (``--accel auto``: KVM where a guest runs under it, else
TCG), and is printed.  Figures only: nothing here passes or fails.  The last
line is exactly ``connected_s=<median> ready_s=<median> accel=<kvm|tcg>`` for
the demo guest, ``image=stock ready_s=<median> accel=<kvm|tcg>`` for the
stock image.

    .venv/bin/python benchmarks/real_guest.py --boots 5
    .venv/bin/python benchmarks/real_guest.py --image stock --boots 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import attrs

from vmready.hypervisor.guestimage.build import ensure_guest
from vmready.hypervisor.guestimage.stock import ensure_stock_guest

BIN_DIRECTORY = os.path.dirname(os.path.abspath(sys.executable))
TWISTD = os.path.join(BIN_DIRECTORY, "twistd")
START_TIMEOUT = 120.0
BOOT_TIMEOUT = 600.0
PHASES = (
    ("qemu", "instance-started"),
    ("started", "instance-agent-started"),
    ("connected", "instance-agent-connected"),
    ("ready", "instance-ready"),
)
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
    """The lifecycle event stream, each event stamped with when it arrived here."""

    def __init__(self, socket_path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self.sock.sendall(b"GET /1.0/events?type=lifecycle HTTP/1.0\r\nHost: vmready\r\n\r\n")
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(65536)
        self.buffer = self.buffer.partition(b"\r\n\r\n")[2]

    def until(self, name: str, action: str, deadline: float) -> float:
        """When ``action`` about ``name`` arrived (the first one from now)."""
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                event = json.loads(line)
                metadata = event.get("metadata") or {}
                source = str(metadata.get("source", ""))
                if metadata.get("action") == action and source.endswith(f"/{name}"):
                    return time.monotonic()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"{name}: no {action} within {BOOT_TIMEOUT:g}s")
            readable, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if readable:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise SystemExit("the daemon closed the event stream")
                self.buffer += chunk


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


def boot_once(socket_path: str, events: Events, name: str, guest: BootFiles) -> dict[str, float]:
    """Launch ``name``, date its phases from the POST, delete it; seconds per phase."""
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
        socket_path, "POST", "/1.0/instances", {"name": name, "config": config, "start": True}
    )
    if answer.get("type") == "error":
        raise SystemExit(f"launch {name}: {answer.get('error')}")
    deadline = sent + BOOT_TIMEOUT
    figures = {phase: events.until(name, action, deadline) - sent for phase, action in PHASES}
    accel = request(socket_path, "GET", f"/1.0/instances/{name}")["metadata"]["boot"]["accel"]
    figures["accel"] = 1.0 if accel["current"] == "kvm" else 0.0
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vmready.cli.main",
            "--socket",
            socket_path,
            "delete",
            name,
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    return figures


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--boots", type=int, default=5)
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/vmready/guest"))
    parser.add_argument("--image", choices=("demo", "stock"), default="demo")
    args = parser.parse_args()
    print(f"building or reusing the {args.image} guest…", flush=True)
    guest = boot_files(args.image, args.cache)
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
        events = Events(socket_path)
        runs = []
        for number in range(args.boots):
            figures = boot_once(socket_path, events, f"bench{number}", guest)
            runs.append(figures)
            accel = "kvm" if figures["accel"] else "tcg"
            print(
                f"boot {number + 1}/{args.boots} ({accel}): "
                + ", ".join(f"{phase} {figures[phase]:.2f}s" for phase, _ in PHASES),
                flush=True,
            )
        print()
        print("phase (from POST)    median      min      max")
        for phase, _ in PHASES:
            values = [run[phase] for run in runs]
            print(
                f"{phase:<18} {statistics.median(values):8.2f}s {min(values):7.2f}s "
                f"{max(values):7.2f}s"
            )
        accel = "kvm" if all(run["accel"] for run in runs) else "tcg"
        connected = statistics.median(run["connected"] for run in runs)
        ready = statistics.median(run["ready"] for run in runs)
        if args.image == "stock":
            print(f"image=stock ready_s={ready:.2f} accel={accel}")
        else:
            print(f"connected_s={connected:.2f} ready_s={ready:.2f} accel={accel}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        kill_strays(data_dir)
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
