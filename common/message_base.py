"""The base of every HTTP message model (:mod:`common.protocol`, :mod:`common.sync_messages`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Message(BaseModel):
    """Unknown fields are refused (a typo is a 4xx naming the field); field docstrings become the
    OpenAPI descriptions; NaN and inf are rejected everywhere."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
