"""Tests of vmready.hypervisor."""
