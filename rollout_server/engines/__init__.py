"""Generation backends behind one interface (:mod:`rollout_server.engines.base`).

``make_engine(cfg)`` picks one from ``rollout_server.engine``; the vLLM module is imported only
when it is selected, so everything else runs where vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_server.engines.base import Engine, EngineUnavailable


def served_model_path(cfg: Any) -> str:
    """``rollout_server.model_path``, else ``model.path``."""
    return cfg.rollout_server.model_path or cfg.model.path


def check_model_dir(path: str) -> str | None:
    """A problem with a local model directory, with its fix; None when it looks loadable."""
    if (Path(path) / "config.json").is_file():
        return None
    return (f"model path {path!r} is not a model directory (no config.json). Fix: build the tiny model with "
            f"`make tiny-model` (python tools/make_tiny_model.py --out {path}), or set "
            "rollout_server.model_path / model.path to a checkpoint directory")


def make_engine(cfg: Any) -> Engine:
    """The engine ``cfg.rollout_server.engine`` names, constructed but not started; it resizes images with
    ``data.min_pixels`` / ``data.max_pixels`` as the learner's encoder does (common/data/image_size.py)."""
    srv = cfg.rollout_server
    path = served_model_path(cfg)
    if srv.engine == "hf":
        from rollout_server.engines.hf import HFEngine

        return HFEngine(path, dtype=srv.dtype, device=srv.device, max_batch=srv.hf_max_batch,
                        max_request_tokens=srv.max_request_tokens, min_pixels=cfg.data.min_pixels,
                        max_pixels=cfg.data.max_pixels)
    if srv.engine == "vllm":
        from rollout_server.engines.vllm.engine import VLLMEngine

        return VLLMEngine(path, srv, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    raise EngineUnavailable(f"unknown rollout_server.engine {srv.engine!r}. Fix: use hf or vllm")
