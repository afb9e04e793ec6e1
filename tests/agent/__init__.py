"""Tests of the guest agent."""
