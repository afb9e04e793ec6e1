"""Daemon start-up at scale: how soon the operator API serves with many instances in the store.

``--instances N`` (default 10,000) instances are written straight into a fresh
data dir's store (``vmready.store.sqlite.Store``, in batches), each ACTIVE,
RUNNING and Ready (``volatile.last_state.ready=true``), as a daemon that was
killed would leave them.  No VM runs for them: start-up reconciliation tries
to adopt each one (fakeqemu finds no process) and settles it stopped, so the
per-instance path of a start runs for every instance, but no QMP session is
opened (no VM really runs: adopting live VMs is not measured here).

Then the daemon is started in a child process (``--role daemon``) exactly as
``twistd -n vmready --data-dir D`` builds it (``vmready.daemon.tap.makeService``,
default options), logging to ``D/vmready.log``.  This process polls
``GET /1.0/instances`` on its unix socket every 2 ms from the moment it spawns
the child, and reports:

- ``start_s``: from spawning the child process (Python, Twisted and vmready
  imports included) until ``GET /1.0/instances`` first answers 200;
- ``serving_s``: from the child's ``startService`` (it writes the
  ``time.time()`` of that call to a file) until that same answer;
- ``ready_cleared``: how many of the N instances were no longer Ready in the
  store at that moment (read by a separate SQLite connection: only committed
  rows);
- on the line before: ``reconciled_s`` (from ``startService`` until the
  daemon's ``recovered`` fired, every instance reconciled), ``imports_s`` (from
  spawning the child to its ``startService``), the size of the first answer,
  and the slowest of ten more ``GET /1.0/instances`` made right after it, while
  the instances are being reconciled.  Written straight into the store, the
  instances have no config drives: their reconciliation includes issuing each
  one an agent certificate, as a daemon does for instances that lack one.

Figures only; nothing passes or fails.  ``--profile FILE`` runs the daemon
child's start under cProfile (from ``startService`` until the API listens) and
writes the stats to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from typing import Any

from vmready.domain import READY_KEY, PowerState, TaskState, VMState
from vmready.store import Store

SOCKET_NAME = "vmready.sock"
STARTED_FILE = "service-started"
RECOVERED_FILE = "service-recovered"
POLL_SECONDS = 0.002
DEADLINE = 300.0
GETS_WHILE_RECONCILING = 10


def fill_store(data_dir: str, count: int) -> None:
    """``count`` instances, ACTIVE, RUNNING and Ready, written in batches of 1,000."""
    store = Store.open(os.path.join(data_dir, "vmready.sqlite"))
    try:
        for first in range(0, count, 1000):
            with store.database.batch():
                for n in range(first, min(count, first + 1000)):
                    name = f"vm{n:05}"
                    store.instances.create_instance(name, {"user.bench": "startup"}, {})
                    store.instances.finish_task(
                        name,
                        TaskState.SPAWNING,
                        VMState.ACTIVE,
                        PowerState.RUNNING,
                        {READY_KEY: "true"},
                    )
    finally:
        store.close()


def ready_keys(data_dir: str) -> int:
    """How many instances are Ready (``volatile.last_state.ready=true``) in the committed store.

    A reconciled instance gets the key back as "false" (not Ready): that counts as cleared.
    """
    with sqlite3.connect(os.path.join(data_dir, "vmready.sqlite")) as db:
        rows = db.execute("SELECT config FROM instances").fetchall()
    return sum(1 for (config,) in rows if json.loads(config).get(READY_KEY) == "true")


def get_instances(socket_path: str) -> tuple[int, int] | None:
    """``GET /1.0/instances``: (status, body size), or None if nothing answers yet."""
    import http.client
    import socket

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(DEADLINE)
            self.sock.connect(socket_path)

    connection = Connection("localhost")
    try:
        connection.request("GET", "/1.0/instances")
        response = connection.getresponse()
        return response.status, len(response.read())
    except OSError:
        return None
    finally:
        connection.close()


def read_stamp(path: str) -> float:
    deadline = time.monotonic() + DEADLINE
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"startup.py: {path} never appeared")
        time.sleep(POLL_SECONDS)
    with open(path) as f:
        return float(f.read())


# -- the daemon child ---------------------------------------------------------


def run_daemon(data_dir: str, profile: str | None) -> None:
    """``--role daemon``: the service ``twistd -n vmready --data-dir D`` runs."""
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    from vmready.daemon import Options, makeService
    from vmready.domain import default_reactor

    reactor: Any = default_reactor()
    options = Options()
    options.parseOptions(["--data-dir", data_dir])
    service = makeService(options)
    log = open(os.path.join(data_dir, "vmready.log"), "a")  # noqa: SIM115 - for the process's life
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(log), [LogLevelFilterPredicate(LogLevel.info)])],
        redirectStandardIO=False,
    )
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()

    def stamp(name: str) -> None:
        with open(os.path.join(data_dir, name + ".tmp"), "w") as f:
            f.write(repr(time.time()))
        os.rename(os.path.join(data_dir, name + ".tmp"), os.path.join(data_dir, name))

    def start() -> None:
        if profiler is not None:
            profiler.enable()
        stamp(STARTED_FILE)
        service.startService()

    def serving(_: object) -> None:
        if profiler is not None and profile is not None:
            profiler.disable()
            profiler.dump_stats(profile)

    service.serving.addBoth(serving)
    service.recovered.addBoth(lambda _: stamp(RECOVERED_FILE))
    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run()


# -- the measurement ------------------------------------------------------------


def measure(count: int, keep: bool, profile: str | None) -> None:
    data_dir = tempfile.mkdtemp(prefix="vmready-startup-")
    try:
        began = time.perf_counter()
        fill_store(data_dir, count)
        print(f"wrote {count} instances in {time.perf_counter() - began:.2f} s", flush=True)
        before = ready_keys(data_dir)
        socket_path = os.path.join(data_dir, SOCKET_NAME)
        command = [sys.executable, os.path.abspath(__file__), "--role", "daemon"]
        command += ["--data-dir", data_dir] + (["--profile", profile] if profile else [])
        spawned_wall = time.time()
        spawned = time.perf_counter()
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        try:
            answer = None
            while answer is None or answer[0] != 200:
                if child.poll() is not None:
                    raise SystemExit(f"startup.py: the daemon exited with {child.returncode}")
                if time.perf_counter() - spawned > DEADLINE:
                    raise SystemExit("startup.py: the operator API never answered")
                answer = get_instances(socket_path) if os.path.exists(socket_path) else None
                if answer is None:
                    time.sleep(POLL_SECONDS)
            answered_wall = time.time()
            start_s = time.perf_counter() - spawned
            still_ready = ready_keys(data_dir)
            # The API while the instances are being reconciled: a few more GETs, timed.
            latencies = []
            for _ in range(GETS_WHILE_RECONCILING):
                asked = time.perf_counter()
                get_instances(socket_path)
                latencies.append(time.perf_counter() - asked)
            started = read_stamp(os.path.join(data_dir, STARTED_FILE))
            serving_s = answered_wall - started
            recovered = read_stamp(os.path.join(data_dir, RECOVERED_FILE))
            print(
                f"reconciled_s={recovered - started:.3f} imports_s={started - spawned_wall:.3f} "
                f"first_answer_bytes={answer[1]} "
                f"get_while_reconciling_max_s={max(latencies):.3f} "
                f"(of {GETS_WHILE_RECONCILING})",
                flush=True,
            )
        finally:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        print(
            f"instances={count} start_s={start_s:.3f} serving_s={serving_s:.3f} "
            f"ready_cleared={before - still_ready}",
            flush=True,
        )
    finally:
        if keep:
            print(f"kept {data_dir}", file=sys.stderr)
        else:
            shutil.rmtree(data_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--keep", action="store_true", help="keep the data dir")
    parser.add_argument("--profile", help="cProfile the daemon child into this file")
    parser.add_argument("--role", choices=("measure", "daemon"), default="measure")
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "daemon":
        run_daemon(args.data_dir, args.profile)
        return
    measure(args.instances, args.keep, args.profile)


if __name__ == "__main__":
    main()
