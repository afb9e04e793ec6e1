"""The ``vmready`` commands: one function per command, each a few requests to the daemon."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from vmready.cli import tables
from vmready.cli.actionprogress import ActionProgress
from vmready.cli.client import APIError, Client, get_instance, instance_path
from vmready.cli.clustercommands import cluster_command
from vmready.cli.completion import completion_script
from vmready.cli.configops import config_command, operation_command
from vmready.cli.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CommandError, UsageError
from vmready.cli.output import EventCSV, Output, to_yaml
from vmready.cli.verbs import by_verb
from vmready.cli.waiter import Waiter, parse_condition
from vmready.domain import ACCEL_KEY, APPEND_KEY, IMAGE_KEY, INITRD_KEY, KERNEL_KEY

_RUNNING_STATUSES = frozenset({"running", "ready", "frozen", "freezing", "starting", "stopping"})


async def _instance_or_none(client: Client, name: str) -> dict[str, Any] | None:
    """The instance object, or None if it is gone (a delete, a launch refused midway)."""
    try:
        return await get_instance(client, name)
    except APIError as e:
        if e.code == 404:
            return None
        raise


def _action_result(operation: dict[str, Any], instance: dict[str, Any] | None) -> dict[str, Any]:
    """What an action prints in the json, yaml and csv formats (docs/api.md, "JSON output")."""
    return {"operation": operation, "instance": instance}


async def _act(
    client: Client,
    output: Output,
    args: argparse.Namespace,
    name: str,
    request: tuple[str, str, Any],
    announce: str | None = None,
    ready: Waiter | None = None,
) -> int:
    """Send the action's ``request`` (method, path, body), then follow it to its end.

    On a terminal the progress line follows it (subscribed before the
    request, so no event is missed); ``announce`` (table format) is printed
    once the daemon accepted the request.
    """
    progress = ActionProgress.for_action(client, output, args, name)
    try:
        if progress is not None:
            await progress.subscribe(client)
        operation = await client.operation(*request)
        if announce is not None and output.is_table:
            output.line(announce)
        if progress is not None:
            progress.follow(operation)
        return await _finish_action(client, output, name, operation, args, ready, progress)
    finally:
        if progress is not None:
            progress.close()


async def _finish_action(
    client: Client,
    output: Output,
    name: str,
    operation: dict[str, Any],
    args: argparse.Namespace,
    ready: Waiter | None = None,
    progress: ActionProgress | None = None,
) -> int:
    """Wait for the operation (unless --no-wait), report its failure or the resulting status.

    The table format says it in a line; the others print the operation as it
    ended and the instance after it (None when deleted, or with --no-wait),
    also when the action failed (then exit 1 with the error on stderr).
    ``ready``: then wait until the workload is Ready (``launch --wait``).
    """
    if args.no_wait:
        if output.is_table:
            output.line(f"Operation /1.0/operations/{operation['id']}: {operation['description']}")
        else:
            output.result(_action_result(operation, None))
        return EXIT_OK
    done = await client.wait_operation(operation)
    if progress is not None:
        progress.pause()
    if done.get("status_code") != 200:
        failed = CommandError(f"Error: {done.get('err') or done.get('status')}")
        if not output.is_table:
            output.result(_action_result(done, await _instance_or_none(client, name)))
        raise failed
    if not output.is_table:
        if ready is not None:
            await ready.wait(args.timeout)
        instance = None if args.command == "delete" else await get_instance(client, name)
        output.result(_action_result(done, instance))
        return EXIT_OK
    if args.command == "delete":
        output.line(f"Deleted {name}")
        return EXIT_OK
    if args.command == "rename":
        output.line(f"Renamed {args.name} to {name}")
        return EXIT_OK
    instance = await get_instance(client, name)
    # The one status, as vmready list shows it (a daemon before it had none: LXD's status).
    status = instance.get("operator_status") or str(instance["status"]).upper()
    output.line(f"{name}: {status}")
    if ready is not None:
        if progress is not None:
            progress.waiting("waiting for the workload to report Ready")
        line = await ready.wait(args.timeout)
        if progress is not None:
            progress.pause()
        output.line(line)
    return EXIT_OK


async def _cmd_launch(client: Client, output: Output, args: argparse.Namespace) -> int:
    config: dict[str, str] = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-c expects key=value, got {item!r}")
        config[key] = value
    if args.memory is not None:
        config["limits.memory"] = args.memory
    if args.cpus is not None:
        config["limits.cpu"] = str(args.cpus)
    # Paths are the caller's: the daemon does not share this working directory.
    for option, key in (
        ("image", IMAGE_KEY),
        ("kernel", KERNEL_KEY),
        ("initrd", INITRD_KEY),
    ):
        value = getattr(args, option)
        if value is not None:
            config[key] = os.path.abspath(value)
    if args.append is not None:
        config[APPEND_KEY] = args.append
    if args.accel is not None:
        config[ACCEL_KEY] = args.accel
    ready: Waiter | None = None
    if args.wait:
        # Subscribe before the instance exists, so no event can be missed.
        ready = Waiter(client, args.name, "ready")
        await ready.subscribe()
    try:
        path = "/1.0/instances"
        if args.target is not None:
            path += "?" + urlencode({"target": args.target}, errors="surrogateescape")
        # LXD's create makes a stopped instance; launch asks for it started, as lxc launch does.
        request = ("POST", path, {"name": args.name, "config": config, "start": True})
        # Announced only once the daemon accepted the name and config.
        announce = f"Creating {args.name}"
        return await _act(client, output, args, args.name, request, announce, ready)
    finally:
        if ready is not None:
            ready.close()


async def _cmd_console(client: Client, output: Output, args: argparse.Namespace) -> int:
    if not args.show_log:
        raise UsageError(
            "vmready console attaches to nothing yet: use --show-log to print the console log"
        )
    log = await client.get_raw(f"{instance_path(args.name)}/console")
    output.raw(log)
    return EXIT_OK


async def _cmd_list(client: Client, output: Output, args: argparse.Namespace) -> int:
    instances = await client.get("/1.0/instances?recursion=1")
    columns = args.columns or tables.default_columns(instances)
    output.data(
        instances,
        lambda value: tables.instances_table(value, columns),
        lambda value: tables.instance_rows(value, columns),
    )
    return EXIT_OK


async def _cmd_info(client: Client, output: Output, args: argparse.Namespace) -> int:
    output.data(await get_instance(client, args.name), tables.info_table)
    return EXIT_OK


async def _cmd_state(client: Client, output: Output, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"action": args.command}
    if getattr(args, "force", False):
        body["force"] = True
    if getattr(args, "timeout", None) is not None:
        body["timeout"] = args.timeout
    request = ("PUT", instance_path(args.name, "state"), body)
    return await _act(client, output, args, args.name, request)


async def _cmd_instance_action(client: Client, output: Output, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.command == "resize":
        if args.memory is None and args.cpus is None:
            raise UsageError("resize needs --memory and/or --cpus")
        if args.memory is not None:
            body["memory"] = args.memory
        if args.cpus is not None:
            body["cpus"] = args.cpus
    request = ("POST", instance_path(args.name, "actions", args.command), body)
    return await _act(client, output, args, args.name, request)


async def _cmd_snapshot(client: Client, output: Output, args: argparse.Namespace) -> int:
    body = {"name": args.snapshot, "stateful": args.stateful}
    request = ("POST", instance_path(args.name, "snapshots"), body)
    return await _act(client, output, args, args.name, request)


async def _cmd_restore(client: Client, output: Output, args: argparse.Namespace) -> int:
    body = {"restore": args.snapshot, "stateful": args.stateful, "force": args.force}
    return await _act(client, output, args, args.name, ("PUT", instance_path(args.name), body))


async def _cmd_snapshots(client: Client, output: Output, args: argparse.Namespace) -> int:
    snapshots = await client.get(instance_path(args.name, "snapshots") + "?recursion=1")
    output.data(snapshots, tables.snapshots_table)
    return EXIT_OK


async def _cmd_snapshot_delete(client: Client, output: Output, args: argparse.Namespace) -> int:
    path = instance_path(args.name, "snapshots", quote(args.snapshot, safe=""))
    # LXD's answer: the (finished) operation, whose metadata is the snapshot as it was.
    deleted = (await client.request("DELETE", path))["metadata"]["metadata"]
    output.data(deleted, lambda _: f"Snapshot {args.snapshot} of {args.name} deleted\n")
    return EXIT_OK


_cmd_snapshot_verb = by_verb(
    "snapshot_verb",
    {
        "create": _cmd_snapshot,
        "delete": _cmd_snapshot_delete,
        "list": _cmd_snapshots,
        "restore": _cmd_restore,
    },
)


async def _cmd_delete(client: Client, output: Output, args: argparse.Namespace) -> int:
    if not args.force:
        instance = await get_instance(client, args.name)
        if str(instance["status"]).lower() in _RUNNING_STATUSES:
            status = instance.get("operator_status") or instance["status"]
            raise CommandError(
                f"Error: instance {args.name} is {str(status).upper()}: "
                "stop it first or pass --force"
            )
    return await _act(client, output, args, args.name, ("DELETE", instance_path(args.name), None))


async def _cmd_rename(client: Client, output: Output, args: argparse.Namespace) -> int:
    operation = await client.operation("POST", instance_path(args.name), {"name": args.new_name})
    return await _finish_action(client, output, args.new_name, operation, args)


async def _cmd_actions(client: Client, output: Output, args: argparse.Namespace) -> int:
    output.data(await client.get(instance_path(args.name, "actions")), tables.actions_table)
    return EXIT_OK


async def _cmd_metrics(client: Client, output: Output, args: argparse.Namespace) -> int:
    output.raw(await client.get_raw("/1.0/metrics"))
    return EXIT_OK


async def _cmd_monitor(client: Client, output: Output, args: argparse.Namespace) -> int:
    types = [part for value in args.type for part in value.split(",") if part]
    printing_failed: Deferred[int] = Deferred()
    event_csv = EventCSV()

    def show(event: dict[str, Any]) -> None:
        try:
            if output.format == "json":
                output.line(json.dumps(event))
            elif output.format == "yaml":
                output.text("---\n" + to_yaml(event))
            elif output.format == "csv":
                output.text(event_csv.row(event))
            else:
                output.line(tables.event_line(event))
        except OSError:
            # stdout went away (``vmready monitor | head``): that ends the monitor.
            if not printing_failed.called:
                printing_failed.callback(EXIT_OK)

    stream = await client.events(types, show)
    printing_failed.addCallback(lambda _: stream.close())
    try:
        why = await stream.ended
    finally:
        stream.close()  # when cancelled (a signal): before the reactor drops the connection
    if why is not None:
        raise CommandError(why, EXIT_FAILED)
    return EXIT_OK


async def _cmd_wait(client: Client, output: Output, args: argparse.Namespace) -> int:
    status = parse_condition(args.condition)
    waiter = Waiter(client, args.name, status)
    await waiter.subscribe()
    try:
        line = await waiter.wait(args.timeout)
    finally:
        waiter.close()
    output.data(waiter.result(args.condition), lambda _: line + "\n")
    return EXIT_OK


async def _cmd_completion(client: Client, output: Output, args: argparse.Namespace) -> int:
    from vmready.cli.parser import build_parser

    output.text(completion_script(build_parser(), args.shell))
    return EXIT_OK


COMMANDS: dict[str, Callable[[Client, Output, argparse.Namespace], Any]] = {
    "launch": _cmd_launch,
    "list": _cmd_list,
    "info": _cmd_info,
    "start": _cmd_state,
    "stop": _cmd_state,
    "restart": _cmd_state,
    "freeze": _cmd_state,
    "unfreeze": _cmd_state,
    "rebuild": _cmd_instance_action,
    "resize": _cmd_instance_action,
    "confirm-resize": _cmd_instance_action,
    "revert-resize": _cmd_instance_action,
    "delete": _cmd_delete,
    "snapshot": _cmd_snapshot_verb,
    "restore": _cmd_restore,
    "snapshots": _cmd_snapshots,
    "console": _cmd_console,
    "actions": _cmd_actions,
    "metrics": _cmd_metrics,
    "monitor": _cmd_monitor,
    "wait": _cmd_wait,
    "config": config_command,
    "rename": _cmd_rename,
    "operation": operation_command,
    "completion": _cmd_completion,
    "cluster": cluster_command,
}


def _replayed_line(entry: Any) -> str:
    """What ``vmready replay --realtime`` prints for a record it just replayed."""
    from vmready.protocols import data_from_fields

    shown = entry.fields.get("text")
    if shown is None and entry.kind in ("ring-read", "ring-write"):
        shown = data_from_fields(entry.fields).decode("utf-8", "replace")
    detail = {k: v for k, v in entry.fields.items() if k not in ("text", "data", "body")}
    text = json.dumps(shown) if shown is not None else json.dumps(detail)
    return f"t={entry.t:.3f}s line {entry.line}: {entry.kind} {text[:100]}"


async def cmd_replay(reactor: IReactorTime, output: Output, args: argparse.Namespace) -> int:
    """``vmready replay FILE``: runs in this process; the daemon is not involved."""
    from vmready.protocols import TranscriptError
    from vmready.record.replay import replay, replay_realtime

    try:
        if args.realtime:
            # Each record at its recorded time: wait, replay it, then say it.
            result = await replay_realtime(
                args.file, reactor, lambda entry: output.line(_replayed_line(entry))
            )
        else:
            result = replay(args.file)
    except TranscriptError as e:
        output.error(str(e))
        return EXIT_USAGE
    output.line(result.describe())
    return EXIT_OK if result.matched else EXIT_FAILED
