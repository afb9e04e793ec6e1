"""Twisted's global reactor for the tests, typed as vmready asks for it."""

from vmready.domain.reactor import default_reactor

reactor = default_reactor()
