"""What a speculator's drafted token costs on this host, in target steps, timed from its own proposals."""

from __future__ import annotations

import torch

from ..runners.model_runner import input_device
from .timing import ATTEMPTS, measure_repeated


# A speculator's drafts ----------------------------------------------------------------------------------------------
def draft_sample(model, speculator, ids: torch.Tensor, k: int, max_new_tokens: int) -> tuple[float, float]:
    """One short greedy call at batch 1 and constant k: `(ms per drafted token, ms per verify step)`, as the
    engine timed them."""
    m = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, speculator=speculator,
                       num_speculative_tokens=k, speculative_schedule="constant", max_new_tokens=max_new_tokens,
                       return_dict_in_generate=True).speculative_metrics
    return 1000 * m.draft_time_s / max(m.num_draft_tokens, 1), 1000 * m.verify_time_s / max(m.num_steps, 1)


def measure_draft_cost(model, speculator, step_cost, k: int = 4, max_new_tokens: int = 24, prompt_tokens: int = 64,
                       repeats: int = 3, attempts: int = ATTEMPTS, sample=None) -> tuple[float, dict, str | None]:
    """A speculator's cost per drafted token in plain steps, from its own proposals in `repeats` short calls (a
    random prompt). Each call's drafting is divided by the same call's verify forwards (of k + 1 tokens, priced at
    `step_cost.relative(1, k + 1)` plain steps), so a load that changed since the step cost was measured cancels
    out. Returns `(cost, timings, why it is not to be trusted or None)`."""

    sample = sample or draft_sample
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(vocab, 1000), (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(input_device(model))
    sample(model, speculator, ids, k, 4)  # warm-up
    verify_steps = float(step_cost.relative(1, torch.tensor(k + 1.0, dtype=torch.float64),
                                            prompt_tokens + max_new_tokens // 2))
    timings = {"draft_ms_per_token": [], "verify_ms_per_step": []}

    def run_round(i: int) -> dict[tuple, float]:
        draft_ms, verify_ms = sample(model, speculator, ids, k, max_new_tokens)
        timings["draft_ms_per_token"].append(round(draft_ms, 3))
        timings["verify_ms_per_step"].append(round(verify_ms, 3))
        return {("draft",): draft_ms / verify_ms * verify_steps}

    def check(medians):
        if not medians[("draft",)] >= 0.0:
            return f"a negative or undefined draft cost ({medians[('draft',)]})"
        return None

    measurement = measure_repeated(run_round, repeats, check, attempts)
    cost = measurement.medians[("draft",)]
    details = {**timings, "verify_steps": round(verify_steps, 3), "attempts": measurement.attempts}
    return cost, details, measurement.problem
