"""QEMU.

Its command line (``cmdline``); the process driver (``driver``) and the
``RunningVM`` it hands out (``runningvm``: ``following``, ``commands``,
``stopping``), with VM events (``vmevents``), QEMU's error lines
(``qemulog``) and VM processes (``vmprocess``); boot sources (``bootsource``),
their file checks (``bootfiles``) and qemu-img (``imagetool``); config drives
(``configdrive``) and the agent zipapp on them (``agentbundle``), accelerators
(``accel``), console logs (``console``), snapshots on disk (``snapshots``) and
the demo guest (the ``guestimage`` package).
"""
