"""Counting a function's calls in a test (how often a warm path still runs its cold work)."""

from __future__ import annotations


def count_calls(monkeypatch, owner, name: str) -> list:
    """Wraps `owner.name` for the test; returns the list its calls' arguments are appended to."""
    calls: list = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
