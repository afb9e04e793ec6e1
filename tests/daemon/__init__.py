"""Tests of vmready.daemon."""
