"""Serving: continuous batching (`ServingEngine`) and an OpenAI-compatible HTTP server (`hf-specdec serve`)."""

from ..scheduler import Request, SamplingParams
from .engine import Delta, QueueFullError, RequestError, RequestStream, ServingEngine

__all__ = ["Delta", "QueueFullError", "Request", "RequestError", "RequestStream", "SamplingParams", "ServingEngine"]
