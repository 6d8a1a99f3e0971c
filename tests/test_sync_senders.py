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
