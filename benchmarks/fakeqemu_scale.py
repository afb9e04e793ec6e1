"""How many fakeqemu VMs fit on one host process, and what they cost.

Starts ``fakeqemu-host``, launches N VMs on it the way vmready would start QEMU
(``FAKEQEMU_HOST=<control> fakeqemu-system-x86_64 ... -daemonize``), each with a
QMP socket, a virtio-serial bus, a 4096-byte ring buffer wired to
``com.canonical.lxd`` and the legacy ``org.linuxcontainers.lxd`` port; connects
to every monitor, drains every ring buffer once, prints the figures and tears
everything down.  Figures only: nothing here passes or fails.

    .venv/bin/python benchmarks/fakeqemu_scale.py --vms 1000
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred, gatherResults

from benchmarks._children import host_answering
from benchmarks._measure import mib, open_files, status_kib
from vmready.domain import default_reactor, raise_file_limit
from vmready.protocols.qmp import QMPClientProtocol, connect_qmp

installed_reactor = default_reactor()

BIN_DIRECTORY = os.path.dirname(os.path.abspath(sys.executable))
FAKEQEMU = os.path.join(BIN_DIRECTORY, "fakeqemu-system-x86_64")
FAKEQEMU_HOST = os.path.join(BIN_DIRECTORY, "fakeqemu-host")
RING = "vmready"
RING_SIZE = 4096
START_TIMEOUT = 60.0

reactor: Any = installed_reactor


def vm_arguments(index: int, qmp: str) -> list[str]:
    """The command line of one VM, as vmready gives it."""
    return [
        "-name",
        f"bench{index}",
        "-machine",
        "q35",
        "-accel",
        "tcg",
        "-nodefaults",
        "-display",
        "none",
        "-m",
        "64",
        "-qmp",
        f"unix:{qmp},server=on,wait=off",
        "-chardev",
        f"ringbuf,id={RING},size={RING_SIZE}",
        "-device",
        "virtio-serial-pci,id=vs0",
        "-device",
        f"virtserialport,chardev={RING},name=com.canonical.lxd,bus=vs0.0",
        "-device",
        "virtserialport,name=org.linuxcontainers.lxd,bus=vs0.0",
        "-daemonize",
    ]


def wait_for_host(control: str, host: subprocess.Popen[bytes]) -> None:
    """Block until the host answers on its control socket."""
    deadline = time.monotonic() + START_TIMEOUT
    while not host_answering(control):
        if host.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("fakeqemu-host did not start; see its log")
        time.sleep(0.05)


def launch_all(control: str, sockets: Sequence[str], launchers: int) -> float:
    """Launch one VM per socket through launcher processes; the seconds it took."""
    environment = {**os.environ, "FAKEQEMU_HOST": control}
    environment.pop("FAKEQEMU_GUEST_DIR", None)

    def launch(index: int) -> None:
        completed = subprocess.run(
            [FAKEQEMU, *vm_arguments(index, sockets[index])],
            env=environment,
            capture_output=True,
            check=False,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"VM {index} refused: {completed.stderr.decode()}")

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=launchers) as pool:
        list(pool.map(launch, range(len(sockets))))
    return time.monotonic() - started


async def timed(step: Callable[[], Deferred[Any]]) -> tuple[float, Any]:
    """Run ``step`` and return how long it took with its result."""
    started = time.monotonic()
    result = await step()
    return time.monotonic() - started, result


async def measure_monitors(
    sockets: Sequence[str], host_pid: int, report: Callable[[str], None]
) -> None:
    """Connect to every monitor, then time one ringbuf-read round over all VMs."""
    clients: list[QMPClientProtocol] = []
    try:
        seconds, connected = await timed(
            lambda: gatherResults(
                [connect_qmp(reactor, path, timeout=START_TIMEOUT) for path in sockets]
            )
        )
        clients = list(connected)
        report(f"QMP connect:        {len(clients)} monitors negotiated in {seconds:.2f} s")
        report(f"host fds connected: {open_files(host_pid)} with every monitor connected")

        def read(client: QMPClientProtocol) -> Deferred[Any]:
            return client.execute("ringbuf-read", {"device": RING, "size": RING_SIZE})

        seconds, _ = await timed(lambda: gatherResults([read(c) for c in clients]))
        report(
            f"ringbuf-read round: {len(clients)} reads in flight at once: {seconds:.3f} s "
            f"({len(clients) / seconds:.0f} reads/s)"
        )
        started = time.monotonic()
        for client in clients:
            await read(client)
        seconds = time.monotonic() - started
        report(
            f"ringbuf-read round: {len(clients)} reads one at a time:    {seconds:.3f} s "
            f"({seconds / len(clients) * 1000:.2f} ms per read)"
        )
        report(f"host RSS connected: {mib(status_kib(host_pid))} with every monitor connected")
    finally:
        for client in clients:
            client.close()
        await gatherResults([client.when_closed() for client in clients])


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vms", type=int, default=1000, help="how many VMs (default 1000)")
    parser.add_argument(
        "--launchers",
        type=int,
        default=2 * (os.cpu_count() or 1),
        help="launcher processes running at once (default: twice the CPU count)",
    )
    args = parser.parse_args(argv)
    raise_file_limit()
    directory = tempfile.mkdtemp(prefix="fqbench-", dir="/tmp")
    control = os.path.join(directory, "control")
    log = open(os.path.join(directory, "host.log"), "wb")  # noqa: SIM115 - closed below
    host = subprocess.Popen(
        [FAKEQEMU_HOST, "--control", control, "serve"], stdout=log, stderr=subprocess.STDOUT
    )

    def report(line: str) -> None:
        print(line, flush=True)

    try:
        wait_for_host(control, host)
        report(
            f"fakeqemu scale: {args.vms} VMs on one fakeqemu-host (pid {host.pid}), "
            f"{os.cpu_count()} CPUs, {args.launchers} launchers at once"
        )
        baseline_rss, baseline_fds = status_kib(host.pid), open_files(host.pid)
        sockets = [os.path.join(directory, f"vm{index}.qmp") for index in range(args.vms)]
        seconds = launch_all(control, sockets, args.launchers)
        report(
            f"launch:             {args.vms} VMs in {seconds:.1f} s "
            f"({args.vms / seconds:.1f} VMs/s, each by its own fakeqemu-system-x86_64)"
        )
        rss, fds = status_kib(host.pid), open_files(host.pid)
        report(
            f"host RSS:           {mib(baseline_rss)} empty, {mib(rss)} with {args.vms} VMs: "
            f"{(rss - baseline_rss) / args.vms:.1f} KiB per VM"
        )
        report(
            f"host open fds:      {baseline_fds} empty, {fds} with {args.vms} VMs: "
            f"{(fds - baseline_fds) / args.vms:.1f} per VM"
        )
        task.react(
            lambda _reactor: Deferred.fromCoroutine(measure_monitors(sockets, host.pid, report)),
            [],
        )
    finally:
        started = time.monotonic()
        host.send_signal(signal.SIGTERM)
        try:
            host.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()
        print(f"teardown:           host stopped in {time.monotonic() - started:.2f} s")
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
