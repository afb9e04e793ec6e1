"""Tests of vmready.trust."""
