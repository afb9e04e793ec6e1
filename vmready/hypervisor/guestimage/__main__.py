"""``python -m vmready.hypervisor.guestimage [--stock]``: build or reuse the demo guest, or the
stock-like cloud image."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Sequence

from vmready.hypervisor.guestimage.build import ensure_guest, launch_command
from vmready.hypervisor.guestimage.cache import CACHE_VARIABLE, default_cache_dir
from vmready.hypervisor.guestimage.commands import GuestImageError
from vmready.hypervisor.guestimage.stock import StockGuest, ensure_stock_guest, stock_cache_dir


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
        help=f"cache directory (default: ${CACHE_VARIABLE}, else ~/.cache/vmready/guest; "
        "with --stock, stock beside it)",
    )
    parser.add_argument(
        "--stock",
        action="store_true",
        help="build (or reuse) the stock-like cloud image instead: Debian's cloud kernel and "
        "cloud-init, nothing of vmready (and its variants with the loader baked in, and for "
        "the documented install)",
    )
    options = parser.parse_args(argv)
    cache = options.cache or (stock_cache_dir() if options.stock else default_cache_dir())

    def stop(signum: int, frame: object) -> None:
        # Unwind like Ctrl-C: the running command is stopped, the build removed.
        raise SystemExit(
            f"vmready.hypervisor.guestimage: stopped by signal {signum}; nothing was cached"
        )

    signal.signal(signal.SIGTERM, stop)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if options.stock:
            print_stock(ensure_stock_guest(cache, log))
            return
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


def print_stock(stock: StockGuest) -> None:
    """The stock-like image's files, and the launch command of its unmodified disk."""
    print(f"kernel: {stock.kernel}")
    print(f"initrd: {stock.initrd}")
    print(f"stock:  {stock.stock} (nothing of vmready)")
    print(f"loader: {stock.loader} (the loader baked in; cloud-init's LXD datasource)")
    print(f"manual: {stock.manual} (cloud-init off; the documented install at first boot)")
    print(f"append: {stock.append}")
    command = ["vmready", "launch", "web1", "--image", stock.stock, "--kernel", stock.kernel]
    print(shlex.join([*command, "--initrd", stock.initrd, "--append", stock.append]))


if __name__ == "__main__":
    main()
