"""A cluster on one PostgreSQL: event fan-out across members and the cost of a forwarded action.

A real PostgreSQL server is started in a temporary directory (``tests.postgres``:
``initdb`` + ``pg_ctl``, a unix socket only), ``--instances N`` (default 1,000)
stopped instances are written straight into its store, spread evenly over
``--members M`` (default 3) members, and M real ``twistd vmready`` daemons are
started on it, each a member (``--store postgresql://…``, ``--member-name``,
``--https-address 127.0.0.1:0``) with its own data dir and operator socket.

Then, with every member's ``/1.0/events`` stream subscribed (a thread each,
stamping each line with ``time.time()`` as it arrives):

- **fan-out**: ``--events K`` (default 300) config changes (``PATCH``) are made
  on the first member's own instances, one at a time; each makes one
  ``instance-updated`` event on that member, relayed to the others through
  PostgreSQL's ``NOTIFY``.  For each event and member, the latency is its
  arrival on that member's stream minus the event's own timestamp (stamped by
  the member that published it; all daemons run on this host's clock).  Printed
  per member: p50, p99 and max, the first member's own (local) stream included.
- **forwarded action**: ``--requests R`` (default 300) ``PATCH`` requests on one
  instance of the first member, sent alternately to the first member itself
  (local) and to the second (which forwards it over the members' mutual TLS),
  each timed from sending the request to its complete answer on the unix socket.
  Printed: p50, p99 of both and the overhead (forwarded minus local) at each.

Figures only; nothing passes or fails.  Needs PostgreSQL's server binaries
(Debian's ``postgresql``), as the tests do.
"""

from __future__ import annotations

import argparse
import contextlib
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
from datetime import datetime
from typing import Any

from tests.postgres import postgres_server
from vmready.domain import PowerState, TaskState, VMState
from vmready.store import Store

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
DEADLINE = 120.0


def _request(socket_path: str, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.0 request on the operator socket: status and body."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(DEADLINE)
        sock.connect(socket_path)
        head = f"{method} {target} HTTP/1.0\r\nHost: vmready\r\nContent-Length: {len(body)}\r\n"
        if body:
            head += "Content-Type: application/json\r\n"
        sock.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head_bytes, _, payload = answer.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), payload


class EventStream(threading.Thread):
    """A member's ``/1.0/events`` stream: every event with the time it arrived."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(daemon=True)
        self.arrivals: list[tuple[float, dict[str, Any]]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(socket_path)
        self._sock.sendall(b"GET /1.0/events?type=lifecycle HTTP/1.0\r\nHost: vmready\r\n\r\n")
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += self._sock.recv(65536)
        self._buffer = buffer.partition(b"\r\n\r\n")[2]
        self.start()

    def run(self) -> None:
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            arrived = time.time()
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    self.arrivals.append((arrived, json.loads(line)))

    def close(self) -> None:
        self._sock.close()


class Member:
    """One ``twistd vmready`` member in a data dir of its own."""

    def __init__(self, root: str, name: str, store: str) -> None:
        self.name = name
        self.directory = os.path.join(root, name)
        os.makedirs(self.directory)
        self.socket_path = os.path.join(self.directory, "vmready.sock")
        command = [TWISTD, "-n", "--pidfile", "", "--logfile", "vmready.log", "vmready"]
        command += ["--config", "", "--data-dir", self.directory, "--store", store]
        command += ["--member-name", name, "--https-address", "127.0.0.1:0"]
        self.process = subprocess.Popen(
            command,
            cwd=self.directory,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_serving(self) -> None:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"member {self.name} exited with {self.process.returncode}")
            with contextlib.suppress(OSError):  # not listening yet
                if _request(self.socket_path, "GET", "/1.0/cluster/members")[0] == 200:
                    return
            time.sleep(0.1)
        raise SystemExit(f"member {self.name} did not serve within {DEADLINE:g}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[round(0.99 * (len(ordered) - 1))]


def _percentiles(samples: list[float]) -> str:
    p50, p99, most = statistics.median(samples), _p99(samples), max(samples)
    return f"p50_ms={p50 * 1000:.2f} p99_ms={p99 * 1000:.2f} max_ms={most * 1000:.2f}"


def _fill(store_url: str, members: list[str], instances: int) -> dict[str, list[str]]:
    """``instances`` stopped instances, spread over the members; each member's names."""
    store = Store.open(store_url)
    owned: dict[str, list[str]] = {name: [] for name in members}
    try:
        for index in range(instances):
            member = members[index % len(members)]
            name = f"vm{index:05d}"
            store.instances.create_instance(name, {}, {}, member=member)
            store.instances.finish_task(
                name, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
            )
            owned[member].append(name)
    finally:
        store.close()
    return owned


def _patch(socket_path: str, name: str, value: str) -> None:
    body = json.dumps({"config": {"user.bench": value}}).encode()
    status, answer = _request(socket_path, "PATCH", f"/1.0/instances/{name}", body)
    if status >= 400:
        raise SystemExit(f"PATCH {name} answered {status}: {answer[:200]!r}")


def _wait_for(streams: list[EventStream], counts: list[int]) -> None:
    """Until each stream has seen its count of ``instance-updated`` events."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if all(len(_updates(s)) >= count for s, count in zip(streams, counts, strict=True)):
            return
        time.sleep(0.05)
    raise SystemExit("not every member saw every event within the deadline")


def _updates(stream: EventStream) -> list[tuple[float, dict[str, Any]]]:
    return [
        (arrived, event)
        for arrived, event in stream.arrivals
        if event["metadata"].get("action") == "instance-updated"
    ]


def _event_time(event: dict[str, Any]) -> float:
    """When the publishing member stamped the event (RFC 3339)."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _measure_fanout(
    members: list[Member], streams: list[EventStream], owned: dict[str, list[str]], events: int
) -> None:
    """``events`` config changes on the first member: each event's latency on each member."""
    first = members[0]
    before = [len(_updates(stream)) for stream in streams]
    for index in range(events):
        _patch(first.socket_path, owned[first.name][index % len(owned[first.name])], str(index))
    _wait_for(streams, [count + events for count in before])
    for member, stream, skip in zip(members, streams, before, strict=True):
        latencies = [arrived - _event_time(event) for arrived, event in _updates(stream)[skip:]]
        where = "local" if member is first else "relayed"
        print(
            f"fanout member={member.name} ({where}) events={len(latencies)} "
            + _percentiles(latencies)
        )


def _measure_forwarding(members: list[Member], owned: dict[str, list[str]], requests: int) -> None:
    """``requests`` changes of one instance, alternately local and forwarded."""
    first = members[0]
    target = owned[first.name][0]
    local: list[float] = []
    forwarded: list[float] = []
    for index in range(requests):
        via, samples = (first, local) if index % 2 == 0 else (members[1], forwarded)
        sent = time.perf_counter()
        _patch(via.socket_path, target, f"r{index}")
        samples.append(time.perf_counter() - sent)
    print(f"action local requests={len(local)} " + _percentiles(local))
    print(f"action forwarded requests={len(forwarded)} " + _percentiles(forwarded))
    p50 = statistics.median(forwarded) - statistics.median(local)
    p99 = _p99(forwarded) - _p99(local)
    print(f"forward_overhead p50_ms={p50 * 1000:.2f} p99_ms={p99 * 1000:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=3, choices=(2, 3))
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()

    server = postgres_server()
    database = server.create_database(migrated=True)
    url = server.url(database)
    names = [f"m{index + 1}" for index in range(args.members)]
    root = tempfile.mkdtemp(prefix="vmready-cluster-bench-")
    members: list[Member] = []
    streams: list[EventStream] = []
    try:
        started = time.monotonic()
        owned = _fill(url, names, args.instances)
        print(f"filled instances={args.instances} s={time.monotonic() - started:.2f}")
        started = time.monotonic()
        members = [Member(root, name, url) for name in names]
        for member in members:
            member.wait_serving()
        print(f"members={args.members} serving_s={time.monotonic() - started:.2f}")
        streams = [EventStream(member.socket_path) for member in members]
        time.sleep(1.0)  # let start-up events pass before counting

        _measure_fanout(members, streams, owned, args.events)
        _measure_forwarding(members, owned, args.requests)
    finally:
        for stream in streams:
            stream.close()
        for member in members:
            member.stop()
        shutil.rmtree(root, ignore_errors=True)
        server.drop_database(database)


if __name__ == "__main__":
    main()
