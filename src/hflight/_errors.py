"""Walking an exception's chain: what it was raised from (``__cause__``) or while handling (``__context__``)."""

from __future__ import annotations

from collections.abc import Iterator


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then the exception it was raised from or during, and so on (each once, even in a cycle)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
