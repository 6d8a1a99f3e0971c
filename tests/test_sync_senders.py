"""``learner.weight_sync.transport.make_sender``: which transport a server gets, and the one interface every sender keeps."""

from __future__ import annotations

import inspect

import pytest
import torch

from learner.weight_sync.base import PushSender, WeightSender

from learner.weight_sync.transport import make_sender
from learner.weight_sync.http import HttpWeightSender
from learner.weight_sync.ipc import IpcWeightSender
from learner.weight_sync.nccl import NcclWeightSender

URL = "http://127.0.0.1:9"  # discard port: nothing may be contacted to build a sender


@pytest.mark.parametrize("transport, cls", [("http", HttpWeightSender), ("nccl", NcclWeightSender),
                                             ("ipc", IpcWeightSender)])
def test_an_explicit_transport_builds_its_sender_without_contacting_the_server(transport, cls):
    sender = make_sender(URL, transport, timeout_s=1.0, client_id="t")
    try:
        assert type(sender) is cls and sender.transport == transport and sender.base_url == URL
        assert isinstance(sender, PushSender)
    finally:
        sender.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto probes the server's engine when CUDA is present")
def test_auto_without_cuda_is_http_and_asks_the_server_nothing():
    sender = make_sender(URL, "auto", timeout_s=1.0)
    try:
        assert isinstance(sender, HttpWeightSender)
    finally:
        sender.close()


def test_an_unknown_transport_is_refused_naming_the_config_key():
    with pytest.raises(ValueError, match="weight_sync.transport"):
        make_sender(URL, "carrier-pigeon")


def test_every_transport_keeps_the_sender_interface_and_implements_send():
    for cls in (HttpWeightSender, NcclWeightSender, IpcWeightSender):
        assert not inspect.isabstract(cls), cls
        for name in ("push", "close"):
            assert callable(getattr(cls, name)), (cls, name)
        assert set(inspect.signature(WeightSender.push).parameters) <= set(inspect.signature(cls.push).parameters)


def test_a_fence_that_drained_rerun_batches_for_long_names_the_knobs_that_fix_it(caplog):
    """At 7b a fence drained re-runs for 48.5 s while no rollout was admitted: the learner's log says why and what
    to change, as a warning the first time and info after; a quick or cut-free fence says nothing."""
    import logging

    from learner.weight_sync.base import SLOW_DRAIN_S, SyncReport

    def report(fence_s: float, spared: int) -> SyncReport:
        return SyncReport(ver=2, fence_s=fence_s, wire_s=1.0, commit_s=0.1, total_s=fence_s + 1.1, bytes=1, n_buckets=1,
                          fingerprint="f", drained=spared, spared=spared)

    sender = make_sender(URL, "http", timeout_s=1.0, client_id="t")
    try:
        with caplog.at_level(logging.INFO, logger="learner.weight_sync.base"):
            sender._note_slow_drain(report(SLOW_DRAIN_S + 40, spared=0))  # drained work of the current ver: no cut
            sender._note_slow_drain(report(SLOW_DRAIN_S / 2, spared=3))
            assert not caplog.records
            sender._note_slow_drain(report(48.5, spared=8))
            sender._note_slow_drain(report(30.0, spared=2))
    finally:
        sender.close()
    first, second = caplog.records
    assert first.levelno == logging.WARNING and second.levelno == logging.INFO
    for needed in ("48.5s", "8 re-run", "weight_sync.every_steps", "max_new_tokens", "MAX_CUTS"):
        assert needed in first.getMessage(), needed
