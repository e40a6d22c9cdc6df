"""HTML for the demo's panes, metrics, per-position acceptance chart and batch table (escaped, no scripts)."""

from __future__ import annotations

from html import escape

from ..metrics import SpeculativeMetrics
from .stream import BatchResult, Comparison, Pane

CSS = """
.sd-pane { min-height: 12em; max-height: 28em; overflow-y: auto; padding: 0.6em; border-radius: 6px;
           border: 1px solid #d0d7de; white-space: pre-wrap; font-family: ui-monospace, monospace; line-height: 1.5; }
.sd-head { font-weight: 600; margin-bottom: 0.3em; display: flex; justify-content: space-between; }
.sd-rate { font-variant-numeric: tabular-nums; color: #0969da; }
.sd-acc0 { background: #b7ebc6; color: #0b3d1c; border-radius: 3px; }
.sd-acc1 { background: #7fd69a; color: #0b3d1c; border-radius: 3px; }
.sd-tgt { }
.sd-legend span { padding: 0 0.4em; margin-right: 0.6em; }
.sd-metrics table, .sd-batch table, .sd-metrics tr, .sd-batch tr { border-collapse: collapse;
                                                                   border: none !important; }
.sd-metrics td, .sd-batch td, .sd-batch th { padding: 0.2em 0.8em; border: none !important;
                                             border-bottom: 1px solid #eaeef2 !important; vertical-align: top;
                                             text-align: left; }
.sd-bar-row { display: flex; align-items: center; gap: 0.5em; margin: 0.15em 0; }
.sd-bar-label { width: 5.5em; text-align: right; font-variant-numeric: tabular-nums; }
.sd-bar-track { flex: 1; background: #eaeef2; border-radius: 3px; height: 1.1em; max-width: 30em; }
.sd-bar { background: #2da44e; height: 100%; border-radius: 3px; }
.sd-status-error { color: #cf222e; font-weight: 600; }
"""

LEGEND = ('<div class="sd-legend"><span class="sd-acc0">accepted draft</span><span class="sd-acc1">accepted draft '
          '(next step)</span><span class="sd-tgt">produced by the target (recovered or bonus token)</span></div>')


def pane_html(pane: Pane | None, title: str) -> str:
    """One pane: a header with tokens and live tokens/s, then the text; accepted drafts are highlighted per step."""
    if pane is None or not pane.pieces and not pane.done:
        rate = "waiting" if pane is None else "generating..."
        return f'<div class="sd-head"><span>{escape(title)}</span><span class="sd-rate">{rate}</span></div>' \
               '<div class="sd-pane"></div>'
    spans = []
    for piece in pane.pieces:
        if not piece.text:
            continue
        if piece.kind == "accepted":
            spans.append(f'<span class="sd-acc{piece.step % 2}" data-kind="accepted">{escape(piece.text)}</span>')
        else:
            spans.append(f'<span class="sd-tgt" data-kind="target">{escape(piece.text)}</span>')
    state = "done" if pane.done else "streaming"
    return (f'<div class="sd-head"><span>{escape(title)}</span><span class="sd-rate" data-state="{state}">'
            f'{pane.num_tokens} tokens, {pane.tokens_per_s:.1f} tokens/s{" (done)" if pane.done else ""}'
            f'</span></div><div class="sd-pane" data-state="{state}">{"".join(spans)}</div>')


def metrics_html(comparison: Comparison) -> str:
    """The speedup and acceptance numbers, once both runs have finished."""
    metrics = comparison.metrics
    if metrics is None or not comparison.done:
        return ""
    settings = comparison.settings
    if settings.do_sample:
        same = "not compared (sampling: both follow the target's distribution, so texts differ run to run)"
    else:
        same = "yes, token for token" if comparison.identical else "NO (please report this)"
    rows = [
        ("speedup", f"{comparison.speedup:.2f}x"),
        ("plain generate", f"{comparison.plain.tokens_per_s:.1f} tokens/s ({comparison.plain.num_tokens} tokens in "
                           f"{comparison.plain.elapsed_s:.2f} s)"),
        ("speculative", f"{comparison.speculative.tokens_per_s:.1f} tokens/s ({comparison.speculative.num_tokens} "
                        f"tokens in {comparison.speculative.elapsed_s:.2f} s)"),
        *_acceptance_rows(metrics),
        ("identical to plain greedy", same),
        ("settings", f"{settings.speculator}, k up to {settings.k} ({settings.schedule}), "
                     + (f"sampling T={settings.temperature:g} top-p={settings.top_p:g} seed {settings.seed}"
                        if settings.do_sample else "greedy")),
    ]
    return _table("sd-metrics", rows)


def _acceptance_rows(metrics: SpeculativeMetrics) -> list[tuple[str, str]]:
    return [
        ("acceptance rate", f"{metrics.acceptance_rate:.3f} ({metrics.num_accepted_tokens} of "
                            f"{metrics.num_draft_tokens} drafted tokens)"),
        ("mean acceptance length", f"{metrics.mean_acceptance_length:.2f} tokens per target forward that drafted"),
        ("target forwards", f"{metrics.num_steps} for {metrics.num_emitted_tokens} tokens"),
    ]


def chart_html(metrics: SpeculativeMetrics | None) -> str:
    """Per-position acceptance: for each draft position i, the share of drafts with at least i + 1 accepted."""
    if metrics is None:
        return ""
    rates = metrics.acceptance_rate_per_position
    if not rates:
        return '<div class="sd-chart"><b>Per-position acceptance</b><p>No draft token was accepted.</p></div>'
    bars = "".join(
        f'<div class="sd-bar-row" data-position="{i + 1}"><span class="sd-bar-label">position {i + 1}</span>'
        f'<div class="sd-bar-track"><div class="sd-bar" style="width: {100 * rate:.1f}%"></div></div>'
        f'<span>{rate:.2f}</span></div>'
        for i, rate in enumerate(rates))
    return (f'<div class="sd-chart"><b>Per-position acceptance</b> (share of {metrics.num_drafts} drafts whose '
            f'first i tokens were all accepted)' + bars + '</div>')


def batch_html(result: BatchResult) -> str:
    """Batched throughput of both runs, then each prompt's output."""
    same = "not compared (sampling)" if result.settings.do_sample else (
        "yes, every row" if result.identical else "NO (please report this)")
    speedup = result.speculative_tokens_per_s / result.plain_tokens_per_s
    summary = _table("sd-metrics", [
        ("batch", f"{len(result.prompts)} prompts, {sum(result.num_new_tokens)} new tokens"),
        ("plain generate", f"{result.plain_tokens_per_s:.1f} tokens/s ({result.plain_time_s:.2f} s)"),
        ("speculative", f"{result.speculative_tokens_per_s:.1f} tokens/s ({result.speculative_time_s:.2f} s)"),
        ("speedup", f"{speedup:.2f}x"),
        *_acceptance_rows(result.metrics),
        ("identical to plain greedy", same),
    ])
    rows = "".join(
        f"<tr><td>{i}</td><td>{escape(_shorten(prompt))}</td><td>{n}</td><td>{escape(output)}</td></tr>"
        for i, (prompt, output, n) in enumerate(zip(result.prompts, result.outputs, result.num_new_tokens), 1))
    return (f'<div class="sd-batch">{summary}<table><tr><th>#</th><th>prompt</th><th>tokens</th><th>output</th></tr>'
            f"{rows}</table></div>")


def status_html(message: str, error: bool = False) -> str:
    css = "sd-status-error" if error else "sd-status"
    return f'<div class="{css}" role="status">{escape(message)}</div>'


def _table(css: str, rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{escape(name)}</td><td>{escape(value)}</td></tr>" for name, value in rows)
    return f'<div class="{css}"><table>{body}</table></div>'


def _shorten(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
