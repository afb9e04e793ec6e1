"""Instances over time: actions and their operations, power sync, Ready, events."""
