"""The guest's root filesystem: the host's apt sources for mmdebstrap, the tree made the guest."""

from __future__ import annotations

import contextlib
import os

from vmready.hypervisor.guestimage.commands import CommandRunner, run_step
from vmready.hypervisor.guestimage.content import (
    HOSTNAME,
    MASKED_GENERATORS,
    MASKED_UNITS,
    SUITE,
    USER_DATA_RUNNER,
    USER_DATA_RUNNER_PATH,
    USER_DATA_UNIT,
    USER_DATA_UNIT_NAME,
)
from vmready.hypervisor.guestimage.earlyagent import (
    EARLY_AGENT_DROPIN,
    EARLY_AGENT_DROPIN_PATH,
    EARLY_AGENT_PATH,
    EARLY_AGENT_SCRIPT,
)


def host_apt_sources(suite: str = SUITE, etc: str = "/etc/apt") -> list[str]:
    """The host's apt source files that serve ``suite`` (mmdebstrap pastes them into the guest)."""
    candidates = [os.path.join(etc, "sources.list")]
    with contextlib.suppress(FileNotFoundError):
        parts = os.path.join(etc, "sources.list.d")
        candidates += sorted(
            os.path.join(parts, name)
            for name in os.listdir(parts)
            if name.endswith((".list", ".sources"))
        )
    found = []
    for path in candidates:
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as f:
                lines = [line.split("#", 1)[0] for line in f]
            if any(suite in line.split() for line in lines) and any(
                "debian" in line for line in lines
            ):
                found.append(path)
    return found


def customize_root(root: str, run: CommandRunner, loader_dir: str) -> None:
    """Make the bootstrapped tree ``root`` the demo guest: loader, user-data runner, settings."""
    run_step(
        run,
        "installing the vmready loader",
        ["sh", os.path.join(loader_dir, "install.sh"), "--root", root],
    )

    def write(path: str, content: str, mode: int = 0o644) -> None:
        target = os.path.join(root, path.lstrip("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        with open(target, "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(target, mode)

    def link(path: str, target: str) -> None:
        where = os.path.join(root, path.lstrip("/"))
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where)
        os.symlink(target, where)

    write(EARLY_AGENT_PATH, EARLY_AGENT_SCRIPT, 0o755)
    write(EARLY_AGENT_DROPIN_PATH, EARLY_AGENT_DROPIN)
    write(USER_DATA_RUNNER_PATH, USER_DATA_RUNNER, 0o755)
    unit = f"/etc/systemd/system/{USER_DATA_UNIT_NAME}"
    write(unit, USER_DATA_UNIT)
    link(f"/etc/systemd/system/multi-user.target.wants/{USER_DATA_UNIT_NAME}", unit)
    write("/etc/hostname", HOSTNAME + "\n")
    write("/etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n")
    write("/etc/fstab", "# The demo guest's one disk.\n/dev/vda / ext4 rw 0 1\n")
    write("/etc/systemd/journald.conf.d/vmready-demo.conf", "[Journal]\nStorage=volatile\n")
    for name in MASKED_UNITS:
        link(f"/etc/systemd/system/{name}", "/dev/null")
    for name in MASKED_GENERATORS:
        link(f"/etc/systemd/system-generators/{name}", "/dev/null")
    lock_root_password(os.path.join(root, "etc/shadow"))
    # mmdebstrap copied the build host's; the guest has no DNS server to ask.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, "etc/resolv.conf"))


def lock_root_password(shadow: str) -> None:
    """Lock root's password in a shadow file (as ``passwd -l root``): nobody logs in as root."""
    with open(shadow, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if fields[0] == "root" and len(fields) > 1 and not fields[1].startswith("!"):
            fields[1] = "!" + fields[1]
            lines[i] = ":".join(fields)
    with open(shadow, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
