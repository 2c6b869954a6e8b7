"""side_by_side without a GPU: arrays no stream can be forked for (NumPy, JAX and other
producers) and levels too small to overlap run the two pieces one after the other, in the
order asked, returning (main's, side's); such arrays get no preallocated outputs."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.side_stream import empty_like_in, side_by_side


@pytest.mark.parametrize("side_first", [False, True])
@pytest.mark.parametrize("together", [False, True])
def test_one_after_the_other_where_no_stream_can_fork(side_first, together):
    calls = []

    def main():
        calls.append("main")
        return 1

    def side():
        calls.append("side")
        return 2

    x = np.zeros(3)  # host memory: no framework stream to fork from
    assert side_by_side(x, main, side, side_first=side_first, together=together) == (1, 2)
    assert calls == (["side", "main"] if side_first else ["main", "side"])


def test_no_preallocated_outputs_for_arrays_that_allocate_their_own():
    assert empty_like_in(np.zeros(3), (2, 3), "float32") is None
    assert empty_like_in(object(), (2, 3), "float32") is None
