"""MLP speculators (the ibm-fms "accelerator" heads; vLLM's `mlp_speculator`): a small recurrent MLP over the
target's final hidden state and the tokens drafted so far.

Stage i takes the previous state (the target's final hidden state for stage 0, then its own output) and the token
before the one it drafts (the newest committed token for stage 0, then its own drafts):

    state = gelu(ln_i(proj_i(state) * state_weight + emb_i(token) * emb_weight * sqrt(inner_dim / 2)))
    logits = head_i(state)

with `state_weight = 0.5 ** (0.5 / n_predict)`, `emb_weight = sqrt(1 - state_weight ** 2)`, and `ln_i` a scale-only
normalisation (no mean subtraction, eps 1e-6) followed by an elementwise scale and shift. With `scale_input` the
target's state is first normalised (no affine) and divided by sqrt(2). With `tie_weights` every stage shares one
embedding, one LM head and one norm, and stages 1 .. n - 1 share one projection (stage 0's reads the target's
width, so it stays separate). The format is written by `convert_head.py` and read in `head_format.py`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .medusa import FinalStateSpeculator

NORM_EPS = 1e-6


def resolved(config: dict) -> dict:
    """The `mlp_speculator` section of our config with defaults filled in (`inner_dim` 0 means `emb_dim`)."""
    mlp = dict(config["mlp_speculator"])
    mlp["inner_dim"] = mlp.get("inner_dim") or mlp["emb_dim"]
    return mlp


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Our format's tensors for an MLP speculator config: name -> shape (all floating point)."""
    mlp = resolved(config)
    n, inner, vocab = mlp["n_predict"], mlp["inner_dim"], mlp["vocab_size"]
    tensors: dict[str, tuple[int, ...]] = {}
    for i in range(1 if mlp["tie_weights"] else n):
        tensors[f"emb.{i}.weight"] = (vocab, inner)
        tensors[f"head.{i}.weight"] = (vocab, inner)
        tensors[f"ln.{i}.weight"] = (inner,)
        tensors[f"ln.{i}.bias"] = (inner,)
    for i in range(min(n, 2) if mlp["tie_weights"] else n):
        tensors[f"proj.{i}.weight"] = (inner, mlp["emb_dim"] if i == 0 else inner)
    return tensors


class ScaleNorm(nn.Module):
    """`x / rms(x)` (no mean subtraction), then an optional elementwise scale and shift."""

    def __init__(self, dim: int, affine: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return x if self.weight is None else x * self.weight + self.bias


class MlpSpeculatorHead(nn.Module):
    """An MLP speculator in our format. Module names follow the reference (`emb`, `proj`, `head`, `ln`); with
    `tie_weights` only the distinct modules exist (`emb.0`, `proj.0`, `proj.1`, `head.0`, `ln.0`).

    Args:
        config (`dict`): the contents of our format's `head_config.json` (kind `"mlp_speculator"`).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        mlp = resolved(config)
        self.num_stages, self.tied = mlp["n_predict"], mlp["tie_weights"]
        inner, vocab = mlp["inner_dim"], mlp["vocab_size"]
        distinct = 1 if self.tied else self.num_stages
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner) for _ in range(distinct))
        self.head = nn.ModuleList(nn.Linear(inner, vocab, bias=False) for _ in range(distinct))
        self.ln = nn.ModuleList(ScaleNorm(inner, affine=True) for _ in range(distinct))
        self.proj = nn.ModuleList(nn.Linear(mlp["emb_dim"] if i == 0 else inner, inner, bias=False)
                                  for i in range(min(self.num_stages, 2) if self.tied else self.num_stages))
        self.input_norm = ScaleNorm(mlp["emb_dim"], affine=False) if mlp["scale_input"] else None
        self.state_weight = 0.5 ** (0.5 / self.num_stages)
        self.emb_scale = math.sqrt(1 - self.state_weight ** 2) * math.sqrt(inner / 2)

    def start(self, state: torch.Tensor) -> torch.Tensor:
        """The target's final hidden state `[rows, emb_dim]` as stage 0 reads it."""
        return state if self.input_norm is None else self.input_norm(state) / math.sqrt(2)

    def stage(self, i: int, state: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage i: `state` `[rows, emb_dim or inner_dim]` and the previous token `[rows]` -> `(state, logits)`."""
        shared = 0 if self.tied else i
        state = self.proj[min(i, 1) if self.tied else i](state) * self.state_weight
        state = state + self.emb[shared](token) * self.emb_scale
        state = nn.functional.gelu(self.ln[shared](state))
        return state, self.head[shared](state)

    def stage_numel(self) -> int:
        """Weights one draft multiplies by: a projection and an LM head (the embedding is a lookup)."""
        return self.proj[-1].weight.numel() + self.head[0].weight.numel()


class MlpSpeculator(FinalStateSpeculator):
    """Drafts with an MLP speculator (ibm-fms accelerator): stage i drafts token i + 1 from its state and the token
    before it, starting from the target's final hidden state and newest committed token.

    Chains only: the reference's candidate trees (`top_k_tokens_per_head`, `n_candidates`) are not built; a step
    drafts up to `n_predict` tokens and a larger `num_speculative_tokens` is capped.

    Args:
        head (`MlpSpeculatorHead`): the head; `MlpSpeculator.from_pretrained(path)` builds it from our format.
    """

    kind = "mlp_speculator"
    head_class = MlpSpeculatorHead
    expected_tensors = staticmethod(expected_tensors)
