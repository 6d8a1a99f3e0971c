"""ZMQ sockets between actors and learner ranks: packs one way, credits the other.

Topology per learner rank ``r`` (several actors may feed one rank; ZMQ fans them in)::

    actor r/0 ─ PackSender (PUSH, connect) ──┐
    actor r/1 ─ PackSender (PUSH, connect) ──┼──► PackReceiver (PULL, bind)  pack_endpoint(cfg, r)
                                             │
    actor r/* ◄─ CreditSubscriber (SUB, connect) ◄── CreditPublisher (PUB, bind)  credit_endpoint(cfg, r)

The learner binds both sockets of its rank, so it may start before or after its actors, and a
restarted learner is found again by every actor without being told (ZMQ reconnects connecting
sockets by itself). :func:`pack_endpoint` and :func:`credit_endpoint` are the ONE place the
addresses come from; the learner and the actors both call them, with the ``learner`` config section.

Where rank ``r`` listens (:func:`learner_host`): ``learner.node_hosts[r // nproc_per_node]`` when the
learner spans nodes (``learner.nnodes``), else ``transport.host``. The learner binds exactly the address
its actors connect to — its node's own interface, never ``0.0.0.0`` — so only the network named in the
config can reach the sockets. Ports are ``base_port + 2·r`` by **global** rank, so the ranks of two nodes
never collide, not even two "nodes" on one machine.

Trust: a non-loopback bind is a trust decision. These sockets have no authentication or encryption
(no ZMQ CURVE): any host that routes to a learner node's ``base_port .. base_port + 2W − 1`` can push
packs to that rank and read its credits (``ver``, queue depth, actor ids; no secrets). The receiver
validates every pack (``common.wire.codec``, ``learner/pack_queue.py``: undecodable, oversized or implausible
frames are dropped and counted), but a well-formed pack from a stranger would be trained on. Keep
learner nodes and actors on a private network and firewall those ports to the actor hosts
(docs/multinode.md).

Delivery semantics are written on each class. In short: packs never drop silently in transit —
the sender blocks (up to a deadline) rather than dropping; the learner's receiver thread drains
its socket eagerly and does drop-oldest in its own counted deque (docs/learner.md, Ready queue). Credits are
state, not events: a subscriber only ever wants the newest, so losing one is harmless.

What this module does not know: what a pack contains (``common.wire.codec`` codes it), torch, or
the credit policy (``actor/credits.py``). It imports pyzmq and the stdlib only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from common.packing.segment import default_max_frame_bytes
from common.wire.codec import Credits, ProtocolError, decode_credits

log = logging.getLogger(__name__)

#: What to tell a user whose actor finds no learner (kept in one place for every timeout message).
LEARNER_START_HINT = "torchrun --nproc_per_node=W learner/main.py --config CONFIG"


def _port(transport_cfg: Any, rank: int, offset: int) -> int:
    if rank < 0:
        raise ValueError(f"learner rank must be >= 0, got {rank}")
    port = int(transport_cfg.base_port) + 2 * int(rank) + offset
    if not 0 < port < 65536:
        raise ValueError(f"transport.base_port {transport_cfg.base_port} + 2·{rank} + {offset} = {port} is not a TCP port")
    return port


def learner_host(transport_cfg: Any, rank: int, learner: Any = None) -> str:
    """The address of learner rank ``rank``'s node: ``learner.node_hosts[rank // learner.nproc_per_node]`` when
    ``learner`` (the config's ``learner`` section) lists node hosts, else ``transport.host``.

    Example: ``node_hosts: [10.0.0.1, 10.0.0.2]``, ``nproc_per_node: 4``: ranks 0-3 -> 10.0.0.1, 4-7 -> 10.0.0.2.
    """
    hosts = getattr(learner, "node_hosts", None)
    if not hosts:
        return str(transport_cfg.host)
    node = int(rank) // int(learner.nproc_per_node)
    if not 0 <= node < len(hosts):
        raise ValueError(f"learner rank {rank} is on node {node}, but learner.node_hosts lists {len(hosts)} nodes "
                         f"({learner.nproc_per_node} ranks each, learner.nproc_per_node)")
    return str(hosts[node])


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def pack_endpoint(transport_cfg: Any, rank: int, learner: Any = None) -> str:
    """``tcp://host:(base_port + 2·rank)``: where learner rank ``rank`` binds its PULL for packs
    (``host`` = :func:`learner_host`; pass ``learner`` = ``cfg.learner`` so a multi-node rank is found).

    Example: ``transport: {host: 127.0.0.1, base_port: 5600}``, rank 1 -> ``tcp://127.0.0.1:5602``.
    """
    return _tcp(learner_host(transport_cfg, rank, learner), _port(transport_cfg, rank, 0))


def credit_endpoint(transport_cfg: Any, rank: int, learner: Any = None) -> str:
    """``tcp://host:(base_port + 2·rank + 1)``: where learner rank ``rank`` binds its PUB for credits."""
    return _tcp(learner_host(transport_cfg, rank, learner), _port(transport_cfg, rank, 1))


def max_frame_bytes(transport_cfg: Any, packing_length: int) -> int:
    """The pack socket's frame cap: ``transport.max_frame_mb``, or :func:`common.packing.segment.default_max_frame_bytes`."""
    mb = getattr(transport_cfg, "max_frame_mb", None)
    return int(mb) << 20 if mb is not None else default_max_frame_bytes(packing_length)


class TransportTimeout(TimeoutError):
    """A deadline passed waiting on a peer; the message names the endpoint and how to start the peer."""


def _close(sock: zmq.Socket, linger_ms: int) -> None:
    if not sock.closed:
        sock.close(linger=linger_ms)


# ============================================================================================
# actor -> learner rank r: packs
# ============================================================================================


class PackSender:
    """Actor side of the pack link: a PUSH socket that **connects** to learner rank ``rank``.

    - Pattern: PUSH -> PULL, one PULL per rank; several actors' PUSH sockets fan in.
    - HWM: ``SNDHWM = hwm`` messages (a pack = one multipart message). Past it :meth:`send` waits.
    - Block vs drop: never drops. ``ZMQ_IMMEDIATE=1`` means a pack is queued only on a completed
      connection, so while no learner is there :meth:`send` waits up to its deadline and then returns
      False (the caller keeps the pack, retries, and drops it itself — counted — if it goes stale).
      Without IMMEDIATE, packs would pile up in a pipe to a learner that may never come.
    - Zero copy: frames are handed to ``send_multipart(copy=False)``; pyzmq keeps a reference to
      each buffer until it is on the wire, so the caller must not mutate the arrays afterwards.
    - Reconnect: automatic (ZMQ retries the TCP connection every ``RECONNECT_IVL`` = 100 ms, up to
      1 s between tries). After a learner restart the next send goes to the new learner; packs that
      were inside the old TCP connection are lost with it (the learner discards its queues on restart
      anyway, and the credit session change tells the actor to stop counting them).
    - Linger: ``linger_ms`` at close (default 0: a stopping actor does not hang on a gone learner;
      the actor flushes before closing and waits for the send to be accepted).
    """

    def __init__(self, endpoint: str, *, hwm: int = 64, linger_ms: int = 0, ctx: zmq.Context | None = None,
                 peer_hint: str = LEARNER_START_HINT) -> None:
        self.endpoint = endpoint
        self.peer_hint = peer_hint
        self.linger_ms = linger_ms
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._sock.connect(endpoint)
        self.sent = 0

    def send(self, frames: Sequence[Any], timeout_s: float) -> bool:
        """Queue one multipart message; False if no learner accepted it within ``timeout_s``."""
        if self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLOUT) == 0:
            return False
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the peer went away between poll and send
            return False
        self.sent += 1
        return True

    def send_or_raise(self, frames: Sequence[Any], timeout_s: float) -> None:
        """:meth:`send`, raising :class:`TransportTimeout` naming the endpoint and the learner command."""
        if not self.send(frames, timeout_s):
            raise TransportTimeout(self.timeout_message(timeout_s))

    def timeout_message(self, waited_s: float) -> str:
        return (
            f"no learner accepted a pack at {self.endpoint} within {waited_s:.1f}s "
            f"(PUSH connects there; the learner rank binds it). Is the learner running? Start it with: {self.peer_hint}"
        )

    def close(self) -> None:
        _close(self._sock, self.linger_ms)


class PackReceiver:
    """Learner side of the pack link: a PULL socket that **binds** rank ``rank``'s pack endpoint.

    - Pattern: PULL, fair-queued over every connected actor.
    - HWM: ``RCVHWM = hwm`` messages; set it ≥ ``queue_limit``. Past it ZMQ stops reading from the
      TCP connection and the senders block (back-pressure, nothing lost). The learner's receiver
      thread should drain eagerly into its own bounded deque, where drop-oldest is counted.
    - Zero copy: :meth:`recv` returns ``zmq.Frame`` objects (``copy=False``); decode them with
      ``common.wire.codec.frames_to_pack`` to get numpy views of the received bytes.
    - Linger: ``linger_ms`` at close (unread packs are discarded with the socket).
    - Restart: binding again on the same port after :meth:`close` works at once (ZMQ sets
      ``SO_REUSEADDR``); the actors' PUSH sockets reconnect by themselves.
    - Slow joiner: not an issue for PUSH/PULL — nothing is sent until a connection exists.
    - Size cap: ``MAXMSGSIZE = max_frame_bytes`` (:func:`max_frame_bytes`). ZMQ reads a frame's declared
      size before allocating it and, past the cap, drops the connection: the peer's message is lost, the
      receiver never grows, and nothing reaches the application (no error, no event but an ordinary
      disconnect), so the loss shows only as that actor's seq gap and its lost-pack count. The sender
      reconnects by itself. The cap is per frame (libzmq 4.3): the number of frames of one message is not
      bounded by ZMQ — a peer that may not be trusted belongs outside the learner's network.
    """

    def __init__(self, endpoint: str, *, hwm: int = 64, linger_ms: int = 0, ctx: zmq.Context | None = None,
                 max_frame_bytes: int = -1) -> None:
        self.endpoint = endpoint
        self.linger_ms = linger_ms
        self.max_frame_bytes = max_frame_bytes  # -1: no cap
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # before bind: accepted connections copy it
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise OSError(
                f"cannot bind the pack receiver at {endpoint} ({exc}); another learner rank or test may hold the port — "
                "change transport.base_port or stop that process"
            ) from None
        self.received = 0

    def recv(self, timeout_s: float) -> list[zmq.Frame] | None:
        """The next message's frames, or None after ``timeout_s`` with nothing to read."""
        if self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN) == 0:
            return None
        frames = self._sock.recv_multipart(copy=False)
        self.received += 1
        return frames

    def close(self) -> None:
        _close(self._sock, self.linger_ms)


# ============================================================================================
# learner rank r -> its actors: credits
# ============================================================================================


class CreditPublisher:
    """Learner side of the back-channel: a PUB socket that **binds** rank ``rank``'s credit endpoint.

    - Pattern: PUB -> SUB; every actor of the rank receives every message.
    - HWM: ``SNDHWM = 8``. PUB never blocks: past the HWM ZMQ silently drops the **newest** message
      for that subscriber. That is acceptable only because credits are state, republished every
      ``transport.credit_interval_s``: the next message supersedes any lost one.
    - Slow joiner: a subscriber that connects late misses everything published before; it gets
      the next periodic publish, so the learner must publish on a timer, not only on change.
    - Linger: 0 (stale credits are worthless after close).
    """

    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 8)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise OSError(f"cannot bind the credit publisher at {endpoint} ({exc}); change transport.base_port "
                          "or stop the process holding it") from None

    def publish(self, frame: bytes) -> None:
        """Send one encoded credits frame (``common.wire.codec.encode_credits``); never blocks."""
        try:
            self._sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB does not raise past HWM, but be explicit about never blocking
            pass

    def close(self) -> None:
        _close(self._sock, 0)


class CreditSubscriber:
    """Actor side of the back-channel: a SUB socket that **connects** to its rank's credit endpoint.

    - Pattern: SUB (subscribed to everything) <- PUB.
    - "Latest wins": :meth:`poll` reads every message waiting and keeps the newest valid one, so a
      slow actor never acts on old credits (the conflate behaviour without ``ZMQ_CONFLATE``).
      Malformed frames are counted in ``invalid`` and skipped.
    - HWM: ``RCVHWM = 8``; older messages past it are dropped by ZMQ — they are superseded anyway.
    - Reconnect: automatic; a restarted learner is heard again from its first periodic publish.
    - Slow joiner: the first message arrives only after the TCP connection and subscription
      complete (tens of ms), hence :meth:`wait_first` with a deadline.
    - Linger: 0.
    """

    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 8)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.latest: Credits | None = None
        self.latest_at: float | None = None  # time.monotonic() when ``latest`` arrived
        self.invalid = 0

    def poll(self, timeout_s: float = 0.0) -> Credits | None:
        """Drain waiting messages (waiting up to ``timeout_s`` for the first); return the newest credits seen so far."""
        wait_ms = max(0, int(timeout_s * 1000))
        while self._sock.poll(wait_ms, zmq.POLLIN):
            wait_ms = 0
            frame = self._sock.recv(copy=False)
            try:
                self.latest = decode_credits(frame)
                self.latest_at = time.monotonic()
            except ProtocolError as exc:
                self.invalid += 1
                log.warning("credits from %s dropped: %s", self.endpoint, exc)
        return self.latest

    def wait_first(self, timeout_s: float, *, what: str = "learner rank", hint: str = LEARNER_START_HINT) -> Credits:
        """Block until credits arrive; :class:`TransportTimeout` naming the endpoint after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            credits = self.poll(min(1.0, max(0.0, deadline - time.monotonic())))
            if credits is not None:
                return credits
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"no credits from the {what} at {self.endpoint} within {timeout_s:.0f}s (SUB connects there; "
                    f"the learner binds it and publishes every transport.credit_interval_s). Start it with: {hint}"
                )

    def age_s(self) -> float | None:
        """Seconds since the newest credits arrived (None before the first)."""
        return None if self.latest_at is None else time.monotonic() - self.latest_at

    def close(self) -> None:
        _close(self._sock, 0)


# ============================================================================================
# learner-side bookkeeping that feeds the per-actor credit fields
# ============================================================================================


@dataclass
class ActorTally:
    """Per-actor counts a learner rank publishes so each actor can compute its own outstanding packs.

    The learner calls :meth:`received` for every decoded pack (header ``actor`` and ``seq``) and
    :meth:`left_queue` whenever one of that actor's packs leaves the ready queue (trained, stale- or
    oldest-dropped). :meth:`as_map` is the ``actors`` field of the credits message:
    ``{"actor-r0-0": [last_seq, queued]}``.
    """

    last_seq: dict[str, int] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)

    def received(self, actor: str, seq: int) -> None:
        self.last_seq[actor] = max(seq, self.last_seq.get(actor, -1))
        self.queued[actor] = self.queued.get(actor, 0) + 1

    def left_queue(self, actor: str, n: int = 1) -> None:
        self.queued[actor] = max(0, self.queued.get(actor, 0) - n)

    def as_map(self) -> dict[str, list[int]]:
        return {a: [s, self.queued.get(a, 0)] for a, s in self.last_seq.items()}
