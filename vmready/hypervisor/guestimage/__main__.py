"""``python -m vmready.hypervisor.guestimage``: build or reuse the demo guest."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from vmready.hypervisor.guestimage.build import ensure_guest, launch_command
from vmready.hypervisor.guestimage.cache import CACHE_VARIABLE, default_cache_dir
from vmready.hypervisor.guestimage.commands import GuestImageError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m vmready.hypervisor.guestimage``: build or reuse the demo guest."""
    parser = argparse.ArgumentParser(
        prog="python -m vmready.hypervisor.guestimage",
        description="Build (or reuse) the demo guest: a Debian kernel, a busybox initramfs and a "
        "qcow2 root disk with the vmready loader.",
    )
    parser.add_argument(
        "--cache",
        default=None,
        help=f"cache directory (default: ${CACHE_VARIABLE}, else ~/.cache/vmready/guest)",
    )
    options = parser.parse_args(argv)
    cache = options.cache or default_cache_dir()

    def stop(signum: int, frame: object) -> None:
        # Unwind like Ctrl-C: the running command is stopped, the build removed.
        raise SystemExit(
            f"vmready.hypervisor.guestimage: stopped by signal {signum}; nothing was cached"
        )

    signal.signal(signal.SIGTERM, stop)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        guest = ensure_guest(cache, log)
    except GuestImageError as e:
        print(f"vmready.hypervisor.guestimage: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"kernel: {guest.kernel}")
    print(f"vmlinux: {guest.vmlinux} (the same kernel uncompressed: boots sooner where accepted)")
    print(f"initrd: {guest.initrd}")
    print(f"image:  {guest.image}")
    print(f"append: {guest.append}")
    print(launch_command(guest))


if __name__ == "__main__":
    main()
