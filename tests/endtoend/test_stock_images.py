"""The user's own cloud image under real QEMU: cloud-init's user-data applied, READY, first try.

The images are built from Debian packages alone by
``vmready.hypervisor.guestimage.stock`` (cached beside the demo guest's):
Debian's cloud kernel (no 9p), ``cloud-init`` in Debian's own configuration,
systemd, booted directly with the image's kernel and initramfs.

- **stock**: nothing of vmready in it.  The daemon's NoCloud seed gives
  cloud-init the user-data, and its vendor-data starts the agent from the seed.
- **stock, invalid user-data**: cloud-init's own verdict is on the console, and the
  instance still comes up (its agent connects).
- **loader baked in, LXD datasource**: cloud-init reads ``/dev/lxd/sock``, which the
  agent answers from its drive before it has a link to the host: ``cloud-id`` says
  ``lxd``, and the user-data, vendor-data, network-config and user.meta-data arrive.
- **the documented loader install**: the stock tree booted with the demo guest's
  kernel (it has 9p), cloud-init off, and a first-boot unit running exactly the
  commands docs/real-guests.md gives: exit 0, nothing left mounted, the agent CONNECTED.

Everything the guest saw it prints on its serial console, read with ``vmready
console NAME --show-log``.  The tests skip where QEMU or the build tools are
missing, and fail instead under ``VMREADY_REQUIRE_QEMU=1`` (CI).
"""

from __future__ import annotations

import os
import re
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.endtoend.test_real_guest import real_guest_images
from tests.system import System, eventually
from vmready.hypervisor.guestimage.build import ensure_guest
from vmready.hypervisor.guestimage.cache import GuestImage
from vmready.hypervisor.guestimage.stock import StockGuest, ensure_stock_guest

# cloud-init runs Python in four stages: under TCG it finished 32 s into the boot on two quiet
# cores, and took ten times that on the same cores loaded with other work.
BOOT_DEADLINE = 1800.0
# The user's workload: files it writes, what it prints, then Ready, as a user would write it.
USER_DATA = """#cloud-config
write_files:
  - path: /run/vmready-test/hello
    content: "written by the user-data\\n"
runcmd:
  - [sh, -c, 'echo "GUEST: hello file: $(cat /run/vmready-test/hello)"']
  - [sh, -c, 'until vmready-agent notify ready --timeout 5; do sleep 1; done']
  - [sh, -c, 'echo "GUEST: declared Ready"']
"""
# The instance's own vendor-data, beside vmready's: both are applied.
VENDOR_DATA = """#cloud-config
bootcmd:
  - [sh, -c, 'echo "GUEST: the instance vendor-data ran" > /dev/console']
"""
# What a guest with the LXD datasource reports of what cloud-init got from /dev/lxd/sock.
LXD_REPORT = r"""#cloud-config
runcmd:
  - [sh, -c, 'echo "GUEST: cloud-id $(cloud-id)"']
  - [sh, -c, 'echo "GUEST: hello file: $(cat /run/vmready-test/hello)"']
  - - python3
    - -c
    - |
      import json
      data = json.load(open("/run/cloud-init/instance-data-sensitive.json"))
      ds = data["ds"]
      print("GUEST: datasource", data["v1"]["platform"], data["v1"]["instance_id"])
      print("GUEST: meta-data", ds["meta-data"].splitlines()[-1])
      keys = sorted(k for k in ds["config"] if k.startswith(("user.", "cloud-init.")))
      print("GUEST: config keys", " ".join(keys))
  - - sh
    - -c
    - 'grep -o "network config is disabled by [a-z]*" /var/log/cloud-init.log | sed "s/^/GUEST: /"'
  - [sh, -c, 'until vmready-agent notify ready --timeout 5; do sleep 1; done']
write_files:
  - path: /run/vmready-test/hello
    content: "written by the user-data\n"
"""
INVALID_USER_DATA = "#cloud-config\nruncmd: [sh, -c, 'unclosed\n  - ]\n"


class StockImageTests(SynchronousTestCase):
    """Each test boots one real guest from an image with cloud-init."""

    def setUp(self) -> None:
        def build(cache: str) -> tuple[StockGuest, GuestImage]:
            stock_cache = os.path.join(os.path.dirname(cache), "stock")
            return (
                ensure_stock_guest(stock_cache, lambda line: None),
                ensure_guest(cache, lambda line: None),
            )

        self.stock, self.demo = real_guest_images(self, build)
        self.system = System(self)
        self.system.start_daemon("--hypervisor", "qemu")
        self.events = self.system.events()

    def launch(self, name: str, image: str, *config: str, demo_kernel: bool = False) -> None:
        kernel, initrd, append = (
            (self.demo.vmlinux or self.demo.kernel, self.demo.initrd, self.demo.append)
            if demo_kernel
            else (self.stock.kernel, self.stock.initrd, self.stock.append)
        )
        options: list[str] = []
        for setting in config:
            options += ["-c", setting]
        self.system.cli(
            "launch", name, "--memory", "1024", "--cpus", "2", "--image", image,
            "--kernel", kernel, "--initrd", initrd, "--append", append, *options,
        )  # fmt: skip

    def wait_for(self, name: str, action: str) -> None:
        """``action`` happened to ``name`` (a real guest under TCG takes its time)."""
        try:
            self.events.wait_for_action(name, action, BOOT_DEADLINE)
        except AssertionError as e:
            console = self.console(name)[-6000:]
            raise AssertionError(f"{e}; the end of its console:\n{console}") from None

    def console(self, name: str) -> str:
        return self.system.cli("console", name, "--show-log").stdout

    def wait_for_console(self, name: str, text: str) -> str:
        def shown() -> str | None:
            log = self.console(name)
            return log if text in log else None

        return eventually(
            shown, f"{text!r} on the console of {name}", timeout=BOOT_DEADLINE, interval=1.0
        )

    def info(self, name: str) -> dict[str, Any]:
        return self.system.info(name)

    def test_aStockImageRunsTheUserDataAndReachesReady(self) -> None:
        before = os.stat(self.stock.stock)
        self.launch(
            "s1",
            self.stock.stock,
            f"cloud-init.user-data={USER_DATA}",
            f"cloud-init.vendor-data={VENDOR_DATA}",
        )
        self.wait_for("s1", "instance-ready")
        self.assertEqual(self.info("s1")["agent"]["status"], "connected")
        log = self.wait_for_console("s1", "GUEST: declared Ready")
        self.assertIn("GUEST: hello file: written by the user-data", log)
        self.assertIn("GUEST: the instance vendor-data ran", log)
        self.assertIn("install.sh: vmready-agent.service enabled and started", log)
        self.assertRegex(log, r"Datasource DataSourceNoCloud \[seed=/dev/vd[a-z]\]")
        after = os.stat(self.stock.stock)
        self.assertEqual((after.st_size, after.st_mtime_ns), (before.st_size, before.st_mtime_ns))
        self.system.cli("delete", "s1", "--force")

    def test_invalidUserDataShowsCloudInitsVerdictAndTheInstanceComesUp(self) -> None:
        self.launch("s2", self.stock.stock, f"cloud-init.user-data={INVALID_USER_DATA}")
        self.wait_for("s2", "instance-agent-connected")
        log = self.wait_for_console("s2", "Failed loading yaml blob")
        self.assertRegex(log, r"Failed loading yaml blob\. Invalid format at line \d+ column \d+")
        info = self.info("s2")
        self.assertEqual((info["status"], info["agent"]["status"]), ("Running", "connected"))
        self.system.cli("delete", "s2", "--force")

    def test_theLoaderBakedInServesCloudInitsLXDDatasourceOnFirstBoot(self) -> None:
        self.launch(
            "l1",
            self.stock.loader,
            f"cloud-init.user-data={LXD_REPORT}",
            f"cloud-init.vendor-data={VENDOR_DATA}",
            "cloud-init.network-config=config: disabled\n",
            "user.meta-data=vmready-marker: from user.meta-data\n",
        )
        self.wait_for("l1", "instance-ready")
        uuid = self.info("l1")["uuid"]
        log = self.wait_for_console("l1", "GUEST: config keys")
        self.assertIn("GUEST: cloud-id lxd", log)
        self.assertIn("GUEST: hello file: written by the user-data", log)
        self.assertIn("GUEST: the instance vendor-data ran", log)
        self.assertIn(f"GUEST: datasource lxd {uuid}", log)
        self.assertIn("GUEST: meta-data vmready-marker: from user.meta-data", log)
        self.assertIn(
            "GUEST: config keys cloud-init.network-config cloud-init.user-data "
            "cloud-init.vendor-data user.meta-data",
            log,
        )
        self.assertIn("GUEST: network config is disabled by ds", log)
        self.system.cli("delete", "l1", "--force")

    def test_theDocumentedLoaderInstallWorksOnFirstTry(self) -> None:
        self.launch("m1", self.stock.manual, demo_kernel=True)
        self.wait_for("m1", "instance-agent-connected")
        log = self.wait_for_console("m1", "DOCUMENTED-INSTALL: nothing left mounted")
        self.assertIn("DOCUMENTED-INSTALL: exit 0", log)
        self.assertIn("install.sh: vmready-agent.service enabled and started", log)
        self.assertRegex(log, re.escape("is busy: mounted at /mnt; copying it from there"))
        self.assertEqual(self.info("m1")["agent"]["status"], "connected")
        self.system.cli("delete", "m1", "--force")
