"""Plumbing shared by the tests: waiting for a condition instead of sleeping."""

from tests.support.eventually import eventually, eventually_async

__all__ = ["eventually", "eventually_async"]
