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

# The second group, appended after the first so that a set built from the first 5872 prompts stays a prefix of
# the whole: new subjects under the same forms, requests for advice on activities, and story prompts that pair a
# character with an event.
MORE_SUBJECTS = [
    "the Moon landing", "sea turtles", "the Sahara", "lightning", "the Silk Road", "honey", "the Arctic",
    "vitamins", "the metric system", "skyscrapers", "the Vikings", "lions", "rice", "cameras", "batteries",
    "the Eiffel Tower", "windmills", "crows", "the Pacific Ocean", "yoga", "the microscope", "jellyfish", "soap",
    "the postal service", "ballet", "kangaroos", "the compass", "tornadoes", "the Industrial Revolution",
    "apples", "the calendar", "squirrels", "opera", "the blood cells", "hiking boots", "the Nile", "sunflowers",
    "the ancient Greeks", "telescopes", "the printing of books", "bamboo", "the human skeleton", "caves",
    "the bicycle helmet", "street food", "lakes", "the Aztecs", "sand", "the thermometer", "sloths", "the harp",
    "nuclear energy", "the Milky Way", "wheat", "parrots", "the refrigerator", "waterfalls", "zebras",
    "the lungs", "fireworks", "ice cream", "the steam engine", "mosquitoes", "marathons", "the Arctic fox",
    "cartoons", "the eclipse", "seaweed", "volleyball", "the hummingbird", "the first computers", "markets",
    "the tortoise", "puzzles", "lanterns", "the theatre", "radio", "the skin", "potatoes", "beavers",
    "wildfires", "the national parks", "ladybugs", "the saxophone", "maple syrup", "the Andes", "fungi",
    "bees in winter", "the desert fox", "satellites", "spices", "the rain gauge", "lemons", "giraffes",
    "the Middle Ages", "snails", "the accordion", "geysers", "sushi", "the tundra", "clocks",
]
ACTIVITIES = [
    "learning to swim", "cooking for a family", "saving for a holiday", "training a puppy", "learning to draw",
    "reading more books", "getting up early", "working from home", "making new friends", "learning to code",
    "growing vegetables", "preparing for an exam", "writing a novel", "keeping a clean kitchen",
    "learning to dance", "caring for houseplants", "speaking with confidence", "staying calm in traffic",
    "learning chess", "taking better photos", "cycling to work", "planning a wedding", "getting fit after forty",
    "raising chickens", "building a bookshelf", "learning the piano", "budgeting as a student", "painting a room",
    "writing poetry", "being a good listener", "hosting a dinner party", "learning to juggle",
    "sleeping better", "eating less sugar", "decluttering a home", "learning to knit", "running your first 5k",
    "starting a podcast", "looking after an elderly parent", "memorising a speech", "fixing a flat tyre",
    "learning to sing", "teaching a child to read", "keeping in touch with old friends", "packing for a move",
    "writing a cover letter", "reducing screen time", "learning to meditate", "baking sourdough bread",
    "birdwatching", "camping with children", "negotiating a salary", "going back to school", "making pottery",
]
ADVICE_FORMS = [
    "What are some good habits for {a}?", "How do I get better at {a}?", "Give me a simple plan for {a}.",
    "What mistakes do beginners make when {a}?", "I find {a} hard. Any advice?",
    "What should I know before {a}?", "How can I stay motivated when {a}?",
    "Write a short guide to {a} for a beginner.", "What are the benefits of {a}?",
    "Give me a weekly schedule for {a}.", "What equipment do I need for {a}?",
    "Explain how to start {a} in five steps.", "Tell me a short story about someone {a}.",
    "Write encouraging words for a friend who is {a}.", "What questions should I ask an expert on {a}?",
]
CHARACTERS = [
    "an old fisherman", "a young witch", "a shy robot", "a retired astronaut", "a clever fox", "a lonely giant",
    "a street musician", "a curious girl", "a grumpy king", "a lost puppy", "a night-shift nurse",
    "a forgetful professor", "a brave mouse", "a travelling merchant", "a school janitor", "a tired dragon",
    "a famous chef", "a new student", "a village blacksmith", "a deep-sea diver", "a mail carrier",
    "a ghost in an old house", "a twelve-year-old inventor", "a zookeeper", "a taxi driver",
]
EVENTS = [
    "finds a map under the floorboards", "wakes up able to talk to animals", "loses something precious",
    "gets a letter from the future", "has to cross a frozen lake", "wins a contest by accident",
    "meets a stranger on a train", "discovers a door that was not there yesterday", "must keep a promise",
    "learns a secret about their family", "is stuck in a storm", "helps a rival", "finds a strange seed",
    "goes back to their hometown", "hears music no one else can hear", "has one day to save the town festival",
    "receives a mysterious package", "befriends a talking tree", "builds a machine that does not work",
    "must choose between two friends",
]
STORY_FORMS = ["Write a short story about {c} who {e}.", "Tell a bedtime story about {c} who {e}."]

# The third group, appended after the second (a set built from the first 10914 prompts stays a prefix): more
# subjects, activities and story pairs, and requests of kinds the first two lack: messages to write, comparisons,
# how things work, why things happen, and recommendations.
THIRD_SUBJECTS = [
    "the rain cloud", "goldfish", "the Mayans", "olive oil", "the Atlantic Ocean", "the hippopotamus", "the kettle",
    "the Sun", "cherry blossoms", "the Incas", "hedgehogs", "the human ear", "the Alps", "earthworms", "the flute",
    "coconuts", "tides and the moon", "the Suez Canal", "wool", "peacocks", "the lawn mower", "the Amazon parrot",
    "the Black Death", "the Titanic", "avocados", "seahorses", "the barometer", "the Mississippi River",
    "the human liver", "dragonflies", "the typewriter", "moss", "the Greek myths", "the Samurai", "tulips",
    "the Dead Sea", "meteor showers", "the beaver dam", "the cello", "Antarctica", "the hot spring", "pigeons",
    "the Colosseum", "the coral snake", "the ukulele", "cinnamon", "the ostrich", "the lunar calendar",
    "the Mongol Empire", "the washing machine", "the cactus", "the cheetah", "the gecko", "the Himalayas",
    "the Great Barrier Reef", "the carrot", "the zoo", "the rainstorm", "the harbour", "the orchestra",
    "the planet Mars", "the planet Jupiter", "Saturn's rings", "the black hole", "the tsunami", "the pyramids",
    "the electric guitar", "the drum", "the orca", "the raccoon", "the moose", "the koala", "the flamingo",
    "the walrus", "the fire station", "the airport", "the hospital", "the bakery",
    "the farmers market", "the bus driver", "the post office", "the swimming pool", "the football stadium",
    "the garden shed", "the attic", "the playground", "the science museum", "the river boat", "the old mill",
    "the city library", "the ski resort", "the desert oasis", "the mountain village", "the fishing harbour",
    "the night sky", "the thunderstorm", "the autumn leaves", "the spring flowers", "the winter solstice",
]
THIRD_ACTIVITIES = [
    "learning to cook rice", "choosing a first car", "learning to play guitar", "organising a bookshelf",
    "planning a road trip", "learning a magic trick", "keeping a fish tank", "starting a vegetable garden",
    "writing thank-you notes", "learning to skateboard", "getting organised at work", "cooking on a budget",
    "training for a bike race", "learning sign language", "preparing for a job interview", "making a scrapbook",
    "learning to touch type", "choosing a good book", "visiting a museum with kids", "learning to surf",
    "taking care of a cat", "building a sandcastle", "learning basic first aid", "hiking in the rain",
    "learning to sew", "making homemade pasta", "drawing portraits", "writing a short film", "learning to row",
    "running a book club", "planting flowers on a balcony", "learning to bake pies", "teaching a dog tricks",
    "keeping a gratitude diary", "learning to ice skate", "starting a stamp collection", "making soup",
    "recording a song", "learning to fish", "building a model airplane", "organising a charity run",
    "learning to climb", "planning a picnic", "learning to play tennis", "taking a long flight",
    "learning history", "choosing a laptop", "cleaning a bicycle", "learning calligraphy", "making a budget",
    "learning to speak French", "looking after a rabbit", "watching the stars", "writing song lyrics",
    "repairing old furniture", "learning to whistle", "cooking a roast dinner", "learning photography at night",
    "keeping bees", "learning to play drums",
]
THIRD_CHARACTERS = [
    "a nervous pilot", "a kind witch", "a tiny elephant", "a bored dragon", "an old clockmaker",
    "a girl who collects stones", "a boy who cannot sleep", "a brave little boat", "a singing whale",
    "a cat who wants to fly", "a tired mail robot", "a young baker", "a lonely snowman", "a retired pirate",
    "a lost tourist",
]
THIRD_EVENTS = [
    "finds a key that opens nothing", "gets a wish but must give one back", "is invited to a royal ball",
    "wakes up in a different century", "must deliver a message before sunset", "finds a dragon egg",
    "loses their voice on the day of a concert", "becomes friends with a shadow", "plants a tree that grows overnight",
    "discovers a hidden city", "has to babysit a baby dinosaur", "finds a book that writes itself",
    "gets lost in a maze", "enters a baking contest", "meets their future self", "learns to swim at last",
    "follows a trail of footprints", "opens a shop that sells dreams", "finds a star that fell to earth",
    "must teach a troll good manners",
]
RECIPIENTS = ["my manager", "a teacher", "a neighbour", "my landlord", "an old friend", "a customer", "my team",
              "a hotel", "a colleague", "my grandmother"]
OCCASIONS = [
    "asking for a day off", "to say thank you for their help", "to apologise for being late",
    "to invite them to a party", "asking for advice", "to share some good news", "to complain about the noise",
    "asking about a delayed order", "to congratulate them on a new job", "to cancel a meeting",
    "to suggest a new idea", "asking for a letter of recommendation",
]
MESSAGE_FORMS = ["Write a short email to {r} {o}.", "Write a polite text message to {r} {o}.",
                 "Help me write a note to {r} {o}."]
PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "films"), ("the sun", "the moon"),
    ("sleet", "hail"), ("viruses", "bacteria"), ("frogs", "toads"), ("crocodiles", "alligators"),
    ("butter", "margarine"), ("a lake", "a sea"), ("rabbits", "hares"), ("baking", "roasting"),
    ("a city", "a town"), ("jam", "jelly"), ("running", "swimming"), ("the piano", "the guitar"),
    ("email", "letters"), ("a bee", "a wasp"), ("a hurricane", "a tornado"), ("a comet", "an asteroid"),
    ("a violin", "a viola"), ("bread", "cake"), ("a poem", "a song"), ("a bus", "a tram"),
    ("mountains", "hills"), ("a leopard", "a jaguar"), ("soup", "stew"), ("chess", "checkers"),
    ("a pond", "a river"), ("walking", "cycling"), ("a dolphin", "a porpoise"), ("rice", "pasta"),
    ("a novel", "a short story"), ("summer", "winter"), ("a museum", "a gallery"), ("a turtle", "a tortoise"),
    ("a map", "a globe"), ("a moth", "a butterfly"), ("a village", "a city"),
]
PAIR_FORMS = ["What is the difference between {x} and {y}?", "Which is better for a beginner, {x} or {y}?",
              "Compare {x} and {y} in a short paragraph.", "Write a funny debate between {x} and {y}."]
DEVICES = [
    "a fridge", "a microwave oven", "a bicycle gear", "a light bulb", "a smartphone camera", "a zipper",
    "a toaster", "a vacuum cleaner", "an elevator", "a thermostat", "a solar cell", "a car engine",
    "a parachute", "a sailboat", "a pencil sharpener", "a traffic light", "a wind-up toy", "a doorbell",
    "a water filter", "a hearing aid", "a bar code scanner", "a dishwasher", "a fountain pen", "a hot air balloon",
    "an electric kettle", "a submarine periscope", "a lock and key", "a calculator", "a helicopter", "a piano key",
]
DEVICE_FORMS = ["How does {d} work?", "Explain how {d} works, step by step.", "What are the main parts of {d}?",
                "Who invented {d}, and why?"]
WHYS = [
    "the sky is blue", "leaves change colour in autumn", "we dream", "cats purr", "the sea is salty",
    "we yawn", "bread rises", "ice floats", "birds fly south", "onions make us cry", "the moon changes shape",
    "we have seasons", "popcorn pops", "stars twinkle", "we get hiccups", "zebras have stripes",
    "some people are left-handed", "metal feels cold", "bubbles are round", "the wind blows",
    "our stomachs rumble", "fireflies glow", "snowflakes have six sides", "dogs wag their tails",
    "we need sleep", "the grass is green", "thunder follows lightning", "hair turns grey", "apples turn brown",
    "music makes us feel happy",
]
WHY_FORMS = ["Why {q}?", "Explain to a child why {q}.", "Give a scientific explanation of why {q}."]
TOPICS = [
    "books for a long train ride", "games to play at a birthday party", "healthy snacks for children",
    "hobbies to try this winter", "names for a new puppy", "ways to spend a rainy weekend",
    "gifts for a teacher", "easy meals for a busy week", "places to visit in spring", "songs for a road trip",
    "questions to ask on a first date", "ways to relax after work", "fun science experiments at home",
    "activities for a family reunion", "plants that are easy to grow", "films for a cosy evening",
    "ideas for a school project", "warm-up exercises", "ways to make a room brighter", "board games for two",
]
TOPIC_FORMS = ["Suggest five {t}.", "Can you recommend some {t}?", "Give me a list of {t}, with a reason for each."]

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
    first = [form.format(s=subject) for subject in SUBJECTS for form in FORMS]
    random.Random(seed).shuffle(first)
    second = ([form.format(s=subject) for subject in MORE_SUBJECTS for form in FORMS]
              + [form.format(a=activity) for activity in ACTIVITIES for form in ADVICE_FORMS]
              + [form.format(c=c, e=e) for c in CHARACTERS for e in EVENTS for form in STORY_FORMS])
    random.Random(seed + 1).shuffle(second)
    third = ([form.format(s=subject) for subject in THIRD_SUBJECTS for form in FORMS]
             + [form.format(a=activity) for activity in THIRD_ACTIVITIES for form in ADVICE_FORMS]
             + [form.format(c=c, e=e) for c in THIRD_CHARACTERS for e in THIRD_EVENTS for form in STORY_FORMS]
             + [form.format(r=r, o=o) for r in RECIPIENTS for o in OCCASIONS for form in MESSAGE_FORMS]
             + [form.format(x=x, y=y) for x, y in PAIRS for form in PAIR_FORMS]
             + [form.format(d=d) for d in DEVICES for form in DEVICE_FORMS]
             + [form.format(q=q) for q in WHYS for form in WHY_FORMS]
             + [form.format(t=t) for t in TOPICS for form in TOPIC_FORMS])
    random.Random(seed + 2).shuffle(third)
    return [p for p in HAND_WRITTEN + first + second + third if not any(word in p.lower() for word in _EXCLUDED)]
