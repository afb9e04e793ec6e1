"""Certificates and mutual TLS: the daemon's and each instance's identities."""
