"""Write recipes/prompts/broad.jsonl: thousands of distinct generation prompts, code and English, for data=generated.

    python -m draftsmith.data.prompt_sets    # rewrites recipes/prompts/broad.jsonl (shipped; rerun only to change it)

Why: the default recipe samples the target for a fixed time, so on a slow CPU it reaches ~660 samples: from
train.jsonl's 126 prompts that is five of each, from these 1351 it is 660 topics. (On an AMX Xeon, whose 14 minutes
give ~1700 samples, the two files trained drafts accepted alike: docs/results.md.) What is written, interleaved so
that any prefix past the hand-written prompts (what a time-limited sampler reaches) is about half code:
- train.jsonl's hand-written prompts, first;
- code: the signature and the docstring's first line of documented top-level functions of this Python's standard
  library (the shape of the code prompt set: `def name(args):` + a one-line docstring; the output depends on the
  Python version that runs this script);
- English: ten openings of train.jsonl crossed with topics listed below.
No prompt of the held-out `code` and `english` sets, none of their function names or topics, is written.
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "recipes" / "prompts"

TEMPLATES = [
    "Scientists have studied {} for", "Write a paragraph about {}.\n\n", "In this essay, I will describe {} and",
    "The most important thing to understand about {} is", "Children often ask why {}",
    "One interesting fact about {} is that", "A brief history of {}:", "Many people do not know that {}",
    "Here is a short explanation of {}:", "An introduction to {}:",
]

TOPICS = """
the water cycle; black holes; the human heart; coral reefs; the French Revolution; machine learning; the Great Wall
of China; honeybees; the stock market; climate change; the Moon landing; ancient Egypt; vaccines; the Industrial
Revolution; earthquakes; the Internet; penguins; democracy; the solar system; jazz music; the Renaissance;
antibiotics; deserts; electric cars; rivers; renewable energy; the immune system; glaciers; the Silk Road; bread
baking; recycling; whales; the theory of evolution; public libraries; tea; friendship; city parks; volunteering; the
ocean tides; bicycles; the English language; gardening; the Cold War; rainbows; bridges; coffee; the human brain;
earthworms; museums; trains; the Sahara; the Roman Empire; DNA; the periodic table; gravity; magnets; lightning;
hurricanes; tornadoes; the northern lights; comets; Mars; Jupiter; the Sun; satellites; rockets; airplanes; ships;
submarines; lighthouses; castles; the pyramids; the Aztecs; the Maya; the Vikings; ancient Greece; ancient China; the
Ottoman Empire; the printing of books; the steam engine; electricity; batteries; solar panels; wind turbines; nuclear
power; the light bulb; radio; television; computers; smartphones; video games; social media; email; cybersecurity;
robots; artificial intelligence; space stations; telescopes; microscopes; bacteria; viruses; fungi; mushrooms; trees;
flowers; bees and pollination; butterflies; ants; spiders; frogs; snakes; crocodiles; sharks; dolphins; octopuses;
elephants; lions; wolves; bears; horses; dogs; cats; birds' migration; owls; eagles; dinosaurs; fossils; rocks and
minerals; diamonds; gold; salt; sugar; chocolate; rice; wheat; potatoes; cheese; olive oil; spices; cooking pasta;
nutrition; vitamins; the digestive system; the lungs; bones; muscles; the skin; eyesight; hearing; dreams; memory;
emotions; stress; meditation; running; swimming; football; basketball; tennis; the marathon; mountain climbing;
camping; maps; compasses; clocks; calendars; money; banks; taxes; trade; supply and demand; small businesses;
advertising; the post office; newspapers; libraries' history; schools; universities; exams; teachers; homework;
reading; poetry; novels; Shakespeare; theatre; opera; painting; sculpture; architecture; photography's history;
cinema; music theory; the piano; the violin; drums; choirs; festivals; weddings; holidays; birthdays; family
traditions; cities; villages; farms; agriculture; irrigation; forests; rainforests; wetlands; oceans; islands; caves;
waterfalls; lakes; mountains' formation; weather forecasts; clouds; snow; droughts; floods; pollution; plastic waste;
clean water; public transport; traffic; roads; tunnels; skyscrapers; houses; furniture; clothing; cotton; wool; silk;
shoes; glass; paper; ink; pencils; the alphabet; numbers; zero; geometry; algebra; probability; statistics; prime
numbers; chess openings; puzzles; card games; board games; kindness; honesty; courage; teamwork; leadership;
negotiation; public speaking; writing a resume; job interviews; time management; habits; learning to cook; learning to
drive; first aid; fire safety; hospitals; nurses; doctors; pharmacies; medicine's history; the heart's rhythm;
sleep cycles in animals; hibernation; camouflage; echolocation; photosynthesis in algae; the carbon cycle; volcano
monitoring; plate tectonics; the Earth's core; the atmosphere; the ozone layer; the seasons; time zones; the speed of
light; sound waves; rainbows' colours; mirrors; lenses; engines; cars' history; motorcycles; helicopters; hot-air
balloons; canals; ports; the Panama Canal; the Eiffel Tower; the Statue of Liberty; the Colosseum; Machu Picchu;
Antarctica; the Arctic; the Himalayas; the Nile; the Mississippi River; Australia's wildlife; Japan's history;
India's history; Brazil's culture; Canada's geography; the United Nations; human rights; elections; courts; laws;
constitutions; citizenship; immigration; languages of the world; sign language; translation; dictionaries
"""

# topics and function names of the held-out prompt sets, never written here (the sets are what we measure on)
HELD_OUT_WORDS = ["printing press", "photosynthesis", "sleep", "city council", "language", "amazon", "inflation",
                  "mountains", "exercise", "telephone", "volcano", "breakfast"]


def held_out() -> tuple[set[str], set[str]]:
    prompts = [json.loads(line)["prompt"] for name in ("code", "english")
               for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    names = set()
    for p in prompts:
        for word in ("def ", "class "):
            for part in p.split(word)[1:]:
                names.add(part.split("(")[0].split(":")[0].strip())
    return set(prompts), names


def english(rng: random.Random) -> list[str]:
    topics = [t.strip() for t in " ".join(TOPICS.split()).split(";") if t.strip()]
    topics = [t for t in topics if not any(w in t.lower() for w in HELD_OUT_WORDS)]
    out = [tpl.format(t) for t in topics for tpl in TEMPLATES]
    rng.shuffle(out)
    return out


def code(rng: random.Random, skip_names: set[str]) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, seen = [], set(skip_names)
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if any(p in ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo") or p.startswith("_")
               for p in rel[:-1]) or rel[-1].startswith(("_", "test")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in seen:
                continue
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
            args = ast.unparse(node.args)
            if not (15 <= len(doc) <= 90 and doc.endswith(".") and doc.isascii() and len(args) <= 60):
                continue
            seen.add(node.name)
            out.append(f'def {node.name}({args}):\n    """{doc}"""\n')
    rng.shuffle(out)
    return out


def main() -> int:
    rng = random.Random(0)
    eval_prompts, eval_names = held_out()
    hand = [json.loads(line) for line in (PROMPTS / "train.jsonl").read_text().splitlines() if line.strip()]
    en, py = english(rng), code(rng, eval_names)
    n = min(len(en), len(py))
    rows = list(hand)
    for e, c in zip(en[:n], py[:n]):  # alternate: a sampler stopped anywhere has sampled half of each
        rows += [{"prompt": c, "domain": "code"}, {"prompt": e, "domain": "english"}]
    seen, unique = set(eval_prompts), []
    for r in rows:
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            unique.append(r)
    out = PROMPTS / "broad.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in unique))
    counts = {d: sum(r["domain"] == d for r in unique) for d in ("code", "english")}
    print(f"{out}: {len(unique)} prompts ({counts['code']} code, {counts['english']} English; "
          f"Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
