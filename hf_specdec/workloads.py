"""Built-in prompts written for this project: grounded tasks, where output copies from the prompt, and open chat."""

from __future__ import annotations

ARTICLE = (
    "The harbour town of Calder Bay rebuilt its sea wall in the spring. Engineers replaced the old timber pilings "
    "with reinforced concrete, raised the walkway by forty centimetres, and added drainage channels every twenty "
    "metres so that storm water could return to the sea. The work took eleven weeks and cost slightly less than the "
    "council had budgeted. Fishermen said the new wall made it easier to unload their boats at low tide, while "
    "shop owners on the promenade reported more visitors once the walkway reopened. The council plans to plant "
    "salt-tolerant grasses along the top of the wall next year and to install benches facing the harbour."
)

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result


def normalise(values):
    low = min(values)
    high = max(values)
    return [(v - low) / (high - low) for v in values]
'''

GROUNDED = {
    "repeat_summarise": f"Here is a news report:\n\n{ARTICLE}\n\nFirst repeat the report word for word, then "
                        "summarise it in one sentence.",
    "code_edit": f"Rewrite this Python code so that every function has a docstring and type hints. Keep the logic "
                 f"exactly the same.\n\n{CODE}",
    "context_qa": f"Answer using only the report below, quoting its exact words.\n\n{ARTICLE}\n\nWhat did the "
                  "engineers replace, how long did the work take, and what does the council plan next year?",
}

OPEN_CHAT = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "advice": "What are some good habits for staying focused while studying at home?",
    "explain": "Explain how a rainbow forms, in simple terms for a ten-year-old.",
}


def chat_inputs(tokenizer, prompts: list[str]):
    """Tokenises user prompts with the chat template (when the tokenizer has one), left-padded as a batch."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    else:
        texts = list(prompts)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


# Open-chat prompts written for measuring heads (`benchmarks/head_agreement.py`, the retired `head_window.py`), in none
# of the training or benchmark sets (some subjects recur there): held out from every head trained on the built-in
# prompts.
HELD_OUT = [
    "Describe what a typical morning looks like for a baker in a small village.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Write a friendly email inviting my neighbours to a street party next Saturday.",
    "Why do cats purr? Give a short answer.",
    "Suggest a simple weekly exercise plan for someone who has never trained before.",
    "Tell me a short fable about a fox and a crow, with a moral at the end.",
]
