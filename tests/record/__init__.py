"""Tests of vmready.record."""
