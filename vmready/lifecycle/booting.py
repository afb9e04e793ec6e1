"""Starting QEMU for an instance.

Its disk, its accelerator (KVM tried, then TCG, saying so), its vsock CID,
relaunches, and powering it off.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from vmready.agentlink.transport import CID_KEY, TRANSPORT_KEY, allocate_cid
from vmready.domain import ACCEL_KEY, HypervisorError, InstanceRecord, PowerState
from vmready.hypervisor import (
    ACCEL_REASON_KEY,
    CURRENT_ACCEL_KEY,
    AccelChoice,
    BootSource,
    ImageInfo,
    ImageTool,
    KVMVerdicts,
    RunningVM,
    SerialLayout,
    check_files,
    choose_accel,
    console_size,
    fakeqemu_guest_paths,
    mark_boot,
)
from vmready.lifecycle.events import EventBus, rfc3339
from vmready.lifecycle.guestlink import GuestReach
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.hooks import Hypervisor
from vmready.lifecycle.journal import ActionContext, Journal
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.settings import LaunchSettings
from vmready.lifecycle.specs import LAYOUT_KEY, RNG_KEY, InstanceSpecs
from vmready.lifecycle.watching import Watching
from vmready.protocols import AgentStatus
from vmready.store import AsyncStore

# How often a first KVM boot is looked at for a sign of life.
_SIGN_OF_LIFE_POLL = 0.25


@attrs.define(kw_only=True, eq=False)
class Booting:
    """Starting QEMU for an instance.

    Its disk, its accelerator (KVM tried, then TCG, saying so), its vsock CID,
    relaunches, and powering it off.
    """

    log = Logger()

    clock: IReactorTime
    store: AsyncStore
    events: EventBus
    journal: Journal
    metrics: LifecycleMetrics
    driver: Hypervisor
    specs: InstanceSpecs
    running: RunningVMs
    reach: GuestReach
    settings: LaunchSettings
    # The serial wiring new VMs get; a running VM keeps the one it was started with.
    serial_layout: SerialLayout
    guestside: GuestSide
    watching: Watching
    images: ImageTool = attrs.field(init=False)
    # What this host taught earlier daemons about KVM (None: never try KVM on trial).
    kvm: KVMVerdicts | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        # ``clock`` is the daemon's reactor: qemu-img runs as a process.
        self.images = ImageTool(self.clock)

    @property
    def kvm_problem(self) -> str | None:
        """Why /dev/kvm cannot be used here (None: it opens; a first guest proves it runs)."""
        return self.settings.kvm_problem

    def use_kvm_verdicts(self, verdicts: KVMVerdicts) -> None:
        """Judge KVM by ``verdicts`` (the host's, per kernel and QEMU build) from now on."""
        self.kvm = verdicts

    async def check_boot_source(self, boot: BootSource) -> ImageInfo | None:
        """Check what an instance would boot; the image's description, or BadRequest."""
        check_files(boot, self.specs.disk_root)
        if boot.image is None:
            return None
        return await self.images.info(boot.image)

    async def spawn(
        self, context: ActionContext, record: InstanceRecord, image: ImageInfo | None
    ) -> None:
        await self.make_disk(context, record, image)
        await self.launch(record)
        await context.finish(PowerState.RUNNING)
        self.events.lifecycle("instance-started", record.name)

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
        disk = self.specs.disk_path(record)
        if image is None or disk is None:
            return
        await self.images.create_overlay(image, disk)
        context.note(f"made the root disk {disk} on {image.describe()}")

    def launch_spec(
        self, record: InstanceRecord, accel: str | None = None, rng: bool = True
    ) -> dict[str, Any]:
        """The device set the VM would have if it started now (under ``accel``, if given)."""
        spec = self.specs.spec_for(record, self.serial_layout, accel, self.settings.transport, rng)
        if spec.config_drive is None and self.reach.link is not None:
            # Every VM a daemon with a guest API starts gets its drive (made at launch).
            spec = attrs.evolve(spec, config_drive=self.specs.config_drive(record))
        return spec.device_set()

    async def launch(
        self,
        record: InstanceRecord,
        incoming: str | None = None,
        accel: str | None = None,
        rng: bool = True,
    ) -> RunningVM:
        """Start the VM with this daemon's serial layout and transport, recorded in the instance.

        ``accel`` forces the accelerator (a restored state must run under the
        one it was saved with); otherwise ``choose_accel`` picks it.  ``rng``:
        with a virtio-rng device (a restored state saved without one loads
        without it).
        """
        transport = self.settings.transport
        updates: dict[str, str | None] = {
            LAYOUT_KEY: self.serial_layout.name,
            TRANSPORT_KEY: transport,
            RNG_KEY: "true" if rng else "false",
        }
        if transport == "vsock" and CID_KEY not in record.config:
            updates[CID_KEY] = str(self._new_cid())
        record = await self.store.instances.update_config(record.name, updates)
        disk = self.specs.disk_path(record)
        if disk is not None and not os.path.exists(disk):
            raise HypervisorError(
                f"the root disk of {record.name}, {disk}, is missing; rebuild the instance to "
                f"boot its image {BootSource.from_config(record.config).image} afresh"
            )
        self.guestside.refresh_config_drive(record)
        if self.driver.kind == "fakeqemu":
            # A new boot: what the guest kept in its tmpfs (the agent's Ready memory) is gone.
            shutil.rmtree(fakeqemu_guest_paths(self.specs.spec_for(record))["state_dir"], True)
        if accel is not None:
            choice = AccelChoice(accel, False, f"{accel.upper()}: the saved state's accelerator")
        else:
            verdict = self.kvm.verdict if self.kvm is not None else None
            choice = choose_accel(record.config.get(ACCEL_KEY, "auto"), self.kvm_problem, verdict)
        return await self._start_vm(record, choice, incoming)

    async def _start_vm(
        self, record: InstanceRecord, choice: AccelChoice, incoming: str | None
    ) -> RunningVM:
        """Launch under ``choice``; a KVM trial that fails is retried under TCG, saying so."""
        if choice.probe and incoming is None and self.kvm is not None:
            # QEMU's own verdict first, in well under a second, from a VM with no image.
            probe = await self.driver.probe_kvm()
            if probe is not None and not probe.starts:
                return await self._fall_back_to_tcg(record, probe.reason, incoming)
            if probe is not None:
                self.log.info("{name}: {reason}", name=record.name, reason=probe.reason)
        spec = self.specs.spec_for(record, accel=choice.accel)
        doing = "restoring" if incoming is not None else "starting"
        started_at = mark_boot(spec.console_log, f"{doing} {record.name}: {choice.reason}")
        launched_at = self.clock.seconds()
        try:
            vm = await self.driver.launch(spec, incoming=incoming)
        except HypervisorError as e:
            if not choice.probe:
                raise
            first = e.message.splitlines()[0] if e.message else "no reason given"
            return await self._fall_back_to_tcg(
                record, f"QEMU failed to start a guest under KVM: {first}", incoming
            )
        await self.store.instances.update_config(
            record.name, {CURRENT_ACCEL_KEY: choice.accel, ACCEL_REASON_KEY: choice.reason}
        )
        self.watching.attach(record.name, vm)
        if incoming is None:
            # A boot (a restored VM resumes where it was): its time to Ready counts from here.
            self.metrics.boot_started(record.name, launched_at)
        booting = not BootSource.from_config(record.config).empty
        if not (choice.probe and incoming is None and booting and self.kvm is not None):
            return vm
        if await self._shows_life(record.name, vm, spec.console_log, started_at):
            self.kvm.record(True, f"guests run under KVM here (first: {record.name})")
            return vm
        timeout = self.settings.kvm_probe_timeout
        reason = (
            f"a guest under KVM showed no sign of life within {timeout:g}s "
            "(nothing on its console, no word from its agent)"
        )
        await self.watching.force_stop(record.name, vm)
        return await self._fall_back_to_tcg(record, reason, incoming)

    async def _fall_back_to_tcg(
        self, record: InstanceRecord, reason: str, incoming: str | None
    ) -> RunningVM:
        """KVM does not run guests here: remember it, say it, and start the VM under TCG."""
        if self.kvm is not None:
            self.kvm.record(False, reason)
        self.log.warn(
            "{name}: {reason}; starting it again under TCG", name=record.name, reason=reason
        )
        self.journal.history(record.name, "accelerator", f"{reason}; restarted under TCG")
        self.events.lifecycle(
            "instance-accelerator-changed",
            record.name,
            {"from": "kvm", "to": "tcg", "reason": reason},
        )
        return await self._start_vm(
            record, AccelChoice("tcg", False, f"TCG: KVM failed here ({reason})"), incoming
        )

    async def _shows_life(self, name: str, vm: RunningVM, console: str, since: int) -> bool:
        """Whether the guest writes to its console or its agent speaks within the probe time."""
        deadline = self.clock.seconds() + self.settings.kvm_probe_timeout
        while not vm.gone:
            if (
                console_size(console) > since
                or self.running.agent_status(name) is not AgentStatus.UNKNOWN
            ):
                return True
            if self.clock.seconds() >= deadline:
                return False
            await deferLater(self.clock, _SIGN_OF_LIFE_POLL, lambda: None)
        return False

    def _new_cid(self) -> int:
        """A vsock CID no other instance on this host holds."""
        used = {
            int(record.config[CID_KEY])
            for record in self.store.view.owned_instances()
            if record.config.get(CID_KEY, "").isdigit()
        }
        return allocate_cid(used)

    async def power_off(
        self, context: ActionContext, name: str, timeout: float, force: bool
    ) -> None:
        vm = self.running.vms.get(name)
        if vm is None or vm.gone:
            self.watching.detach(name)
            record = self.store.view.get_instance(name)
            if await self.driver.kill_owned(self.specs.spec_for(record)):
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
        grace = {"timeout": timeout, "force_at": rfc3339(self.clock.seconds() + timeout)}
        context.progress({"shutdown": grace})
        how = await vm.shutdown(timeout, self.clock)
        context.progress({"shutdown": {**grace, "result": how}})
        context.note("clean stop" if how == "clean" else f"forced stop after {timeout:g}s timeout")
