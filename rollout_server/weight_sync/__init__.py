"""The rollout server's half of weight sync (the whole picture, both halves side by side:
common/weight_sync/__init__.py).

    session.py    SyncController: the session state machine behind /sync/* (one client at a time, the fence
                  closed from begin to commit or abort)
    stream.py     the HTTP transport's bucket stream: bytes read straight into their buffer on the server's port

The ``/sync/*`` routes are rollout_server/routes/sync.py; how an engine stages and swaps weights is its own
(rollout_server/engines/hf.py; the vLLM engine's ipc.py, extension.py, load_plan.py, fast_loader.py).
"""
