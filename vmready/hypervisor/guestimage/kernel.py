"""The demo guest's kernel, built from Debian's source package once per source and configuration.

``ensure_kernel`` returns the kernel for a ``linux-source-6.1`` version from
its own cache (``~/.cache/vmready/kernel``, shared by every demo guest cache:
a fresh ``./dev run --hypervisor qemu`` data dir does not build it again),
building it first if needed: ``apt-get download`` the source, unpack it,
``make tinyconfig``, append ``kernelconfig.KERNEL_CONFIG``, ``make
olddefconfig``, check every line took, ``make bzImage``.  Five to six minutes
on two cores; it needs a C toolchain (``BUILD_PACKAGES``), which ``./dev run
--hypervisor qemu`` and CI install.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence

import attrs

from vmready.hypervisor.bootfiles import has_pvh_entry
from vmready.hypervisor.guestimage.cache import cached_build, default_cache_dir, has_files
from vmready.hypervisor.guestimage.commands import CommandRunner, GuestImageError, run_step
from vmready.hypervisor.guestimage.fetch import Package, fetch_packages
from vmready.hypervisor.guestimage.kernelconfig import KERNEL_CONFIG, config_problems

KERNEL_SOURCE_PACKAGE = "linux-source-6.1"
# Bump when the same source and configuration make a different kernel.
KERNEL_BUILDER_VERSION = 1
KERNEL_CACHE_VARIABLE = "VMREADY_KERNEL_CACHE"
BZIMAGE_FILE = "bzImage"
VMLINUX_FILE = "vmlinux"
CONFIG_FILE = "config"
KERNEL_MANIFEST_FILE = "kernel.json"
# What the build runs, and the Debian package with it: a command, or a header file.
BUILD_PACKAGES = (
    ("gcc", "gcc"),
    ("make", "make"),
    ("flex", "flex"),
    ("bison", "bison"),
    ("bc", "bc"),
    ("xz", "xz-utils"),
    ("/usr/include/stdio.h", "libc6-dev"),
    ("/usr/include/gelf.h", "libelf-dev"),
)


@attrs.frozen
class GuestKernel:
    """A built kernel: the bzImage, the same kernel as an ELF with a PVH entry, its .config."""

    bzimage: str
    vmlinux: str
    config: str
    key: str


# Where a guest build gets its kernel: ``ensure_kernel``, or a test's stand-in.
KernelProvider = Callable[[Package, CommandRunner, Callable[[str], None]], GuestKernel]


def default_kernel_cache() -> str:
    """``$VMREADY_KERNEL_CACHE``, else ``kernel`` beside the default demo guest cache."""
    return os.environ.get(KERNEL_CACHE_VARIABLE) or os.path.join(
        os.path.dirname(default_cache_dir()), "kernel"
    )


def kernel_description(source: Package) -> dict[str, object]:
    """What the kernel is built from: the source package, the configuration, the builder."""
    return {
        "builder": KERNEL_BUILDER_VERSION,
        "source": [source.name, source.version],
        "config": list(KERNEL_CONFIG),
    }


def kernel_key(source: Package) -> str:
    """16 hex digits that change whenever the source, the configuration or the builder does."""
    encoded = json.dumps(kernel_description(source), sort_keys=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def missing_build_packages(
    which: Callable[[str], str | None] = shutil.which,
    exists: Callable[[str], bool] = os.path.exists,
) -> list[str]:
    """The Debian packages the kernel build needs and this host lacks, in install order."""
    missing = []
    for needed, package in BUILD_PACKAGES:
        found = exists(needed) if needed.startswith("/") else which(needed) is not None
        if not found and package not in missing:
            missing.append(package)
    return missing


def _is_complete(directory: str) -> bool:
    return has_files(directory, (BZIMAGE_FILE, VMLINUX_FILE, CONFIG_FILE, KERNEL_MANIFEST_FILE))


def guest_kernel(directory: str, key: str) -> GuestKernel:
    """The files of the kernel built in ``directory``."""
    return GuestKernel(
        bzimage=os.path.join(directory, BZIMAGE_FILE),
        vmlinux=os.path.join(directory, VMLINUX_FILE),
        config=os.path.join(directory, CONFIG_FILE),
        key=key,
    )


def configure(tree: str, run: CommandRunner, wanted: Sequence[str] = KERNEL_CONFIG) -> str:
    """``make tinyconfig`` with ``wanted`` appended, completed by ``olddefconfig``; its text."""
    step = "configuring the kernel"
    run_step(run, f"{step} (make tinyconfig)", ["make", "-s", "tinyconfig"], tree)
    path = os.path.join(tree, ".config")
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(f"{line}\n" for line in wanted))
    run_step(run, f"{step} (make olddefconfig)", ["make", "-s", "olddefconfig"], tree)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    problems = config_problems(text, wanted)
    if problems:
        raise GuestImageError(
            f"{step} failed: {len(problems)} line(s) did not take: {'; '.join(problems[:5])}"
        )
    return text


def build_kernel(
    source: Package,
    workdir: str,
    run: CommandRunner,
    log: Callable[[str], None],
    jobs: int | None = None,
) -> None:
    """Build the kernel of ``source`` into the empty directory ``workdir``."""
    missing = missing_build_packages()
    if missing:
        raise GuestImageError(
            "building the demo guest's kernel failed: this host lacks "
            f"{', '.join(missing)}; install them: apt-get install {' '.join(missing)}"
        )
    unpacked = fetch_packages([source], workdir, run)[source.name]
    tarball = os.path.join(unpacked, "usr", "src", f"{source.name}.tar.xz")
    tree = os.path.join(workdir, "src")
    os.makedirs(tree)
    log(f"guest image: unpacking {source.name} {source.version}")
    unpack = ["tar", "-xJf", tarball, "-C", tree, "--strip-components=1"]
    run_step(run, f"unpacking {os.path.basename(tarball)}", unpack)
    shutil.rmtree(os.path.dirname(unpacked))
    config = configure(tree, run)
    jobs = jobs or (os.cpu_count() or 1) + 1
    log(f"guest image: compiling the kernel (make -j{jobs} bzImage; minutes)")
    make = ["make", "-s", f"-j{jobs}", "KBUILD_BUILD_USER=vmready", "KBUILD_BUILD_HOST=vmready"]
    run_step(run, "compiling the kernel", [*make, "bzImage"], tree)
    vmlinux = os.path.join(tree, "vmlinux")
    with open(vmlinux, "rb") as f:
        if not has_pvh_entry(f):
            raise GuestImageError("compiling the kernel failed: vmlinux has no PVH entry point")
    shutil.copyfile(vmlinux, os.path.join(workdir, VMLINUX_FILE))
    shutil.copyfile(
        os.path.join(tree, "arch", "x86", "boot", "bzImage"), os.path.join(workdir, BZIMAGE_FILE)
    )
    with open(os.path.join(workdir, CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(config)
    shutil.rmtree(tree)
    manifest = dict(kernel_description(source), key=kernel_key(source))
    with open(os.path.join(workdir, KERNEL_MANIFEST_FILE), "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def ensure_kernel(
    source: Package,
    run: CommandRunner,
    log: Callable[[str], None],
    cache_dir: str | None = None,
    builder: Callable[[Package, str, CommandRunner, Callable[[str], None]], None] = build_kernel,
) -> GuestKernel:
    """The kernel of ``source``, from ``cache_dir`` (``default_kernel_cache()``) or built first."""
    cache = cache_dir or default_kernel_cache()
    os.makedirs(cache, exist_ok=True)
    key = kernel_key(source)
    final = cached_build(
        cache, key, _is_complete, lambda workdir: builder(source, workdir, run, log), run, log
    )
    return guest_kernel(final, key)
