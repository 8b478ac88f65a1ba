"""Step 1 of the EAGLE recipe: a prompt corpus for self-distillation.

No dataset hub is reachable, so the corpus is built from what every machine has, deterministically
from a seed:

- ``chat``: single-turn assistant requests from task templates x topics written for this recipe
  (questions, explanations, how-tos, lists, short creative writing, emails, word problems);
- ``howto``: practical questions, everyday tasks x ways of asking (a second, differently phrased
  family: a head trained on one template family generalises poorly to requests phrased otherwise);
- ``rewrite``: copy-heavy rewriting (fix grammar, bullet points, past tense, summarise, ...) of
  English paragraphs taken from the docstrings of the running interpreter's standard library;
- ``code_edit``: small mechanical edits of standard-library functions, drawn with the same selection
  and instruction code as ``data/prompts/build_code_edit.py``.

Prompts that calib's sample banks and tests use (every ``*.jsonl`` under ``exclude_dirs``) are kept
out: by id, by text, and, for code edits, every source file those prompts quote is skipped.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import random
import sysconfig
from pathlib import Path

TOPICS = [
    "black holes", "the water cycle", "compound interest", "sourdough bread", "the French Revolution",
    "volcanoes", "honeybees", "electric cars", "the immune system", "plate tectonics", "jazz music",
    "the printing press", "solar panels", "coral reefs", "the Roman Empire", "vaccines", "sleep",
    "coffee", "meditation", "recycling plastic", "the moon landing", "dinosaurs", "rainbows",
    "the stock market", "antibiotics", "earthquakes", "the internet", "bicycles", "chess",
    "the human heart", "glaciers", "tea ceremonies", "the Silk Road", "wind turbines", "octopuses",
    "inflation", "the Olympic Games", "composting", "penguins", "the periodic table", "tides",
    "machine learning", "the Great Wall of China", "migraines", "gardening in small spaces",
    "public speaking", "time management", "learning a new language", "budgeting", "running a marathon",
    "photography", "origami", "the speed of light", "hurricanes", "democracy", "the Renaissance",
    "DNA", "bread yeast", "climate change", "the Amazon rainforest", "batteries", "credit scores",
    "job interviews", "houseplants", "rock climbing", "the violin", "tornadoes", "the Pyramids of Giza",
    "friendship", "board games", "camping", "nutrition labels", "the metric system", "3D printing",
    "cryptography", "elephants", "the Moon's phases", "renewable energy", "electric guitars",
    "the Industrial Revolution", "wolves", "fermentation", "the Arctic", "submarines", "kites",
    "sunscreen", "first aid", "podcasts", "street food", "minimalism", "the Pacific Ocean",
    "mushrooms", "the Milky Way", "airplanes", "typing faster", "bird migration", "libraries",
    "cheese making", "snowflakes", "the Mona Lisa", "mountain gorillas", "saving for retirement",
    "remote work", "email etiquette", "recipes with lentils", "the Titanic", "quantum computers",
    "cloud computing", "spreadsheets", "password security", "lighthouses", "sharks", "deserts",
    "origami cranes", "the Eiffel Tower", "hiking safety", "vegetable soup", "chocolate",
    "the Nile", "trains", "windmills", "thunderstorms", "the human brain", "robots", "satellites",
]

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short poem about {t}.",
    "Give me five tips related to {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a two-paragraph introduction to {t} for a school report.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Summarise the history of {t} in a few sentences.",
    "What is a common misconception about {t}?",
    "Write a short story for children that involves {t}.",
    "Create a quiz with three questions about {t}, with answers.",
    "Write a friendly email to a colleague recommending a book about {t}.",
    "How would you explain {t} to someone from the 18th century?",
    "List the key terms someone should know about {t}, with one-line definitions.",
    "Write a tweet-length fun fact about {t}.",
    "Describe {t} in exactly three sentences.",
    "What questions might a beginner ask about {t}? Answer two of them.",
    "Write a limerick about {t}.",
    "Make a simple step-by-step plan to learn about {t} in one week.",
    "Compare {t} and {u} in a short table.",
    "Write a short dialogue between two friends talking about {t}.",
    "Why does {t} matter in everyday life?",
    "Give an analogy that helps explain {t}.",
]

TASKS = [
    "make a budget for the month", "clean a cast iron pan", "write a cover letter", "fix a leaking tap",
    "start running", "get better sleep", "learn to juggle", "plant tomatoes on a balcony",
    "prepare for a job interview", "negotiate a salary", "make pancakes", "iron a shirt",
    "change a bicycle tyre", "study for an exam", "write a thank-you note", "organise a small party",
    "save money on groceries", "back up my phone", "choose a laptop", "make a cup of green tea",
    "train a puppy to sit", "keep houseplants alive", "pack for a weekend trip", "write a short speech",
    "memorise a poem", "make homemade pizza dough", "clean windows without streaks", "start a journal",
    "learn to touch type", "stay focused while working from home", "repot a cactus", "cook rice",
    "wash a wool sweater", "make a paper aeroplane", "plan a road trip", "reduce my screen time",
    "write a good email subject line", "sharpen a kitchen knife", "start learning the guitar",
    "make friends in a new city", "prepare a simple salad dressing", "read more books", "tie a tie",
    "fold a fitted sheet", "make cold brew coffee", "get rid of fruit flies", "stretch after a run",
    "take better photos with a phone", "write a short bio", "learn basic Spanish phrases",
    "build a simple bookshelf", "care for a goldfish", "make a to-do list that works",
    "give constructive feedback", "apologise to a friend", "store fresh herbs", "start meditating",
    "make vegetable stock", "unclog a drain", "choose running shoes", "calm down before a presentation",
    "teach a child to ride a bike", "set up a home office", "make a smoothie", "wake up earlier",
    "split a restaurant bill fairly", "write a haiku", "prepare for a long flight", "bake cookies",
    "keep a conversation going", "learn to swim as an adult", "remove a coffee stain",
    "plan meals for a week", "start a vegetable garden", "drink more water", "write a product review",
    "practise mindfulness at work", "choose a good password", "make a simple website",
    "start saving for a holiday", "decorate a small room", "make scrambled eggs", "paint a wall",
    "care for a sourdough starter", "learn chess openings", "write a birthday message",
    "prepare for a marathon", "keep a car battery healthy", "reduce food waste", "make lemonade",
    "write a complaint letter", "get started with watercolour painting", "choose a houseplant",
    "handle a difficult coworker", "learn to whistle", "clean a laptop keyboard", "make a photo album",
    "defrost a freezer", "care for leather boots", "make a simple curry", "improve my handwriting",
    "organise my email inbox", "learn a card trick", "start composting at home",
    "get over a cold faster", "plan a picnic", "write a short story", "practise public speaking",
    "keep cut flowers fresh", "make a weekly cleaning schedule", "roast vegetables",
    "prepare for a first day at a new job", "set goals for the new year", "make a simple kite",
    "hang a picture straight", "cook pasta perfectly", "make friends with a shy cat",
    "spend less on impulse purchases", "learn to draw faces", "make a quick breakfast",
    "write a resignation letter", "choose a gift for a friend", "protect my skin in the sun",
    "stay motivated when learning something new", "take notes in a lecture", "make hummus",
    "keep my bike in good shape", "introduce myself at a meetup", "sort laundry", "make a fruit salad",
    "learn to knit", "brew a good cup of coffee at home", "recover after a long hike",
    "plan a study schedule", "write clear instructions", "clean a microwave", "grow herbs indoors",
]

ASK_FORMS = [
    "How do I {x}?",
    "What's the easiest way to {x}?",
    "I'm a complete beginner. How should I {x}?",
    "What are common mistakes people make when they try to {x}?",
    "Can you give me a short checklist to {x}?",
    "My friend asked me how to {x}. What should I tell them?",
    "Explain step by step how to {x}.",
    "I only have ten minutes. How can I {x}?",
    "What do I need to {x}? Keep it short.",
    "Is it hard to {x}? Give me some honest advice.",
    "Give me three tips to {x}, and explain why each one helps.",
    "Write a short guide for teenagers on how to {x}.",
]

WORD_PROBLEMS = [
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars? Show your steps.",
    "A train travels {a} kilometres in {b} hours. What is its average speed? Explain.",
    "I have {a} apples and give away {b}. Then I buy twice as many as I have left. How many do I have?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If {a} workers build a wall in {b} days, how long would twice as many workers take?",
    "What is {a} percent of {b}? Show how to compute it.",
]

REWRITES = [
    "Fix any spelling or grammar mistakes in the following text and return the corrected text:",
    "Rewrite the following text as a bulleted list of its main points:",
    "Rewrite the following text in the past tense:",
    "Summarise the following text in two sentences:",
    "Rewrite the following text so that a beginner can understand it:",
    "Copy the following text, but replace every technical term with a plainer word where possible:",
    "Translate the following text into simpler English, keeping the same structure:",
    "Turn the following text into a short FAQ with two questions and answers:",
]


def _load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def excluded_prompts(exclude_dirs) -> tuple[set[str], set[str], set[str]]:
    """(ids, prompt texts, quoted source files) of every prompt under ``exclude_dirs``."""
    ids, texts, files = set(), set(), set()
    for d in exclude_dirs:
        for f in sorted(Path(d).glob("*.jsonl")):
            for rec in _load_jsonl(f):
                ids.add(rec["id"])
                texts.update(m["content"].strip() for m in rec["messages"])
                if "source" in rec:
                    files.add(rec["source"]["file"])
    return ids, texts, files


def _chat(n: int, rng: random.Random) -> list[str]:
    combos = [(tpl, t) for tpl in TEMPLATES for t in TOPICS]
    rng.shuffle(combos)
    out = []
    for tpl, t in combos[: max(0, n - n // 10)]:
        out.append(tpl.format(t=t, u=rng.choice([u for u in TOPICS if u != t])))
    while len(out) < n:  # about a tenth are arithmetic word problems
        out.append(rng.choice(WORD_PROBLEMS).format(a=rng.randint(2, 90), b=rng.randint(2, 40)))
    return out


def _howto(n: int, rng: random.Random) -> list[str]:
    combos = [form.format(x=x) for form in ASK_FORMS for x in TASKS]
    rng.shuffle(combos)
    return combos[:n]


def _paragraphs(stdlib: Path, skip_files: set[str]) -> list[str]:
    """English paragraphs (200-700 characters) from stdlib module and class docstrings."""
    out = []
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib)
        if rel.as_posix() in skip_files or {"test", "tests", "idlelib", "site-packages"} & set(rel.parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [n for n in tree.body if isinstance(n, ast.ClassDef)]
        for node in nodes:
            doc = ast.get_docstring(node) or ""
            for para in doc.split("\n\n"):
                text = " ".join(para.split())
                # Prose only: no doctest prompts, tables or code-like lines.
                if 200 <= len(text) <= 700 and ">>>" not in text and text.count("(") < 6 and "  " not in para[:4]:
                    out.append(text)
    return out


@functools.cache
def build_code_edit():
    """``data/prompts/build_code_edit.py`` (a script, not a package module): its function picker and edits."""
    spec = importlib.util.spec_from_file_location("_build_code_edit", Path(__file__).resolve().parents[3]
                                                  / "data" / "prompts" / "build_code_edit.py")
    bce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bce)
    return bce


def _code_edits(n: int, stdlib: Path, skip_files: set[str], seed: int) -> list[dict]:
    bce = build_code_edit()
    cands = [c for c in bce.candidates(stdlib) if c["file"] not in skip_files]
    cands.sort(key=lambda c: (c["file"], c["start"]))
    rng = random.Random(seed)
    rng.shuffle(cands)
    out = []
    for i, cand in enumerate(cands[:n]):
        kinds = sorted(cand["kinds"])
        kind = kinds[i % len(kinds)]
        out.append({"content": bce.instruction(kind, cand["kinds"][kind], cand, rng), "edit": kind,
                    "source": {"file": cand["file"], "start_line": cand["start"], "end_line": cand["end"]}})
    return out


def build_corpus(n_chat: int, n_rewrite: int, n_code_edit: int, exclude_dirs=(), seed: int = 0,
                 stdlib: str | None = None, n_howto: int = 0) -> list[dict]:
    """Return ``[{"id", "category", "messages", ...}]``; deterministic for a seed and Python version.

    Each family draws from its own random stream, so growing one count keeps every other prompt (and
    its cached answer) as it was."""
    rng = random.Random(seed)
    stdlib_dir = Path(stdlib or sysconfig.get_paths()["stdlib"])
    ex_ids, ex_texts, ex_files = excluded_prompts(exclude_dirs)
    records = []
    for i, text in enumerate(_chat(n_chat, rng)):
        records.append({"id": f"eagle-chat-{i:05d}", "category": "chat", "content": text})
    paras = _paragraphs(stdlib_dir, ex_files)
    rng.shuffle(paras)
    for i, para in enumerate(paras[:n_rewrite]):
        records.append({"id": f"eagle-rewrite-{i:05d}", "category": "chat",
                        "content": f"{REWRITES[i % len(REWRITES)]}\n\n{para}"})
    for i, rec in enumerate(_code_edits(n_code_edit, stdlib_dir, ex_files, seed)):
        records.append({"id": f"eagle-code_edit-{i:05d}", "category": "code_edit", **rec})
    for i, text in enumerate(_howto(n_howto, random.Random(f"howto-{seed}"))):
        records.append({"id": f"eagle-howto-{i:05d}", "category": "chat", "content": text})
    out = []
    for rec in records:
        if rec["id"] in ex_ids or rec["content"].strip() in ex_texts:
            continue
        content = rec.pop("content")
        out.append({**rec, "messages": [{"role": "user", "content": content}]})
    return out
