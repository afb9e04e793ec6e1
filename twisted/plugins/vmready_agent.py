"""Registers ``twistd vmready-agent``."""

from twisted.application.service import ServiceMaker

vmready_agent = ServiceMaker(
    "vmready-agent", "vmready.agent.tap", "The in-guest vmready agent.", "vmready-agent"
)
