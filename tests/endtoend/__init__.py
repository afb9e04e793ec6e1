"""Tests of whole systems: daemon, CLI, agents and VMs as processes, real guests."""
