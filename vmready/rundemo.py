"""``./dev run``: the daemon on its defaults, and a demo instance that reaches RUNNING.

Starts ``twistd -n vmready`` (fakeqemu, SQLite in the data dir), waits for its
API socket, launches the instance ``demo`` with the ``vmready`` CLI (or starts
it again if an earlier run left it stopped), waits for RUNNING, shows
``vmready list``, and then keeps the daemon in the foreground until Ctrl-C.
VMs outlive the daemon, as QEMU VMs do: the next run re-adopts them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

DEMO = "demo"
START_TIMEOUT = 60.0


def cli(
    socket_path: str, *args: str, check: bool = True, quiet: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the vmready CLI against the demo daemon, echoing the command unless ``quiet``."""
    command = [sys.executable, "-m", "vmready.cli", "--socket", socket_path, *args]
    result = subprocess.run(command, text=True, capture_output=True, check=False)
    if not quiet:
        print(f"$ vmready {' '.join(args)}", flush=True)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    if check and result.returncode != 0:
        raise SystemExit(f"vmready {' '.join(args)} failed with status {result.returncode}")
    return result


def wait_for_socket(daemon: subprocess.Popen[bytes], path: str) -> None:
    """Bounded wait for the daemon's API socket (or its early exit)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited with status {daemon.returncode}")
        if os.path.exists(path):
            return
        time.sleep(0.1)
    raise SystemExit(f"the daemon did not open {path} within {START_TIMEOUT:g}s")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m vmready.rundemo``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data-dir", default=os.path.abspath(".vmready-data"))
    parser.add_argument("--hypervisor", default="fakeqemu", choices=("fakeqemu", "qemu"))
    parser.add_argument(
        "--exit", action="store_true", help="stop the daemon once the demo is RUNNING"
    )
    args = parser.parse_args(argv)
    socket_path = os.path.join(args.data_dir, "vmready.sock")
    twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
    os.makedirs(args.data_dir, exist_ok=True)
    log = os.path.join(args.data_dir, "vmready.log")
    command = [twistd, "-n", "--pidfile", "", "--logfile", log, "vmready"]
    command += ["--data-dir", args.data_dir, "--hypervisor", args.hypervisor]
    print(f"vmready: starting the daemon: twistd -n vmready --data-dir {args.data_dir}")
    print(f"vmready: its log is {log}")
    daemon = subprocess.Popen(command)
    try:
        wait_for_socket(daemon, socket_path)
        existing = cli(socket_path, "info", DEMO, "--format", "json", check=False, quiet=True)
        if existing.returncode == 0:
            status = json.loads(existing.stdout).get("status")
            if status in ("Stopped", "Error"):
                cli(socket_path, "start", DEMO)
            else:
                print(f"vmready: instance {DEMO} is {status}: its VM outlived the last daemon")
        else:
            cli(socket_path, "launch", DEMO, "--memory", "256", "--cpus", "1")
        cli(socket_path, "wait", DEMO, "status=running", "--timeout", "60")
        cli(socket_path, "list")
        if args.exit:
            return
        print(
            "vmready: the daemon is running; press Ctrl-C to stop it (VMs keep running).\n"
            f"vmready: in another terminal: .venv/bin/vmready --socket {socket_path} list"
        )
        daemon.wait()
    except KeyboardInterrupt:
        print()
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)


if __name__ == "__main__":
    main()
