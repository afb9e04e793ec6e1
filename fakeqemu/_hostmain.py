"""``fakeqemu-host``: run a multi-VM host, or list, kill and crash its VMs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from fakeqemu._host import HOST_VARIABLE
from fakeqemu._hostclient import HostClient, HostRequestError, HostUnreachable


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fakeqemu-host",
        description=f"Host many fakeqemu VMs in one process. Launch a VM on it with "
        f"{HOST_VARIABLE}=<control socket> fakeqemu-system-x86_64 <qemu arguments>.",
    )
    parser.add_argument("--control", required=True, help="the host's control socket")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the host (in the foreground unless -d)")
    serve.add_argument("-d", "--daemonize", action="store_true")
    serve.add_argument("--pidfile", default="")
    serve.add_argument("--logfile", default="-")
    commands.add_parser("list", help="list the VMs the host runs, as JSON")
    kill = commands.add_parser("kill", help="make a VM vanish as if SIGKILLed")
    kill.add_argument("vm")
    crash = commands.add_parser("crash", help="make a VM die with an error message")
    crash.add_argument("vm")
    crash.add_argument("--message", default="crashed on request (fakeqemu-host crash)")
    return parser


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point of ``fakeqemu-host``."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        from twisted.scripts.twistd import run

        twistd_args = ["twistd", "--pidfile", args.pidfile, "--logfile", args.logfile]
        if not args.daemonize:
            twistd_args.append("--nodaemon")
        sys.argv = [*twistd_args, "fakeqemu-host", "--control", args.control]
        run()
        sys.exit(0)
    try:
        with HostClient(args.control) as client:
            if args.command == "list":
                print(json.dumps(client.call("list"), indent=2))
            elif args.command == "kill":
                client.call("kill", vm=args.vm)
            else:
                client.call("crash", vm=args.vm, message=args.message)
    except (HostRequestError, HostUnreachable) as e:
        print(f"fakeqemu-host: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
