"""Weight sync: learner rank 0 pushes its weights to every rollout server; the server swaps them in under a new ``ver``.

Start here. This package is the contract both sides share: the messages, the byte layout of a bucket, the
shared buffers, the weight names and fingerprints. The two halves of every step live in the process that
runs them (tests/test_layout.py: process folders meet only through ``common/``), under the same name on
both sides: ``learner/weight_sync/`` sends, ``rollout_server/weight_sync/`` receives.

Data flow of one push (blocking mode; ``weight_sync.mode: overlap`` runs the same push from a thread)::

    learner, every rank                       learner rank 0                          rollout server
    ───────────────────                       ──────────────                          ──────────────
    step boundary due (weight_sync.every_steps)
      learner/weight_sync/boundary.py ──────► PushSender.push  (learner/weight_sync/base.py)
                                              open   ── POST /sync/init ─────────────► SyncController.init
                                              begin  ── POST /sync/begin ────────────► fence closes (drain|abort)
                                              send   ── the transport, below ─────────► engine stages the bucket
                                              commit ── POST /sync/commit ───────────► swap, fingerprint check,
                                                                                       ver += 1, fence reopens
                                              (any failure: POST /sync/abort, old weights and ver kept)
      every rank adopts rank 0's ver ◄──────┘

Where each piece lives:

    the contract (this package)
      messages.py   every /sync/* request and response, SyncState, the stream magic (pydantic only)
      packed.py     a bucket: tensors laid end to end in one byte buffer (pack on the sender, unpack on the receiver)
      weights.py    names, manifest, fingerprint, exact digest, the chunking rule, the collective group helper
      shared.py     the ipc transport's buffers: SendBuffer (sender) and open_shared (receiver)
    the session (one sync, begin to commit)
      sender        learner/weight_sync/session.py   SyncClient, SyncSession: the /sync calls, each with a deadline
      receiver      rollout_server/weight_sync/session.py   SyncController: the state machine behind /sync/*
      routes        rollout_server/routes/sync.py   the /sync/* HTTP routes in front of the SyncController
    when to push (learner only)
      learner/weight_sync/boundary.py   the step-boundary protocols (blocking, overlap), cadence, counters
      learner/weight_sync/overlap.py    rank 0's snapshot and background push thread
      learner/weight_sync/sharded.py    FSDP2 weights: the bucket plan every rank follows, just-in-time gathers
      learner/weight_sync/base.py       PushSender: the one push protocol every transport runs
      learner/weight_sync/transport.py  make_sender: which transport a server gets (``auto`` decided here)

Each transport, sender | receiver:

    http   learner/weight_sync/http.py (HttpWeightSender)  |  POST /sync/bucket in rollout_server/routes/sync.py,
           learner/weight_sync/stream.py (bucket stream)   |  rollout_server/weight_sync/stream.py (same port, raw bytes);
                                                           |  then the engine's stage_bucket
    ipc    learner/weight_sync/ipc.py (IpcWeightSender)    |  POST /sync/ipc; hf: rollout_server/engines/hf.py
                                                           |  receive_ipc; vLLM: rollout_server/engines/vllm/ipc.py
                                                           |  and extension.py (in vLLM's GPU worker)
    nccl   learner/weight_sync/nccl.py (NcclWeightSender)  |  POST /sync/update; hf: rollout_server/engines/hf.py
                                                           |  receive_nccl; vLLM: rollout_server/engines/vllm/engine.py
                                                           |  and extension.py, load_plan.py, fast_loader.py

The vLLM receivers stay under ``rollout_server/engines/vllm/``: ``extension.py`` runs inside vLLM's worker
processes and, like ``load_plan.py`` and ``fast_loader.py``, works on vLLM's model objects.

Configuration: the ``weight_sync:`` section (docs/config.md); the user's guide: docs/learner.md, Weight sync.

What this package does not know: HTTP, ranks, engines, or when a sync is due. Its modules import torch and
pydantic only (never fastapi or vLLM).
"""
