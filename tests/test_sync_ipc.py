"""``transport: ipc`` on CPU: the server copies each bucket out of the learner's /dev/shm buffer.

The same route, session checks and sender as the CUDA IPC path of the one-GPU topology (there the
buffer is GPU memory; ``tests/test_gpu_vllm.py`` pushes that way to vLLM): a real hf server on
loopback, the tiny model, digests of every served weight.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest
import torch

from common.wire.http import ErrorResponse
from common.weight_sync.messages import SharedBuffer, SyncDigestResponse, SyncIpcRequest
from common.weight_sync import packed as P
from common.weight_sync import weights as W
from common.weight_sync.shared import SHM_DIR, SendBuffer
from learner.weight_sync.session import SyncError
from learner.weight_sync.transport import auto_transport, make_sender
from learner.weight_sync.base import cast_stream, plan
from learner.weight_sync.ipc import IpcWeightSender
from tests.server_proc import rollout_server_process

TOKEN = "ipc-test-token"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    from learner.weight_sync.served import named_weights

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base = {n: t.clone() for n, t in named_weights(model)}
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}"]) as srv:
        http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        yield SimpleNamespace(srv=srv, http=http, base=base)
        http.close()


def digest_of(served) -> SyncDigestResponse:
    r = served.http.get("/sync/digest")
    assert r.status_code == 200, r.text
    return SyncDigestResponse.model_validate_json(r.content)


def test_an_ipc_push_lands_every_weight_bit_exact_in_several_buckets_and_frees_its_buffer(served):
    before = digest_of(served)
    g = torch.Generator().manual_seed(3)
    perturbed = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in served.base.items()}
    sender = make_sender(served.srv.url, "ipc", auth_token=TOKEN, timeout_s=60, client_id="ipc-test")
    assert isinstance(sender, IpcWeightSender)
    try:
        report = sender.push(perturbed.items(), bucket_bytes=256 << 10)
        path = os.path.join(SHM_DIR, sender._buf.describe().path)
        assert os.path.exists(path)  # kept between pushes: the server opens the same file every time
        info = sender.control.open()
        expected = W.exact_digest(cast_stream(info.info, plan(info.info, perturbed.items())))
        info.abort("only the manifest was wanted")
    finally:
        sender.close()
    assert not os.path.exists(path)
    after = digest_of(served)
    assert report.n_buckets > 1 and report.ver == before.ver + 1 == after.ver
    assert after.digests == [expected] != before.digests
    sender = IpcWeightSender(served.srv.url, auth_token=TOKEN, timeout_s=60)
    try:
        sender.push(served.base.items(), bucket_bytes=1 << 30)  # back to the checkpoint, one bucket
    finally:
        sender.close()
    assert digest_of(served).digests == before.digests


def _begun(served, transport: str):
    sender = IpcWeightSender(served.srv.url, auth_token=TOKEN, timeout_s=30)
    session = sender.control.open(1 << 20, transport=transport)
    session.begin("drain")
    return sender, session


def _ipc_request(session, source: SharedBuffer) -> SyncIpcRequest:
    spec = session.info.manifest[0]
    layout = P.packed_layout([(spec.name, torch.zeros(spec.shape))], {spec.name: spec.dtype})
    return SyncIpcRequest(session=session.id, index=0, names=[spec.name], dtypes=[spec.dtype], shapes=[spec.shape],
                          offsets=[layout[0][3]], source=source)


def test_a_bucket_whose_buffer_is_not_on_this_host_ends_the_session_with_the_old_weights(served):
    before = digest_of(served)
    sender, session = _begun(served, "ipc")
    try:
        req = _ipc_request(session, SharedBuffer(kind="shm", path="tandem-sync-gone-0", size=1 << 20))
        r = served.http.post("/sync/ipc", content=req.model_dump_json(), headers={"Content-Type": "application/json"})
        err = ErrorResponse.model_validate_json(r.content)
        assert r.status_code == 400 and err.field == "source", r.text
        assert "one host" in err.message and "old weights kept" in err.message
        with pytest.raises(SyncError, match="409"):  # the session is gone
            session.commit()
    finally:
        sender.close()
    health = served.http.get("/health").json()
    assert (health["sync_state"], health["status"]) == ("idle", "ok")
    assert digest_of(served) == before


def test_ipc_buckets_are_refused_in_an_http_session_and_unsafe_sources_never_parse(served):
    sender, session = _begun(served, "http")
    buf = SendBuffer(1 << 20, "cpu")
    try:
        r = served.http.post("/sync/ipc", content=_ipc_request(session, buf.describe()).model_dump_json(),
                             headers={"Content-Type": "application/json"})
        assert r.status_code == 409 and "transport http" in r.json()["message"], r.text
    finally:
        session.abort("test done")
        sender.close()
        buf.close()
    for bad in ({"kind": "shm", "path": "../../etc/passwd", "size": 10},  # only tandem-sync-* under /dev/shm
                {"kind": "shm", "size": 10},  # no path
                {"kind": "cuda", "size": 10, "handle": "AAAA"}):  # no device, no ref counter
        with pytest.raises(ValueError):
            SharedBuffer.model_validate(bad)
    with pytest.raises(ValueError, match="shared buffer has"):  # a bucket past the buffer's end
        SyncIpcRequest(session="s", index=0, names=["w"], dtypes=["float32"], shapes=[[4]], offsets=[(0, 16)],
                       source=SharedBuffer(kind="shm", path="tandem-sync-x", size=8))


def test_auto_picks_ipc_only_when_the_server_serves_on_the_learners_gpu_alone():
    assert auto_transport("vllm", ["GPU-a"], "GPU-a") == "ipc"
    assert auto_transport("hf", ["GPU-a"], "GPU-a") == "ipc"
    assert auto_transport("vllm", ["GPU-b"], "GPU-a") == "nccl"
    assert auto_transport("vllm", ["GPU-a", "GPU-b"], "GPU-a") == "nccl"  # TP over two GPUs: not one device
    assert auto_transport("hf", [], "GPU-a") == "http"  # a CPU server
    assert auto_transport("vllm", [], None) == "nccl"


def test_an_ipc_bucket_naming_no_served_parameter_is_refused_naming_it_and_the_old_weights_stay(served):
    before = digest_of(served)
    sender, session = _begun(served, "ipc")
    buf = SendBuffer(64, "cpu")
    try:
        req = SyncIpcRequest(session=session.id, index=0, names=["model.not_a_layer.weight"], dtypes=["float32"],
                             shapes=[[4]], offsets=[(0, 16)], source=buf.describe())
        r = served.http.post("/sync/ipc", content=req.model_dump_json(), headers={"Content-Type": "application/json"})
        err = ErrorResponse.model_validate_json(r.content)
        assert r.status_code == 400 and err.field == "names.model.not_a_layer.weight", r.text
        assert "not a parameter of the served model" in err.message and "old weights kept" in err.message
    finally:
        sender.close()
        buf.close()
    assert served.http.get("/health").json()["sync_state"] == "idle"
    assert digest_of(served) == before
