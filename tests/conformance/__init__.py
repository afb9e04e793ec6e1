"""Conformance: the same checks against fakeqemu and real qemu-system-x86_64."""
