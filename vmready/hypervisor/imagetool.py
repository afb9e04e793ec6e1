"""Disk images through ``qemu-img``: what an image is (``ImageInfo``), overlays made on it.

``qemu-img`` runs as a child process through the reactor (``ImageTool``),
never blocking it.  A backing chain is followed one local regular file at a
time, each checked before anything opens it; a raw layer must hold something
a guest can boot or mount.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import stat
from collections.abc import Sequence
from typing import Any, cast

import attrs
from twisted.internet.interfaces import IReactorProcess, IReactorTime
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure

from vmready.domain import BadRequest, HypervisorError
from vmready.hypervisor.bootfiles import check_raw_image, read_head

IMAGE_FORMATS = ("qcow2", "raw")
QEMU_IMG = "qemu-img"
# Longer backing chains than this are refused (each layer is one qemu-img run).
MAX_CHAIN = 16
# A backing name with a protocol prefix (nbd:, http:, json:{…}) rather than a path.
_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_OUTPUT_TAIL = 2000


@attrs.frozen
class ImageInfo:
    """A disk image as ``qemu-img info --backing-chain`` describes it."""

    path: str
    format: str
    virtual_size: int
    # The backing chain below the image, nearest first (empty: a standalone image).
    backing: tuple[str, ...] = ()
    # The format of each backing file, in the same order.
    backing_formats: tuple[str, ...] = ()
    # For a raw image (or a raw bottom of its chain): what it holds.
    content: str = ""

    def describe(self) -> str:
        """One line for people."""
        size = f"{self.virtual_size / (1 << 30):.1f} GiB"
        chain = f", backed by {' <- '.join(self.backing)}" if self.backing else ""
        content = f", {self.content}" if self.content else ""
        return f"{self.format} image {self.path} ({size}{content}{chain})"


def parse_image_info(path: str, output: bytes) -> ImageInfo:
    """``qemu-img info --output=json --backing-chain`` output → ImageInfo, or BadRequest."""
    try:
        chain = json.loads(output)
    except ValueError:
        raise HypervisorError(
            f"qemu-img info {path} answered something that is not JSON: {output[:200]!r}"
        ) from None
    if isinstance(chain, dict):
        chain = [chain]
    if not isinstance(chain, list) or not chain or not all(isinstance(i, dict) for i in chain):
        raise HypervisorError(f"qemu-img info {path} answered an unexpected shape: {chain!r}")
    top = chain[0]
    image_format = str(top.get("format", ""))
    if image_format not in IMAGE_FORMATS:
        raise BadRequest(
            f"image {path} is {_a_format(image_format)}; vmready boots qcow2 and "
            "raw images (convert it: qemu-img convert -O qcow2 …)"
        )
    backing: list[str] = []
    formats: list[str] = []
    for layer, below in itertools.pairwise(chain):
        # The file qemu-img opened: a backing name recorded relative to its image is
        # resolved against the image's directory, not the daemon's working directory.
        name = str(
            below.get("filename")
            or layer.get("full-backing-filename")
            or layer.get("backing-filename")
            or "?"
        )
        below_format = str(below.get("format", ""))
        if below_format not in IMAGE_FORMATS:
            raise BadRequest(
                f"image {path} is backed by {name}, {_a_format(below_format)}; "
                "only qcow2 and raw backing files are followed"
            )
        backing.append(name)
        formats.append(below_format)
    if chain[-1].get("backing-filename"):
        missing = chain[-1].get("full-backing-filename") or chain[-1]["backing-filename"]
        raise BadRequest(f"image {path}: its backing chain points to {missing}, which is missing")
    size = top.get("virtual-size")
    if not isinstance(size, int) or size <= 0:
        raise BadRequest(f"image {path} has no usable size ({size!r})")
    return ImageInfo(path, image_format, size, tuple(backing), tuple(formats))


def _a_format(image_format: str) -> str:
    """``a vmdk image``, or ``an image of unknown format`` when qemu-img named none."""
    return f"a {image_format} image" if image_format else "an image of unknown format"


def _local_backing(image: str, layer: dict[str, Any]) -> str | None:
    """The local file ``layer`` (the image file ``image``) is backed by, or None.

    Only plain local files are followed: a backing name with a protocol
    (``nbd:``, ``http:``, ``json:``…) is refused before anything opens it.
    """
    name = layer.get("backing-filename")
    if not name:
        return None
    name = str(name)
    if _PROTOCOL.match(name) and not name.startswith("/"):
        raise BadRequest(
            f"image {image} is backed by {name!r}, which is not a local file; "
            "vmready follows only local backing files"
        )
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(image)), name))


def _with_content(info: ImageInfo) -> ImageInfo:
    """``info`` with what its raw layers hold; BadRequest for a raw layer that holds nothing.

    Every backing layer must be a regular file, as the image itself must: a
    chain may not lead the guest to a host block device, a device node or a
    network export.
    """
    for backing in info.backing:
        try:
            mode = os.stat(backing).st_mode
        except OSError as e:
            raise BadRequest(
                f"image {info.path} is backed by {backing}, which cannot be examined: {e.strerror}"
            ) from None
        if not stat.S_ISREG(mode):
            raise BadRequest(
                f"image {info.path} is backed by {backing}, which is not a regular file"
            )
    layers = [(info.path, info.format), *zip(info.backing, info.backing_formats, strict=True)]
    contents = [check_raw_image(layer) for layer, kind in layers if kind == "raw"]
    return attrs.evolve(info, content=contents[0]) if contents else info


def _check_backing(image: str, backing: str) -> None:
    """``image``'s backing file is a regular file this daemon can read, or BadRequest."""
    try:
        mode = os.stat(backing).st_mode
    except FileNotFoundError:
        raise BadRequest(f"image {image} is backed by {backing}, which does not exist") from None
    except OSError as e:
        raise BadRequest(
            f"image {image} is backed by {backing}, which cannot be examined: {e.strerror}"
        ) from None
    if not stat.S_ISREG(mode):
        raise BadRequest(f"image {image} is backed by {backing}, which is not a regular file")
    if not os.access(backing, os.R_OK):
        raise BadRequest(f"image {image} is backed by {backing}, which cannot be read")


def _json_object(path: str, output: bytes) -> dict[str, Any]:
    """qemu-img's JSON answer about one file."""
    try:
        value = json.loads(output)
    except ValueError:
        raise HypervisorError(
            f"qemu-img info {path} answered something that is not JSON: {output[:200]!r}"
        ) from None
    if not isinstance(value, dict):
        raise HypervisorError(f"qemu-img info {path} answered an unexpected shape: {value!r}")
    return value


def _failure_text(err: bytes, out: bytes) -> str:
    """qemu-img's complaint as one message (its ``qemu-img: `` prefix dropped)."""
    text = (err or out).decode("utf-8", "replace").strip()[-_OUTPUT_TAIL:]
    lines = [line.removeprefix("qemu-img: ") for line in text.splitlines() if line.strip()]
    return "; ".join(lines) or "no reason given"


class ImageTool:
    """Runs ``qemu-img`` for the daemon, through the reactor (it never blocks)."""

    def __init__(self, reactor: IReactorTime, program: str = QEMU_IMG) -> None:
        """``reactor`` must also spawn processes (``IReactorProcess``), as the daemon's does."""
        self.reactor = reactor
        self.program = program

    async def _run(self, args: Sequence[str]) -> tuple[bytes, bytes, int]:
        executable = _which(self.program)
        if executable is None:
            raise HypervisorError(
                f"{self.program} is not installed; it makes and checks disk overlays "
                "(Debian: apt-get install qemu-utils)"
            )

        def killed(failure: Failure) -> Failure:
            # Killed by a signal, the child's (out, err, signal) arrives as a failure's
            # value: not an exception, so it cannot be raised into a coroutine as it is.
            if isinstance(failure.value, tuple):
                out, err, number = failure.value
                raise HypervisorError(
                    f"{self.program} {args[0]} did not finish: killed by "
                    f"{_signal_name(number)}: {_failure_text(err, out)}"
                )
            return failure

        try:
            result: tuple[bytes, bytes, int] = await getProcessOutputAndValue(
                executable,
                list(args),
                env=dict(os.environ),
                reactor=cast(IReactorProcess, self.reactor),
            ).addErrback(killed)
        except HypervisorError:
            raise
        except Exception as e:
            raise HypervisorError(f"{self.program} {args[0]} could not run: {e}") from None
        return result

    async def info(self, path: str) -> ImageInfo:
        """Check that ``path`` is a bootable qcow2 or raw image whose chain can be followed.

        The chain is walked one file at a time (``qemu-img info`` without
        ``--backing-chain`` does not open a backing file), so each backing
        name is checked — a local regular file, no loop — before anything
        opens it.
        """
        layers: list[dict[str, Any]] = []
        current, seen = path, set()
        while True:
            if layers:
                _check_backing(str(layers[-1]["filename"]), current)
            else:
                read_head(current, "image", 1)
            if os.path.realpath(current) in seen:
                raise BadRequest(f"image {path}: its backing chain loops back to {current}")
            seen.add(os.path.realpath(current))
            args = ["info", "-U", "--output=json"]
            expected = layers[-1].get("backing-filename-format") if layers else None
            if expected:
                args += ["-f", str(expected)]
            out, err, code = await self._run([*args, current])
            if code != 0:
                raise BadRequest(f"image {current} cannot be opened: {_failure_text(err, out)}")
            layer = _json_object(current, out)
            layer["filename"] = current
            data = (layer.get("format-specific") or {}).get("data") or {}
            if isinstance(data, dict) and data.get("data-file"):
                raise BadRequest(
                    f"image {current} keeps its data in an external file "
                    f"({data['data-file']}); vmready boots self-contained images"
                )
            layers.append(layer)
            below = _local_backing(current, layer)
            if below is None:
                break
            if len(layers) > MAX_CHAIN:
                raise BadRequest(f"image {path}: its backing chain is longer than {MAX_CHAIN}")
            current = below
        return _with_content(parse_image_info(path, json.dumps(layers).encode()))

    async def create_overlay(self, image: ImageInfo, overlay: str) -> None:
        """Make ``overlay``, a qcow2 backed by ``image`` (replacing one that exists), and check it.

        Written as ``<overlay>.tmp`` and renamed, so a crash never leaves a
        half-made overlay under the real name.
        """
        os.makedirs(os.path.dirname(overlay), mode=0o700, exist_ok=True)
        partial = overlay + ".tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        out, err, code = await self._run(
            ["create", "-q", "-f", "qcow2", "-F", image.format, "-b", image.path, partial]
        )
        try:
            if code != 0:
                raise HypervisorError(
                    f"qemu-img could not create the overlay {overlay} on {image.path}: "
                    f"{_failure_text(err, out)}"
                )
            out, err, code = await self._run(["info", "-U", "--output=json", partial])
            if code != 0:
                raise HypervisorError(
                    f"the new overlay {overlay} cannot be opened: {_failure_text(err, out)}"
                )
            made = json.loads(out)
            if made.get("format") != "qcow2" or made.get("backing-filename") != image.path:
                raise HypervisorError(
                    f"the new overlay {overlay} is not a qcow2 backed by {image.path}: {made!r}"
                )
            os.chmod(partial, 0o600)
            os.replace(partial, overlay)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _which(program: str) -> str | None:
    if os.sep in program:
        return program if os.access(program, os.X_OK) else None
    import shutil

    return shutil.which(program)
