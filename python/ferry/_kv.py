"""The kv layer's awaitable: LoadTracker.when_layer."""

from . import _ferry
from ._aio import when_all


def _when_layer(self, layer, timeout=None):
    """``await tracker.when_layer(layer, timeout)``: when_all over exactly this layer's transfers
    of the step, across every request (taken when called)."""
    return when_all(self.layer_transfers(layer), timeout)


_ferry.kv.LoadTracker.when_layer = _when_layer
