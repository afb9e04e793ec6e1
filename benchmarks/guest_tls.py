"""The guest API over mutual TLS against a bare Twisted TLS server, in one run.

Two servers, each in its own child process, on the hybrid vsock transport the
daemon uses with fakeqemu (a unix socket ``<path>_<port>``):

- **guest** (``--role guest``): the daemon's guest API as ``VMReadyService``
  builds it (``_start_guest_api``, ``_guest_resource``): a real ``Store`` in a
  data dir, a ``Lifecycle`` on it, the daemon's certificate
  (``ensure_server_certificate``), one instance with its own client
  certificate issued and recorded in the store and written to a config drive
  (``write_config_drive``); ``GuestAPI`` behind ``RecordingGuestResource``
  (the daemon always has recorders), ``guest_site``, ``guest_tls_factory`` and
  ``HybridVSockServerEndpoint``;
- **bare** (``--role bare``): a plain ``twisted.web`` ``Site`` answering the
  guest API's ``GET /1.0`` body bytes, behind ``MutualServerTLS`` with the
  daemon's certificate, accepting exactly the instance's client certificate,
  on the same transport.

Both log to a file at level info, as ``twistd`` does (the access log too).

The client is the guest agent's own code, ``vmready.agent.host``: its TLS
context (``client_context``: the instance's certificate, the daemon's
pinned) and its ``HostEndpoint``, which opens a new mutual-TLS connection per
request and sends ``Connection: close`` (the agent never keeps a connection
alive, nor resumes a TLS session).  It runs in ``--client-processes`` worker
processes (asyncio), each with its share of the requests in flight.  Rounds
of ``--seconds`` (after a 0.5 s warm-up) alternate between the two servers,
``--rounds`` each, with 1 and ``--concurrency`` requests in flight, so that a
passing load on this shared machine favours neither (and with ``--pin``, the
default on 2 CPUs or more, both servers on the same CPU, the clients on the
others); the median round of
each is shown, its server's CPU per request, and the ratio guest / bare, of
requests per second and of server CPU per request (which says more when the
client, not the server, is the limit), and of CPU per request in each
server's least disturbed round.

The last line is ``guest_rps=… bare_rps=… ratio=…`` for the highest
concurrency.  Figures only: nothing here passes or fails.

    .venv/bin/python benchmarks/guest_tls.py
    .venv/bin/python benchmarks/guest_tls.py --rounds 3 --seconds 1   # quicker
    .venv/bin/python benchmarks/guest_tls.py --profile /tmp/p   # into /tmp/p.guest, /tmp/p.bare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._measure import cpu_seconds
from vmready.domain import default_reactor

SCRIPT = os.path.abspath(__file__)
INSTANCE = "bench1"
WARM_UP = 0.5
CLIENT_NICENESS = 5
# With --pin, both servers run on the last CPU (one at a time: the rounds alternate) and the
# clients on the others, so that neither server meets other neighbours than the other does.
SERVER_CPUS = {max(os.sched_getaffinity(0))}
CLIENT_CPUS = set(os.sched_getaffinity(0)) - SERVER_CPUS or SERVER_CPUS


# -- the servers (child processes) --------------------------------------------------


def _log_to(path: str) -> None:
    """Log events at info and above to ``path``, as ``twistd --logfile`` does."""
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    observer = FilteringLogObserver(
        textFileLogObserver(open(path, "a")),  # noqa: SIM115 (open until the process ends)
        [LogLevelFilterPredicate(LogLevel.info)],
    )
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


def _announce(**facts: Any) -> None:
    """Tell the parent where the server listens (one JSON line on stdout)."""
    sys.stdout.write(json.dumps(facts) + "\n")
    sys.stdout.flush()


def _serve(directory: str, listen: Any, profile: str | None) -> None:
    """Run the reactor until SIGTERM, cProfiling it into ``profile`` if asked."""
    from vmready.domain import raise_file_limit

    reactor = default_reactor()
    raise_file_limit()
    reactor.callWhenRunning(listen)
    if profile is None:
        reactor.run()
        return
    import cProfile

    profiler = cProfile.Profile(time.process_time)  # CPU time: other processes do not count
    profiler.runcall(reactor.run)
    profiler.dump_stats(profile)


def run_guest(directory: str, profile: str | None) -> None:
    """``--role guest``: the daemon's guest API stack on a real store and instance."""
    from twisted.internet.defer import Deferred

    from vmready.agentlink import HybridVSockAddress, HybridVSockServerEndpoint
    from vmready.api import GuestAPI, guest_site, guest_tls_factory
    from vmready.domain import PowerState, TaskState, VMState
    from vmready.hypervisor import HypervisorDriver
    from vmready.lifecycle import EventBus, Lifecycle
    from vmready.record import Recorders, RecordingGuestResource
    from vmready.store import Store
    from vmready.trust import ensure_server_certificate, generate, write_config_drive

    reactor = default_reactor()

    _log_to(os.path.join(directory, "guest-server.log"))
    data_dir = os.path.join(directory, "data")
    os.makedirs(data_dir, mode=0o700)
    store = Store.open(os.path.join(data_dir, "vmready.sqlite"))
    lifecycle = Lifecycle(
        reactor,
        store,
        HypervisorDriver(reactor, "fakeqemu"),
        EventBus(reactor.seconds),
        os.path.join(data_dir, "run"),
    )
    store.instances.create_instance(INSTANCE, {"user.purpose": "benchmark"}, {})
    store.instances.finish_task(INSTANCE, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN)
    server = ensure_server_certificate(data_dir)
    client = generate(f"vmready-agent-{INSTANCE}")
    store.certificates.set_agent_certificate(INSTANCE, client.fingerprint)
    drive = os.path.join(data_dir, "drive")
    write_config_drive(drive, client, server.cert_pem)

    api = GuestAPI(lifecycle)
    recorders = Recorders(lifecycle, os.path.join(data_dir, "transcripts"))
    resource = RecordingGuestResource(api.app.resource(), api.identify, recorders)
    factory = guest_tls_factory(server, store.certificates, guest_site(resource))
    path = os.path.join(directory, "guest.sock")

    async def listen() -> None:
        port = await HybridVSockServerEndpoint(reactor, path).listen(factory)
        address = port.getHost()
        assert isinstance(address, HybridVSockAddress)
        _announce(path=path, port=address.port, data_dir=data_dir, drive=drive)

    _serve(directory, lambda: Deferred.fromCoroutine(listen()), profile)


def run_bare(
    directory: str, data_dir: str, drive: str, body_path: str, profile: str | None
) -> None:
    """``--role bare``: a plain twisted.web Site behind the daemon's mutual TLS, nothing else."""
    from twisted.internet.defer import Deferred

    from benchmarks._bareserver import bare_site
    from vmready.agentlink import HybridVSockAddress, HybridVSockServerEndpoint

    reactor = default_reactor()

    _log_to(os.path.join(directory, "bare-server.log"))
    with open(body_path, "rb") as f:
        body = f.read()
    factory = bare_site(data_dir, os.path.join(drive, "agent.crt"), body)
    path = os.path.join(directory, "bare.sock")

    async def listen() -> None:
        port = await HybridVSockServerEndpoint(reactor, path).listen(factory)
        address = port.getHost()
        assert isinstance(address, HybridVSockAddress)
        _announce(path=path, port=address.port)

    _serve(directory, lambda: Deferred.fromCoroutine(listen()), profile)


# -- the client: the agent's own code, in worker processes ---------------------------


def _endpoint(drive: str, path: str, port: int) -> Any:
    """The agent's ``HostEndpoint`` for the server at hybrid vsock ``path``/``port``."""
    from vmready.agent import HostConnector, Transport, VsockAddress, client_context, pinned_der

    with open(os.path.join(drive, "server.crt"), "rb") as f:
        server_pem = f.read()
    context = client_context(
        os.path.join(drive, "agent.crt"), os.path.join(drive, "agent.key"), server_pem
    )
    connector = HostConnector(Transport("hvsock", path), context, pinned_der(server_pem))
    return connector.at(VsockAddress(2, port))


async def _hammer(endpoint: Any, seconds: float, in_flight: int) -> tuple[int, int]:
    """``GET /1.0`` for ``seconds``, ``in_flight`` at a time: (answered 200, other outcomes)."""
    counts = [0, 0]
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            try:
                answer = await endpoint.request("GET", "/1.0")
            except Exception:  # counted, not fatal
                counts[1] += 1
                continue
            counts[0 if answer.status == 200 else 1] += 1

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    return counts[0], counts[1]


def _client_round(task: tuple[str, str, int, float, int]) -> tuple[int, int]:
    """One worker's share of a round (run in a worker process)."""
    drive, path, port, seconds, in_flight = task
    endpoint = _endpoint(drive, path, port)
    return asyncio.run(_hammer(endpoint, seconds, in_flight))


def fetch_once(drive: str, path: str, port: int) -> tuple[int, bytes]:
    """One ``GET /1.0`` as the agent sends it: the status and the raw body."""
    endpoint = _endpoint(drive, path, port)
    answer = asyncio.run(endpoint.request("GET", "/1.0"))
    return answer.status, answer.body


# -- the parent ----------------------------------------------------------------------


class Server:
    """A server child process and where it listens."""

    def __init__(self, label: str, argv: list[str], directory: str) -> None:
        self.label = label
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.stderr = open(os.path.join(directory, f"{label}.stderr"), "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, SCRIPT, *argv], stdout=subprocess.PIPE, stderr=self.stderr, env=env
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {label} server did not start: see {self.stderr.name}")
        self.facts: dict[str, Any] = json.loads(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stderr.close()


class Round:
    """One round against one server: requests, errors, seconds, the server's CPU seconds."""

    def __init__(self, ok: int, errors: int, seconds: float, server_cpu: float) -> None:
        self.ok, self.errors, self.seconds, self.server_cpu = ok, errors, seconds, server_cpu

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    @property
    def cpu_per_request(self) -> float:
        return self.server_cpu / max(self.ok, 1)


def _client_worker(pin: bool) -> None:
    """A client process: niced, and off the servers' CPU when they have one."""
    os.nice(CLIENT_NICENESS)
    if pin:
        os.sched_setaffinity(0, CLIENT_CPUS)


def run_round(
    pool: Any, server: Server, drive: str, seconds: float, in_flight: int, workers: int
) -> Round:
    """``in_flight`` requests spread over ``workers`` client processes for ``seconds``."""
    shares = [in_flight // workers + (1 if i < in_flight % workers else 0) for i in range(workers)]
    tasks = [
        (drive, server.facts["path"], server.facts["port"], seconds, share)
        for share in shares
        if share
    ]
    cpu = cpu_seconds(server.pid)
    started = time.perf_counter()
    results = pool.map(_client_round, tasks)
    elapsed = time.perf_counter() - started
    return Round(
        sum(ok for ok, _ in results),
        sum(errors for _, errors in results),
        elapsed,
        cpu_seconds(server.pid) - cpu,
    )


def median(rounds: Sequence[Round]) -> Round:
    return sorted(rounds, key=lambda r: r.rate)[(len(rounds) - 1) // 2]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (the roles' options are hidden)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("guest", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    parser.add_argument("--body", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per server (default 5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per round")
    parser.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight besides 1 (default 8)"
    )
    parser.add_argument(
        "--client-processes", type=int, default=2, help="client worker processes (default 2)"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=len(os.sched_getaffinity(0)) > 1,
        help="servers on the last CPU, clients on the others (default: with 2 CPUs or more)",
    )
    parser.add_argument(
        "--profile", help="cProfile each server into PROFILE.guest and PROFILE.bare"
    )
    return parser.parse_args(argv)


def start_servers(
    args: argparse.Namespace, directory: str, servers: list[Server]
) -> tuple[Server, Server, str]:
    """The guest API's server, then the bare one answering its body: (guest, bare, drive)."""

    def profile(label: str) -> list[str]:
        return ["--profile", f"{os.path.abspath(args.profile)}.{label}"] if args.profile else []

    guest = Server(
        "guest", ["--role", "guest", "--directory", directory, *profile("guest")], directory
    )
    servers.append(guest)
    if args.pin:
        os.sched_setaffinity(guest.pid, SERVER_CPUS)
    drive = guest.facts["drive"]
    status, body = fetch_once(drive, guest.facts["path"], guest.facts["port"])
    if status != 200:
        raise SystemExit(f"the guest API answered {status}: {body!r}")
    body_path = os.path.join(directory, "body.json")
    with open(body_path, "wb") as f:
        f.write(body)
    where = ["--directory", directory, "--data-dir", guest.facts["data_dir"]]
    bare = Server(
        "bare",
        ["--role", "bare", *where, "--drive", drive, "--body", body_path, *profile("bare")],
        directory,
    )
    servers.append(bare)
    if args.pin:
        os.sched_setaffinity(bare.pid, SERVER_CPUS)
    _, bare_body = fetch_once(drive, bare.facts["path"], bare.facts["port"])
    print(
        f"guest API GET /1.0 against a bare twisted.web Site behind the same MutualServerTLS "
        f"({'the same' if bare_body == body else 'DIFFERENT'} {len(body)} body bytes); "
        f"a new mutual-TLS connection per request (the agent's client code); "
        f"{args.rounds} rounds of {args.seconds:g} s per server, alternating; median round",
        flush=True,
    )
    return guest, bare, drive


def compare(
    args: argparse.Namespace, guest: Server, bare: Server, drive: str, in_flight: int
) -> tuple[float, float]:
    """``--rounds`` rounds of each server with ``in_flight`` requests; the medians' rates."""
    workers = min(args.client_processes, in_flight)
    results: dict[str, list[Round]] = {"guest": [], "bare": []}
    context = multiprocessing.get_context("fork")
    # The clients yield to the servers (nice), so that the server is the limit where the
    # machine allows, and keep off the servers' CPU.
    with context.Pool(workers, initializer=_client_worker, initargs=(bool(args.pin),)) as pool:
        for _ in range(args.rounds):
            for server in (guest, bare):
                run_round(pool, server, drive, WARM_UP, in_flight, workers)
                results[server.label].append(
                    run_round(pool, server, drive, args.seconds, in_flight, workers)
                )
    for label, rounds in results.items():
        middle = median(rounds)
        errors = sum(r.errors for r in rounds)
        print(
            f"  {in_flight} in flight ({workers} client processes), {label:5}: "
            f"{middle.rate:6.0f} req/s, server {1e3 * middle.cpu_per_request:.2f} ms "
            f"CPU/request ({100 * middle.server_cpu / middle.seconds:.0f}% of a CPU); "
            f"range {min(r.rate for r in rounds):.0f}-{max(r.rate for r in rounds):.0f}"
            + (f"; {errors} errors" if errors else ""),
            flush=True,
        )
    g, b = median(results["guest"]), median(results["bare"])
    # The least disturbed round of each (this machine is shared) says it with less noise.
    least = {label: min(r.cpu_per_request for r in rounds) for label, rounds in results.items()}
    print(
        f"  {in_flight} in flight: ratio guest/bare {g.rate / b.rate:.2f} req/s, "
        f"{b.cpu_per_request / g.cpu_per_request:.2f} by server CPU per request "
        f"({least['bare'] / least['guest']:.2f} in each one's least CPU round)",
        flush=True,
    )
    return g.rate, b.rate


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.role == "guest":
        run_guest(args.directory, args.profile)
        return
    if args.role == "bare":
        run_bare(args.directory, args.data_dir, args.drive, args.body, args.profile)
        return
    directory = tempfile.mkdtemp(prefix="vmr-guest-tls-")
    servers: list[Server] = []
    try:
        guest, bare, drive = start_servers(args, directory, servers)
        ratios = {
            in_flight: compare(args, guest, bare, drive, in_flight)
            for in_flight in sorted({1, args.concurrency})
        }
        guest_rps, bare_rps = ratios[max(ratios)]
        ratio = guest_rps / bare_rps
        print(f"guest_rps={guest_rps:.0f} bare_rps={bare_rps:.0f} ratio={ratio:.2f}")
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
