"""What the vmready daemon costs for 100 and 1,000 instances on fakeqemu.

For each count N, a fresh ``fakeqemu-host`` runs every VM in one process and a
fresh ``twistd -n vmready`` daemon is started with ``FAKEQEMU_HOST=<its control
socket>`` in its environment: the daemon starts each VM as it starts QEMU (one
short-lived ``python -m fakeqemu ... -daemonize`` launcher per VM), and the
launcher hands the VM to the host.  Then:

- **launch to ACTIVE**: N instances are created through the API
  (``POST /1.0/instances``), at most ``--concurrency`` at a time; for each, the
  time from sending the POST until the ``/1.0/events`` stream reports its
  vm_state ``active`` (median, p99 by nearest rank, max);
- **peak RSS**: ``VmHWM`` of the twistd process once the N VMs run;
- **idle CPU**: CPU seconds the daemon uses over ``--idle-seconds`` with nothing
  happening but the power sync at its default interval (10 s), as a percentage
  of one CPU;
- **power-sync round**: the daemon is stopped (its VMs keep running), a
  ``Lifecycle`` over the same store and run directory is built in this process,
  ``lifecycle.recovery.recover`` re-adopts the N VMs through their QMP sockets
  (timed too), and ``lifecycle.power_sync.sync_power_states`` is timed over
  ``--sync-rounds`` rounds.

Once, without VMs: **daemon start time** from spawning twistd until the API
answers and the daemon has logged that recovery ran, with an empty store and
with ``--rows`` (10,000) stopped instances written directly through
``vmready.store.sqlite.Store``.

Everything started here (host, daemons, VMs, directories under /tmp) is torn
down at the end.  Figures only: nothing here passes or fails.

    .venv/bin/python benchmarks/lifecycle.py --counts 100,1000
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Sequence
from typing import IO, Any, TypeVar

from twisted.internet import reactor as installed_reactor
from twisted.internet import task
from twisted.internet.defer import Deferred, DeferredSemaphore, TimeoutError, gatherResults
from twisted.logger import globalLogPublisher

from benchmarks._children import FAKEQEMU_HOST, START_TIMEOUT, TWISTD, host_answers
from benchmarks._measure import (
    cpu_seconds,
    mib,
    ms,
    nearest_rank,
    open_files,
    report,
    show_problems,
    sleep,
    status_kib,
)
from vmready.cli import Client, CommandError
from vmready.daemon import Options
from vmready.domain import READY_KEY, PowerState, TaskState, VMState, raise_file_limit
from vmready.hypervisor import HypervisorDriver
from vmready.lifecycle import EventBus, Lifecycle
from vmready.store import Store

LAUNCH_TIMEOUT = 300.0
STOP_TIMEOUT = 60.0
POLL_SECONDS = 0.01
RECOVERED = re.compile(rb"recovered (\d+) instances")
RECOVERY_FAILED = b"recovering instances failed"

reactor: Any = installed_reactor
# The daemons run with twistd's default --power-sync-interval.
DEFAULT_SYNC_INTERVAL = float(Options()["power-sync-interval"])
T = TypeVar("T")


# -- figures ------------------------------------------------------------------


async def timed(step: Awaitable[T]) -> tuple[float, T]:
    """Await ``step``; how long it took, and its result."""
    started = time.perf_counter()
    result = await step
    return time.perf_counter() - started, result


# -- processes ------------------------------------------------------------------


class Processes:
    """Every process this benchmark started, so that nothing outlives it."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen[bytes]] = []

    def spawn(
        self, argv: Sequence[str], log: IO[bytes], environment: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` with stdout and stderr to ``log``."""
        process = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env=environment
        )
        self._running.append(process)
        return process

    async def stop(self, process: subprocess.Popen[bytes]) -> float:
        """SIGTERM ``process`` (SIGKILL after STOP_TIMEOUT); the seconds it took to exit."""
        started = time.perf_counter()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                break
            await sleep(POLL_SECONDS)
        if process in self._running:
            self._running.remove(process)
        return time.perf_counter() - started

    def kill_all(self) -> None:
        """Last resort on the way out: SIGTERM what still runs, then SIGKILL."""
        for process in self._running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._running:
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._running.clear()


async def start_host(processes: Processes, directory: str) -> tuple[subprocess.Popen[bytes], str]:
    """A ``fakeqemu-host`` serving on ``<directory>/host.ctl``, once it answers."""
    control = os.path.join(directory, "host.ctl")
    log = open(os.path.join(directory, "host.log"), "wb")  # noqa: SIM115 - the child keeps it
    with log:
        host = processes.spawn([FAKEQEMU_HOST, "--control", control, "serve"], log)
    await host_answers(control, lambda: host.poll() is None, log.name)
    return host, control


class Daemon:
    """One ``twistd -n vmready`` process and how far its start has got."""

    def __init__(
        self, processes: Processes, data_dir: str, host_control: str | None = None
    ) -> None:
        self.processes = processes
        self.data_dir = data_dir
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        self.socket = os.path.join(data_dir, "vmready.sock")
        self.log_path = os.path.join(data_dir, "twistd.log")
        self.output_path = os.path.join(data_dir, "twistd.out")
        environment = dict(os.environ)
        environment.pop("FAKEQEMU_HOST", None)
        environment.pop("FAKEQEMU_GUEST_DIR", None)
        if host_control is not None:
            environment["FAKEQEMU_HOST"] = host_control
        argv = [TWISTD, "-n", "--pidfile", "", "--logfile", self.log_path]
        argv += ["vmready", "--config", "", "--data-dir", data_dir]
        argv += ["--listen", f"unix:{self.socket}"]
        output = open(self.output_path, "wb")  # noqa: SIM115 - the child keeps it
        with output:
            self.started = time.perf_counter()
            self.process = processes.spawn(argv, output, environment)
        self.client = Client(reactor, self.socket)

    @property
    def pid(self) -> int:
        """The twistd process."""
        return self.process.pid

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            with open(self.output_path, "rb") as f:
                said = f.read().decode("utf-8", "replace").strip()
            raise SystemExit(
                f"the daemon exited with status {self.process.returncode}: {said}\n"
                f"(log: {self.log_path})"
            )
        if time.perf_counter() - self.started > START_TIMEOUT:
            raise SystemExit(f"the daemon did not start within {START_TIMEOUT:g}s")

    async def _api_answers(self) -> float:
        while True:
            self._check_alive()
            try:
                await self.client.get("/1.0")
                return time.perf_counter() - self.started
            except CommandError:
                await sleep(POLL_SECONDS)

    async def _recovery_logged(self) -> float:
        offset = 0
        pending = b""
        while True:
            self._check_alive()
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if RECOVERY_FAILED in line:
                    raise SystemExit(f"the daemon's recovery failed; see {self.log_path}")
                if RECOVERED.search(line):
                    return time.perf_counter() - self.started
            await sleep(POLL_SECONDS)

    async def ready(self) -> tuple[float, float]:
        """Seconds from spawning until the API answered, and until recovery was logged."""
        answered, recovered = await gatherResults(
            [
                Deferred.fromCoroutine(self._api_answers()),
                Deferred.fromCoroutine(self._recovery_logged()),
            ]
        )
        return answered, recovered

    async def stop(self) -> float:
        """Stop the daemon as an operator does (SIGTERM); the seconds it took."""
        return await self.processes.stop(self.process)


# -- launch to ACTIVE -----------------------------------------------------------


class Launches:
    """Launches instances through the API and times each until the events say ACTIVE."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._waiting: dict[str, Deferred[float]] = {}
        self._errors: dict[str, str] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        """A lifecycle event: fire the waiter of an instance that reached active or error."""
        metadata = event.get("metadata") or {}
        name = str(metadata.get("source", "")).removeprefix("/1.0/instances/")
        context = metadata.get("context") or {}
        action = metadata.get("action")
        if action == "instance-error":
            self._errors[name] = str(context.get("error"))
        if action != "instance-state":
            return
        vm_state = context.get("vm_state")
        waiter = self._waiting.get(name)
        if waiter is None or waiter.called:
            return
        if vm_state == VMState.ACTIVE.value:
            waiter.callback(time.perf_counter())
        elif vm_state == VMState.ERROR.value:
            waiter.errback(RuntimeError(self._errors.get(name) or "vm_state error"))

    async def launch(self, name: str) -> float:
        """POST one instance; the seconds until its vm_state is active."""
        arrived: Deferred[float] = Deferred()
        self._waiting[name] = arrived
        started = time.perf_counter()
        try:
            await self.client.request(
                "POST", "/1.0/instances", {"name": name, "config": {}, "start": True}
            )
            active_at = await arrived.addTimeout(LAUNCH_TIMEOUT, reactor)
        finally:
            del self._waiting[name]
        return active_at - started

    async def run(self, names: Sequence[str], concurrency: int) -> tuple[list[float], list[str]]:
        """Launch every name, ``concurrency`` in flight; durations and failures."""
        durations: list[float] = []
        failures: list[str] = []
        semaphore = DeferredSemaphore(concurrency)

        async def one(name: str) -> None:
            try:
                durations.append(await self.launch(name))
            except TimeoutError:
                failures.append(f"{name}: not active within {LAUNCH_TIMEOUT:g}s")
            except (CommandError, RuntimeError) as e:
                failures.append(f"{name}: {e}")

        def start(name: str) -> Deferred[None]:
            return Deferred.fromCoroutine(one(name))

        stream = await self.client.events(["lifecycle"], self.on_event)
        try:
            await gatherResults([semaphore.run(start, name) for name in names])
        finally:
            stream.close()
            await stream.ended
        return durations, failures


# -- the measurements -------------------------------------------------------------


async def measure_count(
    processes: Processes, directory: str, count: int, args: argparse.Namespace
) -> None:
    """Every per-count figure for ``count`` instances."""
    os.makedirs(directory)
    host, control = await start_host(processes, directory)
    try:
        data_dir = os.path.join(directory, "d")
        daemon = Daemon(processes, data_dir, control)
        await daemon.ready()
        report(f"\n{count} instances (daemon pid {daemon.pid}, fakeqemu-host pid {host.pid})")

        names = [f"i{index}" for index in range(count)]
        launches = Launches(daemon.client)
        seconds, (durations, failures) = await timed(launches.run(names, args.concurrency))
        report(
            f"  launch:        {len(durations)} ACTIVE in {seconds:.1f} s "
            f"({len(durations) / seconds:.1f}/s, {args.concurrency} in flight)"
        )
        if durations:
            report(
                f"  launch→ACTIVE: median {ms(statistics.median(durations))}, "
                f"p99 {ms(nearest_rank(durations, 0.99))}, max {ms(max(durations))}"
            )
        if failures:
            report(f"  failed:        {len(failures)}, e.g. {failures[0]}")

        running_hwm = status_kib(daemon.pid, "VmHWM")
        before = cpu_seconds(daemon.pid)
        await sleep(args.idle_seconds)
        used = cpu_seconds(daemon.pid) - before
        report(
            f"  daemon RSS:    peak (VmHWM) {mib(running_hwm)} after launching; "
            f"{mib(status_kib(daemon.pid, 'VmRSS'))} now, {open_files(daemon.pid)} fds"
        )
        report(
            f"  idle CPU:      {used:.2f} CPU s in {args.idle_seconds:g} s = "
            f"{100 * used / args.idle_seconds:.2f}% of one CPU "
            f"(power sync every {DEFAULT_SYNC_INTERVAL:g} s, the default)"
        )
        report(f"  daemon stop:   {await daemon.stop():.2f} s (SIGTERM; the VMs keep running)")
        await measure_power_sync(data_dir, count, args.sync_rounds)
    finally:
        await processes.stop(host)
        shutil.rmtree(directory, ignore_errors=True)


async def measure_power_sync(data_dir: str, count: int, rounds: int) -> None:
    """Re-adopt the daemon's running VMs in this process and time power-sync rounds."""
    store = Store.open(os.path.join(data_dir, "vmready.sqlite"))
    lifecycle = Lifecycle(
        reactor,
        store,
        HypervisorDriver(reactor, "fakeqemu"),
        EventBus(reactor.seconds),
        os.path.join(data_dir, "run"),
    )
    try:
        seconds, _ = await timed(lifecycle.recovery.recover())
        adopted = len(lifecycle.running.vms)
        report(
            f"  re-adopt:      {adopted} of {count} running VMs in {seconds:.2f} s "
            f"(lifecycle.recovery.recover, in-process)"
        )
        samples = []
        for _ in range(rounds):
            seconds, _ = await timed(lifecycle.power_sync.sync_power_states())
            samples.append(seconds)
        median = statistics.median(samples)
        report(
            f"  power sync:    one round over {adopted} running instances: median {ms(median)} "
            f"({ms(median / max(adopted, 1))} each; {rounds} rounds, "
            f"min {ms(min(samples))}, max {ms(max(samples))})"
        )
        unchanged = sum(
            record.power_state is PowerState.RUNNING
            for record in lifecycle.store.view.list_instances()
        )
        if unchanged != count:
            report(f"  note:          {unchanged} of {count} still running after the rounds")
    finally:
        await lifecycle.shutdown()
        store.close()


def write_stopped_rows(path: str, rows: int) -> None:
    """A store with ``rows`` stopped instances, as a stop leaves them (ready key "false")."""
    store = Store.open(path)
    try:
        for index in range(rows):
            name = f"s{index}"
            store.instances.create_instance(name, {"limits.memory": "64", "limits.cpu": "1"}, {})
            store.instances.finish_task(
                name,
                TaskState.SPAWNING,
                VMState.STOPPED,
                PowerState.SHUTDOWN,
                {READY_KEY: "false"},
            )
    finally:
        store.close()


async def measure_start(processes: Processes, directory: str, rows: int) -> None:
    """Daemon start time with an empty store and with ``rows`` stopped instances."""
    report("\ndaemon start (twistd spawned → API answers / recovery logged; no VMs)")
    for count in (0, rows):
        data_dir = os.path.join(directory, f"start{count}")
        os.makedirs(data_dir)
        if count:
            started = time.perf_counter()
            write_stopped_rows(os.path.join(data_dir, "vmready.sqlite"), count)
            seconds = time.perf_counter() - started
            report(f"  store:         {count:,} stopped instances written in {seconds:.1f} s")
        daemon = Daemon(processes, data_dir)
        try:
            answered, recovered = await daemon.ready()
            report(
                f"  {count:>6,} rows:   API answers after {answered:.2f} s, "
                f"recovery logged after {recovered:.2f} s; "
                f"peak RSS {mib(status_kib(daemon.pid, 'VmHWM'))}"
            )
        finally:
            await daemon.stop()
            shutil.rmtree(data_dir, ignore_errors=True)


async def run(args: argparse.Namespace, processes: Processes, directory: str) -> None:
    """All measurements, in order."""
    report(
        f"vmready lifecycle benchmark: fakeqemu, {os.cpu_count()} CPUs, "
        f"counts {', '.join(str(c) for c in args.counts)}"
    )
    await measure_start(processes, directory, args.rows)
    for count in args.counts:
        await measure_count(processes, os.path.join(directory, f"n{count}"), count, args)


def counts(text: str) -> list[int]:
    """``100,1000`` as a list of counts."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"counts must be 1 or more: {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--counts", type=counts, default=[100, 1000], help="instance counts (default 100,1000)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="launches in flight at once (default 16)"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=10.0, help="idle CPU window (default 10)"
    )
    parser.add_argument(
        "--rows", type=int, default=10_000, help="stopped instance rows for the start time"
    )
    parser.add_argument(
        "--sync-rounds", type=int, default=5, help="power-sync rounds timed (default 5)"
    )
    args = parser.parse_args(argv)
    raise_file_limit()
    globalLogPublisher.addObserver(show_problems)
    directory = tempfile.mkdtemp(prefix="vmrb-", dir="/tmp")
    processes = Processes()
    started = time.perf_counter()

    def entry(_reactor: Any) -> Deferred[None]:
        return Deferred.fromCoroutine(run(args, processes, directory))

    try:
        task.react(entry, [])
    finally:
        processes.kill_all()
        shutil.rmtree(directory, ignore_errors=True)
        print(f"\ntotal: {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
