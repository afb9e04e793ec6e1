"""Debian packages at exact versions, downloaded with apt and unpacked without installing them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import attrs

from vmready.hypervisor.guestimage.commands import CommandRunner, GuestImageError, run_step


@attrs.frozen
class Package:
    """A Debian package at the version apt would fetch."""

    name: str
    version: str


def fetch_packages(
    packages: Sequence[Package], workdir: str, run: CommandRunner
) -> dict[str, str]:
    """``apt-get download`` and ``dpkg -x`` each package: where each one's files are."""
    downloads = os.path.join(workdir, "downloads")
    os.makedirs(downloads)
    # apt's download sandbox user must be able to write here.
    os.chmod(downloads, 0o755)
    names = ", ".join(p.name for p in packages)
    wanted = [f"{p.name}={p.version}" for p in packages]
    run_step(run, f"downloading {names}", ["apt-get", "download", "-q", *wanted], downloads)
    unpacked = {}
    for package in packages:
        debs = [n for n in os.listdir(downloads) if n.startswith(package.name + "_")]
        if len(debs) != 1:
            raise GuestImageError(
                f"downloading {package.name} failed: expected one {package.name}_*.deb, "
                f"found {debs or 'none'}"
            )
        where = os.path.join(workdir, "unpacked", package.name)
        os.makedirs(where)
        deb = os.path.join(downloads, debs[0])
        run_step(run, f"unpacking {package.name}", ["dpkg", "-x", deb, where])
        unpacked[package.name] = where
    shutil.rmtree(downloads)
    return unpacked
