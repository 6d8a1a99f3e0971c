"""The wire contract: HTTP models, the ZMQ pack message and the credits message."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from common.wire import codec as W
from common.wire import http as P
from common.weight_sync import messages as S
from common.packing.segment import Pack
from tests.factories import make_segment

# Every HTTP message model: the rollout server's own (common/wire/http.py) and the /sync/* ones (common/weight_sync/messages.py).
HTTP_MODELS = sorted(
    (
        obj
        for module in (P, S)
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and name[0] != "_"
        and obj.__module__ == module.__name__
    ),
    key=lambda m: m.__name__,
)


def test_the_model_list_covers_both_halves_of_the_http_contract():
    names = {m.__name__ for m in HTTP_MODELS}
    assert {"InferRequest", "HealthResponse", "ErrorResponse"} <= names
    assert {"SyncInitRequest", "SyncBucketHeader", "SyncCommitResponse", "SyncDigestResponse", "TensorSpec"} <= names


def example(model: type[BaseModel]) -> dict:
    """The JSON after ``Example:`` in the model's docstring."""
    return json.loads(model.__doc__.split("Example:", 1)[1])


# ---------------------------------------------------------------------------------------------
# HTTP models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", HTTP_MODELS, ids=lambda m: m.__name__)
def test_every_http_model_round_trips_its_docstring_example(model):
    parsed = model.model_validate(example(model))
    again = model.model_validate_json(parsed.model_dump_json())
    assert again == parsed
    assert json.loads(again.model_dump_json()) == json.loads(parsed.model_dump_json())


@pytest.mark.parametrize("model", HTTP_MODELS, ids=lambda m: m.__name__)
def test_every_http_model_forbids_unknown_fields_and_documents_each_field(model):
    assert model.model_config["extra"] == "forbid"
    undocumented = [name for name, f in model.model_fields.items() if not f.description]
    assert not undocumented, f"{model.__name__} fields without a docstring: {undocumented}"
    with pytest.raises(ValidationError, match="bogus"):
        model.model_validate({**example(model), "bogus": 1})


def test_infer_item_with_both_messages_and_prompt_token_ids_is_rejected():
    with pytest.raises(ValidationError, match="exactly one of 'messages' or 'prompt_token_ids'"):
        P.InferItem(messages=[{"role": "user", "content": "hi"}], prompt_token_ids=[1, 2])


def test_infer_item_with_neither_messages_nor_prompt_token_ids_is_rejected():
    with pytest.raises(ValidationError, match="exactly one of 'messages' or 'prompt_token_ids'"):
        P.InferItem(images=["/a.jpg"])


def test_images_must_match_the_image_slots_of_the_messages():
    inline = {"type": "image", "image": "data:image/png;base64,iVBO"}
    content = [{"type": "image"}, inline, {"type": "text", "text": "x"}]
    P.InferItem(messages=[{"role": "user", "content": content}], images=["/a.jpg"])
    with pytest.raises(ValidationError, match="'images' has 2 entries for 1 image parts"):
        P.InferItem(messages=[{"role": "user", "content": content}], images=["/a.jpg", "/b.jpg"])
    with pytest.raises(ValidationError, match="data URI"):
        P.InferItem(prompt_token_ids=[1], images=["data:text/plain;base64,aGk="])


def test_absurd_max_tokens_is_rejected_naming_the_field():
    with pytest.raises(ValidationError, match="max_tokens") as info:
        P.InferRequest(items=[{"prompt_token_ids": [1]}], sampling={"max_tokens": 10**9})
    error = P.ErrorResponse.from_validation_error(info.value, hint="lower rollout_matching.decoding.max_new_tokens")
    assert error.error == "bad_request" and error.field == "sampling.max_tokens"
    assert "sampling.max_tokens" in error.message and str(P.MAX_TOKENS_LIMIT) in error.message


def test_max_tokens_is_required_and_other_sampling_defaults_follow_vllm():
    with pytest.raises(ValidationError, match="max_tokens"):
        P.SamplingParams()
    params = P.SamplingParams(max_tokens=16)
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.stop, params.repetition_penalty) == (
        1.0, 1.0, 0, None, [], 1.0,
    )


@pytest.mark.parametrize(
    "bad", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"repetition_penalty": 0.0}, {"temperature": "nan"}]
)
def test_out_of_range_sampling_knobs_are_rejected_naming_the_knob(bad):
    with pytest.raises(ValidationError, match=next(iter(bad))):
        P.SamplingParams(max_tokens=8, **bad)


@pytest.mark.parametrize("bad, field", [
    ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"top_k": 2**31}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty"), ({"repetition_penalty": 1e30}, "repetition_penalty"),
    ({"stop": [""]}, "stop.0"), ({"stop": ["x" * (P.MAX_STOP_CHARS + 1)]}, "stop.0"),
    ({"stop": ["x"] * (P.MAX_STOP_STRINGS + 1)}, "stop"),
])
def test_sampling_values_no_engine_can_take_are_rejected_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        P.SamplingParams(max_tokens=8, **bad)
    assert P.ErrorResponse.from_validation_error(info.value).field == field


def test_every_ver_on_the_wire_is_bounded_well_inside_int64():
    assert S.MAX_VER < 2**63 and float(S.MAX_VER) == S.MAX_VER  # exact in JSON numbers and msgpack int64
    item = {"prompt_token_ids": [1]}
    with pytest.raises(ValidationError, match="min_ver"):
        S.SyncCommitRequest(session="s", n_buckets=0, min_ver=10**30)
    with pytest.raises(ValidationError, match="min_ver"):
        P.InferRequest(items=[item], sampling={"max_tokens": 8}, min_ver=2**64)
    for model, fields in ((P.InferResponse, {"outputs": [], "engine": "hf", "elapsed_s": 0.0}),
                          (S.SyncCommitResponse, {"commit_s": 0.0, "fingerprint": "f"}),
                          (S.SyncAbortResponse, {"state": "idle", "aborted": True})):
        with pytest.raises(ValidationError, match="ver"):
            model(ver=S.MAX_VER + 1, **fields)
        model(ver=S.MAX_VER, **fields)
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        P.InferItem(prompt_token_ids=[2**40])


def test_batch_size_is_bounded():
    sampling = {"max_tokens": 8}
    with pytest.raises(ValidationError, match="items"):
        P.InferRequest(items=[], sampling=sampling)
    with pytest.raises(ValidationError, match="items"):
        P.InferRequest(items=[{"prompt_token_ids": [1]}] * (P.MAX_BATCH + 1), sampling=sampling)


def test_health_response_carries_the_schema_version_under_the_key_schema():
    health = P.HealthResponse(status="ok", engine="hf", model="m", ver=0, sync_state="idle", world_size=1)
    assert json.loads(health.model_dump_json())["schema"] == W.SCHEMA_VERSION


def test_nccl_sync_init_without_rendezvous_is_rejected():
    with pytest.raises(ValidationError, match="master_addr"):
        S.SyncInitRequest(client="learner-rank0", transport="nccl")


def test_bucket_header_with_offsets_that_disagree_with_dtype_and_shape_is_rejected():
    good = example(S.SyncBucketHeader)
    with pytest.raises(ValidationError, match="lm_head.weight: offsets span"):
        S.SyncBucketHeader.model_validate({**good, "offsets": [[0, 10]]})
    with pytest.raises(ValidationError, match="equal length"):
        S.SyncBucketHeader.model_validate({**good, "dtypes": []})


def test_common_imports_no_torch_vllm_or_fastapi():
    code = "import sys, common.wire.http, common.packing.packer; print(sorted({'torch', 'vllm', 'fastapi'} & set(sys.modules)))"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# actor -> learner (ZMQ): the pack message
# ---------------------------------------------------------------------------------------------


def sample_pack(ver: int = 5) -> Pack:
    return Pack(
        ver=ver,
        channel="B",
        segments=[
            make_segment(37, ver, "a", n_images=1),
            make_segment(9, ver, "b"),
            make_segment(20, ver, "c", n_images=2),
        ],
    )


def assert_same_pack(got: Pack, sent: Pack) -> None:
    assert (got.ver, got.channel, len(got.segments)) == (sent.ver, sent.channel, len(sent.segments))
    for name, array in sent.tensors().items():
        received = got.tensors()[name]
        assert received.dtype == array.dtype and received.shape == array.shape, name
        assert received.tobytes() == array.tobytes(), name  # bit-identical
    for g, s in zip(got.segments, sent.segments):
        assert (g.sample_id, g.length, g.meta) == (s.sample_id, s.length, s.meta)
        assert np.array_equal(g.coord_pos, s.coord_pos) and np.array_equal(g.input_ids, s.input_ids)
        assert np.array_equal(g.pixel_values.reshape(-1), s.pixel_values.reshape(-1))


@pytest.fixture
def push_pull():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close()
    pull.close()
    ctx.term()


def recv_within(sock: zmq.Socket, seconds: float = 5.0) -> list[zmq.Frame]:
    if not sock.poll(int(seconds * 1000)):
        raise AssertionError(f"no message on the PULL socket within {seconds}s (PUSH connected to loopback)")
    return sock.recv_multipart(copy=False)


def test_pack_round_trips_bit_identical_through_real_zmq_sockets_without_copies(push_pull):
    push, pull = push_pull
    sent = sample_pack()
    push.send_multipart(W.pack_to_frames(sent, actor="actor-r0-0", seq=3, meta={"rollout/f1": 0.5}), copy=False)
    frames = recv_within(pull)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    message, got = W.frames_to_pack(frames)
    header = (message.actor, message.seq, message.ver, message.n_segments, message.n_tokens)
    assert header == ("actor-r0-0", 3, 5, 3, 66)
    assert message.meta["rollout/f1"] == 0.5
    assert_same_pack(got, sent)
    assert np.shares_memory(message.tensors["input_ids"], np.frombuffer(frames[1].buffer, np.uint8))
    assert np.shares_memory(got.segments[1].input_ids, message.tensors["input_ids"])


def test_every_wire_dtype_round_trips_through_real_zmq_sockets(push_pull):
    push, pull = push_pull
    rng = np.random.default_rng(0)
    tensors = {name: (rng.standard_normal((3, 5)) * 100).astype(dtype) for name, dtype in W.WIRE_DTYPES.items()}
    tensors["empty"] = np.zeros((0, 7), np.float32)
    frames = W.encode_pack_message(ver=1, actor="a", seq=0, channel="A", n_segments=0, n_tokens=0, tensors=tensors)
    push.send_multipart(frames, copy=False)
    message = W.decode_pack_message(recv_within(pull))
    assert list(message.tensors) == list(tensors)
    for name, array in tensors.items():
        assert message.tensors[name].dtype == array.dtype and message.tensors[name].shape == array.shape
        assert message.tensors[name].tobytes() == array.tobytes(), name


def test_encode_passes_views_of_the_arrays_and_decode_views_the_frames():
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    frames = W.encode_pack_message(ver=0, actor="a", seq=0, channel="B", n_segments=0, n_tokens=0, tensors={"x": array})
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), array)
    received = [bytes(frames[0]), bytes(frames[1])]
    decoded = W.decode_pack_message(received).tensors["x"]
    assert np.shares_memory(decoded, np.frombuffer(received[1], np.uint8))
    assert np.array_equal(decoded, array)


def test_encode_converts_what_it_must_and_refuses_dtypes_off_the_whitelist():
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    big_endian = np.arange(4, dtype=">i8")
    frames = W.encode_pack_message(
        ver=0, actor="a", seq=0, channel="B", n_segments=0, n_tokens=0,
        tensors={"f": fortran, "b": big_endian}, meta={"count": np.int64(3)},
    )
    message = W.decode_pack_message([bytes(f) for f in frames])
    assert np.array_equal(message.tensors["f"], fortran) and np.array_equal(message.tensors["b"], big_endian)
    assert message.meta == {"count": 3}
    with pytest.raises(W.ProtocolError, match="complex64"):
        W.encode_pack_message(
            ver=0, actor="a", seq=0, channel="B", n_segments=0, n_tokens=0, tensors={"z": np.zeros(2, np.complex64)}
        )


@functools.cache
def _valid_frames() -> tuple[bytes, ...]:
    return tuple(bytes(f) for f in W.pack_to_frames(sample_pack(), actor="a", seq=1))


def valid_frames() -> list[bytes]:
    """A valid pack message of ``sample_pack()`` as bytes frames (a fresh list each call)."""
    return list(_valid_frames())


DELETE = object()


def with_header(frames: list[bytes], **changes) -> list[bytes]:
    """``frames`` with some header keys changed (value DELETE removes the key)."""
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb({k: v for k, v in header.items() if v is not DELETE}), *frames[1:]]


def spec_change(index: int, **changes) -> dict:
    specs = msgpack.unpackb(valid_frames()[0])["tensors"]
    specs[index].update(changes)
    return {"tensors": specs}


MALFORMED = {
    "no frames": lambda f: [],
    "not a list": lambda f: f[0],
    "truncated frame list": lambda f: f[:-1],
    "extra frame": lambda f: [*f, b"\x00" * 8],
    "garbage header bytes": lambda f: [b"\xc1\xff\x00garbage", *f[1:]],
    "trailing bytes after header": lambda f: [f[0] + b"\x01", *f[1:]],
    "non-map header": lambda f: [msgpack.packb([1, 2, 3]), *f[1:]],
    "missing key": lambda f: with_header(f, seq=DELETE),
    "extra key": lambda f: with_header(f, bogus=1),
    "wrong schema": lambda f: with_header(f, schema=W.SCHEMA_VERSION + 1),
    "bool ver": lambda f: with_header(f, ver=True),
    "negative seq": lambda f: with_header(f, seq=-1),
    "unknown channel": lambda f: with_header(f, channel="C"),
    "nan created_at": lambda f: with_header(f, created_at=float("nan")),
    "unknown dtype": lambda f: with_header(f, **spec_change(0, dtype="bfloat16")),
    "negative dim": lambda f: with_header(f, **spec_change(0, shape=[-66])),
    "shape byte-size mismatch": lambda f: with_header(f, **spec_change(0, shape=[65])),
    "truncated buffer": lambda f: [*f[:1], f[1][:-3], *f[2:]],
    "duplicate tensor name": lambda f: with_header(f, **spec_change(1, name="input_ids")),
    "wrong pack dtype": lambda f: with_header(f, **spec_change(0, dtype="int32", shape=[132])),
    "missing segments meta": lambda f: with_header(f, meta={}),
    "n_tokens mismatch": lambda f: with_header(f, n_tokens=65),
    "n_segments mismatch": lambda f: with_header(f, n_segments=2),
}


@pytest.mark.parametrize("mutate", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_pack_message_raises_protocol_error(mutate):
    with pytest.raises(W.ProtocolError):
        W.frames_to_pack(mutate(valid_frames()))


def test_truncated_frame_raises_protocol_error_naming_the_count():
    with pytest.raises(W.ProtocolError, match="9 buffer frames but the header lists 10 tensors"):
        W.decode_pack_message(valid_frames()[:-1])


def test_wrong_schema_raises_protocol_error_saying_versions_differ():
    with pytest.raises(W.ProtocolError, match="different tandem versions"):
        W.decode_pack_message(with_header(valid_frames(), schema=99))


def _replace_array(frames: list[bytes], name: str, array: np.ndarray) -> list[bytes]:
    """Swap one tensor of a valid pack message for ``array`` (header spec and frame both)."""
    specs = msgpack.unpackb(frames[0])["tensors"]
    i = next(i for i, s in enumerate(specs) if s["name"] == name)
    specs[i].update(dtype=array.dtype.name, shape=list(array.shape))
    out = with_header(frames, tensors=specs)
    out[i + 1] = array.tobytes()
    return out


def _edited(name: str, edit) -> np.ndarray:
    array = W.decode_pack_message(valid_frames()).tensors[name].copy()
    return edit(array)


@pytest.mark.parametrize(
    "name, array, match",
    [
        ("cu_seqlens", np.array([0, 37, 46, 65], np.int32), "cu_seqlens must rise strictly from 0 to T=66"),
        ("coord_bins", np.zeros(4, np.int64), "equal length"),
        ("image_grid_thw", np.array([[1, 2, 2], [1, 2, 2], [1, 2, 3]], np.int64), "image_grid_thw implies 14"),
        ("labels", np.zeros(65, np.int64), "labels"),
        ("position_ids", np.zeros((3, 65), np.int64), "position_ids"),
        (
            "coord_pos",  # the first box of segment "a" (37 tokens) moved into segment "b"
            _edited("coord_pos", lambda a: np.concatenate([[37], a[1:]])),
            r"segment a: coord_pos outside \[1, 37\)",
        ),
        ("coord_bins", _edited("coord_bins", lambda a: np.concatenate([a[:-1], [1000]])), "coord_bins outside 0..999"),
    ],
)
def test_inconsistent_pack_arrays_raise_protocol_error_naming_the_problem(name, array, match):
    with pytest.raises(W.ProtocolError, match=match):
        W.frames_to_pack(_replace_array(valid_frames(), name, array))


frame_bytes = st.binary(max_size=64)


@settings(max_examples=200, deadline=None)
@given(st.lists(frame_bytes, max_size=4))
def test_random_frames_never_raise_anything_but_protocol_error(frames):
    for decode in (W.decode_pack_message, W.frames_to_pack, W.decode_credits):
        try:
            decode(frames)
        except W.ProtocolError:
            pass
    try:
        W.decode_credits(frames[0] if frames else b"")
    except W.ProtocolError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FUZZED_PATHS = [
    *("schema", "ver", "actor", "seq", "created_at", "n_segments", "n_tokens", "channel", "tensors", "meta"),
    *("tensors.0", "tensors.0.shape", "tensors.4.dtype", "meta.segments", "meta.segments.1"),
    *("seg.length", "seg.n_coord", "seg.n_images", "seg.patches", "seg.meta", "seg.sample_id"),
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(FUZZED_PATHS), value=msgpack_values)
def test_valid_pack_with_one_field_fuzzed_never_raises_anything_but_protocol_error(key, value):
    frames = valid_frames()
    header = msgpack.unpackb(frames[0])
    parts = key.split(".")
    if parts[0] == "seg":
        header["meta"]["segments"][1][parts[1]] = value
    else:
        target = header
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    try:
        W.frames_to_pack([msgpack.packb(header), *frames[1:]])
    except W.ProtocolError:
        pass


# ---------------------------------------------------------------------------------------------
# learner rank r -> actors (ZMQ back-channel): credits
# ---------------------------------------------------------------------------------------------

CREDITS = dict(
    rank=1,
    ver_current=12,
    depth=3,
    target=8,
    version_window=2,
    received_total=1040,
    ts=1718000000.5,
    actors={"actor-r1-0": [41, 2], "actor-r1-1": [17, 1]},
)


def credits_with(**changes) -> bytes:
    """A credits frame with some keys changed (value DELETE removes the key)."""
    message = {"schema": W.SCHEMA_VERSION, **CREDITS, **changes}
    return msgpack.packb({k: v for k, v in message.items() if v is not DELETE})


def test_credits_round_trip_from_bytes_and_zmq_frame(push_pull):
    expected = W.Credits(schema=W.SCHEMA_VERSION, **CREDITS)
    frame = W.encode_credits(**CREDITS)
    assert W.decode_credits(frame) == expected
    push, pull = push_pull
    push.send(frame, copy=False)
    assert pull.poll(5000), "no credits on the PULL socket within 5s (PUSH connected to loopback)"
    assert W.decode_credits(pull.recv(copy=False)) == expected


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "not a msgpack document"),
        (b"\xc1", "not a msgpack document"),
        (msgpack.packb("credits"), "expected a msgpack map"),
        (credits_with(extra=1), "unknown keys"),
        (credits_with(ts=DELETE), "missing keys"),
        (credits_with(schema=0), "schema 0"),
        (credits_with(depth=-1), "'depth' must be a non-negative integer"),
        (credits_with(rank=1.0), "'rank' must be a non-negative integer"),
        (credits_with(ts="now"), "'ts' must be a finite number"),
        (credits_with(actors={"a": [1]}), r"must be \[last_seq, queued\]"),
        (credits_with(actors={"a": [1, -2]}), "non-negative integer"),
        (credits_with(actors=[1]), "'actors' must be a map"),
        ([b"a", b"b"], "one frame"),
        (12, "expected bytes"),
    ],
)
def test_malformed_credits_raise_protocol_error(frame, match):
    with pytest.raises(W.ProtocolError, match=match):
        W.decode_credits(frame)


@settings(max_examples=100, deadline=None)
@given(key=st.sampled_from(sorted(CREDITS) + ["schema"]), value=msgpack_values)
def test_credits_with_one_field_fuzzed_never_raise_anything_but_protocol_error(key, value):
    try:
        W.decode_credits(credits_with(**{key: value}))
    except W.ProtocolError:
        pass


CREDIT_KEYS = ("schema", "rank", "ver_current", "depth", "target", "version_window", "received_total", "ts",
               "actors", "done", "actors.a-0", "actors.a-0.0")


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(CREDIT_KEYS), value=msgpack_values)
def test_valid_credits_with_one_field_fuzzed_decode_to_checked_values_or_raise_protocol_error(key, value):
    """The back-channel's decoder, like the pack's: any one field replaced by any msgpack value either
    decodes to a Credits whose fields hold what the contract says, or raises ProtocolError only."""
    message = msgpack.unpackb(W.encode_credits(rank=1, ver_current=3, depth=2, target=4, version_window=1,
                                               received_total=9, actors={"a-0": (5, 1)}, ts=1.0))
    parts = key.split(".")
    target = message
    for part in parts[:-1]:
        target = target[part]
    if isinstance(target, list):
        target[int(parts[-1])] = value
    else:
        target[parts[-1]] = value
    try:
        credits = W.decode_credits(msgpack.packb(message))
    except W.ProtocolError:
        return
    for name in ("rank", "ver_current", "depth", "target", "version_window", "received_total"):
        assert type(getattr(credits, name)) is int and getattr(credits, name) >= 0
    assert math.isfinite(credits.ts)
    assert all(type(q) is int and q >= 0 for entry in credits.actors.values() for q in entry)
