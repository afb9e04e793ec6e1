"""``twistd vmready``: the daemon's Options and makeService, and nothing else."""

from __future__ import annotations

import math
import os
import socket
import stat
import sys
import tempfile
from collections.abc import Sequence
from typing import NoReturn

from twisted.internet.endpoints import (
    SSL4ServerEndpoint,
    TCP4ServerEndpoint,
    TCP6ServerEndpoint,
    UNIXServerEndpoint,
    serverFromString,
)
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.lockfile import FilesystemLock

from vmready.agentlink.hvsock import HybridVSockServerEndpoint
from vmready.agentlink.link import PollIntervals
from vmready.agentlink.transport import TransportError, choose_transport, vhost_vsock_problem
from vmready.agentlink.vsock import VSockServerEndpoint
from vmready.daemon.clusteroptions import (
    DEFAULT_LEASE_SECONDS,
    ClusterSettings,
    cluster_settings,
    display_location,
    store_location,
)
from vmready.daemon.collector import DEFAULT_SWEEP_INTERVAL
from vmready.daemon.configfile import (
    ConfigFileError,
    Setting,
    as_arguments,
    config_path,
    file_problem,
    given_on_command_line,
    option_names,
    read_settings,
)
from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.daemon.logformat import choose_log_format
from vmready.daemon.notify import Notifier, forget_environment
from vmready.daemon.service import GUEST_SOCKET_BASE, DaemonConfig, VMReadyService
from vmready.domain.limits import raise_file_limit
from vmready.domain.members import LeaseHeld
from vmready.domain.model import StoreError, VMReadyError
from vmready.domain.paths import default_data_dir
from vmready.domain.reactor import default_reactor
from vmready.hypervisor.bootfiles import check_files
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.cmdline import CURRENT_LAYOUT, STARTABLE_LAYOUTS
from vmready.hypervisor.console import DEFAULT_CONSOLE_MAX_BYTES
from vmready.lifecycle.core import DEFAULT_KVM_PROBE_TIMEOUT, MAX_STOP_TIMEOUT
from vmready.lifecycle.recovery import DEFAULT_SYNC_CONCURRENCY
from vmready.protocols.transcript import DEFAULT_KEEP, DEFAULT_MAX_BYTES
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificateError, ensure_server_certificate

HYPERVISORS = ("fakeqemu", "qemu")
# More would only queue in the store and the hypervisor: each instance is a few QMP calls.
MAX_SYNC_CONCURRENCY = 1024
_UNIX_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, the terminating NUL included
_DEFAULT_POLL = PollIntervals()
# QEMU sends a port's VSERPORT_CHANGE at most once in this many seconds.
QEMU_PORT_EVENT_PERIOD = 1.0
# The agent link's reads without an event: option, PollIntervals field, help.
_POLL_OPTIONS = (
    (
        "agent-follow-up",
        "follow_up",
        "Seconds to the first follow-up ring-buffer read after an event that promises a "
        "line (a CONNECT written, a port opened); each next one waits twice as long.",
    ),
    (
        "agent-follow-up-window",
        "follow_up_window",
        "Seconds of follow-up reads before waiting for the next event again.",
    ),
    (
        "agent-poll-agentless",
        "agentless_first",
        "Seconds to the first read of a VM whose agent never appeared; doubling up to the "
        "safety read.",
    ),
    (
        "agent-poll-safety",
        "safety",
        "Seconds between the slow safety reads that remain without events.",
    ),
    (
        "agent-reopen-grace",
        "reopen_grace",
        "Seconds an agent's port may stay closed without a STOPPED line before the agent "
        "is taken as stopped (killed).",
    ),
    (
        "agent-silence-timeout",
        "silence_timeout",
        "Seconds without a status line from a running VM's agent before it is taken as "
        "stopped (agents repeat their status every 5 s).",
    ),
)


class Options(usage.Options):
    """Options for ``twistd vmready``: the command line over the config file over the defaults."""

    # Who this daemon is as a cluster member (None: a single host's SQLite store), once parsed.
    cluster: ClusterSettings | None = None

    optParameters = [
        [
            "config",
            None,
            None,
            "A YAML file setting any of these options by its long name (default: "
            "$VMREADY_CONFIG, else /etc/vmready/vmready.yaml if it exists; '' for none). "
            "The command line wins over the file.",
        ],
        [
            "log-format",
            None,
            "text",
            "text (default) or json: one JSON object per line on standard output (with "
            "twistd --nodaemon), for journald or Loki.",
        ],
        ["data-dir", "d", None, "Where the store, certificates and VM sockets live."],
        [
            "listen",
            "l",
            None,
            "Operator API endpoint string (default: unix:<data-dir>/vmready.sock).",
        ],
        [
            "https-address",
            None,
            None,
            "Also serve the operator API over mutual TLS on HOST:PORT ([IPv6]:PORT, :PORT; "
            "port 8443 if omitted), for clients whose certificate is trusted (vmready config "
            "trust add). Default: none, the unix socket only.",
        ],
        [
            "store",
            None,
            None,
            "Where the store is: a SQLite file (default: <data-dir>/vmready.sqlite) or a "
            "postgresql://USER@HOST/DATABASE URL (libpq's, ?host=/run/postgresql for a unix "
            "socket), which makes this daemon a cluster member sharing it with the others "
            "(needs --https-address).",
        ],
        [
            "member-name",
            None,
            None,
            "This daemon's name as a cluster member (default: the host name).",
        ],
        [
            "member-address",
            None,
            None,
            "HOST:PORT the other cluster members dial to reach this one's mutual-TLS API "
            "(default: --https-address, when it names a host).",
        ],
        [
            "lease-seconds",
            None,
            f"{DEFAULT_LEASE_SECONDS:g}",
            "Seconds a cluster member's lease lasts (1 to 3600), renewed every third of it: a "
            "member that stops renewing is shown unreachable once it runs out.",
        ],
        ["hypervisor", None, "fakeqemu", "fakeqemu (default) or qemu."],
        ["qemu-binary", None, None, "The hypervisor binary (default: per --hypervisor)."],
        [
            "power-sync-interval",
            None,
            "30",
            "Seconds between power-state reconciliations; 0 or less disables it.",
        ],
        ["stop-timeout", None, "30", "Seconds a clean stop waits before forcing."],
        [
            "sync-concurrency",
            None,
            str(DEFAULT_SYNC_CONCURRENCY),
            "Instances reconciled at once by power sync and at daemon start (1 to 1024).",
        ],
        [
            "gc-sweep-interval",
            None,
            str(DEFAULT_SWEEP_INTERVAL),
            "Seconds between checks whether the heap grew enough to sweep it (one full "
            "garbage collection, the survivors frozen): short pauses with thousands of VMs; "
            "0 or less: Python's own schedule only.",
        ],
        [
            "serial-layout",
            None,
            CURRENT_LAYOUT.name,
            "Serial wiring for VMs this daemon starts: current (com.canonical.lxd) or legacy "
            "(org.linuxcontainers.lxd, as before the rename; to reproduce upgrades).",
        ],
        [
            "guest-listen",
            None,
            None,
            "Guest API endpoint string, vsock:port=0 or hvsock:path=<base> "
            "(default: vsock:port=0 when VMs get the vsock transport, else "
            "hvsock:path=<data-dir>/guest-api.sock).",
        ],
        *(
            [option, None, str(getattr(_DEFAULT_POLL, field)), text]
            for option, field, text in _POLL_OPTIONS
        ),
        [
            "record-dir",
            None,
            None,
            "Record every instance's session to <dir>/<instance>.jsonl (an instance's "
            "vmready.record=false opts it out; vmready.record=true records it even without "
            "this option, to <data-dir>/transcripts).",
        ],
        [
            "record-max-bytes",
            None,
            str(DEFAULT_MAX_BYTES),
            "Rotate a transcript to <file>.1 once it passes this size.",
        ],
        ["record-keep", None, str(DEFAULT_KEEP), "Rotated transcripts kept per instance."],
        [
            "guest-transport",
            None,
            "auto",
            "How new VMs' agents reach the guest API: vsock (needs /dev/vhost-vsock), forward "
            "(user-mode networking restricted to one forward), hvsock (fakeqemu guests); auto: "
            "hvsock on fakeqemu, else vsock where /dev/vhost-vsock opens, else forward.",
        ],
        ["default-image", None, None, "The disk image instances launched without one boot."],
        ["default-kernel", None, None, "The kernel instances launched without one boot."],
        ["default-initrd", None, None, "The initramfs for --default-kernel."],
        ["default-append", None, None, "The kernel command line for --default-kernel."],
        [
            "kvm-probe-timeout",
            None,
            str(DEFAULT_KVM_PROBE_TIMEOUT),
            "Seconds a first guest under KVM may show no sign of life (console output, its "
            "agent) before KVM is judged not to work here and it restarts under TCG.",
        ],
        [
            "console-max-bytes",
            None,
            str(DEFAULT_CONSOLE_MAX_BYTES),
            "Rotate a VM's console log to console.log.1 once it passes this size.",
        ],
    ]

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        """Read the config file first: its settings go before the command line's, which win."""
        arguments = list(sys.argv[1:] if options is None else options)
        given = given_on_command_line(self, arguments)
        self.config_file: str | None = None
        self.config_settings: dict[str, Setting] = {}
        if "help" not in given and "version" not in given:
            self.config_file = config_path(given.get("config"), os.environ)
        if self.config_file is not None:
            try:
                self.config_settings = read_settings(self.config_file, *option_names(self))
            except ConfigFileError as e:
                _fail(str(e))
        from_file = as_arguments(self.config_settings, given)
        try:
            super().parseOptions([*from_file, *arguments])
        except usage.UsageError as e:
            self._blame_the_file(str(e), given)
            raise

    def _blame_the_file(self, problem: str, given: dict[str, str]) -> None:
        """A value the config file set is refused: say where it is, in one line."""
        if self.config_file is None:
            return
        for key in self.config_settings:
            if key not in given and problem.startswith(f"--{key} "):
                why = problem.removeprefix(f"--{key} ")
                _fail(file_problem(self.config_file, self.config_settings, key, why))

    def postOptions(self) -> None:
        if self["serial-layout"] not in STARTABLE_LAYOUTS:
            raise usage.UsageError(
                f"--serial-layout must be one of {', '.join(STARTABLE_LAYOUTS)}"
            )
        if self["hypervisor"] not in HYPERVISORS:
            raise usage.UsageError(f"--hypervisor must be one of {', '.join(HYPERVISORS)}")
        for option in ("power-sync-interval", "stop-timeout", "gc-sweep-interval"):
            try:
                self[option] = float(self[option])
            except ValueError:
                raise usage.UsageError(f"--{option} must be a number of seconds") from None
            if not math.isfinite(self[option]):
                raise usage.UsageError(f"--{option} must be a finite number of seconds")
        for option, _field, _help in _POLL_OPTIONS:
            try:
                self[option] = float(self[option])
            except ValueError:
                raise usage.UsageError(f"--{option} must be a number of seconds") from None
            if not (math.isfinite(self[option]) and 0 < self[option] <= 3600):
                raise usage.UsageError(f"--{option} must be more than 0 and at most 3600 seconds")
        if self["agent-reopen-grace"] <= QEMU_PORT_EVENT_PERIOD:
            # QEMU may hold an announcing agent's reopening back this long: a shorter grace
            # would take a live agent for a killed one.
            raise usage.UsageError(
                f"--agent-reopen-grace must be more than {QEMU_PORT_EVENT_PERIOD:g} second "
                "(QEMU reports a port's changes at most once a second)"
            )
        try:
            self["sync-concurrency"] = int(self["sync-concurrency"])
        except ValueError:
            raise usage.UsageError("--sync-concurrency must be a whole number") from None
        if not 1 <= self["sync-concurrency"] <= MAX_SYNC_CONCURRENCY:
            raise usage.UsageError(f"--sync-concurrency must be 1 to {MAX_SYNC_CONCURRENCY}")
        if not 0 <= self["stop-timeout"] <= MAX_STOP_TIMEOUT:
            raise usage.UsageError(f"--stop-timeout must be 0 to {MAX_STOP_TIMEOUT:g} seconds")
        for option, least in (("record-max-bytes", 1024), ("record-keep", 0)):
            try:
                self[option] = int(self[option])
            except ValueError:
                raise usage.UsageError(f"--{option} must be a whole number") from None
            if self[option] < least:
                raise usage.UsageError(f"--{option} must be at least {least}")
        try:
            self["kvm-probe-timeout"] = float(self["kvm-probe-timeout"])
        except ValueError:
            raise usage.UsageError("--kvm-probe-timeout must be a number of seconds") from None
        if not (
            math.isfinite(self["kvm-probe-timeout"]) and 0 < self["kvm-probe-timeout"] <= 3600
        ):
            raise usage.UsageError("--kvm-probe-timeout must be more than 0 and at most 3600")
        try:
            self["console-max-bytes"] = int(self["console-max-bytes"])
        except ValueError:
            raise usage.UsageError("--console-max-bytes must be a whole number") from None
        if self["console-max-bytes"] < 4096:
            raise usage.UsageError("--console-max-bytes must be at least 4096")
        for option in ("default-image", "default-kernel", "default-initrd"):
            if self[option]:
                self[option] = os.path.abspath(self[option])
        if self["record-dir"]:
            self["record-dir"] = os.path.abspath(self["record-dir"])
        if self["https-address"] is not None:
            try:
                HTTPSAddress.parse(self["https-address"])
            except ValueError as e:
                raise usage.UsageError(f"--https-address {e}") from None
        choose_log_format(self["log-format"], getattr(self, "parent", None))
        self["data-dir"] = os.path.abspath(self["data-dir"] or default_data_dir())
        try:
            self["store"] = store_location(self["store"], self["data-dir"])
            self.cluster = cluster_settings(
                self["store"],
                self["member-name"],
                self["member-address"],
                self["https-address"],
                self["lease-seconds"],
            )
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        self["lease-seconds"] = float(self["lease-seconds"])
        if self.cluster is not None:
            self["member-name"] = self.cluster.name
            self["member-address"] = self.cluster.address
        if not self["listen"]:
            # Whoever can reach the operator socket controls every VM: owner only.
            path = os.path.join(self["data-dir"], "vmready.sock").replace(":", "\\:")
            self["listen"] = f"unix:{path}:mode=600"

    @property
    def default_boot(self) -> BootSource:
        """The boot source the options name for instances launched without one."""
        return BootSource(
            image=self["default-image"],
            kernel=self["default-kernel"],
            initrd=self["default-initrd"],
            append=self["default-append"],
        )

    @property
    def poll_intervals(self) -> PollIntervals:
        """The agent link's reads without an event, as the options chose."""
        return PollIntervals(**{field: self[option] for option, field, _help in _POLL_OPTIONS})


def _fail(reason: str) -> NoReturn:
    """Stop twistd before it starts, with one line on stderr and status 1."""
    raise SystemExit(f"vmready: {reason}")


def check_data_dir(path: str) -> None:
    """The data dir exists (or can be made) and is writable."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        _fail(f"data dir {path} is not writable: {e.strerror or e}")


def check_listen_address(listen: str) -> None:
    """Refuse an endpoint string that twistd could not listen on; clear a stale unix socket."""
    reactor = default_reactor()

    try:
        endpoint = serverFromString(reactor, listen)
    except Exception as e:  # each endpoint parser fails in its own way: report any of them
        _fail(f"--listen {listen} is not a usable endpoint string: {e}")
    if isinstance(endpoint, UNIXServerEndpoint):
        _check_unix_socket_path(listen, endpoint._address)
    elif isinstance(endpoint, TCP4ServerEndpoint | TCP6ServerEndpoint | SSL4ServerEndpoint):
        family = socket.AF_INET6 if isinstance(endpoint, TCP6ServerEndpoint) else socket.AF_INET
        _check_tcp_port_free(listen, family, endpoint._interface, endpoint._port)


def check_guest_listen_address(listen: str) -> None:
    """Refuse a guest API endpoint string that cannot work, in one line."""
    reactor = default_reactor()

    try:
        endpoint = serverFromString(reactor, listen)
    except Exception as e:  # each endpoint parser fails in its own way: report any of them
        _fail(f"--guest-listen {listen} is not a usable endpoint string: {e}")
    if isinstance(endpoint, HybridVSockServerEndpoint):
        longest = f"{endpoint.path}_{2**32 - 1}"
        if len(os.fsencode(longest)) >= _UNIX_PATH_MAX:
            _fail(
                f"--guest-listen {listen}: socket path {longest} would be longer than "
                f"{_UNIX_PATH_MAX - 1} bytes; choose a shorter path="
            )
        directory = os.path.dirname(endpoint.path) or "."
        if not os.path.isdir(directory):
            _fail(f"--guest-listen {listen}: directory {directory} does not exist")
    elif not isinstance(endpoint, VSockServerEndpoint):
        _fail(f"--guest-listen {listen}: the guest API listens on vsock: or hvsock: only")


def check_https_address(text: str) -> None:
    """Refuse an ``--https-address`` whose port is taken (or cannot be bound here)."""
    address = HTTPSAddress.parse(text)
    if address.port == 0:
        return
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    _check_tcp_port_free(f"--https-address {text}", family, address.host, address.port)


def _check_unix_socket_path(listen: str, path: str) -> None:
    """A unix socket can be made at ``path``: nobody serves it, and nothing else is there."""
    if not path:
        _fail(f"--listen {listen} names no socket path")
    if len(os.fsencode(path)) >= _UNIX_PATH_MAX:
        _fail(f"--listen {listen}: socket path is longer than {_UNIX_PATH_MAX - 1} bytes")
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        _fail(f"--listen {listen}: directory {directory} does not exist")
    _check_socket_lock(listen, path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        _fail(f"--listen {listen}: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        _remove_stale_socket(listen, path)
        return
    except OSError as e:
        _fail(f"--listen {listen}: cannot check socket {path}: {e.strerror or e}")
    finally:
        probe.close()
    _fail(f"address unix:{path} is in use: another vmready daemon is listening there")


def _check_socket_lock(listen: str, path: str) -> None:
    """Twisted guards a unix socket with ``<path>.lock``: a live holder would stop us later."""
    lock = FilesystemLock(path + ".lock")
    try:
        acquired = lock.lock()
    except OSError as e:
        _fail(f"--listen {listen}: cannot check the lock {path}.lock: {e.strerror or e}")
    if not acquired:
        holder = os.readlink(path + ".lock") if os.path.islink(path + ".lock") else "?"
        _fail(
            f"address unix:{path} is locked by process {holder} ({path}.lock); "
            "another vmready daemon is starting or running there"
        )
    lock.unlock()


def _remove_stale_socket(listen: str, path: str) -> None:
    """Remove a socket left behind by a daemon that is gone."""
    try:
        os.unlink(path)
    except OSError as e:
        _fail(f"--listen {listen}: cannot remove stale socket {path}: {e.strerror or e}")


def _check_tcp_port_free(listen: str, family: int, interface: str, port: int) -> None:
    """Listen on the port for a moment, as twistd will, so a taken port is refused now."""
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Twisted's ports do
        probe.bind((interface, port))
        probe.listen(1)
    except OverflowError:
        _fail(f"cannot listen on {listen}: port {port} is not in 0-65535")
    except OSError as e:
        _fail(f"cannot listen on {listen}: {e.strerror or e}")
    finally:
        probe.close()


def check_store(location: str, cluster: ClusterSettings | None, fingerprint: str) -> None:
    """Open the store once now (migrated, or refused in one line), before twistd daemonizes.

    A cluster member whose name another daemon holds (another certificate,
    its lease running) is refused here, with status 1; the daemon's own join
    decides again (two started at once: one of them stops, saying why).
    """
    try:
        store = Store.open(location)
    except StoreError as e:
        _fail(str(e))
    try:
        if cluster is not None:
            store.members.check_join(cluster.name, fingerprint)
    except LeaseHeld as e:
        _fail(str(e))
    except Exception as e:  # the server went away since it opened: still one line
        _fail(f"cannot read the cluster's members in {display_location(location)}: {e}")
    finally:
        store.close()


def makeService(options: Options) -> VMReadyService:
    """Check what can be checked before twistd daemonizes, then build the service."""
    reactor = default_reactor()

    data_dir = options["data-dir"]
    check_data_dir(data_dir)
    try:
        certificate = ensure_server_certificate(data_dir)
    except CertificateError as e:
        _fail(str(e))
    check_store(options["store"], options.cluster, certificate.fingerprint)
    check_listen_address(options["listen"])
    if options["https-address"] is not None:
        check_https_address(options["https-address"])
    hypervisor = options["hypervisor"]
    try:
        transport = choose_transport(hypervisor, options["guest-transport"], vhost_vsock_problem())
    except TransportError as e:
        _fail(f"--guest-transport {options['guest-transport']}: {e}")
    if not options["guest-listen"]:
        # vsock VMs dial AF_VSOCK; everything else (hvsock guests, the forward) needs none.
        base = os.path.join(data_dir, GUEST_SOCKET_BASE).replace(":", "\\:")
        vsock = transport == "vsock"
        options["guest-listen"] = "vsock:port=0" if vsock else f"hvsock:path={base}"
    check_guest_listen_address(options["guest-listen"])
    default_boot = options.default_boot
    try:
        check_files(default_boot)
    except VMReadyError as e:
        _fail(f"the default boot source cannot boot: {e.message}")
    raise_file_limit()
    config = DaemonConfig(
        data_dir=data_dir,
        listen=options["listen"],
        hypervisor=options["hypervisor"],
        qemu_binary=options["qemu-binary"],
        power_sync_interval=options["power-sync-interval"],
        stop_timeout=options["stop-timeout"],
        guest_listen=options["guest-listen"],
        agent_poll=options.poll_intervals,
        serial_layout=options["serial-layout"],
        record_dir=options["record-dir"],
        record_max_bytes=options["record-max-bytes"],
        record_keep=options["record-keep"],
        guest_transport=options["guest-transport"],
        default_boot=default_boot,
        kvm_probe_timeout=options["kvm-probe-timeout"],
        console_max_bytes=options["console-max-bytes"],
        sync_concurrency=options["sync-concurrency"],
        gc_sweep_interval=options["gc-sweep-interval"],
        https_address=options["https-address"],
        store=options["store"],
        member_name=options["member-name"] if options.cluster is not None else None,
        member_address=options["member-address"] if options.cluster is not None else None,
        lease_seconds=options["lease-seconds"],
    )
    reached = {
        "forward": f"reached by guests through {config.forward_socket} (the forward transport)",
        "vsock": "reached by guests over vsock",
        "hvsock": "reached by fakeqemu guests as unix sockets",
    }[transport]
    summary = "data dir {data_dir}, API on {listen}, guest API on {guest_listen}, {reached}"
    fields = {
        "data_dir": data_dir,
        "listen": options["listen"],
        "guest_listen": options["guest-listen"],
        "reached": reached,
    }
    if options["https-address"] is not None:
        summary += ", remote API on {https}"
        fields["https"] = HTTPSAddress.parse(options["https-address"]).url()
    if options.cluster is not None:
        summary += ", store {store}, cluster member {member}"
        fields["store"] = display_location(options["store"])
        fields["member"] = options.cluster.name
    if options["log-format"] == "json":
        # Logged (twistd replays it once logging starts): stdout must hold JSON lines only.
        Logger(namespace=__name__).info(summary, **fields)
    else:
        print(f"vmready: {summary.format(**fields)}", file=sys.stderr)
    # Read once, then dropped: the VMs' QEMU processes inherit the daemon's environment.
    notifier = Notifier.from_environment(os.environ, os.getpid())
    forget_environment(os.environ)
    return VMReadyService(reactor, config, notifier)
