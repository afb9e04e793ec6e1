"""``vmready cluster``, ``launch --target``, LOCATION and UNKNOWN, on two real members."""

from __future__ import annotations

import io
import json

import yaml

from tests.api.test_cluster import ClusterTestCase, Member
from tests.cli.test_completion import ShellTestCase
from tests.reactor import reactor
from vmready.cli.main import run
from vmready.domain import lease_time


class ClusterCLITests(ClusterTestCase):
    """The CLI against the members' unix sockets, as an operator on either host uses it."""

    async def cli(self, member: Member, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        environ = {"VMREADY_CONFIG_DIR": self.dir, "VMREADY_SOCKET": member.socket}
        code = await run(reactor, list(argv), out, err, environ)
        return code, out.getvalue(), err.getvalue()

    async def ok(self, member: Member, *argv: str) -> str:
        code, out, err = await self.cli(member, *argv)
        self.assertEqual((code, err), (0, ""), out)
        return out

    async def test_clusterList(self) -> None:
        await self.ok(self.a, "launch", "web1", "--target", "a")
        await self.b.lifecycle.store.refresh_instance("web1")
        table = await self.ok(self.b, "cluster", "list")
        self.assertEqual(
            [line.split() for line in table.splitlines()],
            [
                ["NAME", "ADDRESS", "STATE", "INSTANCES"],
                ["a", self.a.address, "ONLINE", "1"],
                ["b", self.b.address, "ONLINE", "0"],
            ],
        )
        listed = json.loads(await self.ok(self.b, "cluster", "list", "--format", "json"))
        self.assertEqual([m["server_name"] for m in listed], ["a", "b"])
        csv = await self.ok(self.b, "cluster", "list", "--format", "csv")
        self.assertEqual(
            csv.splitlines(),
            [
                "NAME,ADDRESS,STATE,INSTANCES",
                f"a,{self.a.address},ONLINE,1",
                f"b,{self.b.address},ONLINE,0",
            ],
        )
        shown = yaml.safe_load(await self.ok(self.a, "cluster", "show", "b"))
        self.assertEqual((shown["server_name"], shown["status"]), ("b", "Online"))
        code, out, err = await self.cli(self.a, "cluster", "show", "c")
        self.assertEqual(
            (code, out, err),
            (1, "", "vmready: Error: no cluster member is called 'c' (members: a, b)\n"),
        )

    async def test_launchTargetAndTheLocationColumn(self) -> None:
        # Through b, onto a: the operation is waited for through b.
        self.assertEqual(
            await self.ok(self.b, "launch", "web1", "--target", "a"),
            "Creating web1\nweb1: RUNNING\n",
        )
        self.assertEqual(self.a.lifecycle.store.view.get_instance("web1").member, "a")
        listed = await self.ok(self.b, "list")
        self.assertEqual(
            [line.split() for line in listed.splitlines()],
            [
                ["NAME", "STATUS", "MEMORY", "CPUS", "LOCATION"],
                ["web1", "RUNNING", "256MiB", "1", "a"],
            ],
        )
        self.assertEqual(
            await self.ok(self.b, "list", "-c", "nL", "--format", "csv"), "NAME,LOCATION\nweb1,a\n"
        )
        self.assertEqual(await self.ok(self.b, "stop", "web1", "--force"), "web1: STOPPED\n")
        code, _, err = await self.cli(self.b, "launch", "web2", "--target", "nowhere")
        self.assertEqual(
            (code, err),
            (1, "vmready: Error: no cluster member is called 'nowhere' (members: a, b)\n"),
        )

    async def test_anUnreachableMembersInstancesAreUnknown(self) -> None:
        await self.ok(self.a, "launch", "web1", "--target", "a")
        await self.b.lifecycle.store.refresh_instance("web1")
        member = await self.unreachable(self.a, self.b)
        at = lease_time(member.lease_expires)
        listed = await self.ok(self.b, "list")
        self.assertEqual(listed.splitlines()[1].split(), ["web1", "UNKNOWN", "256MiB", "1", "a"])
        info = await self.ok(self.b, "info", "web1")
        self.assertIn("Status: UNKNOWN\nLocation: a\n", info)
        self.assertIn(f"Host: host unreachable: member a's lease ran out at {at}\n", info)
        table = await self.ok(self.b, "cluster", "list")
        self.assertEqual(table.splitlines()[1].split(), ["a", self.a.address, "UNREACHABLE", "1"])
        code, _, err = await self.cli(self.b, "stop", "web1")
        self.assertEqual(
            (code, err),
            (
                1,
                "vmready: Error: instance web1's host unreachable: member a's lease ran out "
                f"at {at}\n",
            ),
        )

    async def test_clusterRemove(self) -> None:
        code, out, err = await self.cli(self.a, "cluster", "remove", "b")
        self.assertEqual((code, out), (1, ""))
        self.assertTrue(
            err.startswith("vmready: Error: cluster member b is online (its lease runs until "),
            err,
        )
        self.assertTrue(err.endswith("): stop its daemon first, then remove it\n"), err)
        await self.ok(self.b, "launch", "web1", "--target", "b")
        # As the daemon does when the store tells it another member wrote a row.
        await self.a.lifecycle.store.refresh_instance("web1")
        await self.b.membership.stop()
        self.assertEqual(
            await self.cli(self.a, "cluster", "remove", "b"),
            (
                1,
                "",
                "vmready: Error: cluster member b still has 1 instance: start it again and "
                "delete them first (vmready cannot move instances to another member)\n",
            ),
        )
        self.assertEqual(
            await self.cli(self.b, "cluster", "remove", "b"),
            (
                1,
                "",
                "vmready: Error: cluster member b is the one answering this request and cannot "
                "remove itself: stop its daemon, then remove it through another member\n",
            ),
        )
        # b comes back to delete its instance, and stops again.
        await self.b.membership.start()
        await self.a.membership.refresh()
        self.assertEqual(await self.ok(self.a, "delete", "web1", "--force"), "Deleted web1\n")
        await self.b.membership.stop()
        self.assertEqual(
            await self.ok(self.a, "cluster", "remove", "b"),
            f"Removed cluster member b ({self.b.address})\n",
        )
        table = await self.ok(self.a, "cluster", "list")
        self.assertEqual([line.split()[0] for line in table.splitlines()], ["NAME", "a"])
        self.assertEqual(
            await self.cli(self.a, "cluster", "remove", "b"),
            (1, "", "vmready: Error: no cluster member is called 'b' (members: a)\n"),
        )


class CompletionTests(ShellTestCase):
    """``cluster`` and its verbs complete in real shells, and a typo names it."""

    async def test_bash(self) -> None:
        self.assertEqual(await self.complete("bash", "vmready", "clu"), ["cluster"])
        self.assertEqual(
            await self.complete("bash", "vmready", "cluster", ""), ["list", "show", "remove"]
        )
        self.assertEqual(
            await self.complete("bash", "vmready", "launch", "web1", "--ta"), ["--target"]
        )

    async def test_zsh(self) -> None:
        self.assertEqual(
            await self.complete("zsh", "vmready", "cluster", ""), ["list", "show", "remove"]
        )

    async def test_fish(self) -> None:
        self.assertEqual(
            await self.complete("fish", "vmready", "cluster", ""), ["list", "remove", "show"]
        )

    async def test_didYouMean(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        code = await run(reactor, ["clustr", "list"], out, err, {})
        self.assertEqual(
            (code, err.getvalue()),
            (2, "vmready: unknown command 'clustr' (did you mean 'cluster'?)\n"),
        )
        out, err = io.StringIO(), io.StringIO()
        code = await run(reactor, ["cluster", "remov", "b"], out, err, {})
        self.assertEqual(
            (code, err.getvalue()),
            (
                2,
                "usage: vmready cluster [-h] VERB ...\nvmready: error: argument VERB: invalid "
                "choice: 'remov' (did you mean 'remove'?)\n",
            ),
        )
        out, err = io.StringIO(), io.StringIO()
        code = await run(reactor, ["cluster", "zap", "b"], out, err, {})
        self.assertEqual(code, 2)
        self.assertIn(
            "invalid choice: 'zap' (choose from 'list', 'show', 'remove')", err.getvalue()
        )
