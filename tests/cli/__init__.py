"""Tests of vmready.cli."""
