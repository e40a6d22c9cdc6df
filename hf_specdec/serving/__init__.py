"""Serving: continuous batching (`ServingEngine`) and an OpenAI-compatible HTTP server (`hf-specdec serve`)."""

from ..decode.requests import Request, SamplingParams
from .engine import ServingEngine
from .offline import generate_batch, generate_stream
from .stream import Delta, QueueFullError, RequestError, RequestStream

__all__ = ["Delta", "QueueFullError", "Request", "RequestError", "RequestStream", "SamplingParams", "ServingEngine",
           "generate_batch", "generate_stream"]
