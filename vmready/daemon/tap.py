"""``twistd vmready``: the daemon's Options and makeService, and nothing else."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from twisted.logger import Logger
from twisted.python import usage

from vmready.agentlink import PollIntervals
from vmready.agentlink.transport import TransportError, choose_transport, vhost_vsock_problem
from vmready.api import OPERATOR_LISTEN_BACKLOG
from vmready.daemon.clusteroptions import (
    CLUSTER_OPTIONS,
    ClusterSettings,
    cluster_settings,
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
from vmready.daemon.daemonconfig import GUEST_SOCKET_BASE, DaemonConfig
from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.daemon.logformat import choose_log_format
from vmready.daemon.notify import Notifier, forget_environment
from vmready.daemon.optionvalues import FINITE, Rule, at_least, choice, seconds, whole
from vmready.daemon.preflight import (
    check_data_dir,
    check_guest_listen_address,
    check_https_address,
    check_listen_address,
    check_store,
    fail,
)
from vmready.daemon.service import VMReadyService
from vmready.domain import VMReadyError, default_data_dir, default_reactor, raise_file_limit
from vmready.hypervisor import (
    CURRENT_LAYOUT,
    DEFAULT_CONSOLE_MAX_BYTES,
    STARTABLE_LAYOUTS,
    BootSource,
    check_files,
)
from vmready.lifecycle import DEFAULT_KVM_PROBE_TIMEOUT, DEFAULT_SYNC_CONCURRENCY, MAX_STOP_TIMEOUT
from vmready.protocols import DEFAULT_KEEP, DEFAULT_MAX_BYTES
from vmready.store import display_location
from vmready.trust import CertificateError, ensure_server_certificate

HYPERVISORS = ("fakeqemu", "qemu")
# More would only queue in the store and the hypervisor: each instance is a few QMP calls.
MAX_SYNC_CONCURRENCY = 1024
_DEFAULT_POLL = PollIntervals()
# QEMU sends a port's VSERPORT_CHANGE at most once in this many seconds.
QEMU_PORT_EVENT_PERIOD = 1.0
_POLL_RANGE: Rule = (lambda value: 0 < value <= 3600, "more than 0 and at most 3600 seconds")
# QEMU may hold an announcing agent's reopening back this long: a shorter grace would take a
# live agent for a killed one.
_REOPEN_GRACE: Rule = (
    lambda value: value > QEMU_PORT_EVENT_PERIOD,
    f"more than {QEMU_PORT_EVENT_PERIOD:g} second (QEMU reports a port's changes at most once "
    "a second)",
)
# The agent link's reads without an event: option, PollIntervals field, help, its own rules.
_POLL_OPTIONS: tuple[tuple[str, str, str, tuple[Rule, ...]], ...] = (
    (
        "agent-follow-up",
        "follow_up",
        "Seconds to the first follow-up ring-buffer read after an event that promises a "
        "line (a CONNECT written, a port opened); each next one waits twice as long.",
        (),
    ),
    (
        "agent-follow-up-window",
        "follow_up_window",
        "Seconds of follow-up reads before waiting for the next event again.",
        (),
    ),
    (
        "agent-poll-agentless",
        "agentless_first",
        "Seconds to the first read of a VM whose agent never appeared; doubling up to the "
        "safety read.",
        (),
    ),
    (
        "agent-poll-safety",
        "safety",
        "Seconds between the slow safety reads that remain without events.",
        (),
    ),
    (
        "agent-reopen-grace",
        "reopen_grace",
        "Seconds an agent's port may stay closed without a STOPPED line before the agent "
        "is taken as stopped (killed).",
        (_REOPEN_GRACE,),
    ),
    (
        "agent-silence-timeout",
        "silence_timeout",
        "Seconds without a status line from a running VM's agent before it is taken as "
        "stopped (agents repeat their status every 5 s).",
        (),
    ),
)


def _absolute(path: str) -> str:
    """A path as given, made absolute (an empty one stays empty: none)."""
    return os.path.abspath(path) if path else path


class Options(usage.Options):
    """Options for ``twistd vmready``: the command line over the config file over the defaults."""

    # Who this daemon is as a cluster member (None: a single host's SQLite store), once parsed.
    cluster: ClusterSettings | None = None

    optParameters: list[list[Any]] = [
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
        *CLUSTER_OPTIONS,
        choice("hypervisor", "fakeqemu", "fakeqemu (default) or qemu.", HYPERVISORS),
        ["qemu-binary", None, None, "The hypervisor binary (default: per --hypervisor)."],
        seconds(
            "power-sync-interval",
            30.0,
            "Seconds between power-state reconciliations; 0 or less disables it.",
            FINITE,
        ),
        seconds(
            "stop-timeout",
            30.0,
            "Seconds a clean stop waits before forcing.",
            FINITE,
            (lambda value: 0 <= value <= MAX_STOP_TIMEOUT, f"0 to {MAX_STOP_TIMEOUT:g} seconds"),
        ),
        whole(
            "sync-concurrency",
            DEFAULT_SYNC_CONCURRENCY,
            "Instances reconciled at once by power sync and at daemon start (1 to 1024).",
            (lambda value: 1 <= value <= MAX_SYNC_CONCURRENCY, f"1 to {MAX_SYNC_CONCURRENCY}"),
        ),
        seconds(
            "gc-sweep-interval",
            DEFAULT_SWEEP_INTERVAL,
            "Seconds between checks whether the heap grew enough to sweep it (one full "
            "garbage collection, the survivors frozen): short pauses with thousands of VMs; "
            "0 or less: Python's own schedule only.",
            FINITE,
        ),
        choice(
            "serial-layout",
            CURRENT_LAYOUT.name,
            "Serial wiring for VMs this daemon starts: current (com.canonical.lxd) or legacy "
            "(org.linuxcontainers.lxd, as before the rename; to reproduce upgrades).",
            STARTABLE_LAYOUTS,
        ),
        [
            "guest-listen",
            None,
            None,
            "Guest API endpoint string, vsock:port=0 or hvsock:path=<base> "
            "(default: vsock:port=0 when VMs get the vsock transport, else "
            "hvsock:path=<data-dir>/guest-api.sock).",
        ],
        *(
            seconds(option, getattr(_DEFAULT_POLL, field), text, _POLL_RANGE, *rules)
            for option, field, text, rules in _POLL_OPTIONS
        ),
        [
            "record-dir",
            None,
            None,
            "Record every instance's session to <dir>/<instance>.jsonl (an instance's "
            "vmready.record=false opts it out; vmready.record=true records it even without "
            "this option, to <data-dir>/transcripts).",
            _absolute,
        ],
        whole(
            "record-max-bytes",
            DEFAULT_MAX_BYTES,
            "Rotate a transcript to <file>.1 once it passes this size.",
            at_least(1024),
        ),
        whole("record-keep", DEFAULT_KEEP, "Rotated transcripts kept per instance.", at_least(0)),
        [
            "guest-transport",
            None,
            "auto",
            "How new VMs' agents reach the guest API: vsock (needs /dev/vhost-vsock), forward "
            "(user-mode networking restricted to one forward), hvsock (fakeqemu guests); auto: "
            "hvsock on fakeqemu, else vsock where /dev/vhost-vsock opens, else forward.",
        ],
        [
            "default-image",
            None,
            None,
            "The disk image instances launched without one boot.",
            _absolute,
        ],
        [
            "default-kernel",
            None,
            None,
            "The kernel instances launched without one boot.",
            _absolute,
        ],
        ["default-initrd", None, None, "The initramfs for --default-kernel.", _absolute],
        ["default-append", None, None, "The kernel command line for --default-kernel."],
        seconds(
            "kvm-probe-timeout",
            DEFAULT_KVM_PROBE_TIMEOUT,
            "Seconds a first guest under KVM may show no sign of life (console output, its "
            "agent) before KVM is judged not to work here and it restarts under TCG.",
            (lambda value: 0 < value <= 3600, "more than 0 and at most 3600"),
        ),
        whole(
            "console-max-bytes",
            DEFAULT_CONSOLE_MAX_BYTES,
            "Rotate a VM's console log to console.log.1 once it passes this size.",
            at_least(4096),
        ),
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
                fail(str(e))
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
                fail(file_problem(self.config_file, self.config_settings, key, why))

    def postOptions(self) -> None:
        """What takes more than one option: the log format, the data dir, the store, the API."""
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
                self["fence"],
            )
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        if self.cluster is not None:
            self["member-name"] = self.cluster.name
            self["member-address"] = self.cluster.address
        if not self["listen"]:
            # Whoever can reach the operator socket controls every VM: owner only.
            path = os.path.join(self["data-dir"], "vmready.sock").replace(":", "\\:")
            self["listen"] = f"unix:{path}:mode=600:backlog={OPERATOR_LISTEN_BACKLOG}"

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
        return PollIntervals(**{field: self[option] for option, field, *_ in _POLL_OPTIONS})


def makeService(options: Options) -> VMReadyService:
    """Check what can be checked before twistd daemonizes, then build the service."""
    reactor = default_reactor()
    config, transport = _checked_config(options)
    _announce(options, config, transport)
    # Read once, then dropped: the VMs' QEMU processes inherit the daemon's environment.
    notifier = Notifier.from_environment(os.environ, os.getpid())
    forget_environment(os.environ)
    return VMReadyService(reactor, config, notifier)


def _checked_config(options: Options) -> tuple[DaemonConfig, str]:
    """The daemon's config, once everything it names is usable here; the guest transport."""
    data_dir = options["data-dir"]
    check_data_dir(data_dir)
    try:
        certificate = ensure_server_certificate(data_dir)
    except CertificateError as e:
        fail(str(e))
    check_store(options["store"], options.cluster, certificate.fingerprint)
    check_listen_address(options["listen"])
    if options["https-address"] is not None:
        check_https_address(options["https-address"])
    try:
        transport = choose_transport(
            options["hypervisor"], options["guest-transport"], vhost_vsock_problem()
        )
    except TransportError as e:
        fail(f"--guest-transport {options['guest-transport']}: {e}")
    if not options["guest-listen"]:
        # vsock VMs dial AF_VSOCK; everything else (hvsock guests, the forward) needs none.
        base = os.path.join(data_dir, GUEST_SOCKET_BASE).replace(":", "\\:")
        vsock = transport == "vsock"
        options["guest-listen"] = "vsock:port=0" if vsock else f"hvsock:path={base}"
    check_guest_listen_address(options["guest-listen"])
    try:
        check_files(options.default_boot)
    except VMReadyError as e:
        fail(f"the default boot source cannot boot: {e.message}")
    raise_file_limit()
    member = options.cluster is not None
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
        default_boot=options.default_boot,
        kvm_probe_timeout=options["kvm-probe-timeout"],
        console_max_bytes=options["console-max-bytes"],
        sync_concurrency=options["sync-concurrency"],
        gc_sweep_interval=options["gc-sweep-interval"],
        https_address=options["https-address"],
        store=options["store"],
        member_name=options["member-name"] if member else None,
        member_address=options["member-address"] if member else None,
        lease_seconds=options["lease-seconds"],
        fence_vms=options.cluster is not None and options.cluster.fence_vms,
    )
    return config, transport


def _announce(options: Options, config: DaemonConfig, transport: str) -> None:
    """One line saying where the daemon is and what it serves where."""
    reached = {
        "forward": f"reached by guests through {config.forward_socket} (the forward transport)",
        "vsock": "reached by guests over vsock",
        "hvsock": "reached by fakeqemu guests as unix sockets",
    }[transport]
    summary = "data dir {data_dir}, API on {listen}, guest API on {guest_listen}, {reached}"
    fields = {
        "data_dir": config.data_dir,
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
