"""The sync fence holds under load: every /infer response carries the ver whose weights produced it.

Weight versions are the tiny model with version-specific perturbations whose greedy output differs
between versions; the expected tokens of every version are computed in this process with the same
generator code, so a response tagged ``ver`` must equal ``expected[weights pushed as ver]``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from common.wire.http import InferItem, InferResponse, SamplingParams
from common.weight_sync import weights as W
from learner.weight_sync.session import SyncError
from learner.weight_sync.base import cast_stream, plan
from learner.weight_sync.http import HttpWeightSender
from tests.server_proc import REPO, rollout_server_process

pytestmark = pytest.mark.slow

IDLE_TIMEOUT_S = 1.5
ITEMS = [InferItem(id="chat", messages=[{"role": "user", "content": "Detect all objects."}]),
         InferItem(id="ids", prompt_token_ids=[5, 6, 7, 8, 9])]
SAMPLING = SamplingParams(temperature=0, max_tokens=6)
BODY = {"items": [i.model_dump(exclude_none=True) for i in ITEMS], "sampling": SAMPLING.model_dump()}
BUCKET_BYTES = 256 << 10  # small buckets: a sync is many calls, so the fence is held for a while


def version_weights(base: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Version k: the base weights with a k-seeded perturbation (k = 0 is the checkpoint itself)."""
    if k == 0:
        return {n: t.clone() for n, t in base.items()}
    g = torch.Generator().manual_seed(k)
    out = {}
    for name, t in base.items():
        t = t.clone()
        if "language_model.layers" in name and t.dim() == 2:
            t += 0.05 * torch.randn(t.shape, generator=g)
        if name.endswith("language_model.norm.weight"):
            t = 4.0 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1000 + k))
        out[name] = t
    return out


@dataclass
class Versions:
    """Weights per version index, the greedy tokens each produces, and which index each server ver holds."""

    weights: list[dict[str, torch.Tensor]]
    expected: list[list[list[int]]]
    index_of_ver: dict[int, int] = field(default_factory=lambda: {0: 0})


@pytest.fixture(scope="module")
def versions(tiny_model_dir) -> Versions:
    from transformers import AutoModelForImageTextToText

    from common.generation.generator import HFGenerator
    from common.data.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = HFGenerator(model, load_processor(str(tiny_model_dir)), max_batch=8)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights, expected = [], []
    for k in range(7):
        w = version_weights(base, k)
        model.load_state_dict(w, strict=False)
        outs = gen.generate([i.messages or i.prompt_token_ids for i in ITEMS], [None, None], SAMPLING)
        weights.append(w)
        expected.append([o.token_ids for o in outs])
    assert len({str(e) for e in expected}) == len(expected), "versions must be told apart by their greedy output"
    return Versions(weights, expected)


@pytest.fixture(scope="module")
def server(tiny_model_dir, request):
    overrides = [f"rollout_server.sync_idle_timeout_s={IDLE_TIMEOUT_S}", "rollout_server.hf_max_batch=4"]
    # The expected outputs are computed while the server loads.
    with rollout_server_process(tiny_model_dir, overrides, while_loading=lambda: request.getfixturevalue("versions")) as srv:
        yield srv


class Hammer:
    """Client threads sending /infer back to back; every result is kept, every failure too."""

    def __init__(self, url: str, n_threads: int = 3) -> None:
        self.url, self.stop_flag = url, threading.Event()
        self.results: list[tuple[int, list[list[int]], float]] = []  # (ver, tokens per item, seconds)
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n_threads)]

    def _run(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as c:
            while not self.stop_flag.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post(self.url + "/infer", json=BODY)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code}: {r.text}")
                    continue
                resp = InferResponse.model_validate_json(r.content)
                self.results.append((resp.ver, [o.token_ids for o in resp.outputs], time.monotonic() - t0))

    def __enter__(self) -> Hammer:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a client thread is stuck in /infer"

    def wait_for(self, n: int, deadline_s: float = 30.0) -> None:
        end, target = time.monotonic() + deadline_s, len(self.results) + n
        while len(self.results) < target:
            assert time.monotonic() < end, f"only {len(self.results)} /infer results after {deadline_s}s: {self.failures}"
            time.sleep(0.02)


def current_ver(server) -> int:
    return httpx.get(server.url + "/health", timeout=10).json()["ver"]


def assert_every_response_matches_its_ver(results, versions: Versions) -> None:
    assert results, "no /infer completed"
    for ver, tokens, _ in results:
        assert ver in versions.index_of_ver, f"a response tagged ver {ver}, which no committed sync produced"
        assert tokens == versions.expected[versions.index_of_ver[ver]], (
            f"response tagged ver {ver} has the greedy output of another version")


@pytest.mark.parametrize("fence", ["drain", "abort"])
def test_under_load_every_response_carries_the_ver_whose_weights_produced_it(server, versions, fence):
    client = HttpWeightSender(server.url, timeout_s=60)
    ver0 = current_ver(server)
    reports = []
    with Hammer(server.url) as hammer:
        hammer.wait_for(3)
        for _ in range(2):
            k = len(versions.index_of_ver)  # the next unused weights
            report = client.push(versions.weights[k].items(), bucket_bytes=BUCKET_BYTES, fence=fence)
            versions.index_of_ver[report.ver] = k
            reports.append(report)
            hammer.wait_for(3)
    assert not hammer.failures, hammer.failures[:3]
    assert [r.ver for r in reports] == [ver0 + 1, ver0 + 2]  # exactly one per committed sync
    assert current_ver(server) == ver0 + 2
    assert all(r.n_buckets > 1 for r in reports)
    assert_every_response_matches_its_ver(hammer.results, versions)
    seen = {ver for ver, _, _ in hammer.results}
    assert {ver0, ver0 + 1, ver0 + 2} <= seen, f"load did not span the syncs: saw vers {sorted(seen)}"
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    if fence == "abort":
        assert sum(r.aborted for r in reports) >= 1, "no in-flight request was cut: the abort fence was not exercised"
        reruns = float(next(line for line in metrics.splitlines() if line.startswith("rollout_fence_reruns ")).split()[1])
        assert reruns >= 1
    else:
        assert sum(r.drained for r in reports) >= 1


KILLED_CLIENT = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    from common.weight_sync import weights as W
    from learner.weight_sync.base import cast_stream, plan
    from learner.weight_sync.http import HttpWeightSender
    url, path = sys.argv[1], sys.argv[2]
    client = HttpWeightSender(url, timeout_s=60)
    session = client.open(bucket_bytes=1 << 18)
    planned = plan(session.info, load_file(path).items())
    session.begin("drain")
    first = next(W.iter_buckets(cast_stream(session.info, planned), 1 << 18))
    session.send_bucket(first)
    print("SENT", flush=True)
    import time; time.sleep(120)
""")


def test_a_sync_client_killed_after_the_first_bucket_leaves_old_weights_and_ver(server, versions, tmp_path):
    from safetensors.torch import save_file

    ver = current_ver(server)
    path = tmp_path / "w.safetensors"
    save_file({n: t.contiguous() for n, t in versions.weights[-1].items()}, str(path))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url, str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with Hammer(server.url, n_threads=2) as hammer:
            hammer.wait_for(2)
            line = proc.stdout.readline()  # the child prints once its first bucket is staged
            assert line.strip() == "SENT", proc.stderr.read() if proc.poll() is not None else line
            killed_at = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            hammer.wait_for(4, deadline_s=IDLE_TIMEOUT_S + 30)  # waiting calls resume after the idle timeout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert not hammer.failures, hammer.failures[:3]
    assert current_ver(server) == ver
    assert_every_response_matches_its_ver(hammer.results, versions)
    assert {v for v, _, _ in hammer.results} == {ver}
    assert max(s for _, _, s in hammer.results) >= 0.5 * IDLE_TIMEOUT_S  # calls waited at the fence, not failed
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'rollout_syncs_total{outcome="timeout"} 1.0' in metrics
    assert time.monotonic() - killed_at < IDLE_TIMEOUT_S + 30


def test_an_explicit_abort_mid_sync_keeps_old_weights_and_ver_and_serving_resumes(server, versions):
    ver = current_ver(server)
    client = HttpWeightSender(server.url, timeout_s=60)
    with Hammer(server.url, n_threads=2) as hammer:
        hammer.wait_for(2)
        session = client.open(bucket_bytes=BUCKET_BYTES)
        planned = plan(session.info, versions.weights[-1].items())
        begun = session.begin("abort")
        assert begun.ver_before == ver
        session.send_bucket(dict(planned[:2]))
        aborted = session.abort("test: explicit abort")
        assert aborted.aborted and aborted.ver == ver
        hammer.wait_for(3)
    assert not hammer.failures, hammer.failures[:3]
    assert current_ver(server) == ver
    assert_every_response_matches_its_ver(hammer.results, versions)


def test_a_commit_of_an_incomplete_upload_fails_and_keeps_old_weights_and_ver(server, versions):
    ver = current_ver(server)
    client = HttpWeightSender(server.url, timeout_s=60)
    session = client.open(bucket_bytes=BUCKET_BYTES)
    planned = plan(session.info, versions.weights[-1].items())
    session.begin("drain")
    session.send_bucket(dict(planned[:3]))
    with pytest.raises(SyncError) as info:
        session.commit()
    assert info.value.status == 400 and "not sent" in str(info.value) and "old weights kept" in str(info.value)
    with Hammer(server.url, n_threads=1) as hammer:
        hammer.wait_for(2)
    assert current_ver(server) == ver and not hammer.failures
    assert_every_response_matches_its_ver(hammer.results, versions)


def test_a_commit_whose_fingerprint_differs_from_the_staged_weights_is_refused_before_the_swap(server, versions):
    ver = current_ver(server)
    client = HttpWeightSender(server.url, timeout_s=60)
    session = client.open(bucket_bytes=BUCKET_BYTES)
    planned = plan(session.info, versions.weights[-1].items())
    session.begin("drain")
    for bucket in W.iter_buckets(cast_stream(session.info, planned), BUCKET_BYTES):
        session.send_bucket(bucket)
    with pytest.raises(SyncError, match="fingerprint") as info:
        session.commit(fingerprint="0" * 16)
    assert info.value.status == 400
    r = httpx.post(server.url + "/infer", json=BODY, timeout=30)
    resp = InferResponse.model_validate_json(r.content)
    assert resp.ver == ver == current_ver(server)
    assert [o.token_ids for o in resp.outputs] == versions.expected[versions.index_of_ver[ver]]


def test_a_transport_failing_mid_send_gets_the_session_aborted_by_the_one_push_protocol(server, versions):
    """``PushSender.push`` owns the abort: any transport's failure after the fence closed reopens it at
    once (no idle timeout), the old weights and ver stay, and the transport's ``_failed`` hook runs."""
    from learner.weight_sync.base import PushSender

    class CutLink(PushSender):
        transport = "cut"
        failed: list[BaseException] = []

        def _send(self, session, planned, prepared, bucket_bytes, deadline):
            session.send_bucket(dict(cast_stream(session.info, planned[:2])))
            raise ConnectionResetError("link cut after the first bucket")

        def _failed(self, exc):
            self.failed.append(exc)

    ver = current_ver(server)
    with CutLink(server.url, timeout_s=60) as sender, pytest.raises(ConnectionResetError):
        sender.push(versions.weights[-1].items(), bucket_bytes=BUCKET_BYTES)
    assert [type(e) for e in CutLink.failed] == [ConnectionResetError]
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["ver"] == ver, health  # reopened by the abort, not a timeout
    r = httpx.post(server.url + "/infer", json=BODY, timeout=30)
    resp = InferResponse.model_validate_json(r.content)
    assert resp.ver == ver and [o.token_ids for o in resp.outputs] == versions.expected[versions.index_of_ver[ver]]


def test_a_stalled_bucket_upload_ends_its_session_at_the_idle_timeout_and_the_fence_reopens(server, versions):
    """10 bytes of a 1000-byte bucket, then silence: the read gives up after sync_idle_timeout_s (a 408),
    the session is aborted with the old weights and ver, /health is ok again and /infer is served."""
    from common.weight_sync.messages import BUCKET_HEADER, SyncBucketHeader
    from tests.test_server_bad_input import metric, raw_http

    ver = current_ver(server)
    session = HttpWeightSender(server.url, timeout_s=60).open()
    session.begin("drain")
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "syncing"
    header = SyncBucketHeader(session=session.id, index=0, names=["x"], dtypes=["uint8"], shapes=[[1000]],
                              offsets=[(0, 1000)]).model_dump_json()
    status, body = raw_http(server.port, f"POST /sync/bucket HTTP/1.1\r\nHost: x\r\n{BUCKET_HEADER}: {header}\r\n"
                            "Content-Length: 1000", [b"\0" * 10], timeout_s=IDLE_TIMEOUT_S + 30)
    assert status == 408 and body["error"] == "request_timeout" and "old weights kept" in body["message"], body
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert (health["status"], health["sync_state"], health["ver"]) == ("ok", "idle", ver), health
    r = httpx.post(server.url + "/infer", json=BODY, timeout=30)
    resp = InferResponse.model_validate_json(r.content)
    assert resp.ver == ver and [o.token_ids for o in resp.outputs] == versions.expected[versions.index_of_ver[ver]]
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert metric(http, 'rollout_syncs_total{outcome="stalled"}') == 1
