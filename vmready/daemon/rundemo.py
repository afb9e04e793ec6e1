"""``./dev run``: the daemon on its defaults, and a demo instance that reaches READY.

Starts ``twistd -n vmready`` (fakeqemu, SQLite in the data dir), waits for its
API socket, launches the instance ``demo`` with the ``vmready`` CLI (or starts
it again if an earlier run left it stopped), waits for RUNNING, then plays the
guest: starts ``vmready-agent`` on the demo's config drive (a fakeqemu guest is
a host process), waits for the agent link, and declares the workload Ready
with ``vmready-agent notify ready``.  It shows ``vmready list`` and keeps the
daemon in the foreground until Ctrl-C.  VMs and their agents outlive the
daemon, as guests do: the next run re-adopts the VM, the agent reconnects to
the new daemon and re-reports Ready by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from vmready.hypervisor import AGENT_CONFIG, AGENT_ZIPAPP
from vmready.lifecycle import CONFIG_DRIVE, run_dir_name

DEMO = "demo"
START_TIMEOUT = 60.0
# A real guest boots under TCG where KVM does not run guests: give it time.
REAL_READY_TIMEOUT = 180
AGENT_PIDFILE = "agent.pid"


def cli(
    socket_path: str, *args: str, check: bool = True, quiet: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the vmready CLI against the demo daemon, echoing the command unless ``quiet``."""
    command = [sys.executable, "-m", "vmready.cli.main", "--socket", socket_path, *args]
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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def ensure_agent(data_dir: str, instance: dict[str, object]) -> str:
    """The demo's guest agent, started unless it still runs; returns its guest API socket."""
    run_dir = os.path.join(data_dir, "run", run_dir_name(str(instance["uuid"])))
    drive = os.path.join(run_dir, CONFIG_DRIVE)
    with open(os.path.join(drive, AGENT_CONFIG)) as f:
        settings = json.load(f)
    guest_root = os.path.dirname(settings["devlxd_socket"])
    os.makedirs(guest_root, mode=0o700, exist_ok=True)
    pidfile = os.path.join(guest_root, AGENT_PIDFILE)
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        pid = 0
    if pid and _alive(pid):
        print(f"vmready: the demo's agent (process {pid}) is still running in its guest")
        return str(settings["devlxd_socket"])
    log = os.path.join(guest_root, "agent.log")
    # As a guest runs it: the zipapp from its config drive, without the host's site-packages.
    zipapp = os.path.join(drive, AGENT_ZIPAPP)
    command = [sys.executable, "-S", "-I", zipapp, "--config-drive", drive]
    print(f"vmready: starting the guest agent: python3 -S -I {zipapp} --config-drive {drive}")
    print(f"vmready: its log is {log}")
    with open(log, "ab") as output:
        agent = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,  # it lives in the guest, not in this terminal
        )
    with open(pidfile, "w") as f:
        f.write(f"{agent.pid}\n")
    return str(settings["devlxd_socket"])


def declare_ready(devlxd_socket: str) -> None:
    """What a workload in the guest does once it is up: ``vmready-agent notify ready``."""
    print("$ vmready-agent notify ready   # in the guest, by its workload", flush=True)
    command = [sys.executable, "-m", "vmready.agent.main", "notify", "ready"]
    result = subprocess.run(
        [*command, "--socket", devlxd_socket], text=True, capture_output=True, check=False
    )
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"vmready-agent notify ready failed with status {result.returncode}")


# What the real-QEMU demo needs on the host, by Debian package.
HOST_PACKAGES = {
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-img": "qemu-utils",
    "socat": "socat",
    "mmdebstrap": "mmdebstrap",
    "busybox": "busybox-static",
}
# The demo guest's workload: once its agent serves /dev/lxd/sock, it declares Ready.
DEMO_WORKLOAD = """#!/bin/sh
# The demo's workload (cloud-init.user-data): declare Ready once the agent links.
for attempt in $(seq 1 240); do
    if vmready-agent notify ready --timeout 5; then
        echo "demo workload: declared Ready (attempt $attempt)"
        exit 0
    fi
    sleep 0.5
done
echo "demo workload: the agent never took Ready" >&2
exit 1
"""


def ensure_host_packages() -> None:
    """Install what real QEMU guests need (as root, with apt-get), or say exactly what to run.

    With the tools that build the demo guest's kernel (``guestimage.kernel``).
    """
    from vmready.hypervisor.guestimage import missing_build_packages

    missing = sorted({pkg for tool, pkg in HOST_PACKAGES.items() if shutil.which(tool) is None})
    missing = sorted({*missing, *missing_build_packages()})
    if not missing:
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(
            f"vmready: real guests need {', '.join(missing)}; install them with: "
            f"sudo {' '.join(command)}"
        )
    print(f"vmready: installing {' '.join(missing)} (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (["apt-get", "update", "-qq"], command):
        if subprocess.run(step, env=env, check=False).returncode != 0:
            raise SystemExit(f"vmready: {' '.join(step)} failed")


def launch_real_demo(socket_path: str, data_dir: str) -> None:
    """Build (or reuse) the demo guest and launch ``demo`` from it, its workload included."""
    from vmready.hypervisor.guestimage import ensure_guest

    guest = ensure_guest(os.path.join(data_dir, "images"), log=print)
    cli(
        socket_path,
        "launch",
        DEMO,
        "--memory",
        "512",
        "--cpus",
        "2",
        "--image",
        guest.image,
        "--kernel",
        guest.vmlinux or guest.kernel,
        "--initrd",
        guest.initrd,
        "--append",
        guest.append,
        "-c",
        f"cloud-init.user-data={DEMO_WORKLOAD}",
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m vmready.daemon.rundemo``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data-dir", default=os.path.abspath(".vmready-data"))
    parser.add_argument("--hypervisor", default="fakeqemu", choices=("fakeqemu", "qemu"))
    parser.add_argument(
        "--exit", action="store_true", help="stop the daemon once the demo is READY (and listed)"
    )
    args = parser.parse_args(argv)
    real = args.hypervisor == "qemu"
    if real:
        ensure_host_packages()
    started = time.monotonic()
    socket_path = os.path.join(args.data_dir, "vmready.sock")
    daemon = start_daemon(args.data_dir, args.hypervisor)
    try:
        wait_for_socket(daemon, socket_path)
        bring_up(socket_path, args.data_dir, real)
        if real:
            reach_ready_in_real_guest(socket_path, started)
        else:
            reach_ready_as_guest(socket_path, args.data_dir)
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


def start_daemon(data_dir: str, hypervisor: str) -> subprocess.Popen[bytes]:
    """``twistd -n vmready`` on the data dir, logging to its ``vmready.log``."""
    twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
    os.makedirs(data_dir, exist_ok=True)
    log = os.path.join(data_dir, "vmready.log")
    # The embedded defaults: no /etc/vmready/vmready.yaml of the host applies to the demo.
    command = [twistd, "-n", "--pidfile", "", "--logfile", log, "vmready", "--config", ""]
    command += ["--data-dir", data_dir, "--hypervisor", hypervisor]
    print(f"vmready: starting the daemon: twistd -n vmready --data-dir {data_dir}")
    print(f"vmready: its log is {log}")
    return subprocess.Popen(command)


def bring_up(socket_path: str, data_dir: str, real: bool) -> None:
    """The demo instance RUNNING: adopted, started again, or launched."""
    existing = cli(socket_path, "info", DEMO, "--format", "json", check=False, quiet=True)
    if existing.returncode == 0:
        status = json.loads(existing.stdout).get("status")
        if status in ("Stopped", "Error"):
            cli(socket_path, "start", DEMO)
        else:
            print(f"vmready: instance {DEMO} is {status}: its VM outlived the last daemon")
    elif real:
        launch_real_demo(socket_path, data_dir)
    else:
        cli(socket_path, "launch", DEMO, "--memory", "256", "--cpus", "1")
    cli(socket_path, "wait", DEMO, "status=running", "--timeout", "120")


def _demo_instance(socket_path: str) -> dict[str, Any]:
    instance: dict[str, Any] = json.loads(
        cli(socket_path, "info", DEMO, "--format", "json", quiet=True).stdout
    )
    return instance


def reach_ready_in_real_guest(socket_path: str, started: float) -> None:
    """The guest boots, its loader starts the agent, its workload declares Ready."""
    cli(socket_path, "wait", DEMO, "agent", "--timeout", str(REAL_READY_TIMEOUT))
    cli(socket_path, "wait", DEMO, "status=ready", "--timeout", str(REAL_READY_TIMEOUT))
    accel = (_demo_instance(socket_path).get("boot") or {}).get("accel") or {}
    print(
        f"vmready: {DEMO} is READY {time.monotonic() - started:.1f}s after the daemon "
        f"started, under {str(accel.get('current')).upper()} ({accel.get('reason')})"
    )


def reach_ready_as_guest(socket_path: str, data_dir: str) -> None:
    """Play the fakeqemu guest: its agent, then its workload's Ready (unless re-reported)."""
    devlxd_socket = ensure_agent(data_dir, _demo_instance(socket_path))
    cli(socket_path, "wait", DEMO, "agent", "--timeout", "60")
    again = cli(
        socket_path, "wait", DEMO, "status=ready", "--timeout", "3", check=False, quiet=True
    )
    if again.returncode == 0:
        print(f"vmready: {DEMO} is READY again: its agent re-reported Ready by itself")
    else:
        declare_ready(devlxd_socket)
        cli(socket_path, "wait", DEMO, "status=ready", "--timeout", "60")


if __name__ == "__main__":
    main()
