"""Every byte that crosses a process boundary, grouped by link, with one schema version.

Links, and the module that declares each message::

    actor ──HTTP /infer──────────────► rollout server      InferRequest -> InferResponse       http.py
    learner rank 0 ──HTTP /sync/*────► rollout server      Sync*Request -> Sync*Response       ../weight_sync/messages.py
    ops / tests ──HTTP GET /sync/digest► rollout server   SyncDigestResponse                  ../weight_sync/messages.py
    anyone ──HTTP /health────────────► rollout server      HealthResponse                      http.py
    rollout server ──any 4xx/5xx─────► any HTTP client     ErrorResponse                       http.py
    actor ──ZMQ PUSH─────────────────► learner rank r      pack message                        codec.py
    learner rank r ──ZMQ back-channel► its actors          credits message                     codec.py

Every HTTP message is a pydantic model on ``base.py``'s ``Message`` (unknown fields are a 4xx naming the
field); the ZMQ decoders raise only ``ProtocolError``. ``transport.py`` makes the ZMQ sockets and says, where
each is made, who binds, the high-water mark and what a slow peer sees. Nothing here imports torch.
"""
