"""vmready.hypervisor.noagent: why a booted guest has no agent, as its console tells it."""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from vmready.hypervisor.console import mark_boot
from vmready.hypervisor.noagent import agent_absence, missing_agent_reason

EARLIER_BOOT = b"vmready-agent: an older boot's complaint\n"
MARK = b"\n--- vmready: starting web1: TCG: KVM is not available ---\n"


class MissingAgentReasonTests(SynchronousTestCase):
    def test_imageWithNeitherCloudInitNorLoader(self) -> None:
        console = MARK + b"[    0.000000] Linux version 6.1.0\nWelcome to Debian GNU/Linux 12!\n"
        self.assertEqual(
            missing_agent_reason(console, 120),
            "no agent spoke 120s into the boot: the image has neither cloud-init nor the "
            "vmready loader; use a cloud image with cloud-init (it reads the instance's "
            "NoCloud seed, whose vendor-data starts the agent), or install the vmready loader "
            "in the image (docs/real-guests.md)",
        )

    def test_cloudInitRanButDidNotStartIt(self) -> None:
        console = MARK + (
            b"[   20.1] cloud-init[412]: Cloud-init v. 22.4.2 running 'init'\n"
            b"[   31.7] cloud-init[690]: Cloud-init v. 22.4.2 finished at Sun, 29 Nov 2026 "
            b"08:10:00 +0000. Datasource DataSourceNoCloud [seed=/dev/vdb].  Up 31.60 seconds\n"
        )
        self.assertEqual(
            missing_agent_reason(console, 120),
            "no agent spoke 120s into the boot: cloud-init ran in the guest but did not start it "
            "(a user-data with vendor_data: {enabled: false} turns the agent off; cloud-init's "
            "lines on the console say more)",
        )

    def test_cloudInitStillRunningIsNotBlamed(self) -> None:
        # A slow first boot: cloud-init has not reached the stage that runs the vendor-data.
        console = MARK + b"[   20.1] cloud-init[412]: Cloud-init v. 22.4.2 running 'init-local'\n"
        self.assertEqual(
            missing_agent_reason(console, 120),
            "no agent spoke 120s into the boot: cloud-init is still running in the guest and "
            "has not started it yet (a slow first boot: this clears when the agent connects; "
            "cloud-init's lines on the console say how far it got)",
        )

    def test_theLoadersOwnLastWordIsQuoted(self) -> None:
        console = MARK + (
            b"Cloud-init v. 22.4.2 running 'init'\n"
            b"[   21.0] vmready-agent-setup[501]: vmready-agent-setup: no config drive: x\n"
            b"install.sh: the agent needs Python 3.9 or newer, and /usr/bin/python3 is "
            b"Python 3.8\n"
        )
        self.assertEqual(
            missing_agent_reason(console, 120),
            "no agent spoke 120s into the boot; its last word on the console: install.sh: the "
            "agent needs Python 3.9 or newer, and /usr/bin/python3 is Python 3.8",
        )

    def test_aSilentGuest(self) -> None:
        self.assertEqual(
            missing_agent_reason(MARK, 90),
            "no agent spoke 90s into the boot, and the guest wrote nothing on its console: does "
            "it boot? (a kernel command line of your own needs console=ttyS0)",
        )

    def test_anAgentThatStartedIsToldByItsOwnLine(self) -> None:
        # Its configuration refused: STARTED, STOPPED and its one line, again and again.
        console = MARK + (
            b"Cloud-init v. 22.4.2 running 'init'\n"
            b"vmready-agent: agent.key does not belong to agent.crt in /run/vmready-agent\n"
            b"[FAILED] Failed to start vmready-agent.service - vmready guest agent.\n"
        )
        self.assertEqual(
            missing_agent_reason(console, 120, heard=True),
            "the agent started but had not connected 120s into the boot; its last word on the "
            "console: vmready-agent: agent.key does not belong to agent.crt in /run/vmready-agent",
        )

    def test_anAgentThatStartedWithNoLineOfItsOwn(self) -> None:
        console = MARK + b"Cloud-init v. 22.4.2 finished at Sun, 29 Nov 2026 08:10:00 +0000.\n"
        self.assertEqual(
            missing_agent_reason(console, 145, heard=True),
            "the agent started but had not connected 145s into the boot, and wrote no line of "
            "its own on the console: its log in the guest says why (docs/agent.md, "
            "troubleshooting)",
        )

    def test_onlyThisBootCounts(self) -> None:
        console = EARLIER_BOOT + MARK + b"Welcome to Debian GNU/Linux 12!\n"
        self.assertIn(
            "neither cloud-init nor the vmready loader", missing_agent_reason(console, 1)
        )

    def test_theConsoleLogIsRead(self) -> None:
        log = os.path.join(self.mktemp(), "console.log")
        mark_boot(log, "starting web1")
        with open(log, "ab") as f:
            f.write(b"Cloud-init v. 22.4.2 finished at Sun, 29 Nov 2026 08:10:00 +0000.\n")
        self.assertIn("cloud-init ran in the guest but did not start it", agent_absence(log))
