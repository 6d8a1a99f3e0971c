"""The rollout server's routes, one ``APIRouter`` per concept; ``rollout_server/app.py`` includes them.

    health.py   GET /health, GET /metrics          is the server up, and what it has done
    infer.py    POST /infer, and ``generate``      the serving path /v1 shares (budgets, fence, cancellation)
    openai.py   /v1/models, /v1/completions, /v1/chat/completions   an OpenAI-compatible subset
    sync.py     /sync/*                            weight sync (the state machine is rollout_server/weight_sync/session.py)

Handlers take what they use as dependencies (``server: rollout_server.state.Server``), never from a closure.
"""
