"""Starting QEMU for an instance.

Its disk, its accelerator (KVM tried, then TCG, saying so), its vsock CID,
relaunches, and powering it off.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import attrs
from twisted.internet.task import deferLater
from twisted.logger import Logger

from vmready.agentlink.transport import (
    CID_KEY,
    TRANSPORT_KEY,
    allocate_cid,
)
from vmready.domain.model import (
    HypervisorError,
    InstanceRecord,
)
from vmready.domain.states import READY_KEY, PowerState
from vmready.hypervisor.accel import (
    ACCEL_KEY,
    ACCEL_REASON_KEY,
    CURRENT_ACCEL_KEY,
    AccelChoice,
    choose_accel,
)
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.console import (
    console_size,
    mark_boot,
)
from vmready.hypervisor.imagetool import ImageInfo
from vmready.hypervisor.runningvm import RunningVM
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.state import (
    _SIGN_OF_LIFE_POLL,
    LAYOUT_KEY,
    ActionContext,
    LifecycleState,
    fakeqemu_guest_paths,
)
from vmready.lifecycle.watching import Watching
from vmready.protocols.ringbuffer import AgentStatus


class Booting:
    """Starting QEMU for an instance.

    Its disk, its accelerator (KVM tried, then TCG, saying so), its vsock CID,
    relaunches, and powering it off.
    """

    log = Logger()

    def __init__(self, state: LifecycleState, guestside: GuestSide, watching: Watching) -> None:
        self.state = state
        self.guestside = guestside
        self.watching = watching

    async def spawn(
        self, context: ActionContext, record: InstanceRecord, image: ImageInfo | None
    ) -> None:
        await self.make_disk(context, record, image)
        await self.launch(record)
        await context.finish(PowerState.RUNNING)
        self.state.events.lifecycle("instance-started", record.name)

    async def build_stopped(
        self, context: ActionContext, record: InstanceRecord, image: ImageInfo | None
    ) -> None:
        """A create that does not start: the disk made, no VM; it rests STOPPED."""
        await self.make_disk(context, record, image)
        await context.finish(PowerState.SHUTDOWN)

    async def make_disk(
        self, context: ActionContext, record: InstanceRecord, image: ImageInfo | None
    ) -> None:
        """A fresh overlay on the instance's image (its old one, if any, is replaced)."""
        disk = self.state.disk_path(record)
        if image is None or disk is None:
            return
        await self.state.images.create_overlay(image, disk)
        context.note(f"made the root disk {disk} on {image.describe()}")

    def launch_spec(self, record: InstanceRecord, accel: str | None = None) -> dict[str, Any]:
        """The device set the VM would have if it started now (under ``accel``, if given)."""
        spec = self.state.spec_for(
            record, self.state.serial_layout, accel, self.state.settings.transport
        )
        if spec.config_drive is None and self.state.guest is not None:
            # Every VM a daemon with a guest API starts gets its drive (made at launch).
            spec = attrs.evolve(spec, config_drive=self.state.config_drive(record))
        return spec.device_set()

    async def launch(
        self, record: InstanceRecord, incoming: str | None = None, accel: str | None = None
    ) -> RunningVM:
        """Start the VM with this daemon's serial layout and transport, recorded in the instance.

        ``accel`` forces the accelerator (a restored state must run under the
        one it was saved with); otherwise ``choose_accel`` picks it.
        """
        transport = self.state.settings.transport
        updates: dict[str, str | None] = {
            LAYOUT_KEY: self.state.serial_layout.name,
            TRANSPORT_KEY: transport,
        }
        if transport == "vsock" and CID_KEY not in record.config:
            updates[CID_KEY] = str(self._new_cid())
        record = await self.state.store.instances.update_config(record.name, updates)
        disk = self.state.disk_path(record)
        if disk is not None and not os.path.exists(disk):
            raise HypervisorError(
                f"the root disk of {record.name}, {disk}, is missing; rebuild the instance to "
                f"boot its image {BootSource.from_config(record.config).image} afresh"
            )
        self.guestside.refresh_config_drive(record)
        if self.state.driver.kind == "fakeqemu":
            # A new boot: what the guest kept in its tmpfs (the agent's Ready memory) is gone.
            shutil.rmtree(fakeqemu_guest_paths(self.state.spec_for(record))["state_dir"], True)
        if accel is not None:
            choice = AccelChoice(accel, False, f"{accel.upper()}: the saved state's accelerator")
        else:
            verdict = self.state.kvm.verdict if self.state.kvm is not None else None
            choice = choose_accel(
                record.config.get(ACCEL_KEY, "auto"), self.state.kvm_problem, verdict
            )
        return await self._start_vm(record, choice, incoming)

    async def _start_vm(
        self, record: InstanceRecord, choice: AccelChoice, incoming: str | None
    ) -> RunningVM:
        """Launch under ``choice``; a KVM trial that fails is retried under TCG, saying so."""
        if choice.probe and incoming is None and self.state.kvm is not None:
            # QEMU's own verdict first, in well under a second, from a VM with no image.
            probe = await self.state.driver.probe_kvm()
            if probe is not None and not probe.starts:
                return await self._fall_back_to_tcg(record, probe.reason, incoming)
            if probe is not None:
                self.log.info("{name}: {reason}", name=record.name, reason=probe.reason)
        spec = self.state.spec_for(record, accel=choice.accel)
        doing = "restoring" if incoming is not None else "starting"
        started_at = mark_boot(spec.console_log, f"{doing} {record.name}: {choice.reason}")
        launched_at = self.state.clock.seconds()
        try:
            vm = await self.state.driver.launch(spec, incoming=incoming)
        except HypervisorError as e:
            if not choice.probe:
                raise
            first = e.message.splitlines()[0] if e.message else "no reason given"
            return await self._fall_back_to_tcg(
                record, f"QEMU failed to start a guest under KVM: {first}", incoming
            )
        await self.state.store.instances.update_config(
            record.name, {CURRENT_ACCEL_KEY: choice.accel, ACCEL_REASON_KEY: choice.reason}
        )
        self.watching.attach(record.name, vm)
        if incoming is None:
            # A boot (a restored VM resumes where it was): its time to Ready counts from here.
            self.state.metrics.boot_started(record.name, launched_at)
        booting = not BootSource.from_config(record.config).empty
        if not (choice.probe and incoming is None and booting and self.state.kvm is not None):
            return vm
        if await self._shows_life(record.name, vm, spec.console_log, started_at):
            self.state.kvm.record(True, f"guests run under KVM here (first: {record.name})")
            return vm
        timeout = self.state.settings.kvm_probe_timeout
        reason = (
            f"a guest under KVM showed no sign of life within {timeout:g}s "
            "(nothing on its console, no word from its agent)"
        )
        self.watching.detach(record.name)
        await vm.force_stop()
        return await self._fall_back_to_tcg(record, reason, incoming)

    async def _fall_back_to_tcg(
        self, record: InstanceRecord, reason: str, incoming: str | None
    ) -> RunningVM:
        """KVM does not run guests here: remember it, say it, and start the VM under TCG."""
        if self.state.kvm is not None:
            self.state.kvm.record(False, reason)
        self.log.warn(
            "{name}: {reason}; starting it again under TCG", name=record.name, reason=reason
        )
        self.state.history(record.name, "accelerator", f"{reason}; restarted under TCG")
        self.state.events.lifecycle(
            "instance-accelerator-changed",
            record.name,
            {"from": "kvm", "to": "tcg", "reason": reason},
        )
        return await self._start_vm(
            record, AccelChoice("tcg", False, f"TCG: KVM failed here ({reason})"), incoming
        )

    async def _shows_life(self, name: str, vm: RunningVM, console: str, since: int) -> bool:
        """Whether the guest writes to its console or its agent speaks within the probe time."""
        deadline = self.state.clock.seconds() + self.state.settings.kvm_probe_timeout
        while not vm.gone:
            if (
                console_size(console) > since
                or self.state.agent_status(name) is not AgentStatus.UNKNOWN
            ):
                return True
            if self.state.clock.seconds() >= deadline:
                return False
            await deferLater(self.state.clock, _SIGN_OF_LIFE_POLL, lambda: None)
        return False

    def _new_cid(self) -> int:
        """A vsock CID no other instance on this host holds."""
        used = {
            int(record.config[CID_KEY])
            for record in self.state.store.view.owned_instances()
            if record.config.get(CID_KEY, "").isdigit()
        }
        return allocate_cid(used)

    async def relaunch_with(
        self,
        context: ActionContext,
        name: str,
        updates: dict[str, str | None],
        was_running: bool,
    ) -> InstanceRecord:
        if was_running:
            await self.power_off(context, name, self.state.stop_timeout, force=False)
        record = await self.state.store.instances.update_config(
            name, {**updates, READY_KEY: "false"}
        )
        if was_running:
            await self.launch(record)
        return record

    async def power_off(
        self, context: ActionContext, name: str, timeout: float, force: bool
    ) -> None:
        vm = self.state.vms.get(name)
        if vm is None or vm.gone:
            self.watching.detach(name)
            record = self.state.store.view.get_instance(name)
            if await self.state.driver.kill_owned(self.state.spec_for(record)):
                context.note("killed a VM process whose monitor vmready had lost")
            else:
                context.note("power-off: no VM was running")
            return
        self.watching.detach(name)
        if force:
            await vm.force_stop()
            context.note("forced stop")
            return
        # The grace period starts now (the ACPI button is pressed at once): say when it ends.
        grace = {"timeout": timeout, "force_at": self.state.clock.seconds() + timeout}
        context.progress({"shutdown": grace})
        how = await vm.shutdown(timeout, self.state.clock)
        context.progress({"shutdown": {**grace, "result": how}})
        context.note("clean stop" if how == "clean" else f"forced stop after {timeout:g}s timeout")
