"""Probes for the open-chat head's own gain and the batch floors on a CPU (issue 50), each run side by side in one
process: what docs/benchmarks.md reports under "Five repeats, with their spread" (head-depth, verify-forms,
ngram-priors) and "Tried and not kept, 2026-12-07" (the rest). Of the changes they try, only the n-gram priors for
short matches paid on a 2-core AMD EPYC (shipped).

    python benchmarks/cpu_probes.py head-int8 [--rounds 3]        # the shipped head float32 / int8, batch 1, open chat
    python benchmarks/cpu_probes.py head-products [--rounds 15]   # one draft's products: float32 (W @ x.T).T / bfloat16
    python benchmarks/cpu_probes.py padded-rows [--rounds 12]     # the target's products at n rows / padded to n + 1
    python benchmarks/cpu_probes.py weigh-rows [--rounds 4]       # generate at batch 4, rows weighed by tokens left or not
    python benchmarks/cpu_probes.py ngram-split [--rounds 4]      # open-chat n-gram at batch 4: as it runs / no drafts /
                                                                  # no lookups
    python benchmarks/cpu_probes.py head-depth                    # the head's acceptance by position; the gain a chain
                                                                  # could reach at batch 1 by this host's profile
    python benchmarks/cpu_probes.py head-confidence               # chains cut where the head's joint probability
                                                                  # falls below a threshold, by this host's profile
    python benchmarks/cpu_probes.py verify-forms [--rounds 6]     # a verify at widths 1-6: the profile's linear forms /
                                                                  # packed at 3-4 rows as well (LM head, groups, all)
    python benchmarks/cpu_probes.py ngram-priors [--rounds 5]     # n-gram priors m/(m+1.5) / m/(m+3) / short only,
                                                                  # batch 1 and 4 [--hybrid]
    python benchmarks/cpu_probes.py head-returns [--rounds 3]     # the head / with the whole-step check of drafts
    python benchmarks/cpu_probes.py static-defaults [--rounds 3]  # nothing measured: speculators priced by the static
                                                                  # CPU curve as shipped / candidates [--candidates]
Each also takes `--model`, `--threads` (default 2) and `--max-new-tokens` (default 128). Ratios against speculation
off are medians of paired calls; configurations alternate, their order reversed every other round.
"""

import argparse
import dataclasses
import statistics
import time

import _common  # benchmarks/, this script's folder
import torch

import hf_specdec
from hf_specdec.costs import adaptive, calibration
from hf_specdec.costs.linear_forms import thin_product
from hf_specdec.costs.linear_weights import shape_key
from hf_specdec.decode import scheduler
from hf_specdec.decode.speculator import Speculator
from hf_specdec.types import DraftProposal


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


def generate(model, inputs, max_new_tokens: int, speculator, **kwargs):
    """Seconds and metrics of one greedy call (several inputs: their summed time, the last one's metrics); `kwargs`
    go to `generate`."""
    start, metrics = time.perf_counter(), None
    for one in inputs:
        with torch.no_grad():
            out = model.generate(**one, max_new_tokens=max_new_tokens, do_sample=False, speculator=speculator,
                                 return_dict_in_generate=True, **kwargs)
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
    report(interleaved(configs, lambda s, inputs=inputs: generate(model, inputs, args.max_new_tokens, s),
                           args.rounds))


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


def host_prices(model) -> tuple | None:
    """This host's step-cost curve and the shipped head's draft cost per token (the default cache's profile), or None
    (said) where the profile lacks a step cost."""
    profile = calibration.load_profile(model)
    if profile is None or profile.step_cost is None:
        print("no measured step cost for this host: run `hf-specdec calibrate` first")
        return None
    return profile.step_cost, next(iter(profile.draft_costs.values()), 0.0)


def head_depth(args) -> None:
    """The shipped head's acceptance by draft position at a constant k of 6 (open chat and the held-out prompts, batch
    1), and the most speculation could gain over speculation off at batch 1 for a chain accepted position by position
    with chance a, priced by this host's profile (`hf-specdec calibrate`): its step-cost curve, the head's draft cost
    per token, and one more draft's worth for the step's catch-up. Host work outside the forwards is left out, so
    the real gain is lower."""
    model, tokenizer = _common.load(args)
    head = hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model))
    for workload in ("open_chat", "held_out"):
        drafts, reached = 0, [0] * 6
        for text in _common.prompt_texts(workload):
            with torch.no_grad():
                m = model.generate(**_common.chat_batch(tokenizer, [text]), max_new_tokens=args.max_new_tokens,
                                   do_sample=False, speculator=head, num_speculative_tokens=6,
                                   speculative_schedule="constant", return_dict_in_generate=True).speculative_metrics
            drafts += m.num_drafts
            reached = [a + b for a, b in zip(reached, m.accepted_per_position + [0] * 6)]
        share = [n / max(drafts, 1) for n in reached]  # drafts with at least j + 1 accepted
        given = [share[0]] + [b / a if a else 0.0 for a, b in zip(share, share[1:])]
        print(f"{workload}: {drafts} drafts; accepted at position 1-6 given the one before: "
              f"{', '.join(f'{p:.2f}' for p in given)}; accepted per draft {sum(share):.2f}")
    prices = host_prices(model)
    if prices is None:
        return
    cost, draft = prices
    for a in (0.5, 0.55, 0.6, 0.65, 0.7, 0.75):
        gains = [(sum(a ** j for j in range(k + 1)) / (float(cost.relative(1, torch.tensor(k + 1.0), 256))
                                                        + (k + 1) * draft), k) for k in range(1, 11)]
        print(f"a = {a:.2f}: at most {max(gains)[0]:.2f}x speculation off (k = {max(gains)[1]})")


def head_confidence(args) -> None:
    """Whether the head's own confidence says where to stop its chain: drafts at a constant k of 6, batch 1 (open
    chat and the held-out prompts), each draft's probability under the head recorded beside the step's accepted
    count; then, from these records, the gain over speculation off of chains cut where the drafts' joint probability
    falls below a threshold, against constant chains of 1-6, priced as `head-depth` prices them (this host's profile:
    step-cost curve, the head's draft cost per token, one more for the catch-up). No timing but the profile's."""
    from hf_specdec.speculators import eagle as eagle_module

    model, tokenizer = _common.load(args)
    head = hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model))
    step_probs, records = [], []  # this step's draft probabilities; (probabilities, accepted) per step
    original_pick, original_commit = eagle_module.sample_or_argmax, head.commit

    def pick(scores, do_sample, generator=None):
        step_probs.append(float(torch.softmax(scores.float(), dim=-1).max()))
        return original_pick(scores, do_sample, generator)

    def commit(batch, num_accepted):
        if step_probs:
            records.append((list(step_probs), int(num_accepted[0])))
        step_probs.clear()
        return original_commit(batch, num_accepted)

    eagle_module.sample_or_argmax, head.commit = pick, commit
    per_workload = {}
    try:
        for workload in ("open_chat", "held_out"):
            records.clear()
            for text in _common.prompt_texts(workload):
                with torch.no_grad():
                    model.generate(**_common.chat_batch(tokenizer, [text]), max_new_tokens=args.max_new_tokens,
                                   do_sample=False, speculator=head, num_speculative_tokens=6,
                                   speculative_schedule="constant")
            per_workload[workload] = [r for r in records if len(r[0]) == 6]
    finally:
        eagle_module.sample_or_argmax = original_pick
    prices = host_prices(model)
    if prices is None:
        return
    cost, draft = prices
    relative = [float(cost.relative(1, torch.tensor(n + 1.0), 256)) for n in range(7)]

    def gain(steps, offer) -> tuple[float, float, float]:
        """Tokens per unit of cost over speculation off, mean drafts offered, their acceptance."""
        tokens = spent = offered = accepted = 0.0
        for probs, got in steps:
            n, logits = offer(probs)
            tokens += 1 + min(got, n)
            spent += relative[n] + draft * (1 + logits)
            offered, accepted = offered + n, accepted + min(got, n)
        return tokens / spent, offered / len(steps), accepted / max(offered, 1)

    def cut(threshold):
        def offer(probs):
            joint, n = 1.0, 0
            for p in probs:
                joint *= p
                if joint < threshold:
                    break
                n += 1
            return n, min(n + 1, len(probs))  # the draft past the last one offered is computed to be judged
        return offer

    for workload, steps in per_workload.items():
        print(f"{workload}: {len(steps)} steps of 6 drafts; accepted per step {sum(g for _, g in steps) / len(steps):.2f}")
        for k in range(1, 7):
            g = gain(steps, lambda probs, k=k: (k, k))[0]
            print(f"  constant k = {k}: {g:.3f}x speculation off")
        for threshold in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5):
            g, n, a = gain(steps, cut(threshold))
            print(f"  cut at joint probability {threshold:.2f}: {g:.3f}x speculation off, {n:.2f} drafts a step "
                  f"accepted at {a:.2f}")


def verify_forms(args) -> None:
    """A verify step's time at widths 1-6 (a speculator drafting k tokens every step, all rejected) with this host's
    profile as measured, and with the packed form at 3 and 4 rows as well: for the LM head alone, for the sibling
    groups (q/k/v, gate/up) as one product alone, and for every weight shape and group (`--widths`: which widths)."""
    model, tokenizer = _common.load(args)
    measured = calibration.load_profile(model)
    if measured is None:
        print("no profile for this host: run `hf-specdec calibrate` first")
        return
    extra = (3, 4)

    def packed_at(shapes, groups):
        """The measured profile with the packed form at `extra` rows for the named shapes and groups too."""
        return dataclasses.replace(
            measured,
            thin_linear_shapes={s: tuple(r for r in rows if s not in shapes or r not in extra)
                                for s, rows in measured.thin_linear_shapes.items()},
            packed_linear_shapes={s: tuple(sorted({*rows, *extra})) if s in shapes else rows
                                  for s, rows in measured.packed_linear_shapes.items()},
            fused_linear_groups={g: tuple(sorted({*rows, *extra})) if g in groups else rows
                                 for g, rows in measured.fused_linear_groups.items()})

    lm_head = shape_key(model.get_output_embeddings().weight.shape)
    profiles = {"measured": measured, "LM head packed": packed_at({lm_head}, set()),
                "groups fused": packed_at(set(), set(measured.fused_linear_groups)),
                "all packed": packed_at(set(measured.packed_linear_shapes), set(measured.fused_linear_groups))}
    original = calibration.load_profile
    chosen = [measured]
    calibration.load_profile = lambda m, *a, **kw: chosen[0] if m is model else original(m, *a, **kw)

    class Rejected(Speculator):
        """Drafts k copies of token 1 for every row, every step."""

        def propose(self, batch, k):
            rows = len(batch.active)
            return DraftProposal(torch.ones(rows, k, dtype=torch.long), torch.full((rows,), k))

    inputs = _common.chat_batch(tokenizer, [_common.prompt_texts("grounded")[0]])

    def call(case):
        chosen[0], k = case
        with torch.no_grad():
            m = model.generate(**inputs, max_new_tokens=24, do_sample=False, speculator=Rejected() if k else "off",
                               num_speculative_tokens=max(k, 1), speculative_schedule="constant",
                               return_dict_in_generate=True).speculative_metrics
        return m.verify_time_s / m.num_steps

    for width in args.widths:
        runs = interleaved({name: (profile, width - 1) for name, profile in profiles.items()}, call, args.rounds)
        others = ", ".join(f"{name} {statistics.median(p / m for m, p in zip(runs['measured'], runs[name])):.3f}x"
                           for name in list(profiles)[1:])
        print(f"width {width}: {1000 * statistics.median(runs['measured']):.1f} ms a verify as measured; paired: "
              f"{others}")


def ngram_priors(args) -> None:
    """n-gram with its acceptance priors per matched length m / (m + 1.5) (as shipped until 2026-12-07), less
    optimistic for every match (m / (m + 3)) and for the short ones only (m / (m + 3) up to two tokens, as shipped
    since), against speculation off: grounded and open chat at batch 1 (each prompt in turn) and 4 (`--cells`,
    `--priors`: some of them). `--hybrid`: the same priors in n-gram + head."""
    model, tokenizer = _common.load(args)

    def lookup(short: float, long: float) -> hf_specdec.NgramSpeculator:
        """n-gram with priors m / (m + short) for matches of up to two tokens, m / (m + long) for longer ones."""
        ngram = hf_specdec.NgramSpeculator()
        ngram.confidence_priors = tuple(m / (m + (short if m <= 2 else long))
                                        for m in range(len(ngram.confidence_priors)))
        if not args.hybrid:
            return ngram
        head = hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model))
        return hf_specdec.HybridSpeculator(head, ngram)

    configs = {"off": "off", "priors m/(m+1.5)": lookup(1.5, 1.5), "priors m/(m+3)": lookup(3.0, 3.0),
               "priors m/(m+3) to 2 (shipped)": lookup(3.0, 1.5)}
    run_cells(args, tokenizer, configs, lambda s, inputs: generate(model, inputs, args.max_new_tokens, s))


def run_cells(args, tokenizer, configs: dict, call) -> None:
    """`call(config, inputs)` for the configurations named in `args.priors` (all without) beside speculation off, in
    each `args.cells` cell (default: grounded and open chat at batch 1, each prompt in turn, and 4), side by side."""
    configs = {name: configs[name] for name in ("off", *args.priors)} if args.priors else configs
    cells = [(w, r) for w in ("grounded", "open_chat") for r in (1, 4) if not args.cells or f"{w}:{r}" in args.cells]
    for workload, rows in cells:
        inputs = ([_common.chat_batch(tokenizer, [text]) for text in _common.prompt_texts(workload)] if rows == 1
                  else [_common.chat_batch(tokenizer, workload, rows=4)])
        print(f"{workload}, batch {rows}:", flush=True)
        report(interleaved(configs, lambda config, inputs=inputs: call(config, inputs), args.rounds))


def head_returns(args) -> None:
    """The shipped head with adaptive k as `generate` runs it, and with the serving engine's whole-step check
    (`AdaptiveK(check_returns=True)`: a draft's extra cost per band of batch sizes corrected by what the steps that
    drafted really took), against speculation off (`--cells`; default grounded and open chat at batch 1 and 4)."""
    model, tokenizer = _common.load(args)
    checked, original = [False], adaptive.AdaptiveK.__init__

    def init(self, *a, **kw):
        original(self, *a, **{**kw, "check_returns": checked[0] or kw.get("check_returns", False)})

    adaptive.AdaptiveK.__init__ = init
    head = hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model))
    configs = {"off": ("off", False), "head": (head, False), "head, whole steps checked": (head, True)}

    def call(config, inputs):
        checked[0] = config[1]
        return generate(model, inputs, args.max_new_tokens, config[0])
    run_cells(args, tokenizer, configs, call)


# The static CPU curve as timed with the stock linear forms (what a call that measured nothing runs): SmolLM2-135M,
# float32, 2-core AMD EPYC, `HF_SPECDEC_CALIBRATION=off python benchmarks/step_cost.py --threads 2` (2026-12-07). A
# forward of 2 tokens costs 1.55 plain steps at batch 1 there, where the shipped curve prices it free.
STOCK_CPU = hf_specdec.StepCost(per_row=0.0, per_context_token=0.0132, points=(
    (1, 66.4), (2, 103.3), (3, 103.3), (4, 103.3), (6, 107.0), (8, 107.0), (12, 108.1), (16, 115.0), (24, 134.0),
    (32, 161.3), (48, 207.9), (64, 232.2), (96, 313.5), (128, 381.0), (192, 528.8), (256, 681.1)))
STATIC_CANDIDATES = {"stock": STOCK_CPU, "stock-x1.5": STOCK_CPU.pessimistic(1.5), "stock-x2": STOCK_CPU.pessimistic()}


def static_defaults(args) -> None:
    """Where nothing was measured (`speculative_calibration=False`: the stock linear forms, the static step cost, drafts
    priced by parameter count): n-gram and the shipped head as shipped, and n-gram, the head and n-gram + head priced
    by each candidate static CPU curve (`--candidates`, names in `STATIC_CANDIDATES`), against speculation off
    (`--priors`: the configurations to run, by name)."""
    model, tokenizer = _common.load(args)
    head = lambda: hf_specdec.EagleSpeculator.from_pretrained(hf_specdec.trained_head(args.model))
    hybrid = lambda: hf_specdec.HybridSpeculator(head(), hf_specdec.NgramSpeculator())
    configs = {"off": ("off", None), "n-gram (as shipped)": (hf_specdec.NgramSpeculator(), None),
               "head (as shipped)": (head(), None), "n-gram + head (as shipped)": (hybrid(), None)}
    for name in args.candidates:
        cost = STATIC_CANDIDATES[name]
        configs |= {f"n-gram ({name})": (hf_specdec.NgramSpeculator(), cost), f"head ({name})": (head(), cost),
                    f"n-gram + head ({name})": (hybrid(), cost)}

    def call(config, inputs):
        speculator, step_cost = config
        return generate(model, inputs, args.max_new_tokens, speculator, speculative_calibration=False,
                        **({} if step_cost is None else {"speculative_step_cost": step_cost}))
    run_cells(args, tokenizer, configs, call)


PROBES = {"head-int8": (head_int8, 3), "head-products": (head_products, 15), "padded-rows": (padded_rows, 12),
          "weigh-rows": (weigh_rows, 4), "ngram-split": (ngram_split, 4), "head-depth": (head_depth, 1),
          "verify-forms": (verify_forms, 6), "ngram-priors": (ngram_priors, 5),
          "head-confidence": (head_confidence, 1), "static-defaults": (static_defaults, 3),
          "head-returns": (head_returns, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--rounds", type=int, help="timed rounds (default: the probe's own)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hybrid", action="store_true", help="ngram-priors: n-gram + the shipped head")
    parser.add_argument("--priors", type=lambda v: v.split(","), default=None,
                        help="ngram-priors, static-defaults: the configurations to run beside speculation off, by name (default: all)")
    parser.add_argument("--cells", type=lambda v: v.split(","), default=None,
                        help="ngram-priors, static-defaults: WORKLOAD:BATCH cells, e.g. grounded:4 (default: both workloads, 1 and 4)")
    parser.add_argument("--candidates", type=lambda v: v.split(","), default=["stock-x2"],
                        help="static-defaults: candidate static CPU curves (names in STATIC_CANDIDATES)")
    parser.add_argument("--widths", type=lambda v: [int(w) for w in v.split(",")], default=[1, 2, 3, 4, 5, 6],
                        help="verify widths for verify-forms (default: 1,2,3,4,5,6)")
    _common.add_model_args(parser, options=("model", "threads"))
    args = parser.parse_args()
    probe, rounds = PROBES[args.probe]
    args.rounds = args.rounds or rounds
    probe(args)


if __name__ == "__main__":
    main()
