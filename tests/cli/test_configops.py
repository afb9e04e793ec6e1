"""``vmready config``, ``rename`` and ``operation`` against the operator API on a unix socket."""

from __future__ import annotations

import json

import yaml

from tests.cli.test_cli import CLITestCase
from tests.fixtures import make_lifecycle
from vmready.api.operator import OperatorAPI
from vmready.cli.configops import parse_set
from vmready.cli.errors import UsageError


class ConfigCommandTests(CLITestCase):
    def setUp(self) -> None:
        self.lifecycle = make_lifecycle(self)
        # As the daemon serves it: its options as the server's config.
        options = {"stop-timeout": "30", "hypervisor": "fakeqemu"}
        self.serve(OperatorAPI(self.lifecycle, "fakeqemu", config=options).app.resource())

    async def test_setGetShowAndUnsetAnInstancesKeys(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("config", "set", "web1", "user.role=db", "user.x=1"), (0, "", "")
        )
        self.assertEqual(
            await self.cli("config", "set", "web1", "user.team", "blue green"), (0, "", "")
        )
        self.assertEqual(
            await self.cli("config", "get", "web1", "user.team"), (0, "blue green\n", "")
        )
        code, out, _ = await self.cli("config", "show", "web1")
        self.assertEqual(code, 0)
        shown = yaml.safe_load(out)
        self.assertEqual(shown, self.lifecycle.store.view.get_instance("web1").config)
        self.assertEqual(list(shown), sorted(shown))
        self.assertEqual(await self.cli("config", "unset", "web1", "user.x"), (0, "", ""))
        self.assertNotIn("user.x", self.lifecycle.store.view.get_instance("web1").config)
        # A key that is not set: an empty line, success (as incus does).
        self.assertEqual(await self.cli("config", "get", "web1", "user.x"), (0, "\n", ""))
        code, out, _ = await self.cli("--format", "json", "config", "get", "web1", "user.x")
        self.assertEqual((code, json.loads(out)), (0, None))
        code, out, _ = await self.cli("config", "show", "web1", "--format", "json")
        self.assertEqual(json.loads(out)["user.role"], "db")

    async def test_theDaemonRefusesBadKeysInItsOwnWords(self) -> None:
        await self.launch("web1")
        code, out, err = await self.cli("config", "set", "web1", "volatile.last_state.ready=true")
        self.assertEqual((code, out), (1, ""))
        self.assertTrue(
            err.startswith("vmready: Error: Invalid config key 'volatile.last_state.ready'"), err
        )
        code, _, err = await self.cli("config", "set", "web1", "limits.memory=1GiB")
        self.assertEqual(
            (code, err),
            (
                1,
                "vmready: Error: Cannot change limits.memory of instance web1 while it is "
                "running: use the resize action\n",
            ),
        )
        code, _, err = await self.cli("config", "unset", "web1", "boot.image")
        self.assertEqual(code, 1)
        self.assertIn("Cannot change boot.image of instance web1", err)
        code, _, err = await self.cli("config", "get", "nope", "user.a")
        self.assertEqual((code, err), (1, "vmready: Error: Instance nope not found\n"))
        code, _, err = await self.cli("config", "set", "web1", "user.a=1", "oops")
        self.assertEqual(code, 2)
        self.assertIn("expected KEY=VALUE, got 'oops'", err)

    async def test_theDocumentedGuestDataLoopStopsAtTheBoundInOneLine(self) -> None:
        # docs/real-guests.md's loop: 120,000-byte values until the daemon refuses one.
        await self.launch("c1")
        value = "x" * 120000
        for i in range(1, 41):
            code, out, err = await self.cli("config", "set", "c1", f"user.k{i}", value)
            if code:
                break
        self.assertEqual(
            (i, code, out, err),
            (
                35,
                1,
                "",
                "vmready: Error: Invalid config: the instance's user.* and cloud-init.* keys "
                "come to 4.1 MiB, more than the 4 MiB a guest is given at boot (its NoCloud "
                "seed and config drive); make them smaller\n",
            ),
        )
        self.assertNotIn("user.k35", self.lifecycle.store.view.get_instance("c1").config)
        self.assertIn("user.k34", self.lifecycle.store.view.get_instance("c1").config)

    async def test_theDaemonsOptionsAreReadButNotSet(self) -> None:
        self.assertEqual(await self.cli("config", "get", "stop-timeout"), (0, "30\n", ""))
        self.assertEqual(await self.cli("config", "get", "no-such-option"), (0, "\n", ""))
        code, out, _ = await self.cli("config", "show")
        self.assertEqual(
            (code, yaml.safe_load(out)), (0, {"stop-timeout": "30", "hypervisor": "fakeqemu"})
        )
        for argv in (
            ("config", "set", "stop-timeout=10"),
            ("config", "set", "stop-timeout", "10"),
            ("config", "unset", "stop-timeout"),
        ):
            code, out, err = await self.cli(*argv)
            self.assertEqual((code, out), (1, ""), argv)
            self.assertEqual(
                err,
                "vmready: Error: stop-timeout: the daemon's options are read when it starts and "
                "cannot be changed while it runs: set it in its config file "
                "(/etc/vmready/vmready.yaml, or the file named by twistd vmready --config or "
                "$VMREADY_CONFIG) or on twistd vmready's command line, then restart the daemon "
                "(running VMs keep running)\n",
            )

    def test_setsArgumentsAreReadAsIncusReadsThem(self) -> None:
        self.assertEqual(parse_set(["a=1", "b=2"]), (None, {"a": "1", "b": "2"}))
        self.assertEqual(parse_set(["a", "1"]), (None, {"a": "1"}))
        self.assertEqual(parse_set(["web1", "a=1"]), ("web1", {"a": "1"}))
        self.assertEqual(parse_set(["web1", "a", "x=y"]), ("web1", {"a": "x=y"}))
        self.assertEqual(parse_set(["web1", "a=1", "b="]), ("web1", {"a": "1", "b": ""}))
        self.assertRaises(UsageError, parse_set, ["web1"])
        self.assertRaises(UsageError, parse_set, ["web1", "=1", "b=2"])


class RenameCommandTests(CLITestCase):
    async def test_renameAStoppedInstance(self) -> None:
        await self.launch("web1")
        self.assertEqual((await self.cli("stop", "web1", "--force"))[0], 0)
        self.assertEqual(
            await self.cli("rename", "web1", "api1"), (0, "Renamed web1 to api1\n", "")
        )
        _, out, _ = await self.cli("list", "-c", "ns")
        self.assertEqual(out, "NAME  STATUS\napi1  STOPPED\n")
        code, out, _ = await self.cli("start", "api1")
        self.assertEqual(code, 0, out)

    async def test_renameInJSONPrintsTheOperationAndTheRenamedInstance(self) -> None:
        await self.launch("web1")
        self.assertEqual((await self.cli("stop", "web1", "--force"))[0], 0)
        code, out, _ = await self.cli("rename", "web1", "api1", "--format", "json")
        result = json.loads(out)
        self.assertEqual(
            (code, result["operation"]["status"], result["instance"]["name"]),
            (0, "Success", "api1"),
        )

    async def test_aRunningInstanceOrATakenNameIsRefused(self) -> None:
        await self.launch("web1")
        await self.launch("web2")
        code, out, err = await self.cli("rename", "web1", "api1")
        self.assertEqual(
            (code, out, err),
            (
                1,
                "",
                "vmready: Error: Cannot rename instance web1: it is running; only a stopped "
                "instance can be renamed\n",
            ),
        )
        self.assertEqual((await self.cli("stop", "web1", "--force"))[0], 0)
        code, _, err = await self.cli("rename", "web1", "web2")
        self.assertEqual(
            (code, err), (1, "vmready: Error: Cannot rename web1 to web2: instance web2 exists\n")
        )


class OperationCommandTests(CLITestCase):
    async def test_listShowAndWait(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("stop", "web1", "--no-wait", "--format", "json")
        stop_id = json.loads(out)["operation"]["id"]
        code, out, _ = await self.cli("operation", "wait", stop_id)
        self.assertEqual((code, out), (0, "Stop instance web1: Success\n"))
        code, out, _ = await self.cli("operation", "list")
        header, *rows = out.splitlines()
        self.assertEqual(header.split(), ["ID", "DESCRIPTION", "STATUS", "CREATED", "INSTANCE"])
        self.assertEqual(
            [(row.split()[0], row.split()[-1]) for row in rows],
            [
                (op.id, "web1")
                for op in sorted(self.lifecycle.operations.list(), key=lambda o: o.created_at)
            ],
        )
        self.assertRegex(out, r"Stop instance web1 +SUCCESS ")
        code, out, _ = await self.cli("operation", "show", stop_id)
        shown = yaml.safe_load(out)
        self.assertEqual((code, shown["id"], shown["status"]), (0, stop_id, "Success"))
        code, out, _ = await self.cli("operation", "list", "--format", "csv")
        self.assertTrue(out.startswith("ID,DESCRIPTION,STATUS,CREATED,INSTANCE\n"), out)

    async def test_waitForAFailedOperationExits1WithItsError(self) -> None:
        await self.launch("web1")
        await self.cli("stop", "web1", "--force")
        code, out, _ = await self.cli("start", "web1", "--no-wait", "--format", "json")
        start = json.loads(out)["operation"]["id"]
        operation = self.lifecycle.operations.get(start)
        await operation.when_done()
        operation.finish(operation.updated_at, "the VM would not boot")  # as a failed start ends
        code, out, err = await self.cli("operation", "wait", start)
        self.assertEqual((code, out, err), (1, "", "vmready: Error: the VM would not boot\n"))
        code, out, err = await self.cli("operation", "wait", start, "--format", "json")
        self.assertEqual((code, json.loads(out)["err"]), (1, "the VM would not boot"))

    async def test_waitWithATimeoutLeavesARunningOperationAlone(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("stop", "web1", "--no-wait", "--format", "json")
        stop = json.loads(out)["operation"]["id"]
        code, out, err = await self.cli("operation", "wait", stop, "--timeout", "0")
        self.assertEqual(
            (code, out, err),
            (
                1,
                "",
                f"vmready: timed out after 0s waiting for operation {stop} "
                "(Stop instance web1: still running)\n",
            ),
        )
        await self.lifecycle.operations.get(stop).when_done()

    async def test_anUnknownOperationIsNotFound(self) -> None:
        code, _, err = await self.cli("operation", "show", "nope")
        self.assertEqual((code, err), (1, "vmready: Error: Operation nope not found\n"))
        self.assertEqual(await self.cli("operation", "list"), (0, "No operations\n", ""))
