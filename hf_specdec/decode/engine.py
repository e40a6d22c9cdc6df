"""The one-call engine: `generate(speculator=...)` as a batch of requests that all arrive at once.

`SpeculativeEngine.generate` lays the prompts out as transformers does, hands them to a `scheduler.Scheduler` and
runs it until every row has stopped; `step.Step` is what one step does (propose -> verify -> commit, chains or trees).
The server runs the same scheduler with requests arriving over time (`serving.ServingEngine`).
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import torch

from ..cache.block_manager import OutOfBlocksError
from ..costs.adaptive import AdaptiveK
from ..costs.calibration import adaptive_costs, ensure_profile, host_linear, report_idle
from ..costs.step_cost import StepCost
from ..metrics import SpeculativeMetrics, logger
from ..runners.dense import make_runner, runner_attention
from ..runners.graphed import for_model, requested_settings
from ..runners.model_runner import ModelRunner
from ..structured.constraints import RowConstraints
from ..types import SequenceBatch
from .logits import LogitsProcessing
from .requests import Request
from .scheduler import Scheduler
from .speculator import Speculator
from .step import Step
from .stopping import StopRules


def compile_steps(model, target, speculator: Speculator, generation_config=None) -> None:
    """Compiled steps (`runners/graphed.py`) where the switches (`generation_config`'s, `HF_SPECDEC_COMPILE`) ask for
    them: the target runner's, and the speculator's own forwards where it runs a model."""
    graphs = requested_settings(target.device, generation_config)
    if isinstance(target, ModelRunner):
        target.use_graphs(for_model(graphs, model))
    speculator.graph_settings, speculator.graph_switches = graphs, (target.device.type, generation_config)


def compiled(target) -> str | None:
    """How the target runner's steps run compiled (`compile_steps` turned them on): `"frozen"` where the graph holds
    the weights (`GraphSettings.frozen`), `"compiled"` otherwise, None where they run eagerly."""
    graphs = getattr(target, "graphs", None)
    if graphs is None:
        return None
    return "frozen" if graphs.settings.frozen else "compiled"


def steps_packed(target) -> bool:
    """Whether the target's verify steps feed each row only its own drafts (a packed runner's eager steps), as
    adaptive k prices them; compiled steps feed every row the widest row's tokens (one graph per width)."""
    return target.packed and compiled(target) is None


class SpeculativeEngine:
    """Runs one batched speculative `generate` call.

    Args:
        model (`PreTrainedModel`): the target.
        speculator (`Speculator`): proposes drafts.
        num_speculative_tokens (`int`): k, the most drafts per row and step.
        block_size (`int`): KV block size in tokens.
        max_num_blocks (`int`, *optional*): cap on the target's KV pool; a batch that cannot fit is refused.
        schedule (`str`): `"adaptive"` picks k in `[0, num_speculative_tokens]` each step from the acceptance seen so
            far (see `costs/adaptive.py`); `"constant"` always drafts `num_speculative_tokens`.
        step_cost (`StepCost`, *optional*): adaptive k's model of a target forward's cost; defaults to the cached
            profile of this host (`costs/calibration.py`), else one measured for the model's device type.
        tree_nodes (`int`, *optional*): draft trees instead of chains: the speculator proposes up to this many nodes
            per row, at most `num_speculative_tokens` deep, and one forward verifies them all (see `_tree_step`).
            Trees use a fixed shape: `schedule` must be `"constant"`.
        tree_branching (`int`): children a tree node may get (the speculator's top-k per expansion).
        calibration (`bool`): use this host's cached profile (measured costs, the small-row linear form), if any.
        generation_config (`GenerationConfig`, *optional*): the call's; its `disable_compile` and `compile_config`
            decide whether the target's narrow steps run compiled (`runners/graphed.py`).
    """

    def __init__(self, model, speculator: Speculator, num_speculative_tokens: int, block_size: int = 16,
                 max_num_blocks: int | None = None, schedule: str = "adaptive", step_cost: StepCost | None = None,
                 tree_nodes: int | None = None, tree_branching: int = 4, calibration: bool = True,
                 generation_config=None):
        if schedule not in ("adaptive", "constant"):
            raise ValueError(f"speculative_schedule must be 'adaptive' or 'constant', got {schedule!r}")
        if tree_nodes is not None:
            if schedule != "constant":
                raise ValueError("draft trees have a fixed shape: use speculative_schedule='constant' with them")
            if not speculator.supports_trees:
                raise ValueError(f"{type(speculator).__name__} drafts chains only; drop speculative_tree_nodes= "
                                 "(draft trees need an EagleSpeculator)")
        self.model = model
        self.speculator = speculator
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks
        self.schedule = schedule
        self.step_cost = step_cost
        self.tree_nodes = tree_nodes
        self.tree_branching = tree_branching
        self.calibration = calibration
        self.generation_config = generation_config

    def generate(self, input_ids, attention_mask, max_new_tokens: int, do_sample: bool, logits_processor=None,
                 stopping_criteria=None, eos_token_ids=None, pad_token_id: int = 0, streamer=None,
                 constraints: RowConstraints | None = None):
        """Generates up to `max_new_tokens` per row.

        Args:
            input_ids: `[batch, prompt_width]` prompts, padded on either side as `attention_mask` says.
            attention_mask: `[batch, prompt_width]` or `None` (no padding).
            constraints: grammars or a `prefix_allowed_tokens_fn` constraining rows (`structured/constraints.py`).
        Returns:
            `(sequences, metrics)`: `[batch, prompt_width + generated]` sequences as transformers returns them (the
            input, then generated tokens padded with `pad_token_id`), and the call's `SpeculativeMetrics`.
        """
        metrics = SpeculativeMetrics()
        start = time.perf_counter()
        self._constraints = constraints if constraints else None
        if self._constraints is not None and self.tree_nodes is not None:
            raise ValueError("grammar= and prefix_allowed_tokens_fn= are not supported with draft trees yet; drop "
                             "speculative_tree_nodes=")
        batch = self._make_batch(input_ids, attention_mask, max_new_tokens, do_sample, logits_processor, pad_token_id)
        self._check_pool_fits(batch.lengths, max_new_tokens)
        target = make_runner(self.model, block_size=self.block_size, max_num_blocks=self.max_num_blocks)
        compile_steps(self.model, target, self.speculator, self.generation_config)
        self._policy = None
        # This host's profile, measured before the first step of the first call that lacks one; fixed for the call
        measuring = time.perf_counter()
        ensure_profile(self.model, self.speculator, self.calibration)
        metrics.measure_time_s = time.perf_counter() - measuring
        if self.schedule == "adaptive" and self.speculator.proposes_drafts:
            cost, draft_cost, cost_source = adaptive_costs(self.model, self.speculator, self.step_cost,
                                                           self.calibration)
            # Calibrated acceptance (the drafts verified are those whose estimates came out highest, so those
            # estimates overrate them): it depends on outputs only, so seeded calls still choose the same k. Without
            # it n-gram ran at 0.93-0.97x speculation off on open chat at batch 4 (docs/benchmarks.md).
            # Steps compiled with their weights frozen cost what no eager profile says (1-4 tokens at the price of
            # one on a CPU, then dearer per token than eager ones): the policy prices drafts by the steps' own
            # timings once it has seen a few (`MeasuredStepCost`).
            self._policy = AdaptiveK(len(batch.lengths), self.k, cost, draft_cost,
                                     priors=self.speculator.confidence_priors, packed=steps_packed(target),
                                     calibrate=True, measure_steps=compiled(target) == "frozen")
        stop = StopRules(stopping_criteria, eos_token_ids)
        if self.tree_nodes is not None and not getattr(target, "supports_trees", True):
            raise ValueError(f"{type(self.model).__name__} runs on hf_specdec's masked cache (it does not use "
                             "transformers' attention interface), which cannot attend by a draft tree; drop "
                             "speculative_tree_nodes=")
        step = Step(self.speculator, self.k, self.tree_nodes, self.tree_branching, self._constraints, self._policy)
        scheduler = Scheduler(batch, target, step, stop, pad_token_id, metrics, collect_tokens=streamer is not None)
        requests = [Request(None, max_new_tokens, slot=row) for row in range(len(batch.lengths))]
        scheduler.place(requests, self._region_tokens(batch.lengths, max_new_tokens))
        with ExitStack() as stack:
            stack.enter_context(runner_attention(self.model))
            stack.enter_context(host_linear(self.model, self.speculator, self.calibration, compiled(target)))
            self.speculator.begin(self.model, batch)
            stack.callback(self.speculator.end)
            while scheduler.has_work() and max_new_tokens > 0:
                for request, tokens, _ in scheduler.step():
                    if request.finish_reason == "error":  # a row's grammar allows no token: the call fails
                        raise ValueError(request.error)
                    if streamer is not None and request.slot == 0 and tokens:
                        streamer.put(torch.tensor(tokens))
        num_generated = [r.num_generated for r in requests]
        if streamer is not None:
            streamer.end()
        metrics.num_emitted_tokens = sum(num_generated)
        metrics.total_time_s = time.perf_counter() - start
        metrics.k_per_step = list(self._policy.chosen) if self._policy is not None else [self.k] * metrics.num_steps
        logger.info(metrics.summary())
        if self._policy is not None:
            report_idle(self._policy, self.model, self.speculator, cost_source)
        return self._sequences(input_ids, batch, num_generated, pad_token_id), metrics

    # A one-call batch reserves each row's worst case up front, in consecutive regions of the KV pool, so attention
    # reads every row's keys and values in place instead of gathering them each layer and step (the PyTorch path;
    # `PagedKVCache.give_regions`). Like a static cache this holds memory for tokens rows may never reach, so only
    # for answers of at most this many tokens and where the regions (each as long as the longest row needs) hold at
    # most twice what the rows' own worst cases add up to; otherwise blocks are taken as rows grow.
    REGION_MAX_NEW_TOKENS = 1024

    def _region_tokens(self, prompt_lengths: list[int], max_new_tokens: int) -> int | None:
        extra = max(self.k, self.tree_nodes or 0) + 1  # a step's drafts are written before they are verified
        worst = [n + max_new_tokens + extra for n in prompt_lengths]
        region = -(-max(worst) // self.block_size) * self.block_size
        if max_new_tokens > self.REGION_MAX_NEW_TOKENS or len(worst) * region > 2 * sum(worst):
            return None
        if self.max_num_blocks is not None and len(worst) * region // self.block_size > self.max_num_blocks - 1:
            return None
        return region

    def _check_pool_fits(self, prompt_lengths: list[int], max_new_tokens: int) -> None:
        # Refuse before starting, so a batch that cannot fit never leaves other rows half-generated.
        if self.max_num_blocks is None:
            return
        extra = max(self.k, self.tree_nodes or 0)  # a step's drafts are written before they are verified
        worst = sum(-(-(n + max_new_tokens + extra) // self.block_size) for n in prompt_lengths)
        if worst > self.max_num_blocks - 1:
            raise OutOfBlocksError(
                f"this batch may need {worst} KV blocks of {self.block_size} tokens but the pool is capped at "
                f"{self.max_num_blocks - 1}; lower the batch size or max_new_tokens, or raise max_num_blocks"
            )

    def _make_batch(self, input_ids, attention_mask, max_new_tokens, do_sample, logits_processor, pad_token_id):
        rows, width = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
        lengths = mask.sum(-1)
        if (lengths == 0).any():
            empty = (lengths == 0).nonzero().flatten().tolist()
            raise ValueError(f"rows {empty} of the batch have empty prompts (attention_mask all 0); give every row "
                             "at least one token")
        # Left-pack each row's real tokens against column `width`, as transformers' left padding would.
        buffer = torch.full((rows, width + max_new_tokens + self.k + 2), pad_token_id, dtype=torch.long,
                            device=input_ids.device)
        first_col = width - lengths
        cols = first_col[:, None] + mask.long().cumsum(-1) - 1
        cols = torch.where(mask.bool(), cols, buffer.shape[1] - 1)  # padding goes to a scratch column
        buffer.scatter_(1, cols, input_ids.long())  # int32 ids, say, as plain generate takes them
        buffer[:, -1] = pad_token_id
        vocab = self.model.config.get_text_config().vocab_size
        return SequenceBatch(buffer, first_col, lengths.tolist(), list(range(rows)), width, do_sample,
                             LogitsProcessing(logits_processor, rows), vocab)

    @staticmethod
    def _sequences(input_ids, batch, num_generated, pad_token_id):
        longest = max(num_generated, default=0)
        generated = batch.token_ids[:, batch.prompt_width: batch.prompt_width + longest]
        generated_count = torch.tensor(num_generated, device=generated.device)
        keep = torch.arange(longest, device=generated.device)[None, :] < generated_count[:, None]
        return torch.cat([input_ids, torch.where(keep, generated, pad_token_id)], dim=1)

