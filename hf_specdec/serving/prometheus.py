"""Prometheus' text format for `GET /metrics`: the engine's state and counters, the speculative ones as vLLM names
them."""

from __future__ import annotations

from .engine import ServingEngine


def prometheus_text(engine: ServingEngine) -> str:
    """The server's state and counters in Prometheus' text format (the speculative ones as vLLM names them)."""
    m = engine.metrics
    lines = []

    def add(name: str, kind: str, help_text: str, samples):
        lines.append(f"# HELP hf_specdec:{name} {help_text}")
        lines.append(f"# TYPE hf_specdec:{name} {kind}")
        for labels, value in samples:
            lines.append(f"hf_specdec:{name}{labels} {value}")

    add("num_requests_running", "gauge", "Requests in the running batch.", [("", engine.num_running)])
    add("num_requests_waiting", "gauge", "Requests waiting in the queue.", [("", engine.num_waiting)])
    add("kv_cache_blocks_in_use", "gauge", "KV blocks held by running requests.", [("", engine.num_blocks_in_use)])
    add("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
        [("", round(engine.tokens_per_second(), 3))])
    counters = dict(engine.counters)
    add("request_total", "counter", "Requests accepted.", [("", counters["requests"])])
    add("request_rejected_total", "counter", "Requests refused because the queue was full.",
        [("", counters["rejected"])])
    add("request_cancelled_total", "counter", "Requests cancelled (client gone, shutdown).",
        [("", counters["cancelled"])])
    add("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", counters["prompt_tokens"])])
    add("generation_tokens_total", "counter", "Tokens generated.", [("", counters["generation_tokens"])])
    add("spec_decode_num_drafts_total", "counter", "Row-steps in which the speculator proposed drafts.",
        [("", m.num_drafts)])
    add("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", m.num_draft_tokens)])
    add("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", m.num_accepted_tokens)])
    add("spec_decode_num_accepted_tokens_per_pos_total", "counter",
        "Drafts with at least position + 1 tokens accepted.",
        [(f'{{position="{i}"}}', n) for i, n in enumerate(list(m.accepted_per_position))])
    add("num_steps_total", "counter", "Verify steps (target forwards).", [("", m.num_steps)])
    add("prefill_chunks_total", "counter", "Pieces of long prompts fed on their own (chunked prefill).",
        [("", engine.scheduler.num_prefill_chunks)])
    cache = engine.prefix_cache
    add("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
        [("", cache.num_queried_tokens if cache is not None else 0)])
    add("prefix_cache_hits_total", "counter", "Prompt tokens found there (not fed again).",
        [("", cache.num_hit_tokens if cache is not None else 0)])
    return "\n".join(lines) + "\n"
