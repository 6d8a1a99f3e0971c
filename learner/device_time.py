"""Device time of the forward/backward spans of one optimizer step (``time/forward_backward_gpu``).

CUDA runs behind the host: the host wall time around a forward and a backward (``time/forward_backward``)
covers launching their kernels and whatever the host waited for in between, while the kernels can finish
later, at the host's next wait, inside some other timed part or none. Two timing events per span,
recorded on the device's current stream, measure the span where it runs::

    host:    start.record ─ forward launches ─ loss read (waits for the forward) ─ backward launches ─ stop.record
    stream:  [start] forward kernels ......................................... backward kernels [stop]
                      ▲ elapsed_time(start, stop): the span on the device, idle gaps included

Recording an event does not wait; reading ``elapsed_time`` needs both events complete, so :meth:`seconds`
is called once per step at a point where the host has already waited for the stream past the last stop
(the caller names that point). On a CPU device every call is a no-op and :meth:`seconds` is 0.

What this module does not know: what the spans hold, or where the step syncs.
"""

from __future__ import annotations

from typing import Any

import torch


class DeviceSpans:
    """Spans on ``device``'s current stream, summed and forgotten by :meth:`seconds` once per step."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.device = device
        self._spans: list[tuple[Any, Any]] = []
        self._open: Any = None

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        if self.enabled:
            self._open = self._event()

    def stop(self) -> None:
        if self.enabled and self._open is not None:
            self._spans.append((self._open, self._event()))
            self._open = None

    def seconds(self) -> float:
        """The device time of the spans since the last call, in seconds (0 on CPU or without spans).

        The one ``synchronize`` on the last stop returns at once where the caller promises the host already
        waited past it; it is there so ``elapsed_time`` never raises on an event still pending (it would
        wait rather than fail if the promise were broken). Every earlier stop precedes the last on the stream.
        """
        if not self._spans:
            return 0.0
        self._spans[-1][1].synchronize()
        total_ms = sum(start.elapsed_time(stop) for start, stop in self._spans)
        self._spans.clear()
        return total_ms / 1000.0
