"""Stand-ins for device objects, so the launch code can be driven on a machine without a GPU."""

from __future__ import annotations

import math
import types


class FakeArray:
    """Shape, byte strides, item size and address: what the launch code reads of an array."""

    def __init__(self, shape, itemsize, strides=None, ptr=1 << 20):
        self.shape, self.itemsize, self.size = shape, itemsize, math.prod(shape)
        if strides is None:
            strides, step = [], itemsize
            for n in reversed(shape):
                strides.insert(0, step)
                step *= n
        self.strides = tuple(strides)
        self.data = types.SimpleNamespace(ptr=ptr)
        dense, step = True, itemsize
        for n, stride in zip(reversed(shape), reversed(self.strides), strict=True):
            dense = dense and (n == 1 or stride == step)
            step *= n
        self.flags = types.SimpleNamespace(c_contiguous=dense)


class FakeStream:
    """A stream pointer, whether it is being captured, and the event waits it was asked for
    (appended to `log` as ("wait", ptr, the event's `on`))."""

    def __init__(self, ptr, capturing=False, log=None):
        self.ptr, self.capturing, self.log = ptr, capturing, log

    def is_capturing(self):
        return self.capturing

    def wait_event(self, event):
        self.log.append(("wait", self.ptr, event.on))
