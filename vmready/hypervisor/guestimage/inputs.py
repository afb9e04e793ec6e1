"""What a build depends on, resolved from apt: packages' versions, files; its hash is the key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import attrs

from vmready.guestfiles import loader_files
from vmready.hypervisor.guestimage.commands import (
    CommandRunner,
    GuestImageError,
    run_command,
    run_step,
)
from vmready.hypervisor.guestimage.content import (
    BUILDER_VERSION,
    BUSYBOX_PACKAGE,
    DISK_SIZE,
    HOSTNAME,
    INIT_SCRIPT,
    KERNEL_APPEND,
    MASKED_GENERATORS,
    MASKED_UNITS,
    ROOT_PACKAGES,
    SUITE,
    USER_DATA_RUNNER,
    USER_DATA_UNIT,
    USER_DATA_UNIT_NAME,
)
from vmready.hypervisor.guestimage.earlyagent import (
    EARLY_AGENT_DROPIN,
    EARLY_AGENT_SCRIPT,
)
from vmready.hypervisor.guestimage.fetch import Package
from vmready.hypervisor.guestimage.kernel import KERNEL_SOURCE_PACKAGE, kernel_key


@attrs.frozen
class GuestInputs:
    """Everything a build depends on; its hash is the cache key."""

    # The source package the guest's kernel is built from (``kernel.ensure_kernel``).
    kernel: Package
    busybox: Package
    root_packages: tuple[Package, ...]
    files: Mapping[str, bytes]

    def description(self) -> dict[str, object]:
        """A JSON-able record of the inputs (the manifest, and what the key hashes)."""
        return {
            "builder": BUILDER_VERSION,
            "suite": SUITE,
            "kernel": [self.kernel.name, self.kernel.version],
            "kernel_build": kernel_key(self.kernel),
            "busybox": [self.busybox.name, self.busybox.version],
            "root_packages": [[p.name, p.version] for p in self.root_packages],
            "masked_units": list(MASKED_UNITS),
            "masked_generators": list(MASKED_GENERATORS),
            "append": KERNEL_APPEND,
            "disk_size": DISK_SIZE,
            "hostname": HOSTNAME,
            "files": {
                name: hashlib.sha256(data).hexdigest() for name, data in sorted(self.files.items())
            },
        }

    @property
    def key(self) -> str:
        """16 hex digits that change whenever any input changes."""
        encoded = json.dumps(self.description(), sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]


def image_files() -> dict[str, bytes]:
    """The files the builder puts into the guest, by a name: the loader's and the demo's own."""
    files = {f"loader/{name}": data for name, data in loader_files().items()}
    files["initramfs/init"] = INIT_SCRIPT.encode()
    files["demo/vmready-agent-early"] = EARLY_AGENT_SCRIPT.encode()
    files["demo/vmready-demo-early.conf"] = EARLY_AGENT_DROPIN.encode()
    files["demo/run-user-data"] = USER_DATA_RUNNER.encode()
    files[f"demo/{USER_DATA_UNIT_NAME}"] = USER_DATA_UNIT.encode()
    return files


def parse_apt_show(text: str) -> dict[str, dict[str, str]]:
    """``apt-cache show`` stanzas, keyed by package name (the first stanza of each wins)."""
    packages: dict[str, dict[str, str]] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        last = None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and last is not None:
                fields[last] += "\n" + line.strip()
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        if "Package" in fields:
            packages.setdefault(fields["Package"], fields)
    return packages


def kernel_package_of(depends: str, metapackage: str) -> str:
    """The ``linux-image-<ver>-…`` that a kernel metapackage's Depends names."""
    for alternative in depends.replace("|", ",").split(","):
        name = alternative.strip().split(" ", 1)[0]
        if name.startswith("linux-image-") and name != metapackage:
            return name
    raise GuestImageError(
        f"resolving the kernel package failed: {metapackage} depends on no "
        f"linux-image-<version> package (Depends: {depends!r})"
    )


def apt_show_metapackage(
    run: CommandRunner, step: str, metapackage: str
) -> dict[str, dict[str, str]]:
    """``apt-cache show`` of ``metapackage``, parsed; a one-line error if apt knows none."""
    shown = parse_apt_show(
        run_step(run, step, ["apt-cache", "show", "--no-all-versions", metapackage]).decode()
    )
    if metapackage not in shown:
        raise GuestImageError(f"{step} failed: apt knows no {metapackage} (apt-get update?)")
    return shown


def resolve_inputs(run: CommandRunner = run_command) -> GuestInputs:
    """Ask apt which versions a build would use now (no download; apt's lists must be current)."""
    names = [KERNEL_SOURCE_PACKAGE, BUSYBOX_PACKAGE, *ROOT_PACKAGES]
    step = "resolving the guest's packages"
    shown = parse_apt_show(
        run_step(run, step, ["apt-cache", "show", "--no-all-versions", *names]).decode()
    )
    missing = [name for name in names if name not in shown]
    if missing:
        raise GuestImageError(
            f"{step} failed: apt knows no {', '.join(missing)} (apt-get update, or add Debian "
            f"{SUITE} to apt's sources)"
        )
    packages = {name: Package(name, shown[name]["Version"]) for name in names}
    return GuestInputs(
        kernel=packages[KERNEL_SOURCE_PACKAGE],
        busybox=packages[BUSYBOX_PACKAGE],
        root_packages=tuple(packages[name] for name in ROOT_PACKAGES),
        files=image_files(),
    )
