"""QEMU.

Its command line (``cmdline``), the process driver (``driver``), boot sources
and overlays (``bootsource``), config drives (``configdrive``) and the agent
zipapp on them (``agentbundle``), accelerators (``accel``), console logs
(``console``), snapshots on disk (``snapshots``) and the demo guest
(``guestimage``).
"""
