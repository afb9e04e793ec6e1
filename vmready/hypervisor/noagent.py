"""Why a booted guest has no connected agent, as its console tells it: one line, what to do.

A real guest's agent comes from one of two places: the vmready loader baked
into its image (it starts the agent from the config drive or the NoCloud
seed), or cloud-init, which reads the instance's NoCloud seed and runs its
vendor-data (the loader's ``install.sh`` from the seed).  An image with
neither boots, and its agent never speaks.  ``AGENT_EXPECTED_WITHIN``
seconds into a boot with no word from an agent, the daemon reads the boot's
console (the part after its own ``--- vmready: … ---`` mark) and says what
it shows: the loader's or the agent's own last complaint, cloud-init having
run without starting it (or still running), a guest that wrote nothing at all, or neither
cloud-init nor the loader (``agent_absence``; ``missing_agent_reason`` is the
pure part).  An agent that said ``STARTED`` but never ``CONNECTED`` (its
configuration refused: it says ``STARTED`` before it reads it, then ``STOPPED``)
is told by its own last line on the console.
"""

from __future__ import annotations

from vmready.hypervisor.console import read_console

# A stock cloud image under TCG starts the agent some 25 s into its first boot (cloud-init's
# init stage); a guest twice as slow as the slowest measured still speaks well within this.
AGENT_EXPECTED_WITHIN = 120.0
# How long after its first STARTED a healthy agent has connected: its imports take up to ~12 s
# under a loaded emulator (the host allows 15 s of silence after a STARTED), then one dial
# takes at most 15 s.  An agent first heard late in AGENT_EXPECTED_WITHIN is given this.
AGENT_CONNECT_WITHIN = 30.0
# How much of the console's tail is read for it.
CONSOLE_BYTES = 256 * 1024
_BOOT_MARK = b"\n--- vmready: "
# What the loader's scripts and the agent begin their lines with.
_OWN_PREFIXES = ("vmready-agent-setup: ", "vmready-agent: ", "install.sh: ", "vmready-boothook: ")
_CLOUD_INIT = "Cloud-init v. "
# What cloud-init's final stage prints when it is over ("Cloud-init v. 22.4.2 finished at …").
_CLOUD_INIT_FINISHED = " finished at "
_HINT = (
    "use a cloud image with cloud-init (it reads the instance's NoCloud seed, whose vendor-data "
    "starts the agent), or install the vmready loader in the image (docs/real-guests.md)"
)


def _this_boot(console: bytes) -> str:
    """The console since the daemon's last boot mark (all of it when there is none)."""
    mark = console.rfind(_BOOT_MARK)
    if mark >= 0:
        end = console.find(b"\n", mark + len(_BOOT_MARK))
        console = console[end + 1 :] if end >= 0 else b""
    return console.decode("utf-8", "replace")


def _own_complaint(text: str) -> str | None:
    """The last line the loader or the agent wrote (systemd may prefix it with a time)."""
    found = None
    for line in text.splitlines():
        for prefix in _OWN_PREFIXES:
            at = line.find(prefix)
            if at >= 0:
                found = line[at:].strip()
    return found


def missing_agent_reason(console: bytes, seconds: float, heard: bool = False) -> str:
    """Why no agent spoke ``seconds`` into a boot whose console ends with ``console``.

    ``heard``: an agent spoke (it said STARTED) but had not connected by then.
    """
    text = _this_boot(console)
    if heard:
        said = f"the agent started but had not connected {seconds:g}s into the boot"
    else:
        said = f"no agent spoke {seconds:g}s into the boot"
    complaint = _own_complaint(text)
    if complaint is not None:
        return f"{said}; its last word on the console: {complaint}"
    if heard:
        return (
            f"{said}, and wrote no line of its own on the console: its log in the guest says "
            "why (docs/agent.md, troubleshooting)"
        )
    finished = any(
        _CLOUD_INIT in line and _CLOUD_INIT_FINISHED in line for line in text.splitlines()
    )
    if _CLOUD_INIT in text and not finished:
        return (
            f"{said}: cloud-init is still running in the guest and has not started it yet "
            "(a slow first boot: this clears when the agent connects; cloud-init's lines on the "
            "console say how far it got)"
        )
    if finished:
        return (
            f"{said}: cloud-init ran in the guest but did not start it (a user-data with "
            "vendor_data: {enabled: false} turns the agent off; cloud-init's lines on the "
            "console say more)"
        )
    if not text.strip():
        return (
            f"{said}, and the guest wrote nothing on its console: does it boot? (a kernel "
            "command line of your own needs console=ttyS0)"
        )
    return f"{said}: the image has neither cloud-init nor the vmready loader; {_HINT}"


def agent_absence(
    console_log: str, seconds: float = AGENT_EXPECTED_WITHIN, heard: bool = False
) -> str:
    """Why no agent spoke (``heard``: connected) ``seconds`` into the boot at ``console_log``."""
    return missing_agent_reason(read_console(console_log, CONSOLE_BYTES), seconds, heard)
