"""Plumbing shared by the tests: waiting for a condition (or a ZMQ subscriber) instead of sleeping."""

from tests.support.eventually import eventually, eventually_async
from tests.support.joined import joined

__all__ = ["eventually", "eventually_async", "joined"]
