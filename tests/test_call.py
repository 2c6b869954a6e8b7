"""The call path without a GPU: a prepared launch is reused for a call with the signature it
was validated for, and only for such a call (PyTorch CPU tensors stand in for CUDA ones; the
stream and device queries are faked)."""

from __future__ import annotations

import importlib

import pytest

from rtcinfer.interop import ArrayInfo, Op, OutSlot, Prepared, call

from .fakes import fake_gpu

torch = pytest.importorskip("torch")
path = importlib.import_module("rtcinfer.interop.call")


@pytest.fixture
def recorded(monkeypatch):
    """An op x -> y (y like x) whose prepare and run are recorded."""
    log = {"prepared": [], "runs": []}

    def info(x, name):  # a CPU tensor as a CUDA one on device 0
        if x is None:
            return None
        strides, offset = tuple(x.stride()), x.data_ptr() & 15
        return path.ArrayInfo(tuple(x.shape), strides, str(x.dtype)[6:], 0, offset)

    fake_gpu(monkeypatch)
    real = path._torch()
    monkeypatch.setattr(path, "_torch_info", info)
    monkeypatch.setattr(path, "_torch", lambda: (real[0], real[1], lambda d: 7, real[3]))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)

    def prepare(infos, align, static):
        log["prepared"].append((tuple(infos), align, static))
        x = infos[0]
        return Prepared((OutSlot(x.shape, x.dtype),),
                        lambda stream, device, ptrs, scalars: log["runs"].append(
                            (stream, ptrs, scalars)))  # fmt: skip

    return Op("toy", ("x", "w"), prepare), log


def test_a_seen_signature_reuses_its_launch(recorded):
    op, log = recorded
    x, w = torch.zeros(4, 8), torch.zeros(8)
    for scale in (1.0, 2.0, 3.0):
        y = call(op, (x, w), ("static",), (scale,))
    assert len(log["prepared"]) == 1 and len(log["runs"]) == 3
    stream, ptrs, scalars = log["runs"][-1]
    assert stream == 7 and scalars == (3.0,)
    assert ptrs == [x.data_ptr(), w.data_ptr(), y.data_ptr()]
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()


@pytest.mark.parametrize(
    "change",
    [
        lambda x, w: (x.t().contiguous().t(), w),  # strides
        lambda x, w: (x.double(), w),  # dtype
        lambda x, w: (x[:3], w),  # shape
        lambda x, w: (torch.zeros(33)[1:].view(4, 8), w),  # address alignment (4 bytes off)
        lambda x, w: (x, torch.zeros(9)[1:]),  # another argument's alignment
        lambda x, w: (x, w[:4]),  # another argument's shape
    ],
    ids=["strides", "dtype", "shape", "alignment", "other alignment", "other shape"],
)
def test_what_changes_the_launch_prepares_again(recorded, change):
    op, log = recorded
    x, w = torch.zeros(4, 8), torch.zeros(8)
    call(op, (x, w), ("static",))
    call(op, change(x, w), ("static",))
    assert len(log["prepared"]) == 2
    first, second = log["prepared"]
    assert first[0] != second[0]  # the second call was validated on what it passed


def test_static_arguments_are_part_of_the_key(recorded):
    op, log = recorded
    x, w = torch.zeros(4, 8), torch.zeros(8)
    call(op, (x, w), ("a",))
    call(op, (x, w), ("b",))
    call(op, (x, w), ("a",))
    assert [p[2] for p in log["prepared"]] == [("a",), ("b",)]


def test_an_absent_slot_differs_from_a_present_one(recorded):
    op, log = recorded
    x, w = torch.zeros(4, 8), torch.zeros(8)
    call(op, (x, w))
    call(op, (x, None))
    assert len(log["prepared"]) == 2
    assert log["runs"][-1][1][1] == 0  # an absent slot's pointer


def test_a_norm_over_misaligned_rows_keeps_the_contiguous_arithmetic():
    """Only the access width follows a view's alignment and strides: threads and the vector
    each thread sums stay those of contiguous rows, so the bits are the same."""
    from rtcinfer import norm

    hidden = 4096
    x = ArrayInfo((3, hidden), (4097, 1), "bfloat16", 0)
    w = ArrayInfo((hidden,), (1,), "bfloat16", 0)
    dense = ArrayInfo((3, hidden), (hidden, 1), "bfloat16", 0)
    narrow = norm._FUSED.prepare([x, x, w], 2, ("fused_add_rmsnorm",))
    wide = norm._FUSED.prepare([dense, dense, w], 16, ("fused_add_rmsnorm",))
    narrow_spec, wide_spec = (p.preload.__self__.kernel.spec for p in (narrow, wide))
    assert (narrow_spec.vec, narrow_spec.threads) == (wide_spec.vec, wide_spec.threads) == (8, 128)
    assert (narrow_spec.load_vec, wide_spec.load_vec) == (1, 0)


def test_the_device_of_a_stream_is_asked_of_the_driver_once(monkeypatch):
    """What a JAX handler launches on: the device of XLA's stream, asked of the driver once
    per stream handle (its context's device); the default streams answer with the current
    context's device."""
    from rtcinfer import launch

    asked = []

    class Driver:
        @staticmethod
        def cuStreamGetCtx(stream):
            asked.append(("ctx", stream))
            return 0, f"ctx-of-{stream}"

        @staticmethod
        def cuCtxPushCurrent(ctx):
            asked.append(("push", ctx))
            Driver.current = ctx
            return (0,)

        @staticmethod
        def cuCtxPopCurrent():
            asked.append(("pop",))
            Driver.current = "ctx-main"
            return 0, None

        @staticmethod
        def cuCtxGetDevice():
            return 0, {"ctx-of-160": 1, "ctx-of-176": 2, "ctx-main": 0}[Driver.current]

    Driver.current = "ctx-main"
    monkeypatch.setattr(launch, "driver", lambda: Driver)
    monkeypatch.setattr(launch, "_STREAM_DEVICES", {})
    assert launch.stream_device(0xA0) == 1 and launch.stream_device(0xB0) == 2
    assert launch.stream_device(0xA0) == 1  # cached: one query per stream
    assert asked.count(("ctx", 0xA0)) == 1 and Driver.current == "ctx-main"
    assert launch.stream_device(0) == 0  # the legacy default stream: the current context's


def test_a_stream_the_driver_cannot_place_goes_to_the_current_device(monkeypatch):
    from rtcinfer import launch

    class Driver:
        @staticmethod
        def cuStreamGetCtx(stream):
            return 201, None  # CUDA_ERROR_INVALID_CONTEXT

        @staticmethod
        def cuCtxGetDevice():
            return 0, 3

    monkeypatch.setattr(launch, "driver", lambda: Driver)
    monkeypatch.setattr(launch, "_STREAM_DEVICES", {})
    assert launch.stream_device(0xC0) == 3


def test_a_call_returns_its_outputs_but_the_scratch():
    """Per-call scratch outputs (Prepared.scratch, the last ones) are not returned; the rest
    come back bare when one is left, else as a tuple."""
    from rtcinfer.interop.call import returned

    assert returned(["o"], 0) == "o"
    assert returned(["o", "lse"], 0) == ("o", "lse")
    assert returned(["o", "partial o", "partial lse", "counters"], 3) == "o"
    assert returned(["o", "lse", "partial o", "partial lse", "counters"], 3) == ("o", "lse")


def test_an_in_place_update_lands_in_the_output_buffer_xla_gave():
    """JAX: an output aliasing input slot i may come with a buffer of its own; the input is
    copied there (stream-ordered) and the slot pointed at it, so the kernel's in-place update
    fills the output and leaves the caller's input alone. Where XLA aliased them, no copy."""
    from rtcinfer.interop.call_jax import move_in_place_updates

    copies = []
    in_place = [(0, 1, 64), (1, 3, 32)]  # output 0 updates slot 1, output 1 slot 3
    ptrs = [100, 200, 300, 400]
    move_in_place_updates(in_place, ptrs, [200, 900], 7, lambda *a: copies.append(a))
    assert copies == [(900, 400, 32, 7)]
    assert ptrs == [100, 200, 300, 900]
    ptrs = [100, 200, 300, 400]
    move_in_place_updates(in_place, ptrs, [200, 400], 7, lambda *a: copies.append(a))
    assert ptrs == [100, 200, 300, 400] and len(copies) == 1


def test_a_misaligned_buffer_from_xla_is_named():
    from rtcinfer.interop.call_jax import _misaligned

    op = Op("append", ("key", "value", "indptr"), lambda *a: None)
    message = _misaligned(op, [0x1000, 0x2000, 0x3004], [0x4000, 0x5008])
    assert message.startswith("append: XLA passed indptr, output 1 at an address not aligned")
    assert "multiples of 16 bytes" in message


def _two_device_op(monkeypatch, devices: dict):
    """An op x, w -> y over CPU tensors that stand in for CUDA ones on the device `devices`
    gives each (by id), device 0 current; returns the op, its runs and the device switches."""
    fake = fake_gpu(monkeypatch, devices=2)
    switches, runs = [], []
    fake.current = 0
    monkeypatch.setattr(fake, "getDevice", lambda: fake.current, raising=False)

    def set_device(d):
        switches.append(d)
        fake.current = d

    monkeypatch.setattr(fake, "setDevice", set_device, raising=False)

    def info(x, name):
        if x is None:
            return None
        return path.ArrayInfo(tuple(x.shape), tuple(x.stride()), str(x.dtype)[6:], devices[id(x)])

    real = path._torch()
    monkeypatch.setattr(path, "_torch_info", info)
    monkeypatch.setattr(path, "_torch", lambda: (real[0], real[1], lambda d: 100 + d, real[3]))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: devices[id(self)])

    def prepare(infos, align, static):
        return Prepared((OutSlot(infos[0].shape, infos[0].dtype, source=0, alias=True),),
                        lambda stream, device, ptrs, scalars: runs.append(
                            (stream, device, fake.current)))  # fmt: skip

    return Op("toy2", ("x", "w"), prepare), runs, switches


def test_a_call_on_another_device_launches_there_and_restores_the_current(monkeypatch):
    x, w = torch.zeros(4, 8), torch.zeros(8)
    op, runs, switches = _two_device_op(monkeypatch, {id(x): 1, id(w): 1})
    call(op, (x, w))
    assert runs == [(101, 1, 1)]  # device 1's stream, device 1 current during the launch
    assert switches == [1, 0]  # and device 0 current again after it


def test_arrays_on_two_devices_in_one_call_are_refused(monkeypatch):
    x, w = torch.zeros(4, 8), torch.zeros(8)
    op, runs, _ = _two_device_op(monkeypatch, {id(x): 0, id(w): 1})
    with pytest.raises(ValueError, match="arrays are on different devices: {'x': 0, 'w': 1}"):
        call(op, (x, w))
    assert runs == []


def test_with_one_gpu_a_call_does_not_ask_for_the_current_device(monkeypatch):
    """A process that sees one GPU launches there without asking which device is current (a
    thread without a context is handled by the launch's retry, rtcinfer/launch.py)."""
    x, w = torch.zeros(4, 8), torch.zeros(8)
    op, runs, _ = _two_device_op(monkeypatch, {id(x): 0, id(w): 0})
    fake = path.gpu.runtime()
    fake.devices = 1
    asked = []
    monkeypatch.setattr(fake, "getDevice", lambda: asked.append(1) or 0, raising=False)
    call(op, (x, w))
    call(op, (x, w))
    assert runs == [(100, 0, 0), (100, 0, 0)] and asked == []
    assert all(prep.one_device for prep in op.cache.values())
