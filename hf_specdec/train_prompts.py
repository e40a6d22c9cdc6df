"""The built-in prompt set for self-distillation: hand-written requests, then requests composed from task forms and
subjects, so that `hf-specdec train-eagle --self-distill N` can draw thousands of varied user turns offline.

The benchmark's open-chat and grounded prompts (`hf_specdec.workloads`) are not in the set, nor are their subjects
(lighthouse, rainbow, studying at home, Calder Bay), so the benchmark measures a head on requests it never saw.
"""

from __future__ import annotations

import random

HAND_WRITTEN = [
    "Write a haiku about autumn leaves.", "Explain what a black hole is in two paragraphs.",
    "Give me three tips for a job interview.", "How do I make a simple tomato pasta sauce?",
    "Write a short poem about the sea at night.", "What is the difference between weather and climate?",
    "Describe a busy market in a small town.", "Why is the sky blue?", "Write a thank-you note to a teacher.",
    "What are the benefits of regular exercise?", "Explain photosynthesis to a child.",
    "Tell me a fun fact about octopuses.", "How does a bicycle stay upright?",
    "Write a short dialogue between a cat and a dog.", "What should I pack for a weekend camping trip?",
    "Summarise the plot of Cinderella in a few sentences.", "Explain how vaccines work.",
    "Give me a recipe for pancakes.", "What is machine learning, in simple words?",
    "Write a limerick about a forgetful wizard.", "How can I save money on groceries?",
    "Describe the water cycle.", "What are some ways to reduce stress?", "Explain what gravity does.",
    "Write an email asking a colleague for a meeting next week.", "Why do we have seasons?",
    "List five animals that live in the desert and one fact about each.", "How do plants grow from seeds?",
    "Write the opening paragraph of a mystery novel.", "What is the capital of France and what is it known for?",
    "Explain the rules of chess briefly.", "How do I write a good essay introduction?",
    "What causes earthquakes?", "Describe your ideal weekend.", "Give advice to someone learning to cook.",
    "Explain how the internet works in simple terms.", "Write a short speech for a friend's birthday.",
    "What are the planets in our solar system?", "How do bees make honey?",
    "Write a product description for a reusable water bottle.", "What is the history of the bicycle?",
    "Explain why sleep is important.", "Tell a short story about a robot who learns to paint.",
    "How do I start learning to play the guitar?", "What are good habits for healthy teeth?",
    "Describe a sunrise over the mountains.", "Explain what a computer program is.",
    "Give me ideas for a rainy day with kids.",
]

# Task forms: "{s}" is a subject below.
FORMS = [
    "Explain {s} in simple terms.", "What is {s}?", "Tell me about {s}.", "Write a short story about {s}.",
    "Write a poem about {s}.", "Give me five facts about {s}.", "What are the pros and cons of {s}?",
    "How would you explain {s} to a child?", "Write a short essay on {s}.", "Describe {s} in a few sentences.",
    "What is the history of {s}?", "Why does {s} matter?", "Give me three tips related to {s}.",
    "Write a blog post introduction about {s}.", "What are common misconceptions about {s}?",
    "Summarise what people should know about {s}.", "Write a dialogue between two friends talking about {s}.",
    "List some questions a student might ask about {s}, with answers.", "How has {s} changed over time?",
    "Write a short news report about {s}.", "What would the world be like without {s}?",
    "Compare {s} with something similar and explain the differences.", "Write a limerick about {s}.",
    "Give a step-by-step guide to learning about {s}.", "Write a diary entry from someone who loves {s}.",
    "What are the main ideas behind {s}?", "Write a persuasive paragraph about {s}.",
    "Describe a day in the life of someone who works with {s}.", "What are some interesting questions about {s}?",
    "Write a haiku about {s}.", "Write a short advertisement about {s}.", "Explain the science behind {s}.",
]

SUBJECTS = [
    "volcanoes", "the moon", "honeybees", "electric cars", "the Roman Empire", "chocolate", "coral reefs",
    "the human heart", "recycling", "solar panels", "dinosaurs", "the ocean tides", "friendship", "coffee",
    "trains", "the Great Wall of China", "penguins", "clouds", "the printing press", "vaccines", "gardening",
    "jazz music", "the immune system", "deserts", "robots", "bread baking", "the Olympic Games", "mushrooms",
    "earthquakes", "libraries", "owls", "the stock market", "social media", "rain forests", "glaciers",
    "the telephone", "bicycles", "ancient Egypt", "whales", "chess", "the solar system", "wind turbines",
    "photography", "the brain", "elephants", "time zones", "airplanes", "meditation", "tea", "the internet",
    "video games", "kindness", "mountains", "spiders", "the water cycle", "cheese", "poetry", "castles",
    "hurricanes", "bats", "the alphabet", "money", "maps", "snow", "football", "trees", "the violin", "bridges",
    "electricity", "sharks", "museums", "pizza", "the Renaissance", "sleep", "frogs", "space travel", "rivers",
    "umbrellas", "democracy", "the color blue", "cats", "dogs", "horses", "wolves", "the desert at night",
    "city parks", "public transport", "the piano", "board games", "bees and flowers", "magnets", "fossils",
    "the seasons", "islands", "archaeology", "origami", "the Amazon river", "submarines", "kites", "comets",
    "knitting", "birds migrating", "a small village", "an old bookshop", "a train journey", "a rainy afternoon",
    "a mountain hike", "a family dinner", "a science fair", "a lost key", "a new neighbour", "a city at night",
    "the first day of school", "a summer festival", "a broken clock", "a talking parrot", "a secret garden",
    "a hot air balloon", "a snowy cabin", "a market in the morning", "a music lesson", "a camping trip",
    "a stray kitten", "an inventor", "a detective", "a baker", "a pilot", "a gardener", "a firefighter",
    "a teacher", "an astronaut", "a chef", "a painter", "a farmer", "a doctor", "a librarian", "a sailor",
    "healthy eating", "learning a new language", "saving energy at home", "writing a resume", "public speaking",
    "time management", "drinking enough water", "climate change", "artificial intelligence", "the human eye",
    "sound waves", "light", "atoms", "gravity", "photosynthesis", "the food chain", "volunteering",
    "traveling on a budget", "running a marathon", "keeping a journal", "planting a tree", "baking cookies",
    "moving to a new city", "starting a small business", "teamwork", "curiosity", "patience", "good manners",
    "the invention of the wheel", "paper", "glass", "salt", "cotton", "rubber", "steel", "plastic pollution",
    "bird songs", "ants", "butterflies", "octopuses", "dolphins", "tigers", "polar bears", "camels", "pandas",
]

_EXCLUDED = ("lighthouse", "rainbow", "studying", "calder bay")


def built_in_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    """The first `count` prompts of the built-in set: the hand-written ones, then composed (form, subject) requests
    in a seeded order without repeats. `count=None` gives the hand-written ones only."""
    if count is None:
        return list(HAND_WRITTEN)
    prompts = _all_prompts(seed)
    if not 1 <= count <= len(prompts):
        raise ValueError(f"the built-in set holds 1 to {len(prompts)} prompts, got {count}; give your own with "
                         "--data FILE for more")
    return prompts[:count]


def max_prompts() -> int:
    return len(_all_prompts(0))


def _all_prompts(seed: int) -> list[str]:
    composed = [form.format(s=subject) for subject in SUBJECTS for form in FORMS]
    random.Random(seed).shuffle(composed)
    return [p for p in HAND_WRITTEN + composed if not any(word in p.lower() for word in _EXCLUDED)]
