"""Serving: continuous batching (`ServingEngine`) and an OpenAI-compatible HTTP server (`hf-specdec serve`)."""

from ..decode.scheduler import Request, SamplingParams
from .engine import Delta, QueueFullError, RequestError, RequestStream, ServingEngine
from .offline import generate_batch, generate_stream

__all__ = ["Delta", "QueueFullError", "Request", "RequestError", "RequestStream", "SamplingParams", "ServingEngine",
           "generate_batch", "generate_stream"]
