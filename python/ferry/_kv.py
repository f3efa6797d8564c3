"""The kv layer's awaitable: LoadTracker.when_layer."""

from . import _ferry
from ._aio import _when_all

_WHO = "ferry.kv.LoadTracker.when_layer"


def _when_layer(self, layer, timeout=None):
    """``await tracker.when_layer(layer, timeout)``: when_all over exactly this layer's transfers
    of the step, across every request (taken when called)."""
    return _when_all(self._layer_transfers(layer, _WHO), timeout, _WHO)


_ferry.kv.LoadTracker.when_layer = _when_layer
