"""Tests of vmready.protocols."""
