"""The learner's half of weight sync: when to push, and how the bytes leave (the whole picture, both halves
side by side: common/weight_sync/__init__.py).

    boundary.py   WeightSync: the step-boundary protocols (blocking: barrier → rank-0 push → barrier →
                  broadcast ver; overlap: snapshot + push thread), cadence, counters
    overlap.py    rank 0's overlap machinery (WeightSnapshot, BackgroundPush)
    base.py       WeightSender (the interface boundary.py holds) and PushSender (the one push protocol:
                  open → plan → fingerprint → begin → send → commit, abort on failure)
    session.py    SyncClient, SyncSession: the HTTP control calls of a session, each with a deadline
    transport.py  make_sender: the sender for one server (``auto`` picks ipc, nccl or http)
    http.py       HttpWeightSender: packed buckets over HTTP (portable: CPU, any engine)
    stream.py     the HTTP sender's bucket stream (raw bytes on the server's port)
    ipc.py        IpcWeightSender: the server copies from the learner's shared buffer (same GPU: CUDA IPC)
    nccl.py       NcclWeightSender: packed broadcasts on a dedicated NCCL group (GPU, vLLM or hf engine)
    sharded.py    FSDP2 weights: the bucket plan every rank follows, gathers just in time, the running fingerprint

A new transport is a ``PushSender`` subclass with its ``_send`` (and the hooks it needs) plus one branch in
``transport.py``, and its receiving half on the server.
"""
