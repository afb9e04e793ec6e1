"""Tests of vmready.domain."""
