"""The demo guest: a small Debian VM with the vmready loader, built from Debian packages, cached.

``ensure_guest(cache_dir)`` returns a kernel, an initramfs, a qcow2 root disk and
the kernel command line to boot them with, building them first when the cache
has no build for the current inputs:

- the kernel is built from Debian's own source (``linux-source-6.1``, fetched with
  ``apt-get download``) as ``make tinyconfig`` plus what the guest uses (virtio
  disk, console, rng, 9p, network, vsock, ACPI button, pvpanic, what systemd
  needs), all built in; cached on its own (``~/.cache/vmready/kernel``), since
  it depends on nothing else of the guest;
- the initramfs is ``busybox-static`` and ``/init``: it mounts ``/dev/vda``,
  starts the vmready agent and hands over to systemd;
- the root disk is a Debian bookworm ``minbase`` (``mmdebstrap``) with systemd,
  python3, udev and dbus, the vmready loader pre-installed by its own
  ``install.sh --root``, a stand-in for cloud-init that runs the instance's
  ``user-data`` script, and the units that only slow a VM's boot masked.

A build lives in ``<cache_dir>/<key>/``, where the key hashes every input (the
packages' versions, the files put into the image, this builder's version). It
is built in a temporary directory and renamed into place, under a lock, so a
failed, interrupted or concurrent build never leaves anything that looks cached.

This runs before or outside the daemon's reactor (a CLI, a test's setup), so it
uses blocking subprocesses. ``python -m vmready.hypervisor.guestimage`` builds from a shell.

The parts: ``content`` (what the guest is made of), ``inputs`` (what a build
depends on, the cache key), ``commands`` (running commands), ``fetch`` (Debian
packages downloaded and unpacked), ``kernelconfig`` and ``kernel`` (the
kernel's configuration, its build and cache), ``initramfs`` (the initramfs),
``earlyagent`` (the agent the initramfs starts ahead of systemd), ``rootfs``
(the root filesystem), ``cache`` (built guests on disk), ``build`` (the steps,
``ensure_guest``), ``stock`` (the stock-like cloud image the real-guest tests
boot: Debian's cloud kernel and cloud-init, nothing of vmready;
``ensure_stock_guest``) and ``__main__`` (the CLI).
"""

from vmready.hypervisor.guestimage.build import ensure_guest
from vmready.hypervisor.guestimage.kernel import missing_build_packages
from vmready.hypervisor.guestimage.stock import ensure_stock_guest

__all__ = ["ensure_guest", "ensure_stock_guest", "missing_build_packages"]
