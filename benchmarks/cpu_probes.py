"""Probes for the open-chat head's own gain and the batch floors on a CPU (issue 50), each run side by side in one
process: what docs/benchmarks.md, "Tried and not kept, 2026-12-07", reports. None of them paid on a 2-core AMD EPYC.

    python benchmarks/cpu_probes.py head-int8 [--rounds 3]        # the shipped head float32 / int8, batch 1, open chat
    python benchmarks/cpu_probes.py head-products [--rounds 15]   # one draft's products: float32 (W @ x.T).T / bfloat16
    python benchmarks/cpu_probes.py padded-rows [--rounds 12]     # the target's products at n rows / padded to n + 1
    python benchmarks/cpu_probes.py weigh-rows [--rounds 4]       # generate at batch 4, rows weighed by tokens left or not
    python benchmarks/cpu_probes.py ngram-split [--rounds 4]      # open-chat n-gram at batch 4: as it runs / no drafts /
                                                                  # no lookups
Each also takes `--model`, `--threads` (default 2) and `--max-new-tokens` (default 128). Ratios against speculation
off are medians of paired calls; configurations alternate, their order reversed every other round.
"""

import argparse
import statistics
import time

import _common  # benchmarks/, this script's folder
import torch

import hf_specdec
from hf_specdec.costs import adaptive
from hf_specdec.costs.linear_forms import thin_product
from hf_specdec.decode import scheduler


def interleaved(configs: dict, call, rounds: int) -> dict[str, list]:
    """`call(config)` for every configuration, once untimed, then `rounds` times alternating."""
    for config in configs.values():
        call(config)
    samples = {name: [] for name in configs}
    for i in range(rounds):
        for name in (list(configs) if i % 2 else list(configs)[::-1]):
            samples[name].append(call(configs[name]))
    return samples


def report(samples: dict[str, list], off: str = "off") -> None:
    """Each configuration's median seconds, paired ratio against `off` and its last call's speculative metrics."""
    for name, runs in samples.items():
        ratio = statistics.median(o[0] / r[0] for o, r in zip(samples[off], runs))
        m = runs[-1][1]
        extra = ""
        if m is not None and m.num_draft_tokens:
            extra = (f", tokens a step {m.num_emitted_tokens / m.num_steps:.2f}, acceptance {m.acceptance_rate:.2f}, "
                     f"draft ms a token {1000 * m.draft_time_s / m.num_draft_tokens:.2f}")
        print(f"{name}: {statistics.median(r[0] for r in runs):.2f} s, {ratio:.3f}x speculation off, "
              f"steps {m.num_steps if m is not None else '-'}{extra}")


def generate(model, inputs, max_new_tokens: int, speculator):
    """Seconds and metrics of one greedy call (several inputs: their summed time, the last one's metrics)."""
    start, metrics = time.perf_counter(), None
    for one in inputs:
        with torch.no_grad():
            out = model.generate(**one, max_new_tokens=max_new_tokens, do_sample=False, speculator=speculator,
                                 return_dict_in_generate=True)
        metrics = out.speculative_metrics
    return time.perf_counter() - start, metrics


def int8_head(model_name: str, qconfig) -> hf_specdec.EagleSpeculator:
    """The head shipped for `model_name` with its layer's and LM head's products in int8 (torch's dynamic
    quantization)."""
    head = hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(model_name))
    parts = torch.nn.ModuleDict({"layer": head.head.layer, "lm_head": torch.nn.Sequential(head.head.lm_head)})
    torch.ao.quantization.quantize_dynamic(parts, {torch.nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
    head.head.layer, head.head.lm_head = parts["layer"], parts["lm_head"][0]
    return head


def head_int8(args) -> None:
    model, tokenizer = _common.load(args)
    inputs = [_common.chat_batch(tokenizer, [text]) for text in _common.prompt_texts("open_chat")]
    configs = {"off": "off",
               "float32 head": hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model)),
               "int8 head, per tensor": int8_head(args.model, torch.ao.quantization.default_dynamic_qconfig),
               "int8 head, per channel": int8_head(args.model, torch.ao.quantization.per_channel_dynamic_qconfig)}
    report(interleaved(configs, lambda s: generate(model, inputs, args.max_new_tokens, s), args.rounds))


def head_products(args) -> None:
    """A head's 9 products of one draft (fc, q, k, v, o, gate, up, down, LM head over 8192 tokens) at one row, over 8
    copies of the weights so that they stream from memory."""
    torch.set_num_threads(args.threads)
    shapes = [(8192, 576), (576, 1728), (576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
              (576, 1536)]
    weights = [[torch.randn(s) * 0.05 for s in shapes] for _ in range(8)]
    forms = {"float32 (W @ x.T).T": (weights, thin_product),
             "bfloat16 F.linear": ([[w.bfloat16() for w in ws] for ws in weights],
                                   lambda w, x: torch.nn.functional.linear(x, w))}

    def call(form):
        copies, product = form
        xs = {n: torch.randn(1, n, dtype=copies[0][0].dtype) for n in (576, 1536, 1728)}
        start = time.perf_counter()
        with torch.no_grad():
            for ws in copies:
                for w in ws:
                    product(w, xs[w.shape[1]])
        return (time.perf_counter() - start) / len(copies)

    for name, runs in interleaved(forms, call, args.rounds).items():
        print(f"{name}: {1000 * statistics.median(runs):.3f} ms a draft's products")


def padded_rows(args) -> None:
    """The target's products in a forward's order at n rows through `(W @ x.T).T`, and at n rows padded to n + 1."""
    model, _ = _common.load(args)
    weights = [m.weight.detach() for m in model.modules() if type(m) is torch.nn.Linear]
    cases = {f"{n} rows" + (f" as {n + 1}" if pad else ""): (n, pad) for n in (3, 5, 7) for pad in (False, True)}

    def call(case):
        n, pad = case
        xs = {k: torch.randn(n, k) for k in {w.shape[1] for w in weights}}
        start = time.perf_counter()
        with torch.no_grad():
            for w in weights:
                x = xs[w.shape[1]]
                (w @ torch.cat([x, x[:1]]).t())[:, :n].t().contiguous() if pad else thin_product(w, x)
        return time.perf_counter() - start

    for name, runs in interleaved(cases, call, args.rounds).items():
        print(f"{name}: {1000 * statistics.median(runs):.1f} ms for {len(weights)} products")


def weigh_rows(args) -> None:
    """`generate` at batch 4 with `Scheduler(weigh_rows=True)` (the server's setting) against its default."""
    model, tokenizer = _common.load(args)
    weigh, original = [False], scheduler.Scheduler.__init__

    def init(self, *a, **kw):
        original(self, *a, **{**kw, "weigh_rows": weigh[0] or kw.get("weigh_rows", False)})

    scheduler.Scheduler.__init__ = init
    head = hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model))
    for workload in ("grounded", "open_chat"):
        inputs = [_common.chat_batch(tokenizer, workload, rows=4)]
        configs = {"off": ("off", False)}
        for name, spec in (("ngram", "ngram"), ("head", head)):
            configs.update({f"{name}": (spec, False), f"{name}, rows weighed": (spec, True)})

        def call(config):
            weigh[0] = config[1]
            return generate(model, inputs, args.max_new_tokens, config[0])

        print(f"{workload}, batch 4:")
        report(interleaved(configs, call, args.rounds))


def ngram_split(args) -> None:
    """Open-chat n-gram at batch 4 (after a grounded call, as the bench runs it): as it runs, with the lookup run every
    step but no draft verified, and with the lookup skipped too."""
    model, tokenizer = _common.load(args)
    mode = ["as it runs"]
    choose_rows, may_draft = adaptive.AdaptiveK.choose_rows, adaptive.AdaptiveK.may_draft

    def no_offers(original, skipped):
        def call(self, rows, available, *a, **kw):
            return original(self, rows, [0] * len(available) if mode[0] in skipped else available, *a, **kw)
        return call

    adaptive.AdaptiveK.choose_rows = no_offers(choose_rows, ("no drafts",))
    adaptive.AdaptiveK.may_draft = no_offers(may_draft, ("no lookups",))
    generate(model, [_common.chat_batch(tokenizer, "grounded", rows=4)], args.max_new_tokens, "ngram")
    inputs = [_common.chat_batch(tokenizer, "open_chat", rows=4)]
    configs = {"off": "off", "as it runs": "ngram", "no drafts": "ngram", "no lookups": "ngram"}

    def call(name):
        mode[0] = name
        return generate(model, inputs, args.max_new_tokens, configs[name])

    report(interleaved({name: name for name in configs}, call, args.rounds))


PROBES = {"head-int8": (head_int8, 3), "head-products": (head_products, 15), "padded-rows": (padded_rows, 12),
          "weigh-rows": (weigh_rows, 4), "ngram-split": (ngram_split, 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--rounds", type=int, help="timed rounds (default: the probe's own)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    _common.add_model_args(parser, options=("model", "threads"))
    args = parser.parse_args()
    probe, rounds = PROBES[args.probe]
    args.rounds = args.rounds or rounds
    probe(args)


if __name__ == "__main__":
    main()
