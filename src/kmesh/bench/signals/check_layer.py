"""Which layer recovery's check should read (`kmesh bench signals --check-layers`).

An All-Gather-like prompt: an exact prefix, then a region of segments, each computed alone in its
own context (after the model's BOS, if its tokenizer adds one) at positions 0.., its keys turned
to the region's positions and its KV reused; a short header before each segment and a question
after the last are new tokens (always computed). Full prefill of the same prompt is the truth.

Recovery's first phase (kv_deviation, or the gate) computes every region token through layers
0..c against the exact prefix: that is full prefill of those layers, so a reused row's deviation
at check layer c is ||k_reused - k_full|| / ||k_full|| at layer c (recover.py's `_deviation`).
How wrong a reused row's KV is for what follows is taken as that deviation averaged over every
layer. Per check layer c the bench reports:

- `spearman`: the rank correlation of the reused rows' deviation at c with that average;
- `deviation`: their mean deviation at c (what the gate compares with its threshold);
- `kl`: KL(full || recovered) of the last token's next-token distribution after `recover` with
  kv_deviation, `ratio` and check layer c (its fresh layers 0..c kept, the chosen rows through
  the rest), and `cost`, what that recovery computed (token-layers / layers);
- `kl_chosen_only`: the same rows chosen at c, but only they (and the new tokens) computed,
  through every layer, against the reused KV of the rest: what the choice alone buys;
- `layer1_same_cost`: for c > 1, the ratio at which check layer 1 costs what c did, and the KL
  it gets (a later check layer is paid for in early layers computed for every token).

And once per prompt, for scale: `kl_none` (nothing recomputed), `kl_random` and `kl_oracle`
(`ratio` of the rows, chosen at random or by the all-layer average, computed like
`kl_chosen_only`).
"""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kmesh.bench.quality import next_token_kl
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.rope import rerotate_keys
from kmesh.recovery.recover import RecoveryConfig, RegionInput, recover

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


@dataclass(frozen=True, slots=True)
class _Placed:
    region: RegionInput
    full_k: torch.Tensor  # [layers, region tokens, kv_heads, head_dim]: full prefill's keys
    logits: torch.Tensor  # [vocab]: full prefill's last token


def _place(executor: Executor, prompt: Prompt) -> _Placed:
    """Full prefill of the prompt, and its region with every segment's own KV placed in it."""
    config = executor.config
    tokens = list(prompt.prefix) + [t for part, _ in prompt.parts for t in part]
    p, n = len(prompt.prefix), len(tokens)
    full = executor.forward([SequenceInput(torch.tensor(tokens), torch.arange(n))])[0]
    k_full, v_full = torch.stack(full.k), torch.stack(full.v)
    t = n - p
    shape = (config.num_layers, t, config.num_kv_heads, config.head_dim)
    reused_k = torch.zeros(shape, dtype=executor.dtype)
    reused_v = torch.zeros(shape, dtype=executor.dtype)
    reusable = torch.zeros(t, dtype=torch.bool)
    segment = torch.zeros(t, dtype=torch.int64)
    start = 0
    for index, (part, reused) in enumerate(prompt.parts):
        rows = slice(start, start + len(part))
        segment[rows] = index
        if reused:
            own = list(prompt.own) + list(part)
            alone = executor.forward([SequenceInput(torch.tensor(own), torch.arange(len(own)))])[0]
            k = torch.stack(alone.k)[:, len(prompt.own) :]
            v = torch.stack(alone.v)[:, len(prompt.own) :]
            to = torch.arange(p + start, p + start + len(part))
            reused_k[:, rows] = rerotate_keys(k, to - to[0] + len(prompt.own), to, config)
            reused_v[:, rows] = v
            reusable[rows] = True
        start += len(part)
    prefix = DenseKV(torch.arange(p), list(k_full[:, :p]), list(v_full[:, :p]))
    region = RegionInput(
        torch.tensor(tokens[p:]),
        torch.arange(p, n),
        prefix,
        reused_k,
        reused_v,
        reusable,
        segment,
    )
    return _Placed(region, k_full[:, p:], executor.logits(full.hidden[-1:])[0])


def deviations(reused_k: torch.Tensor, full_k: torch.Tensor) -> torch.Tensor:
    """[layers, rows] relative L2 deviation of reused from full prefill's keys (recover.py's
    `_deviation`, the fresh keys at a check layer being full prefill's)."""
    fresh = full_k.float().flatten(2)
    return (reused_k.float().flatten(2) - fresh).norm(dim=2) / fresh.norm(dim=2).clamp_min(1e-6)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of two [n] vectors (ties broken by order)."""
    ranks = [torch.argsort(torch.argsort(x)).double() for x in (a, b)]
    ranks = [r - r.mean() for r in ranks]
    return float((ranks[0] * ranks[1]).sum() / (ranks[0].norm() * ranks[1].norm()))


def _kl_computing(executor: Executor, placed: _Placed, chosen: torch.Tensor) -> float:
    """KL(full || recovered) when the region rows `chosen` (of the reusable ones) and the new
    ones are computed through every layer and every other row keeps its reused KV."""
    region = placed.region
    compute = torch.sort(torch.cat((chosen, torch.nonzero(~region.reusable)[:, 0]))).values
    keep = torch.ones(len(region.token_ids), dtype=torch.bool)
    keep[compute] = False
    context = DenseKV(
        region.positions[keep], list(region.reused_k[:, keep]), list(region.reused_v[:, keep])
    )
    out = executor.forward(
        [
            SequenceInput(
                region.token_ids[compute], region.positions[compute], context, region.prefix
            )
        ]
    )[0]
    return _kl(placed.logits, executor.logits(out.hidden[-1:])[0])


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    return float(next_token_kl(reference[None], logits[None])[0])


def measure_prompt(
    executor: Executor,
    prompt: Prompt,
    check_layers: Sequence[int],
    ratio: float,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One prompt's figures (module docstring)."""
    placed = _place(executor, prompt)
    region = placed.region
    rows = torch.nonzero(region.reusable)[:, 0]
    deviation = deviations(region.reused_k[:, rows], placed.full_k[:, rows])  # [layers, rows]
    truth = deviation.mean(dim=0)
    budget = round(ratio * len(rows))
    generator = torch.Generator().manual_seed(seed)
    random_rows = rows[torch.randperm(len(rows), generator=generator)[:budget]]
    result: dict[str, Any] = {
        "tokens": len(prompt.prefix) + len(region.token_ids),
        "prefix": len(prompt.prefix),
        "reused": len(rows),
        "segments": [len(part) for part, reused in prompt.parts if reused],
        "kl_none": _kl_computing(executor, placed, rows[:0]),
        "kl_random": _kl_computing(executor, placed, random_rows),
        "kl_oracle": _kl_computing(executor, placed, rows[torch.topk(truth, budget).indices]),
        "deviation_by_layer": [round(float(d.mean()), 5) for d in deviation],
        "layers": {},
    }
    for layer in check_layers:
        at = deviation[layer]
        cfg = RecoveryConfig("kv_deviation", ratio, check_layer=layer)
        recovered = recover(executor, [region], cfg)[0]
        assert recovered.last_hidden is not None  # the question's last token is new
        kl = _kl(placed.logits, executor.logits(recovered.last_hidden[None])[0])
        result["layers"][str(layer)] = {
            "spearman": round(spearman(at, truth), 4),
            "deviation": round(float(at.mean()), 5),
            "kl": kl,
            "cost": round(recovered.computed_tokens, 2),
            "kl_chosen_only": _kl_computing(executor, placed, rows[torch.topk(at, budget).indices]),
        }
        if layer > 1:
            # Check layer 1 with the ratio that costs what this layer's recovery cost.
            layers = executor.config.num_layers
            t, new = len(region.token_ids), len(region.token_ids) - len(rows)
            chosen = (recovered.computed_tokens - 2 * t / layers) * layers / (layers - 2) - new
            same = min(1.0, max(0.0, chosen / len(rows)))
            cheap = recover(executor, [region], RecoveryConfig("kv_deviation", same, check_layer=1))
            assert cheap[0].last_hidden is not None
            result["layers"][str(layer)]["layer1_same_cost"] = {
                "ratio": round(same, 4),
                "kl": _kl(placed.logits, executor.logits(cheap[0].last_hidden[None])[0]),
            }
        if log is not None:
            row = result["layers"][str(layer)]
            log(
                f"layer {layer}: spearman {row['spearman']:.3f} deviation {row['deviation']:.4f} "
                f"kl {kl:.4f} chosen-only {row['kl_chosen_only']:.4f} cost {row['cost']:.0f}"
            )
    return result


def check_layer_report(
    executor: Executor,
    tokenizer: Any,
    seeds: Sequence[int],
    check_layers: Sequence[int],
    ratio: float = 0.2,
    segments: int = 5,
    lengths: tuple[int, int] = (150, 400),
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every seed's prompt measured at every check layer, and the mean over seeds per layer."""
    config = executor.config
    by_seed = {}
    for seed in seeds:
        if log is not None:
            log(f"seed {seed}")
        prompt = make_prompt(tokenizer, seed, segments, lengths)
        by_seed[str(seed)] = measure_prompt(executor, prompt, check_layers, ratio, seed, log)
    mean: dict[str, dict[str, float]] = {}
    for layer in map(str, check_layers):
        rows = [result["layers"][layer] for result in by_seed.values()]
        keys = ("spearman", "deviation", "kl", "cost", "kl_chosen_only")
        mean[layer] = {key: sum(row[key] for row in rows) / len(rows) for key in keys}
        if "layer1_same_cost" in rows[0]:
            same = [row["layer1_same_cost"]["kl"] for row in rows]
            mean[layer]["layer1_same_cost_kl"] = sum(same) / len(same)
    return {
        "layers": config.num_layers,
        "windows": list(config.windows),
        "ratio": ratio,
        "segments": segments,
        "lengths": list(lengths),
        "seeds": by_seed,
        "mean": mean,
    }


def print_check_layers(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    seeds = list(report["seeds"])
    windows = report["windows"]
    table = Table(
        title=f"check layer: rows chosen at it, ratio {report['ratio']}; values per seed "
        f"{', '.join(seeds)}"
    )
    columns = (
        "layer",
        "window",
        "spearman vs all-layer deviation",
        "mean deviation",
        "KL",
        "KL, chosen rows only",
        "layer 1 at this cost: KL",
        "cost (tokens)",
    )
    for column in columns:
        table.add_column(column)

    def cells(layer: str, pick: Callable[[dict[str, Any]], float | None], form: str) -> str:
        values = [pick(report["seeds"][seed]["layers"][layer]) for seed in seeds]
        return " / ".join("-" if v is None else format(v, form) for v in values)

    for layer in report["mean"]:
        window = windows[int(layer)]
        table.add_row(
            layer,
            "global" if window is None else str(window),
            cells(layer, lambda row: row["spearman"], ".2f"),
            cells(layer, lambda row: row["deviation"], ".3f"),
            cells(layer, lambda row: row["kl"], ".3f"),
            cells(layer, lambda row: row["kl_chosen_only"], ".3f"),
            cells(layer, lambda row: row.get("layer1_same_cost", {}).get("kl"), ".3f"),
            cells(layer, lambda row: row["cost"], ".0f"),
        )
    console.print(table)
    reference = Table(title="for scale: KL with the same share of rows recomputed")
    for column in ("seed", "tokens", "reused", "none", "random", "by all-layer deviation"):
        reference.add_column(column)
    for seed, result in report["seeds"].items():
        reference.add_row(
            seed,
            str(result["tokens"]),
            str(result["reused"]),
            *(f"{result[key]:.3f}" for key in ("kl_none", "kl_random", "kl_oracle")),
        )
    console.print(reference)
