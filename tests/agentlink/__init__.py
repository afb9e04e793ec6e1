"""Tests of vmready.agentlink."""
