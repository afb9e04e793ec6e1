"""A real Linux guest under real QEMU: boot, agent link, Ready, restarts, power-off, panic.

The guest is the demo guest ``vmready.hypervisor.guestimage`` builds from Debian packages
(Debian's kernel, a small busybox initramfs, a minbase root disk with python3
and systemd, the vmready loader installed as LXD images carry theirs).  The
daemon is ``twistd -n vmready --hypervisor qemu``, whose VMs reach the guest
API over vsock where ``/dev/vhost-vsock`` exists and over the restricted
forward elsewhere.  Nothing here is simulated: the agent runs inside the guest
from the config drive, the workload is a shell script the guest runs from
its user-data, and everything the guest saw it prints on its serial console,
which the test reads with ``vmready console NAME --show-log``.

It skips where QEMU, qemu-img, socat or the guest build cannot run, and fails
instead under ``VMREADY_REQUIRE_QEMU=1`` (CI), so CI proves it every run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from typing import TypeVar

from twisted.trial.unittest import SynchronousTestCase

from tests.conformance.support import REQUIRE_QEMU_VARIABLE
from tests.system import System, eventually, unix_http
from vmready.domain.states import READY_KEY

# A TCG guest on two shared cores boots in well under this; the bound is for slow days.
BOOT_DEADLINE = 300.0
GUEST_CACHE_VARIABLE = "VMREADY_GUEST_CACHE"
TOOLS = ("qemu-system-x86_64", "qemu-img", "socat", "mmdebstrap", "busybox", "mkfs.ext4")
T = TypeVar("T")

# The guest's workload (its cloud-init.user-data), run by the guest at every boot.
WORKLOAD = r"""#!/bin/sh
say() { echo "GUEST: $*"; }
say "boot $(cat /proc/sys/kernel/random/boot_id)"
for p in /proc/[0-9]*; do
    line=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)
    case "$line" in
        *vmready-agent.pyz*--config-drive*) say "agent cmdline: $line"; agent=${p#/proc/};;
    esac
done
say "agent process: $agent" \
    "unit's: $(systemctl show -p MainPID --value vmready-agent.service)" \
    "cgroup: $(cat "/proc/$agent/cgroup")"
if python3 -c 'import twisted' 2>/dev/null; then say "twisted: importable"
else say "twisted: absent"; fi
n=0
until vmready-agent notify ready --timeout 5; do
    n=$((n + 1))
    if [ "$n" -ge 300 ]; then say "notify: gave up"; exit 1; fi
    sleep 0.5
done
say "declared Ready"
exec python3 -S -I - <<'PY'
import http.client, os, socket, ssl, time

def say(*words):
    print("GUEST:", *words, flush=True)

class Devlxd(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("lxd", timeout=10)

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect("/dev/lxd/sock")

def get(path):
    connection = Devlxd()
    try:
        connection.request("GET", path)
        answer = connection.getresponse()
        return answer.status, answer.read().decode("utf-8", "replace")
    finally:
        connection.close()

for path in ("/1.0", "/1.0/config", "/1.0/config/user.probe", "/1.0/meta-data"):
    status, body = get(path)
    say("GET", path, status, body.strip().replace("\n", " | "))

status, host_port = get("/1.0/config/user.host-port")
for host, port in (
    ("10.0.2.2", int(host_port)),
    ("10.0.2.100", 22),
    ("10.0.2.100", 8444),
    ("10.0.2.3", 53),
    ("192.0.2.1", 80),
):
    probe = socket.socket()
    probe.settimeout(2)
    try:
        probe.connect((host, port))
        say("isolation: REACHED", f"{host}:{port}")
    except OSError as e:
        say("isolation: blocked", f"{host}:{port}", type(e).__name__)
    finally:
        probe.close()

context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE
try:
    with socket.create_connection(("10.0.2.100", 8443), timeout=5) as raw:
        with context.wrap_socket(raw) as tls:
            tls.sendall(b"GET /1.0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = tls.recv(100)
            if not answer:
                raise ConnectionResetError("closed")
            say("forward without a certificate: answered", answer[:20])
except (OSError, ssl.SSLError) as e:
    say("forward without a certificate: refused", type(e).__name__)
say("checks done")

def agent_pid():
    out = os.popen("systemctl show -p MainPID --value vmready-agent.service").read()
    return int(out.strip() or 0)

def answers():
    try:
        return get("/1.0")[0] == 200
    except OSError:
        return False

def kill_agent():
    # The agent dies; systemd's unit restarts it (Restart=on-failure) and it serves again.
    killed = agent_pid()
    os.kill(killed, 9)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = agent_pid()
        if now not in (0, killed) and answers():
            say("agent restarted by systemd as process", now, "was", killed)
            return
        time.sleep(0.5)
    say("agent not restarted by systemd")

killed_once = False
while True:
    try:
        status, action = get("/1.0/config/user.action")
    except OSError:
        status, action = 0, ""
    if status == 200 and action == "kill-agent" and not killed_once:
        killed_once = True
        kill_agent()
    if status == 200 and action in ("poweroff", "panic"):
        say("action", action)
        break
    time.sleep(0.5)
if action == "poweroff":
    os.execvp("poweroff", ["poweroff"])
with open("/proc/sysrq-trigger", "w") as trigger:
    trigger.write("c")
PY
"""


def _unavailable() -> str | None:
    """Why a real guest cannot run here, or None."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (Debian: qemu-system-x86 qemu-utils socat "
            "mmdebstrap busybox-static e2fsprogs)"
        )
    return None


def real_guest_images(case: SynchronousTestCase, build: Callable[[str], T]) -> T:
    """What ``build`` makes from the guest cache directory: the images a real-guest test boots.

    Skips, saying why, where QEMU or the build tools are missing or the images
    cannot be built, and fails instead under ``VMREADY_REQUIRE_QEMU=1``.
    """
    reason = _unavailable()
    required = os.environ.get(REQUIRE_QEMU_VARIABLE) == "1"
    if reason is not None:
        if required:
            case.fail(f"{REQUIRE_QEMU_VARIABLE}=1 but a real guest cannot run: {reason}")
        case.skipTest(reason)
    from vmready.hypervisor.guestimage.commands import GuestImageError

    cache = os.environ.get(GUEST_CACHE_VARIABLE) or os.path.expanduser("~/.cache/vmready/guest")
    try:
        return build(cache)
    except GuestImageError as e:
        if required:
            case.fail(f"{REQUIRE_QEMU_VARIABLE}=1 but the guest images cannot be built: {e}")
        case.skipTest(f"the guest images cannot be built here: {e}")


class RealGuestTests(SynchronousTestCase):
    """The issue's whole scenario on one real guest, step by step."""

    def setUp(self) -> None:
        from vmready.hypervisor.guestimage.build import ensure_guest

        self.guest = real_guest_images(self, lambda cache: ensure_guest(cache, lambda line: None))

    def console(self, system: System, name: str) -> str:
        return system.cli("console", name, "--show-log").stdout

    def wait_for_console(self, system: System, name: str, text: str) -> str:
        def shown() -> str | None:
            log = self.console(system, name)
            return log if text in log else None

        return eventually(
            shown, f"{text!r} on the console of {name}", timeout=BOOT_DEADLINE, interval=0.5
        )

    def set_config(self, system: System, name: str, config: dict[str, str | None]) -> None:
        answer = unix_http(
            system.socket_path,
            "PATCH",
            f"/1.0/instances/{name}",
            json.dumps({"config": config}).encode(),
        )
        self.assertEqual(answer.status, 200, answer.body)

    def test_realGuestFromLaunchToDelete(self) -> None:
        system = System(self)
        system.start_daemon("--hypervisor", "qemu")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.1)
        self.addCleanup(listener.close)
        events = system.events()
        system.cli(
            "launch",
            "g1",
            "--memory",
            "512",
            "--cpus",
            "2",
            "--image",
            self.guest.image,
            "--kernel",
            self.guest.vmlinux or self.guest.kernel,
            "--initrd",
            self.guest.initrd,
            "--append",
            self.guest.append,
            "-c",
            f"cloud-init.user-data={WORKLOAD}",
            "-c",
            "user.probe=hello from the host",
            "-c",
            f"user.host-port={listener.getsockname()[1]}",
        )
        info = system.info("g1")
        overlay = os.path.join(system.directory, "disks", os.path.basename(system.run_dir("g1")))
        overlay += ".qcow2"
        self.assertTrue(os.path.isfile(overlay))
        self.assertEqual(info["boot"]["image"], self.guest.image)
        self.assertIn(info["boot"]["accel"]["current"], ("kvm", "tcg"))

        # The agent, started by the guest's loader from the config drive, links up.
        for action in ("instance-agent-started", "instance-agent-connected"):
            events.wait_for_action("g1", action, BOOT_DEADLINE)
        system.cli("wait", "g1", "status=ready", "--timeout", str(BOOT_DEADLINE))
        self.assertEqual(system.info("g1")["config"][READY_KEY], "true")

        log = self.wait_for_console(system, "g1", "GUEST: checks done")
        agent = re.search(r"GUEST: agent cmdline: (.*)", log)
        assert agent is not None, log
        words = agent.group(1).split()
        self.assertEqual(words[:4], ["/usr/bin/python3", "-S", "-I", words[3]])
        self.assertTrue(words[3].endswith("/vmready-agent.pyz"), words)
        # Started by the initramfs before systemd, then adopted by the agent's unit.
        early = re.search(
            r"vmready-initramfs: \[[\d.]+\] the vmready agent starts ahead "
            r"of /sbin/init as process (\d+)",
            log,
        )
        assert early is not None, log
        pid = early.group(1)
        self.assertIn(
            f"GUEST: agent process: {pid} unit's: {pid} "
            "cgroup: 0::/system.slice/vmready-agent.service",
            log,
        )
        self.assertIn("GUEST: twisted: absent", log)
        self.assertIn("GUEST: GET /1.0/config/user.probe 200 hello from the host", log)
        uuid = info["uuid"]
        self.assertIn(
            f"GUEST: GET /1.0/meta-data 200 instance-id: {uuid} | local-hostname: g1", log
        )
        self.assertRegex(log, r"GUEST: GET /1\.0/config 200 .*/1\.0/config/user\.probe")
        self.assertNotIn("isolation: REACHED", log)
        self.assertEqual(log.count("GUEST: isolation: blocked"), 5, log)
        self.assertIn("GUEST: forward without a certificate: refused", log)
        with self.assertRaises(TimeoutError):
            listener.accept()  # nothing from the guest ever reached the host's loopback

        # The agent killed in the guest: systemd restarts it (the adopted agent was the
        # unit's main process), it links up again and reasserts the workload's Ready.
        events = system.events()
        self.set_config(system, "g1", {"user.action": "kill-agent"})
        log = self.wait_for_console(system, "g1", "GUEST: agent restarted by systemd")
        restarted = re.search(r"GUEST: agent restarted by systemd as process (\d+) was (\d+)", log)
        assert restarted is not None, log
        self.assertEqual(restarted.group(2), pid)
        self.assertNotEqual(restarted.group(1), pid)
        events.wait_for_action("g1", "instance-agent-connected", BOOT_DEADLINE)
        system.cli("wait", "g1", "status=ready", "--timeout", str(BOOT_DEADLINE))
        self.set_config(system, "g1", {"user.action": None})

        # A new daemon: a new port, the agent reconnects, Ready comes back by itself.
        system.stop_daemon()
        system.start_daemon("--hypervisor", "qemu")
        system.cli("wait", "g1", "status=ready", "--timeout", str(BOOT_DEADLINE))
        self.assertEqual(self.console(system, "g1").count("GUEST: declared Ready"), 1)

        # The guest powers itself off: Stopped, not ready.
        events = system.events()
        self.set_config(system, "g1", {"user.action": "poweroff"})
        system.cli("wait", "g1", "status=stopped", "--timeout", str(BOOT_DEADLINE))
        stopped = system.info("g1")
        self.assertEqual(stopped["config"][READY_KEY], "false")
        self.assertEqual(stopped["error"], "")
        events.wait_for_action("g1", "instance-agent-stopped", BOOT_DEADLINE)

        # Started again: a new boot, the workload declares Ready again.
        self.set_config(system, "g1", {"user.action": None})
        system.cli("start", "g1")
        system.cli("wait", "g1", "status=ready", "--timeout", str(BOOT_DEADLINE))
        self.wait_for_console(system, "g1", "GUEST: checks done")

        # A kernel panic: Error, with the reason kept, the panic on the console.
        self.set_config(system, "g1", {"user.action": "panic"})
        system.cli("wait", "g1", "status=error", "--timeout", str(BOOT_DEADLINE))
        crashed = system.info("g1")
        self.assertIn("guest kernel panicked", crashed["error"])
        self.assertEqual(crashed["config"][READY_KEY], "false")
        self.assertIn("Kernel panic", self.wait_for_console(system, "g1", "Kernel panic"))

        system.cli("delete", "g1", "--force")
        self.assertFalse(os.path.exists(overlay))
