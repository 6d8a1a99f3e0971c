"""``learner.device_time.DeviceSpans``: the forward/backward spans timed on the device (``time/forward_backward_gpu``).

* CPU (always): on a CPU device nothing is recorded and the time is 0; on a "cuda" device with torch's event
  class replaced by a fake, spans sum their elapsed times (ms → s), the host synchronizes once per step (on
  the last stop, never in ``start``/``stop``), and each step starts from nothing.
* GPU (``-m gpu``): real CUDA events around a forward and backward whose kernels outlast their launch: the
  device time exceeds the launching host's wall time, and reading it after a host wait costs no wait.
"""

from __future__ import annotations

import time

import pytest
import torch

from learner import device_time
from learner.device_time import DeviceSpans


def test_on_a_cpu_device_nothing_is_recorded_and_the_time_is_zero(monkeypatch):
    def no_events(*_a, **_k):
        raise AssertionError("a CPU learner created a CUDA event")

    monkeypatch.setattr(device_time.torch.cuda, "Event", no_events)
    spans = DeviceSpans(torch.device("cpu"))
    for _ in range(3):
        spans.start()
        spans.stop()
    assert not spans.enabled and spans.seconds() == 0.0


class _FakeEvent:
    """Stands for ``torch.cuda.Event``: its record time is a counter; ``synchronize`` calls are logged."""

    clock = 0.0
    synced: list[float] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs timing events"
        self.at = None

    def record(self, stream=None) -> None:
        _FakeEvent.clock += 1.0
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        _FakeEvent.synced.append(self.at)

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.at - self.at) * 250.0  # ms: each span of one tick is 0.25 s


def test_spans_sum_in_seconds_with_one_synchronize_per_step_on_the_last_stop(monkeypatch):
    monkeypatch.setattr(device_time.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(device_time.torch.cuda, "current_stream", lambda device=None: None)
    _FakeEvent.clock, _FakeEvent.synced = 0.0, []
    spans = DeviceSpans(torch.device("cuda", 0))
    for _ in range(3):  # three micro-steps: start at 1, 3, 5; stop at 2, 4, 6
        spans.start()
        spans.stop()
    assert _FakeEvent.synced == [], "start/stop waited for the device (the hot path must not)"
    assert spans.seconds() == pytest.approx(0.75)
    assert _FakeEvent.synced == [6.0], "one synchronize, on the last stop event"
    assert spans.seconds() == 0.0 and _FakeEvent.synced == [6.0]  # the next step starts from nothing
    spans.start()
    spans.stop()
    assert spans.seconds() == pytest.approx(0.25)


def test_a_stop_without_a_start_records_no_span(monkeypatch):
    monkeypatch.setattr(device_time.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(device_time.torch.cuda, "current_stream", lambda device=None: None)
    spans = DeviceSpans(torch.device("cuda", 0))
    spans.stop()
    assert spans.seconds() == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine")
def test_on_a_gpu_the_device_time_covers_kernels_that_outlast_their_launch():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    layer = torch.nn.Linear(4096, 4096, device=dev)
    x = torch.randn(8192, 4096, device=dev)
    layer(x).sum().backward()  # warm-up: cuBLAS handles, allocator
    torch.cuda.synchronize(dev)
    spans = DeviceSpans(dev)
    t0 = time.monotonic()
    for _ in range(3):
        spans.start()
        for _ in range(4):
            layer(x).square().mean().backward()  # ~0.8 TFLOP each: far longer to run than to launch
        spans.stop()
    wall = time.monotonic() - t0
    norm = float(layer.weight.grad.norm())  # the step's host wait (clip_and_step reads the gradient norm)
    waited = time.monotonic()
    gpu = spans.seconds()
    read_s = time.monotonic() - waited
    assert norm > 0 and gpu > wall, (gpu, wall)  # the launches returned before the kernels ran
    assert read_s < 0.05, f"reading the events after the host wait took {read_s:.3f} s: it waited for the device"
