"""The directory's awaitables: ``await directory.lookup(...)`` and the other pending values.

Each pending value has a ``made`` Transfer that ends when the value is made (or could not be);
awaiting it resumes on the awaiting loop's thread (ferry's asyncio glue, _aio.py), and the value is
then taken without blocking, raising FerryError (.error a ferry.directory.Errc) when it failed.
"""

from . import _ferry


def _await_pending(self):
    yield from self.made.__await__()
    return self.get(0)


for _name in ("PendingPublication", "PendingRecord", "PendingLookups", "PendingEvent"):
    getattr(_ferry.directory, _name).__await__ = _await_pending
