"""The ``vmready`` command line, parsed with argparse."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

import vmready
from vmready.cli.completion import SHELLS
from vmready.cli.errors import UsageError
from vmready.cli.output import FORMATS
from vmready.cli.remoteparser import add_remote_commands
from vmready.cli.suggest import command_index, with_choice_suggestion
from vmready.cli.tables import DEFAULT_COLUMNS, LIST_COLUMNS, Column, parse_columns
from vmready.cli.verbs import Verbs
from vmready.domain import ACCEL_CHOICES

# ``vmready snapshot VERB``; without one, ``create`` (the older ``snapshot NAME SNAPSHOT``).
SNAPSHOT_VERBS = ("create", "delete", "list", "restore")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``run`` owns the exit status."""

    def error(self, message: str) -> NoReturn:
        """A usage error (a mistyped verb or choice: the nearest one named)."""
        raise UsageError(with_choice_suggestion(message), self.format_usage())


def _seconds(text: str) -> float:
    """A ``--timeout``: a finite number, 0 or more (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    # float() also accepts "nan" and "inf", which no timer can take.
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


def _columns(text: str) -> tuple[Column, ...]:
    """A ``list --columns``: letters or comma-separated names (argparse names the option)."""
    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_DEFAULT_HEADERS = " ".join(column.header for column in parse_columns(DEFAULT_COLUMNS))
_LIST_HELP = (
    "COLUMNS is letters (-c nsmc) or comma-separated names (-c name,status,task_state):\n"
    + "".join(f"  {c.letter}  {c.name:<15} {c.header}\n" for c in LIST_COLUMNS)
    + f"default: {DEFAULT_COLUMNS} ({_DEFAULT_HEADERS})\n"
    "STATUS is the one status: the task in progress (STOPPING, RESIZING…) or where the\n"
    "instance rests (READY, RUNNING, FROZEN, STOPPED, RESIZED, ERROR).\n"
)

_WAIT_HELP = """\
CONDITION is status=<status>, case-insensitive, one of:
  running (also met by ready), ready, stopped, frozen, error, starting,
  stopping, freezing;
or "agent": the instance's guest agent is connected to the daemon.

wait subscribes to the daemon's events first, then checks the instance once,
then wakes on the matching lifecycle event; it never polls.

exit status:
  0  the condition was met
  1  timed out (--timeout), or an error: unknown instance, the daemon unreachable
  2  usage error
  3  the instance was deleted or went to Error while waiting for another status
  130  interrupted (SIGINT, Ctrl-C); 143 for SIGTERM
"""

_CONFIG_HELP = """\
instance keys: limits.memory, limits.cpu (only while stopped: else use resize),
  user.*, cloud-init.*, vmready.record; boot.* are set at launch only and
  volatile.* belong to the daemon (shown, never set).
daemon options: 'config show' and 'config get KEY' read the options the daemon
  runs with (GET /1.0); they are read when it starts, so 'config set KEY=VALUE'
  refuses and says where to set them: its config file (/etc/vmready/vmready.yaml,
  or --config FILE / $VMREADY_CONFIG) or twistd vmready's command line.
"""

_COMPLETION_HELP = """\
install:
  bash  echo 'source <(vmready completion bash)' >> ~/.bashrc
  zsh   echo 'source <(vmready completion zsh)' >> ~/.zshrc   (after compinit)
  fish  vmready completion fish > ~/.config/fish/completions/vmready.fish
"""


_RAW = argparse.RawDescriptionHelpFormatter
_NO_WAIT_HELP = "print the operation's id and return at once instead of waiting for it"


def build_parser() -> argparse.ArgumentParser:
    """The ``vmready`` argument parser."""
    parser = _Parser(
        prog="vmready",
        description="Operate vmready instances through the daemon's API.",
        epilog=(
            "formats: table (for people), json, yaml, csv (for programs; an action prints "
            "its operation and the instance after it). "
            "exit status: 0 success; 1 an error (the daemon refused, the action failed, "
            "not found, no daemon); 2 usage error; 130 interrupted (143: SIGTERM); "
            "see 'vmready wait -h' for wait"
        ),
    )
    # The version GET /1.0's environment.server_version reports (lxc version shows it).
    parser.add_argument("--version", action="version", version=f"vmready {vmready.__version__}")
    parser.add_argument(
        "--socket", default=None, help="the daemon's API socket (also accepted after COMMAND)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="output format where the output is data (also accepted after COMMAND)",
    )
    commands = Verbs(parser, "command", _common_options(), metavar="COMMAND")
    action = _action_options()
    _add_launch(commands)
    _add_list_and_info(commands)
    _add_actions(commands, action)
    _add_snapshot_commands(commands, action)
    config_verbs = _add_config_commands(commands)
    rename = commands.add("rename", "rename a stopped instance", action)
    rename.add_argument("name")
    rename.add_argument("new_name", metavar="NEW")
    _add_operation_commands(commands)
    _add_watching_commands(commands)
    _add_replay(commands)
    cluster_verbs = _add_cluster_commands(commands)
    # Remote use: ``remote``, ``config trust``, and list's and monitor's optional REMOTE:.
    add_remote_commands(commands, config_verbs, cluster_verbs)
    commands.add(
        "completion",
        "print the shell completion script of bash, zsh or fish",
        description="Print a completion script for SHELL: commands, options, instance names.",
        epilog=_COMPLETION_HELP,
        formatter_class=_RAW,
        shared=False,
    ).add_argument("shell", metavar="SHELL", choices=SHELLS, help="bash, zsh or fish")
    return parser


def _common_options() -> _Parser:
    """``--socket`` and ``--format``, also accepted after COMMAND."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--socket",
        default=argparse.SUPPRESS,
        help="the daemon's API socket (default: $VMREADY_SOCKET or <data dir>/vmready.sock)",
    )
    common.add_argument(
        "--format",
        choices=FORMATS,
        default=argparse.SUPPRESS,
        help="output format where the output is data (default: table)",
    )
    return common


def _action_options() -> _Parser:
    """An action's ``--wait`` (the default) or ``--no-wait``."""
    action = _Parser(add_help=False)
    waiting = action.add_mutually_exclusive_group()
    waiting.add_argument(
        "--wait",
        dest="no_wait",
        action="store_false",
        default=False,
        help="wait for the operation to finish, showing its progress on a terminal (default)",
    )
    waiting.add_argument("--no-wait", dest="no_wait", action="store_true", help=_NO_WAIT_HELP)
    return action


def _add_launch(commands: Verbs) -> None:
    # launch waits for its operation unless --no-wait; its --wait waits for more (Ready).
    launching = _Parser(add_help=False)
    launch_waiting = launching.add_mutually_exclusive_group()
    launch_waiting.add_argument(
        "--wait", action="store_true", help="then wait until the workload reports Ready"
    )
    launch_waiting.add_argument("--no-wait", action="store_true", help=_NO_WAIT_HELP)
    launch = commands.add("launch", "create and start an instance", launching)
    launch.add_argument("name")
    launch.add_argument("--memory", help="memory, MiB or with a unit (512, 2GiB)")
    launch.add_argument("--cpus", type=int, help="number of vCPUs")
    launch.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key (user.*, cloud-init.*, limits.*); repeatable",
    )
    launch.add_argument("--image", metavar="PATH", help="boot this qcow2 or raw disk image")
    launch.add_argument("--kernel", metavar="PATH", help="boot this Linux kernel (bzImage)")
    launch.add_argument("--initrd", metavar="PATH", help="with --kernel: its initramfs")
    launch.add_argument("--append", metavar="TEXT", help="with --kernel: its command line")
    launch.add_argument(
        "--accel",
        choices=ACCEL_CHOICES,
        help="kvm, tcg, or auto (default: KVM where it runs guests, else TCG)",
    )
    launch.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS", help="how long --wait waits at most"
    )
    launch.add_argument(
        "--target",
        metavar="MEMBER",
        help="in a cluster: the member to launch on (default: the least loaded online one)",
    )


def _add_list_and_info(commands: Verbs) -> None:
    listing = commands.add(
        "list",
        "list instances with their status",
        description="List instances with their status.",
        epilog=_LIST_HELP,
        formatter_class=_RAW,
    )
    listing.add_argument(
        "-c",
        "--columns",
        type=_columns,
        default=None,
        metavar="COLUMNS",
        help=f"the columns of the table and CSV formats (default: {DEFAULT_COLUMNS})",
    )
    commands.add("info", "show one instance").add_argument("name")


def _add_actions(commands: Verbs, action: _Parser) -> None:
    """The actions on one instance: start to delete."""
    commands.add("start", "start an instance", action).add_argument("name")
    for name, text in (("stop", "stop an instance"), ("restart", "restart an instance")):
        sub = commands.add(name, text, action)
        sub.add_argument("name")
        sub.add_argument("--force", action="store_true", help="power off at once")
        sub.add_argument(
            "--timeout",
            type=_seconds,
            metavar="SECONDS",
            help="how long a clean shutdown may take before it is forced (default: the daemon's)",
        )
    for name, text in (
        ("freeze", "pause an instance's VM"),
        ("unfreeze", "resume a frozen instance"),
        ("rebuild", "rebuild an instance (also recovers one in Error)"),
    ):
        commands.add(name, text, action).add_argument("name")
    resize = commands.add(
        "resize", "change memory and/or vCPUs (then confirm-resize or revert-resize)", action
    )
    resize.add_argument("name")
    resize.add_argument("--memory", help="new memory, MiB or with a unit")
    resize.add_argument("--cpus", type=int, help="new number of vCPUs")
    for name, text in (
        ("confirm-resize", "keep the new size of a resized instance"),
        ("revert-resize", "go back to the size before the resize"),
    ):
        commands.add(name, text, action).add_argument("name")
    delete = commands.add("delete", "delete an instance", action)
    delete.add_argument("name")
    delete.add_argument("--force", action="store_true", help="delete even if it is running")


def _add_snapshot_commands(commands: Verbs, action: _Parser) -> None:
    verbs = commands.group(
        "snapshot",
        "take, delete, list or restore an instance's snapshots",
        description=(
            "Snapshots of an instance: its config, and with --stateful its running VM. "
            "'vmready snapshot NAME SNAPSHOT' is short for 'vmready snapshot create NAME "
            "SNAPSHOT'."
        ),
        dest="snapshot_verb",
    )
    create = verbs.add(
        "create", "take a snapshot of an instance (its config; --stateful: its VM)", action
    )
    create.add_argument("name")
    create.add_argument("snapshot", metavar="SNAPSHOT")
    create.add_argument(
        "--stateful",
        action="store_true",
        help="also save the running VM's state (it pauses while QEMU writes it)",
    )
    forget = verbs.add(
        "delete", "delete a snapshot and its files (refused while a restore from it runs)"
    )
    forget.add_argument("name")
    forget.add_argument("snapshot", metavar="SNAPSHOT")
    verbs.add("list", "list an instance's snapshots").add_argument("name")
    for restore in (
        verbs.add("restore", "restore an instance from one of its snapshots", action),
        commands.add("restore", "restore an instance from one of its snapshots", action),
    ):
        restore.add_argument("name")
        restore.add_argument("snapshot", metavar="SNAPSHOT")
        restore.add_argument(
            "--stateful", action="store_true", help="resume the VM from the saved state"
        )
        restore.add_argument(
            "--force",
            action="store_true",
            help="with --stateful: let QEMU try even if the device set changed since the snapshot",
        )


def _add_config_commands(commands: Verbs) -> Verbs:
    """``config`` (docs/operator-guide.md); its verbs, for ``config trust`` to join."""
    verbs = commands.group(
        "config",
        (
            "show, get, set or unset an instance's config keys, show the daemon's options, "
            "manage the remote API's trusted clients (config trust)"
        ),
        description=(
            "An instance's config keys, or (without an instance name) the daemon's options. "
            "Like incus, the number of arguments decides: 'config get NAME KEY' reads an "
            "instance's key, 'config get KEY' a daemon option. 'config trust' manages the "
            "client certificates the daemon's remote API trusts."
        ),
        dest="config_verb",
        epilog=_CONFIG_HELP,
        formatter_class=_RAW,
    )

    def config_verb(name: str, help: str, usage: str) -> argparse.ArgumentParser:
        usage = f"vmready config {name} [-h] [--socket SOCKET] [--format FORMAT] {usage}"
        return verbs.add(name, help, usage=usage)

    config_verb(
        "show", "an instance's config (YAML unless --format), or the daemon's options", "[NAME]"
    ).add_argument("name", nargs="?", help="the instance (none: the daemon)")
    config_verb(
        "get",
        "one key's value (an empty line when it is not set), or a daemon option's",
        "[NAME] KEY",
    ).add_argument("args", nargs="+", metavar="ARG", help="[NAME] KEY")
    config_verb(
        "set",
        "set instance keys: NAME KEY=VALUE... or NAME KEY VALUE",
        "NAME KEY=VALUE... | NAME KEY VALUE",
    ).add_argument("args", nargs="+", metavar="ARG", help="NAME KEY=VALUE..., or NAME KEY VALUE")
    config_verb("unset", "remove instance keys: NAME KEY...", "NAME KEY...").add_argument(
        "args", nargs="+", metavar="ARG", help="NAME KEY..."
    )
    return verbs


def _add_operation_commands(commands: Verbs) -> None:
    verbs = commands.group(
        "operation",
        "list, show or wait for the daemon's operations (long-running actions)",
        description=(
            "The daemon's operations: every action (launch, stop, snapshot, rename…) runs as "
            "one; finished ones are kept for 5 minutes."
        ),
        dest="operation_verb",
    )
    verbs.add("list", "list operations, oldest first")
    verbs.add("show", "show one operation (YAML unless --format)").add_argument("id", metavar="ID")
    operation_wait = verbs.add(
        "wait", "wait until an operation ends: exit 0 if it succeeded, 1 if it failed"
    )
    operation_wait.add_argument("id", metavar="ID")
    operation_wait.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="give up after this many seconds (exit 1; the operation runs on)",
    )


def _add_watching_commands(commands: Verbs) -> None:
    """What shows an instance or the daemon: console, history, metrics, events, wait."""
    console = commands.add("console", "show an instance's serial console")
    console.add_argument("name")
    console.add_argument(
        "--show-log", action="store_true", help="print the console log (what the guest wrote)"
    )
    commands.add("snapshots", "list an instance's snapshots").add_argument("name")
    commands.add("actions", "show an instance's action history").add_argument("name")
    commands.add("metrics", "print the daemon's metrics (Prometheus text format)")
    commands.add("monitor", "print events as they happen, until interrupted").add_argument(
        "--type",
        action="append",
        default=[],
        help="event types to show: lifecycle, operation (default: all); repeatable",
    )
    wait = commands.add(
        "wait",
        "wait until an instance reaches a status, or its agent connects",
        description="Wait until an instance reaches a status.",
        epilog=_WAIT_HELP,
        formatter_class=_RAW,
    )
    wait.add_argument("name")
    wait.add_argument("condition", metavar="CONDITION", help="status=<status>, or agent")
    wait.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS", help="give up after this many seconds"
    )


def _add_replay(commands: Verbs) -> None:
    replay = commands.add(
        "replay",
        "replay a recorded session against a fresh in-memory daemon (no daemon needed)",
        description=(
            "Replay a transcript (recorded by twistd vmready --record-dir, vmready.record=true "
            "or vmready-agent --record) against a fresh daemon core and a fakeqemu VM on a "
            "deterministic clock, and compare what the host does with the recording."
        ),
        epilog=(
            "exit status: 0 the host did what it did in the recording; 1 it diverged (the "
            "first divergence is printed); 2 the transcript is malformed or of an "
            "unsupported version (its line is named)"
        ),
        shared=False,
    )
    replay.add_argument("file", metavar="FILE", help="the transcript (JSON lines)")
    replay.add_argument(
        "--realtime",
        action="store_true",
        help="replay at the recorded pace, printing each record (default: as fast as possible)",
    )


def _add_cluster_commands(commands: Verbs) -> Verbs:
    verbs = commands.group(
        "cluster",
        "list, show or remove the members of the daemon's cluster",
        description=(
            "The members of the daemon's cluster: daemons sharing one store, each holding a "
            "lease it renews. A member whose lease ran out is UNREACHABLE; its instances show "
            "UNKNOWN until it returns."
        ),
        dest="cluster_verb",
    )
    verbs.add(
        "list",
        "list the members (NAME ADDRESS STATE INSTANCES)",
        description="List the members (NAME ADDRESS STATE INSTANCES).",
    )
    verbs.add(
        "show",
        "show one member (YAML unless --format)",
        description="Show one member (YAML unless --format).",
    ).add_argument("member", metavar="NAME")
    verbs.add(
        "remove",
        "retire a member: offline, with no instance left",
        description=(
            "Retire a member: its row goes and its certificate is no longer trusted as a "
            "member's. Refused while it is online (stop its daemon first), while instances "
            "are still on it (vmready cannot move them: delete them first), and by the member "
            "itself (ask another member)."
        ),
    ).add_argument("member", metavar="NAME")
    return verbs


def with_snapshot_verb(argv: list[str]) -> list[str]:
    """``vmready snapshot NAME SNAPSHOT`` (the older form) as ``snapshot create NAME SNAPSHOT``.

    An instance named like a verb is reached with the verb spelled out:
    ``vmready snapshot create delete SNAPSHOT``.
    """
    index = command_index(argv)
    if index is None or argv[index] != "snapshot":
        return argv
    rest = argv[index + 1 :]
    if not rest or rest[0] in SNAPSHOT_VERBS or rest[0] in ("-h", "--help"):
        return argv
    return [*argv[: index + 1], "create", *rest]
