"""The prompts of `kmesh bench signals --check-layers` (bench/signals/check_layer.py): an
exact prefix, then a region of segments each after a short header, then a question; as text on a
model's tokenizer (`make_prompt`) or as random token ids of the same shape (`random_prompt`)."""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Short paragraphs on unrelated subjects: each segment draws its sentences from one subject
# first, so the segments' contexts differ the way different agents' reports do.
SUBJECTS: tuple[tuple[str, ...], ...] = (
    (
        "The river rose three feet overnight after the storm stalled over the hills.",
        "Farmers along the eastern bank moved their cattle to higher pastures before dawn.",
        "By noon the old stone bridge was closed, and the ferry took its place for a week.",
        "Engineers measured the current at the narrows and found it twice the spring average.",
        "The town council met in the library because the hall's basement had flooded.",
        "Volunteers filled sandbags in the school yard while children carried water bottles.",
        "A fisherman said he had not seen the water this high since his grandfather's time.",
        "When the rain stopped, the river fell slowly, leaving a line of mud on every wall.",
        "Insurance agents arrived on Thursday with clipboards and cameras.",
        "The mill's wheel, idle for decades, turned again for a few hours in the flood.",
        "Some residents argued that the upstream dam had released too much water too late.",
        "The regional office promised a report on the dam's operation within a month.",
        "Meanwhile the bakery on the square gave away bread to anyone who had lost power.",
        "By the next market day most stalls had reopened, though the prices were higher.",
    ),
    (
        "To compute the median of a stream, keep two heaps: a max-heap and a min-heap.",
        "Every new value goes into one heap, and the heaps are rebalanced so their sizes "
        "differ by at most one.",
        "The median is then the top of the larger heap, or the mean of both tops.",
        "Each insertion costs logarithmic time, and reading the median costs constant time.",
        "A common bug is to forget that Python's heapq module only provides a min-heap.",
        "The usual trick is to store negated values in the max-heap.",
        "For a sliding window, deletions are needed, which plain heaps do not support well.",
        "One option is lazy deletion: mark the removed values and skip them when they surface.",
        "Another is a balanced binary search tree, which supports removal directly.",
        "In practice, for windows of a few thousand values, a sorted list with bisect is "
        "fast enough.",
        "Benchmarks on random data show the sorted list winning below ten thousand elements.",
        "Above that, the cost of shifting memory on every insertion starts to dominate.",
        "Tests should cover duplicates, negative numbers and windows of size one.",
        "Finally, document whether the median of an even count is the lower middle or the mean.",
    ),
    (
        "Preheat the oven to two hundred degrees and butter a deep baking dish.",
        "Slice the potatoes thinly, about the thickness of a coin, and keep them in cold water.",
        "Warm the cream with two crushed cloves of garlic, a bay leaf and a pinch of nutmeg.",
        "Drain the potatoes and dry them well, or the gratin will be watery.",
        "Layer the slices in the dish, seasoning every layer with salt and pepper.",
        "Pour the warm cream over the potatoes until it just reaches the top layer.",
        "Scatter grated cheese on top; a hard mountain cheese browns best.",
        "Bake for about an hour, until a knife slides through without resistance.",
        "If the top browns too quickly, cover the dish loosely with foil.",
        "Let the gratin rest for ten minutes before serving so the cream can set.",
        "It keeps for two days in the refrigerator and reheats well in a low oven.",
        "Some cooks add thin slices of onion between the layers for sweetness.",
        "Others replace half of the cream with milk for a lighter dish.",
        "Serve it with a green salad dressed with mustard and lemon.",
    ),
    (
        "The committee reviewed the quarterly figures on Monday morning.",
        "Revenue grew by four percent, mostly from the new subscription plans.",
        "Costs rose faster, however, because of the second data center and higher salaries.",
        "The finance director warned that the margin would shrink unless prices changed.",
        "Sales argued that a price increase now would push small customers to competitors.",
        "Product suggested a cheaper plan with fewer features to keep those customers.",
        "Support reported that most complaints concerned slow exports, not prices.",
        "The chief executive asked for a plan to fix the exports before the next review.",
        "Engineering estimated six weeks for the fix, with two engineers on it full time.",
        "The committee agreed to postpone any price change until the fix had shipped.",
        "Marketing will survey one hundred customers about the proposed cheaper plan.",
        "The minutes were circulated on Tuesday, and no one asked for corrections.",
        "The next review is scheduled for the first week of the following quarter.",
        "Everyone was reminded to submit travel expenses before the end of the month.",
    ),
    (
        "Octopuses have three hearts and blue blood rich in a copper-based protein.",
        "Two of the hearts pump blood through the gills, and the third through the body.",
        "Most of an octopus's neurons are in its arms rather than in its central brain.",
        "Each arm can taste and touch, and can react on its own when cut from the body.",
        "Octopuses change colour and texture in a fraction of a second to match a background.",
        "They do this with cells called chromatophores, controlled directly by nerves.",
        "In aquariums they have been seen opening jars and escaping through tiny gaps.",
        "Their lives are short: many species live only one or two years.",
        "A female guards her eggs for weeks and usually dies soon after they hatch.",
        "Researchers study them to understand intelligence that evolved apart from ours.",
        "Their last common ancestor with humans was a worm-like animal living long ago.",
        "Some divers report octopuses that recognize individual people and follow them.",
        "Others have watched them throw shells and silt at fish that annoyed them.",
        "Because they are so capable, several countries now protect them in laboratories.",
    ),
    (
        "The train left the capital at dawn and climbed slowly into the mountains.",
        "For the first hour the windows showed nothing but fog and the shapes of pine trees.",
        "Then the fog lifted and the valley opened below, green and full of small villages.",
        "A conductor in a grey coat checked tickets and recommended the soup in the dining car.",
        "The soup was barley with smoked meat, served with dark bread and butter.",
        "At the border station the train waited forty minutes while officers checked passports.",
        "On the other side the signs changed language and the houses had steeper roofs.",
        "An old woman across the aisle shared dried apricots and stories about her sons.",
        "One son was a pilot, she said, and the other repaired bicycles in the harbour town.",
        "The line followed a lake for an hour, its water so clear the stones showed on the bottom.",
        "At dusk the train reached the coast and the air smelled of salt and diesel.",
        "Passengers crowded the platform, waving to relatives and calling for porters.",
        "The night ferry to the islands left at ten, and the ticket office closed at nine.",
        "Those who missed it slept in the waiting room, on benches worn smooth by years of use.",
    ),
    (
        "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
        "The light reactions take place in the thylakoid membranes of the chloroplast.",
        "There, chlorophyll absorbs mostly red and blue light and reflects green.",
        "The energy splits water molecules, releasing oxygen as a by-product.",
        "The Calvin cycle, in the stroma, uses that energy to fix carbon into sugars.",
        "Its key enzyme, rubisco, is probably the most abundant protein on Earth.",
        "Rubisco is slow and sometimes grabs oxygen instead of carbon dioxide.",
        "Some plants, like maize, concentrate carbon dioxide to avoid that waste.",
        "Desert plants open their pores at night and store carbon as an acid until morning.",
        "The efficiency of photosynthesis in the field is only one or two percent.",
        "Even so, it supplies nearly all the chemical energy used by life on land.",
        "Engineers have tried to copy it in artificial leaves that make fuel from sunlight.",
        "The devices work in the laboratory but remain too expensive and fragile.",
        "Improving rubisco in crops is one of the long-standing goals of plant biology.",
    ),
    (
        "Dear Ms. Alvarez, thank you for your letter of the twelfth.",
        "I am sorry to hear that the replacement parts arrived damaged.",
        "Our warehouse has confirmed that the box was crushed during transport.",
        "A new set of parts was shipped this morning by express courier.",
        "You should receive it within three working days, at no cost to you.",
        "Please keep the damaged parts until our carrier collects them next week.",
        "We have also credited your account with a discount on your next order.",
        "If the new parts do not fit, our technician can visit your workshop.",
        "He is available on Tuesdays and Thursdays between nine and four.",
        "You can book a visit by replying to this letter or calling our service line.",
        "We value your business and apologize again for the inconvenience.",
        "Our catalogue for the coming season is enclosed for your reference.",
        "Note the new range of stainless fittings on pages twelve to fifteen.",
        "With kind regards, the customer service team.",
    ),
)
NAMES = ("Ada", "Bao", "Carmen", "Dmitri", "Esi", "Farid", "Greta", "Hugo")
PREFIX_TEXT = (
    "You are the coordinator of a team of agents. Each agent wrote a report below. Read them "
    "all, then answer the question at the end."
)
QUESTION = "\n\nQuestion: In one sentence each, what did the reports above say?\nAnswer:"


@dataclass(frozen=True, slots=True)
class Prompt:
    """An All-Gather-like prompt as token ids: `prefix` exact; `parts` the region in order, each
    (tokens, reused: a segment computed in its own context); `own` what precedes each reused
    part in its own context (the BOS, or nothing)."""

    prefix: tuple[int, ...]
    parts: tuple[tuple[tuple[int, ...], bool], ...]
    own: tuple[int, ...]


def make_prompt(
    tokenizer: Any, seed: int, segments: int = 5, lengths: tuple[int, int] = (150, 400)
) -> Prompt:
    """`segments` reused segments of `lengths[0]..lengths[1]` tokens (drawn from `seed`) of
    varied text, each after a short header, then a question."""
    rng = random.Random(seed)
    first = tokenizer("x")["input_ids"][0]
    bos = [first] if first == tokenizer.bos_token_id else []  # the tokenizer's BOS, if it adds one

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    subjects = rng.sample(range(len(SUBJECTS)), segments)
    names = rng.sample(NAMES, segments)
    parts: list[tuple[tuple[int, ...], bool]] = []
    for index, (subject, name) in enumerate(zip(subjects, names, strict=True)):
        target = rng.randint(*lengths)
        sentences: list[str] = []
        order = [subject] + [s for s in range(len(SUBJECTS)) if s != subject]
        pool = [s for o in order for s in rng.sample(SUBJECTS[o], len(SUBJECTS[o]))]
        while len(ids(" ".join(sentences))) < target and pool:
            sentences.append(pool.pop(0))
        body = ids(" ".join(sentences))[:target]
        parts.append((tuple(ids(f"\n\nReport {index + 1}, by {name}:\n")), False))
        parts.append((tuple(body), True))
    parts.append((tuple(ids(QUESTION)), False))
    return Prompt(tuple(bos + ids(PREFIX_TEXT)), tuple(parts), tuple(bos))


def random_prompt(
    vocab: int, seed: int, prefix: int, segments: Sequence[int], header: int = 3
) -> Prompt:
    """A prompt of random token ids of the same shape (for models without a tokenizer)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())

    parts: list[tuple[tuple[int, ...], bool]] = []
    for n in segments:
        parts += [(draw(header), False), (draw(n), True)]
    parts.append((draw(header), False))
    return Prompt(draw(prefix), tuple(parts), ())
