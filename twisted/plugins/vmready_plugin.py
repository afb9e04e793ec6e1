"""Registers ``twistd vmready``."""

from twisted.application.service import ServiceMaker

vmready = ServiceMaker("vmready", "vmready.daemon.tap", "The vmready host daemon.", "vmready")
