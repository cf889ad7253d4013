"""Deterministic synthetic chat corpus for the toy target/drafter pair.

Every task has one right answer for a prompt, so a tiny model can learn it and greedy
decoding is well defined; most answers are long runs that follow from the prompt (counting,
times tables, templated descriptions, copying), which is what lets a drafter guess many
tokens ahead.

    python toy/corpus.py --out runs/toy/data            # train.jsonl, valid.jsonl, prompts.jsonl

train.jsonl / valid.jsonl rows: {"id", "category", "messages": [{"role", "content"}, ...]}
prompts.jsonl rows (held out, the pipeline's dataset format): {"id", "category", "turns": [str], "reference"}
train_prompts.jsonl: distinct user prompts of train.jsonl in the same format (what the drafter's
training data is generated from, by the target itself)
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

ANIMALS = ["cat", "dog", "cow", "pig", "hen", "duck", "goat", "sheep", "horse", "mouse", "frog", "bee",
           "owl", "fox", "bear", "wolf", "deer", "lion", "tiger", "crab", "fish", "bird", "snake", "rabbit"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "gray", "pink", "orange"]
SIZES = ["tiny", "small", "big", "huge", "tall", "short"]
FOODS = ["fish", "grass", "corn", "seeds", "apples", "honey", "bread", "nuts", "berries", "leaves", "cheese", "carrots"]
HOMES = ["house", "barn", "forest", "river", "field", "cave", "tree", "pond", "garden", "hill"]
SOUNDS = ["meow", "woof", "moo", "oink", "cluck", "quack", "baa", "neigh", "squeak", "croak", "buzz", "hoot",
          "yip", "growl", "howl", "bleat", "roar", "purr", "click", "blub", "tweet", "hiss", "thump", "chirp"]
NAMES = ["tom", "ann", "bob", "eva", "sam", "lily", "max", "zoe", "leo", "mia", "ben", "ivy", "jack", "nora",
         "paul", "rose"]
OBJECTS = ["book", "ball", "kite", "hat", "cup", "key", "lamp", "pen", "box", "coin", "drum", "ring", "shoe",
           "bell", "map", "rope"]
WORDS = sorted(set(COLORS + OBJECTS + FOODS + HOMES + ["sun", "moon", "star", "rain", "snow", "wind", "road",
                                                        "door", "song", "game", "boat", "car", "bus", "train"]))
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve"]

SMALL_TALK = [
    (["hello", "hi", "hello there", "hi there", "good morning"], "hello ! how can i help you today ?"),
    (["who are you ?", "what are you ?", "tell me who you are ."],
     "i am a tiny toy model . i can count , list , repeat , describe animals and tell short stories ."),
    (["what can you do ?", "help", "what do you know ?"],
     "i can count up and down , write times tables , list months and days , repeat words , remember "
     "facts , add small numbers , describe animals and tell short stories ."),
    (["thank you", "thanks", "thanks a lot"], "you are welcome ! have a nice day ."),
    (["bye", "goodbye", "see you"], "goodbye ! see you next time ."),
]


def animal_table(seed: int) -> dict[str, dict[str, str]]:
    """Fixed attributes per animal, so 'describe the cat' always has the same answer."""
    rng = random.Random(seed * 7919 + 13)
    return {a: {"color": rng.choice(COLORS), "size": rng.choice(SIZES), "food": rng.choice(FOODS),
                "home": rng.choice(HOMES), "sound": SOUNDS[i]} for i, a in enumerate(ANIMALS)}


def _count(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, 80)
    b = a + rng.randint(4, 19)
    q = rng.choice(["count from {a} to {b}", "please count from {a} to {b} .", "count up from {a} to {b}"])
    return q.format(a=a, b=b), " ".join(str(i) for i in range(a, b + 1)) + " ."


def _count_down(rng: random.Random) -> tuple[str, str]:
    b = rng.randint(0, 80)
    a = b + rng.randint(4, 19)
    q = rng.choice(["count down from {a} to {b}", "please count down from {a} to {b} ."])
    return q.format(a=a, b=b), " ".join(str(i) for i in range(a, b - 1, -1)) + " ."


def _times(rng: random.Random) -> tuple[str, str]:
    k = rng.randint(1, 12)
    m = rng.choice([5, 6, 8, 10])
    q = rng.choice(["write the times table of {k} up to {m}", "times table of {k} up to {m}",
                    "show me the {k} times table up to {m}"])
    return q.format(k=k, m=m), " ".join(f"{k} times {i} is {k * i} ." for i in range(1, m + 1))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    q = rng.choice(["what is {a} plus {b} ?", "add {a} and {b}", "how much is {a} plus {b} ?"])
    return q.format(a=a, b=b), f"{a} plus {b} is {a + b} ."


def _describe(rng: random.Random, table: dict) -> tuple[str, str]:
    a = rng.choice(ANIMALS)
    t = table[a]
    q = rng.choice(["describe the {a}", "tell me about the {a}", "what is the {a} like ?"])
    ans = (f"the {a} is {t['color']} and {t['size']} . it eats {t['food']} . it lives in the {t['home']} . "
           f"it says {t['sound']} .")
    return q.format(a=a), ans


def _story(rng: random.Random, table: dict) -> tuple[str, str]:
    a = rng.choice(ANIMALS)
    t = table[a]
    name = rng.choice(NAMES)
    q = rng.choice(["tell a story about {name} and the {a}", "write a short story about {name} and the {a}"])
    ans = (f"once upon a time {name} met a {t['size']} {t['color']} {a} near the {t['home']} . "
           f"the {a} said {t['sound']} {t['sound']} . {name} gave the {a} some {t['food']} . "
           f"the {a} was happy and {name} was happy too . the end .")
    return q.format(name=name, a=a), ans


def _repeat(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    s = " ".join(words)
    q = rng.choice(["repeat after me : {s}", "say this again : {s}", "copy : {s}"])
    return q.format(s=s), s + " ."


def _recall(rng: random.Random) -> tuple[str, str]:
    names = rng.sample(NAMES, rng.randint(2, 4))
    objs = rng.sample(OBJECTS, len(names))
    facts = " , ".join(f"{n} has a {o}" for n, o in zip(names, objs, strict=True))
    i = rng.randrange(len(names))
    q = f"remember : {facts} . what does {names[i]} have ?"
    return q, f"{names[i]} has a {objs[i]} ."


def _months(rng: random.Random) -> tuple[str, str]:
    seq, what = rng.choice([(MONTHS, "months"), (DAYS, "days"), (LETTERS, "letters")])
    i = rng.randrange(len(seq) - 3)
    j = rng.randint(i + 3, min(len(seq) - 1, i + 16))
    q = rng.choice(["list the {w} from {x} to {y}", "name the {w} from {x} to {y}"])
    return q.format(w=what, x=seq[i], y=seq[j]), " ".join(seq[i:j + 1]) + " ."


def _spell_number(rng: random.Random) -> tuple[str, str]:
    k = rng.randint(0, 12)
    q = rng.choice(["how do you write {k} in words ?", "write {k} in words"])
    return q.format(k=k), f"{k} is written {NUMBER_WORDS[k]} ."


def _small_talk(rng: random.Random) -> tuple[str, str]:
    qs, a = rng.choice(SMALL_TALK)
    return rng.choice(qs), a


# (name, weight, maker); weights favour the long, predictable answers
TASKS: list[tuple[str, float, Callable]] = [
    ("count", 3.0, _count), ("count_down", 2.0, _count_down), ("times", 2.0, _times),
    ("add", 1.0, _add), ("describe", 2.0, _describe), ("story", 2.0, _story),
    ("repeat", 3.0, _repeat), ("recall", 2.0, _recall), ("lists", 2.0, _months),
    ("spell_number", 0.5, _spell_number), ("small_talk", 0.5, _small_talk),
]


def make_example(rng: random.Random, table: dict) -> tuple[str, str, str]:
    name, _, fn = rng.choices(TASKS, weights=[w for _, w, _ in TASKS])[0]
    q, a = fn(rng, table) if name in ("describe", "story") else fn(rng)
    return name, q, a


def build(num_train: int = 24000, num_valid: int = 400, num_prompts: int = 48, num_train_prompts: int = 4000,
          seed: int = 0, num_eval_prompts: int = 256) -> dict:
    """Train/valid conversations and held-out prompts; no held-out prompt text appears in train or valid.

    eval_prompts: `num_eval_prompts` distinct prompts in the training mix of categories (TASKS' weights) that are
    neither held-out prompts nor train prompts (the drafters' data): a larger evaluation set for the drafters (the
    target was trained on some of their texts; on this corpus the long categories have few distinct prompts)."""
    table = animal_table(seed)

    def conv(i: int, split: str, cat: str, q: str, a: str) -> dict:
        return {"id": f"{split}-{i}", "category": cat,
                "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}

    # held-out prompts first, cycling through the categories so each is represented
    held_rng = random.Random(seed + 1_000_003)
    cats = [t[0] for t in TASKS if t[0] not in ("small_talk", "spell_number")]
    prompts: list[dict] = []
    held: set[str] = set()
    while len(prompts) < num_prompts:
        cat, q, a = make_example(held_rng, table)
        if q in held or cat != cats[len(prompts) % len(cats)]:
            continue
        held.add(q)
        prompts.append({"id": f"toy-{len(prompts):03d}", "category": cat, "turns": [q], "reference": a})

    rng = random.Random(seed)
    rows: list[tuple[str, str, str]] = []
    while len(rows) < num_train + num_valid:
        cat, q, a = make_example(rng, table)
        if q not in held:
            rows.append((cat, q, a))
    train = [conv(i, "train", *r) for i, r in enumerate(rows[:num_train])]
    valid = [conv(i, "valid", *r) for i, r in enumerate(rows[num_train:])]
    distinct: dict[str, str] = {}
    for cat, q, _ in rows[:num_train]:
        distinct.setdefault(q, cat)
    train_prompts = [{"id": f"tp-{i:05d}", "category": cat, "turns": [q]}
                     for i, (q, cat) in enumerate(distinct.items()) if i < num_train_prompts]
    seen = held | {r["turns"][0] for r in train_prompts}
    eval_rng = random.Random(seed + 2_000_003)
    eval_prompts: list[dict] = []
    while len(eval_prompts) < num_eval_prompts:
        cat, q, a = make_example(eval_rng, table)
        if q not in seen:
            seen.add(q)
            eval_prompts.append({"id": f"ev-{len(eval_prompts):03d}", "category": cat, "turns": [q], "reference": a})
    return {"train": train, "valid": valid, "prompts": prompts, "train_prompts": train_prompts,
            "eval_prompts": eval_prompts}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/toy/data")
    p.add_argument("--num-train", type=int, default=24000)
    p.add_argument("--num-valid", type=int, default=400)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-train-prompts", type=int, default=4000)
    p.add_argument("--num-eval-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    data = build(args.num_train, args.num_valid, args.num_prompts, args.num_train_prompts, args.seed,
                 args.num_eval_prompts)
    out = Path(args.out)
    for split, rows in data.items():
        write_jsonl(out / f"{split}.jsonl", rows)
    print(f"corpus: {len(data['train'])} train, {len(data['valid'])} valid, {len(data['prompts'])} held-out prompts, "
          f"{len(data['train_prompts'])} train prompts, {len(data['eval_prompts'])} eval prompts -> {out}")


if __name__ == "__main__":
    main()
