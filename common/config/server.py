"""The ``rollout_server`` config section: its schema and its fail-fast rules (trust boundary, request budgets).

:func:`check_server_rules` is called by :func:`common.config.load._check_rules` with the section and the problem
collector (every problem names the dotted key, the value and the fix).

What this module does not know: how the server enforces the limits (``rollout_server/guard.py``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Literal

from common.config.fields import doc


@dataclass
class RolloutServerConfig:
    """The rollout server process (`python -m rollout_server`)."""

    engine: Literal["vllm", "hf"] = doc("vllm on GPUs; hf = transformers generate (CPU default, tests).", "hf")
    model_path: str | None = doc("Served model directory; None = model.path.", None)
    host: str = doc("Bind address (loopback unless told otherwise).", "127.0.0.1")
    port: int = doc("HTTP port.", 8000)
    auth_token: str | None = doc(
        "Bearer token required on /sync/* (weight sync) when set; required when host is not loopback (the "
        "config is refused without it). Keep it out of the YAML: auth_token: ${oc.env:TANDEM_SYNC_TOKEN}.", None
    )
    gpus: list[int] | None = doc("GPU ids of the server (launcher sets CUDA_VISIBLE_DEVICES); must not overlap learner.gpus.", None)
    tensor_parallel_size: int = doc("vLLM tensor parallel size.", 1)
    gpu_memory_utilization: float = doc("vLLM KV-cache memory share.", 0.85)
    max_model_len: int | None = doc("vLLM context cap; None = model default.", None)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc("Serving dtype; auto = bf16 on CUDA, fp32 on CPU.", "auto")
    max_batch_items: int = doc("Largest /infer batch accepted (more is a 413 naming the limit).", 256)
    hf_max_batch: int = doc("hf engine: sequences per generate call.", 16)
    enable_prefix_caching: bool = doc("vLLM prefix caching (reset after every weight update).", True)
    enforce_eager: bool = doc("vLLM: no torch.compile, no CUDA graphs: decodes ~4-5x slower, starts hardly faster "
                              "than with a warm compile cache (docs/gpu.md).", False)
    load_format: Literal["auto", "dummy"] = doc(
        "vLLM weight loading: auto = model_path's safetensors; dummy = random weights of its config "
        "(benchmarks: the learner's first sync overwrites them).", "auto"
    )
    weight_load: Literal["fast", "native"] = doc(
        "vLLM NCCL sync: fast = receive into two persistent chunk buffers and replay a copy plan "
        "recorded once per weight layout (falls back to native, logged, when the model's loaders do "
        "more than copy; docs/gpu.md); native = vLLM's update_weights (layerwise reload).", "fast"
    )
    sync_idle_timeout_s: float = doc("A sync session idle this long is aborted (old weights kept).", 120.0)
    log_level: str = doc("Server log level.", "info")
    device: str = doc("hf engine device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.", "auto")
    admission_timeout_s: float = doc(
        "Longest an /infer call waits at a closed fence (or for min_ver) before a 503 naming the wait.", 600.0
    )
    max_bucket_mb: int = doc("Largest /sync/bucket body accepted (bigger is a 413); ≥ the learner's bucket_mb.", 2048)
    shutdown_grace_s: float = doc("On SIGTERM, in-flight requests get this long to finish before they are cut.", 10.0)
    max_request_mb: int = doc(
        "Largest request body other than /sync/bucket (/infer, /v1/*, /sync/* JSON), counted as it arrives "
        "whatever the framing (chunked too): bigger is a 413 before it is buffered.", 64
    )
    body_read_timeout_s: float = doc(
        "A request body that stops arriving this long is a 408; a stalled /sync/bucket upload (gap capped at "
        "sync_idle_timeout_s) also aborts its sync session, old weights kept, fence reopened.", 30.0
    )
    max_request_tokens: int = doc(
        "Per request: prompt tokens + max_tokens, summed over its items; more is a 413 naming it (clients split).",
        1048576,
    )
    max_request_megapixels: float = doc(
        "Per request: image pixels summed over its images, read from the headers before anything is decoded; "
        "more is a 413 naming it (the actors' client splits the batch).", 256.0
    )
    max_image_megapixels: float = doc(
        "Per image: pixels from its header; a larger image is a 413 before it is decoded (PIL refuses "
        "more than ~179 MP whatever this says).", 40.0
    )


def loopback_host(host: str) -> bool:
    """True when a server bound to ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name (or 0.0.0.0-like wildcard spelled otherwise): it may resolve to anything
        return False


def check_server_rules(srv: Any, problems: Any) -> None:
    """Weight sync locked beyond loopback; request budgets positive. ``problems.add(key, value, why, fix)``."""
    if isinstance(srv.host, str) and not loopback_host(srv.host) and not srv.auth_token:
        problems.add("rollout_server.auth_token", srv.auth_token,
                     f"rollout_server.host {srv.host!r} is reachable beyond loopback, and without a token anyone "
                     "who reaches the port can replace the served weights through /sync/*",
                     "set rollout_server.auth_token to a secret every process of the run reads (in the YAML: "
                     "auth_token: ${oc.env:TANDEM_SYNC_TOKEN}, then export TANDEM_SYNC_TOKEN=$(openssl rand -hex 16)),"
                     " or bind rollout_server.host: 127.0.0.1")
    for key in ("max_request_mb", "max_request_tokens", "max_bucket_mb", "max_batch_items"):
        value = getattr(srv, key)
        if isinstance(value, int) and value < 1:
            problems.add(f"rollout_server.{key}", value, "must be ≥ 1", f"set rollout_server.{key} to a positive limit")
    for key in ("max_request_megapixels", "max_image_megapixels"):
        mp = getattr(srv, key)
        if isinstance(mp, (int, float)) and not mp > 0:
            problems.add(f"rollout_server.{key}", mp, "must be > 0", f"set rollout_server.{key} to a positive budget")
