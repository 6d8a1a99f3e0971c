"""A model-free :class:`rollout_server.engines.base.Engine` for in-process app tests (no weights, no
generation): tests subclass it to make one part fail or answer in a chosen way."""

from __future__ import annotations

from rollout_server.engines.base import Engine


class StubEngine(Engine):
    """Serves nothing: no tensors, empty outputs, commits that succeed; ``/sync/digest`` is a 501."""

    name = "stub"

    async def start(self): ...
    async def stop(self): ...
    async def generate(self, items, sampling): return []
    def encode_text(self, prompt): return [1]
    def manifest(self): return []
    def tied_groups(self): return []
    def serving_dtype(self): return "float32"
    async def stage_bucket(self, tensors): return 0
    async def commit(self, expected_fingerprint=None): return True
    async def discard(self): ...
    def fingerprint(self): return "0" * 16
