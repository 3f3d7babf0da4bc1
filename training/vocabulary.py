"""A System One decision task that cannot be memorised: the training and held-out families share the task
(what decides each answer) but no surface vocabulary (names, messages, formats, wordings).

Three kinds of state, with questions of two sorts:

- *structural* questions, answered by reading the state's structure, whatever its formatting and names:
  service logs (does the last line say ERROR: `last_error`; how severe is the last line: `last_level`;
  which component logged the latest error: `last_failure`), order timelines (the latest status:
  `status`; a refund requested after delivery: `late_refund`; who placed the order: `customer`) and
  support tickets (how urgent, from the ticket's cues: `urgency`; which product it is about: `product`);
- *semantic* questions, answered from what words mean: which team handles a ticket (`department`). A
  small model knows only the words its generator uses for that (DEPARTMENT_KEYWORDS, shared by both
  families); evaluate.py scores it apart.

The task vocabulary both families share: level spellings (LEVELS: ERROR, err, E, FATAL, ...), the five
order statuses, the word "refund", urgency cues (URGENCY_CUES), department keywords, the record's
question ids. Everything else is *surface* vocabulary and disjoint between the families:

- listed words (components, people, products, items, log message words) belong to one family each, by a
  hash of the word (`family_of`), so the same word is in the same family in every role;
- made-up names (components, people, products) are drawn from syllables every family shares; a name
  belongs to the family its hash says, and never spells a listed word or contains a task word;
- log formats (composed from wrappings and separators) and time stamps, order headers and event lines,
  ticket phrasings and question wordings come in two disjoint sets.

Names are passed in the options (the components, products, customers a question chooses among change
with every example), so no answer can be recalled: the model must find the option in the state. Labels
are computed from the facts the generator draws; tests/test_vocabulary.py re-derives every one from the
text alone.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "heldout")
STRUCTURAL = ("last_error", "last_level", "last_failure", "status", "late_refund", "customer", "urgency", "product")
SEMANTIC = ("department",)
WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Example:
    request: dict[str, Any]
    answers: dict[str, str]  # question id -> correct option id
    kind: str  # ticket | log | order


# ---- the task vocabulary (shared) ----------------------------------------------------------------
# Level spellings, one style per log (real logs are consistent); score: info 0, warn 1, error 2.
LEVEL_STYLES = [
    ("ERROR", "WARN", "INFO"),
    ("ERROR", "WARNING", "INFO"),
    ("error", "warn", "info"),
    ("error", "warning", "info"),
    ("Error", "Warning", "Info"),
    ("ERR", "WRN", "INF"),
    ("err", "wrn", "inf"),
    ("E", "W", "I"),
    ("FATAL", "WARN", "INFO"),
    ("CRITICAL", "WARNING", "INFO"),
    ("CRIT", "WARN", "INFO"),
    ("fatal", "warn", "info"),
]
LEVELS = {  # every spelling -> its level (0 info, 1 warn, 2 error)
    spelling: 2 - i for style in LEVEL_STYLES for i, spelling in enumerate(style)
}
STATUSES = ["placed", "paid", "shipped", "delivered", "cancelled"]
URGENCY_CUES = {  # score -> phrases that state it (task vocabulary: a cue must be known to be read)
    0: [
        "No rush.",
        "No rush, whenever you can.",
        "Not urgent.",
        "This is not urgent at all.",
        "No hurry.",
        "Low priority.",
        "Low priority for now.",
        "Take your time.",
        "Whenever you have time.",
        "This can wait.",
        "It can wait until next week.",
    ],
    2: [
        "This is urgent.",
        "URGENT:",
        "Urgent, please help.",
        "Please help ASAP.",
        "Fix asap please!",
        "I need this fixed right now.",
        "Please look into it immediately.",
        "CRITICAL:",
        "This is critical for us.",
        "This is an emergency.",
        "As soon as possible please.",
    ],
}
DEPARTMENT_KEYWORDS = {  # team -> words a ticket about it uses (semantic: the model knows only these)
    "billing": ["invoice", "charge", "payment", "receipt", "overcharge"],
    "technical": ["crash", "bug", "login", "password", "freeze"],
    "shipping": ["parcel", "tracking", "delivery", "courier", "package"],
    "sales": ["quote", "upgrade", "seats", "licence", "discount"],
    "accounts": ["username", "profile", "email", "avatar"],
    "logistics": ["freight", "pallet", "warehouse", "container"],
    "care": ["warranty", "repair", "return", "replacement"],
}
TASK_WORDS = frozenset(
    w.lower()
    for text in [
        *LEVELS,
        *STATUSES,
        "refund",
        "refunded",
        *(p for phrases in URGENCY_CUES.values() for p in phrases),
        *DEPARTMENT_KEYWORDS,
        *(k for keys in DEPARTMENT_KEYWORDS.values() for k in keys),
    ]
    for w in WORD.findall(text)
)

# ---- the surface vocabulary (one family per word) ------------------------------------------------
COMPONENT_WORDS = """api db cache queue auth gateway scheduler worker mailer search payments inventory checkout
cart pricing resolver notifier ledger uploader thumbnailer cdn proxy router indexer crawler renderer storage
backup metrics session web frontend backend cron broker redis postgres nginx etcd vault registry builder deployer
sync exporter importer tracker reporter webhook balancer dns smtp sms ingest batcher compactor planner
dispatcher collector limiter locator signer verifier converter transcoder mirror bouncer watcher""".split()
PERSON_WORDS = """Alice Bruno Chen Dana Emeka Farah Goran Hana Ines Jonas Kaito Lena Mateo Nadia Omar Priya Sam
Theo Gwen Yusra Lotte Ben Ada Tobiah Saga Quentin Wen Matteo Kenji Pavel Noor Gaspard Ingrid Jonah Oskar Hendrik
Ilse Marta Felix Rosa Ivan Leila Hugo Clara Diego Elif Aziz Mina Lars Petra Rahul Sofia Tariq Uma Viktor Wanda
Xavier Yara Zoe Anouk Boris Cyrus Dilnoza Esra Fiona Gideon Hiro Isla Jasper Kira Luca Maja Nils Olga Paulo
Aiko Bjorn Carmen Darius Eun Femke Gustavo Helga Idris Jun Kofi Lucien Milan Nia Oren Pilar Rafael Selin Tomas
Ulla Vera Wilmer Yannick Zainab Arjun Bea Cosmin Dorota Emil Fatima Giulia Hamza Iris Jakub Kalani""".split()
PRODUCT_PARTS = """Photo Task Note Cloud Mail Chart Code Page Spark Lumo Bright Quill Orbit Tide Fern Cobalt
Pixel Form Flow Desk Pad Hub Box Mint Nest Mill Line Drive Pilot Ledger Board Deck Stack Loop Wave Leaf Frame
Vault Dash Beam Grid Forge Port Shelf""".split()
ITEM_WORDS = """lamp desk chair cable mouse monitor stand kettle mug camera tent boots scarf gloves blender sofa drone
jacket speaker headphones pump bike helmet rug vase blanket pillow toaster fan heater charger keyboard tripod
backpack bottle clock mirror printer shelf stool tablet watch""".split()
MESSAGE_NOUNS = """connection socket handshake disk token request job chunk lock pool index certificate payload
checksum upstream replica shard buffer heartbeat snapshot migration cursor stream partition lease webhook
signature cookie quota manifest thread batch segment tunnel""".split()
MESSAGE_VERBS = """refused failed corrupted rejected crashed exhausted unreachable expired lost dropped invalid
stalled served loaded started synced accepted warmed rotated flushed renewed queued pending retried evicted
resumed skipped compacted throttled delayed reset opened closed""".split()
SYLLABLES = """ba bo da del dri fa fen ga gor ha ka kel ko la lin lu ma mer mo na nor nu pa pel qui ra rin ro sa sel
so ta tam tor tu va vel vo za zel zu isk ova ane ith bre cor dun""".split()


def family_of(word: str) -> str:
    """The family a surface word belongs to, by a stable hash (one in four held out)."""
    return "heldout" if zlib.crc32(word.lower().encode()) % 4 == 0 else "train"


def _listed(words: list[str], split: str) -> list[str]:
    return sorted(w for w in words if family_of(w) == split)


LISTED = {  # family -> category -> words
    split: {
        "component": _listed(COMPONENT_WORDS, split),
        "person": _listed(PERSON_WORDS, split),
        "product_part": _listed(PRODUCT_PARTS, split),
        "item": _listed(ITEM_WORDS, split),
        "noun": _listed(MESSAGE_NOUNS, split),
        "verb": _listed(MESSAGE_VERBS, split),
    }
    for split in SPLITS
}
LISTED_WORDS = frozenset(w.lower() for split in SPLITS for words in LISTED[split].values() for w in words)


def spells_a_known_word(name: str) -> bool:
    """A made-up name may not be a listed word (of either family) nor contain a task word: it would then
    be that word, or carry a fact (a status, a level) it does not state."""
    lowered = name.lower()
    return lowered in LISTED_WORDS or any(len(w) >= 3 and w in lowered for w in TASK_WORDS)


def made_up_name(rng: random.Random, split: str, capital: bool = False) -> str:
    """A name from shared syllables that belongs to `split` (by hash) and spells no known word."""
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 2, 3))))
        if family_of(name) == split and not spells_a_known_word(name):
            return name.capitalize() if capital else name


def _component(rng: random.Random, split: str) -> str:
    roll = rng.random()
    if roll < 0.45:
        name = rng.choice(LISTED[split]["component"])
    else:
        name = made_up_name(rng, split)
    if rng.random() < 0.12:
        name += f"-{rng.randint(1, 9)}"
    elif rng.random() < 0.08:
        name += "-" + rng.choice(LISTED[split]["component"])
    return name


def _person(rng: random.Random, split: str) -> str:
    return rng.choice(LISTED[split]["person"]) if rng.random() < 0.5 else made_up_name(rng, split, capital=True)


def _product(rng: random.Random, split: str) -> str:
    parts = LISTED[split]["product_part"]
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(parts) + rng.choice(parts)  # "PhotoBox"
    if roll < 0.7:
        return made_up_name(rng, split, capital=True)
    return made_up_name(rng, split, capital=True) + " " + rng.choice(parts)  # "Cobalt Notes"


def _distinct(rng: random.Random, draw, count: int, avoid: set[str] = frozenset()) -> list[str]:
    """`count` distinct names from `draw`, none of them in `avoid` nor contained in another (so no option
    can be found inside another's occurrences)."""
    chosen: list[str] = []
    while len(chosen) < count:
        name = draw()
        if name in avoid or any(name.lower() in c.lower() or c.lower() in name.lower() for c in chosen):
            continue
        chosen.append(name)
    return chosen


# ---- question wordings (disjoint; training also asks with none: the record then shows the id) ------
INSTRUCTIONS = {
    "last_error": {
        "train": (
            "Is the last log line an ERROR?",
            "Does the log end with an error?",
            "Is the final line an error?",
            "Was the last entry logged as an error?",
        ),
        "heldout": ("Did the log finish on a failure?", "Is the closing entry a failure?"),
    },
    "last_level": {
        "train": (
            "How severe is the last log line?",
            "Rate the level of the final line.",
            "Level of the last entry?",
            "How serious is the newest line?",
        ),
        "heldout": ("Severity of the most recent entry?", "How bad is the newest record?"),
    },
    "last_failure": {
        "train": (
            "Which component logged the latest ERROR?",
            "What is the last component to fail?",
            "Which service had the most recent error?",
            "Component of the last error line?",
        ),
        "heldout": ("What broke most recently?", "Which service broke last?"),
    },
    "status": {
        "train": (
            "What is the current order status?",
            "What is the latest status of the order?",
            "Status of the order now?",
            "Which state is the order in?",
        ),
        "heldout": ("Where is the purchase at now?", "Current state of the purchase?"),
    },
    "late_refund": {
        "train": (
            "Was a refund requested after delivery?",
            "Did a refund request come after the delivery?",
            "Refund asked for once delivered?",
        ),
        "heldout": ("Did the buyer want money back once it had arrived?", "Refund wanted after it arrived?"),
    },
    "customer": {
        "train": ("Who placed the order?", "Which customer is this order for?", "Customer name?"),
        "heldout": ("Whose purchase is it?", "Who bought this?"),
    },
    "urgency": {
        "train": ("How urgent is the ticket?", "Rate how urgent this is.", "Urgency of the request?"),
        "heldout": ("How pressing is this issue?", "Rate the urgency."),
    },
    "product": {
        "train": ("Which product is the ticket about?", "What product is this about?", "Product mentioned?"),
        "heldout": ("Which of our products does the writer mean?", "Name the product in question."),
    },
    "department": {
        "train": (
            "Which team should handle this ticket?",
            "Which department does this belong to?",
            "Pick the team for this request.",
        ),
        "heldout": ("Route the ticket to a team.", "Who should own this case?"),
    },
}


def _instruction(rng: random.Random, split: str, question_id: str) -> str | None:
    if split == "train" and rng.random() < 0.2:
        return None
    return rng.choice(INSTRUCTIONS[question_id][split])


SCORE_LABELS = {
    "last_level": {
        "train": (
            ["info", "warning", "error"],
            ["fine", "warn", "failure"],
            ["normal", "concerning", "failed"],
            ["ok", "degraded", "broken"],
        ),
        "heldout": (["healthy", "shaky", "down"], ["green", "amber", "red"]),
    },
    "urgency": {
        "train": (
            ["not urgent", "normal", "urgent"],
            ["low", "medium", "high"],
            ["later", "soon", "now"],
            ["whenever", "this week", "today"],
        ),
        "heldout": (["can wait", "regular", "pressing"], ["minor", "standard", "severe"]),
    },
}
NEUTRAL_LABELS = ["alpha", "beta", "gamma", "one", "two", "three", "A", "B", "C", "x", "y", "z", "0", "1", "2"]


def _score_criteria(rng: random.Random, split: str, question_id: str) -> list[str]:
    """Training sometimes gives arbitrary labels, so a score option is read by its position too."""
    if split == "train" and rng.random() < 0.25:
        return rng.sample(NEUTRAL_LABELS, 3)
    return list(rng.choice(SCORE_LABELS[question_id][split]))


# ---- service logs --------------------------------------------------------------------------------
def _clock(t: int) -> str:
    return f"{9 + t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"


LOG_STAMPS = {  # t: seconds since the log began
    "train": [
        lambda t: "",
        lambda t: _clock(t),
        lambda t: f"2026-12-01 {_clock(t)}",
        lambda t: f"2026-12-01T{_clock(t)}Z",
        lambda t: f"{1733040000 + t}",
        lambda t: f"[{_clock(t)}]",
        lambda t: f"(+{t}s)",
    ],
    "heldout": [
        lambda t: f"[t+{t}s]",
        lambda t: f"Dec 01 {_clock(t)}",
        lambda t: f"@{1000 * t}ms",
    ],
}
LOG_FIELDS = {  # a log's format: how each field is written, and what stands between the fields
    "train": {
        "level": ["{}", "{}", "[{}]", "({})", "level={}", "{}:"],
        "component": ["{}", "{}:", "[{}]", "({})", "component={}", "{}[{pid}]:"],
        "message": ["{}", "{}", 'msg="{}"', "- {}"],
        "separator": [" ", " ", " - ", " | "],
    },
    "heldout": {
        "level": ["<{}>", "{{{}}}"],
        "component": ["@{}", "svc={}"],
        "message": ['text="{}"', "» {}"],
        "separator": [" :: ", " ~ "],
    },
}
LOG_RECORDS = {  # whole-line formats beside the composed ones: JSON lines
    "train": lambda lv, c, m: f'{{"level":"{lv}","component":"{c}","msg":"{m}"}}',
    "heldout": lambda lv, c, m: f'{{"severity":"{lv}","service":"{c}","text":"{m}"}}',
}


def _log_format(rng: random.Random, split: str):
    """One format for the whole log, drawn from the family's pieces: which of level and component comes
    first, each one's wrapping, the message's, the separator. Training sees dozens of combinations, so
    no delimiter is the one the facts come with; held-out pieces are training's disjoint counterparts."""
    if rng.random() < 0.1:
        record = LOG_RECORDS[split]
        return lambda stamp, lv, c, m: record(lv, c, m)
    fields = LOG_FIELDS[split]
    level, component, message = (rng.choice(fields[f]) for f in ("level", "component", "message"))
    separator, component_first = rng.choice(fields["separator"]), rng.random() < 0.25
    pid = rng.randint(100, 999)

    def line(stamp: str, lv: str, c: str, m: str) -> str:
        facts = [level.format(lv), component.format(c, pid=pid)]
        facts = facts[::-1] if component_first else facts
        return separator.join(p for p in [stamp, *facts, message.format(m)] if p)

    return line


def _message(rng: random.Random, split: str, components: list[str]) -> str:
    """Message words carry no level (any message on any line), so only the level word decides; some
    name another component, so only the component field does."""
    noun, verb = rng.choice(LISTED[split]["noun"]), rng.choice(LISTED[split]["verb"])
    roll = rng.random()
    if roll < 0.15:
        return f"{noun} to {rng.choice(components)} {verb}"
    if roll < 0.3:
        return f"{noun} {verb} after {rng.randint(2, 90)}s"
    return f"{noun} {verb}"


def _log(rng: random.Random, split: str) -> tuple[str, dict[str, tuple[dict, str]]]:
    n = rng.randint(1, 32) if rng.random() < 0.1 else rng.randint(1, 10)
    pool = _distinct(rng, lambda: _component(rng, split), rng.randint(2, min(6, n + 1)))
    style = rng.choice(LEVEL_STYLES)
    stamp = rng.choice(LOG_STAMPS[split])
    layout = _log_format(rng, split)
    error_rate = rng.choice([0.1, 0.25, 0.4])
    lines, levels, components, t = [], [], [], rng.randint(0, 3000)
    for _ in range(n):
        roll = rng.random()
        level = 2 if roll < error_rate else (1 if roll < error_rate + 0.25 else 0)
        component = rng.choice(pool)
        t += rng.randint(0, 40)
        lines.append(layout(stamp(t), style[2 - level], component, _message(rng, split, pool)).strip())
        levels.append(level)
        components.append(component)
    questions = {
        "last_error": (
            {"type": "noul", "instructions": _instruction(rng, split, "last_error")},
            str(levels[-1] == 2).lower(),
        ),
        "last_level": (
            {
                "type": "score",
                "instructions": _instruction(rng, split, "last_level"),
                "criteria": _score_criteria(rng, split, "last_level"),
            },
            str(levels[-1]),
        ),
    }
    failing = [c for c, level in zip(components, levels, strict=True) if level == 2]
    if failing:
        absent = _distinct(rng, lambda: _component(rng, split), rng.randint(0, 2), avoid=set(pool))
        shown = [c for c in pool if c != failing[-1]]
        options = [failing[-1]] + rng.sample(shown, min(len(shown), rng.randint(1, 4)))
        options += [a for a in absent if not any(a.lower() in o.lower() or o.lower() in a.lower() for o in options)]
        rng.shuffle(options)
        questions["last_failure"] = (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "last_failure"),
                "criteria": {c: None for c in options},
            },
            failing[-1],
        )
    return "\n".join(lines), questions


# ---- order timelines -----------------------------------------------------------------------------
ORDER_HEADERS = {  # (number, customer, items) -> first line
    "train": [
        lambda n, c, items: f"Order {n} for {c} ({', '.join(items)})",
        lambda n, c, items: f"Order #{n} - {c}: {', '.join(items)}",
        lambda n, c, items: f"Customer: {c}, order {n}, items: {', '.join(items)}",
        lambda n, c, items: f"#{n} {c} / {' & '.join(items)}",
        lambda n, c, items: f"{c} ordered {' and '.join(items)} (#{n})",
        lambda n, c, items: f"Order {n} ({', '.join(items)}) by {c}",
        lambda n, c, items: f"{c} - order #{n} - {', '.join(items)}",
        lambda n, c, items: f"Order {n} | {c} | {', '.join(items)}",
        lambda n, c, items: f"[{n}] {c}: {' + '.join(items)}",
    ],
    "heldout": [
        lambda n, c, items: f"Purchase no. {n}: {' + '.join(items)} (buyer {c})",
        lambda n, c, items: f"{c} // basket {n} // {', '.join(items)}",
    ],
}
ORDER_LINES = {  # (index, event) -> line
    "train": [
        lambda i, e: f"2026-11-{3 + 2 * i:02d} {e}",
        lambda i, e: f"{e} on Nov {3 + 2 * i}",
        lambda i, e: f"- {e}",
        lambda i, e: f"{i + 1}. {e}",
        lambda i, e: f"Nov {3 + 2 * i} - {e}",
        lambda i, e: f"[step {i + 1}] {e}",
        lambda i, e: f"{9 + i}:00 {e}",
        lambda i, e: e,
        lambda i, e: f"Nov {3 + 2 * i}: {e}",
        lambda i, e: f"* {e}",
    ],
    "heldout": [
        lambda i, e: f"day {i + 1} - {e}",
        lambda i, e: f"({i + 1}) {e}",
    ],
}
STATUS_PHRASES = {"train": ["{}", "{}", "order {}", "marked {}", "status: {}"], "heldout": ["{}", "now {}"]}
REFUND_PHRASES = {
    "train": ["refund requested", "refund request", "customer requested a refund", "{customer} asked for a refund"],
    "heldout": ["refund wanted", "{customer} wants a refund"],
}
NOTE_PHRASES = {  # events that change nothing; {agent}: another person, a distractor for `customer`
    "train": [
        "remark added by {agent}",
        "{agent} contacted the customer",
        "address updated",
        "invoice sent",
        "handled by {agent}",
        "{agent} updated the address",
    ],
    "heldout": ["{agent} left a comment", "gift wrap chosen", "phone number changed"],
}


def _order(rng: random.Random, split: str) -> tuple[str, dict[str, tuple[dict, str]]]:
    # 40% get a refund request after delivery; the rest none, or one before delivery (or before an
    # order that never got delivered): only the order of the events tells them apart. Steps are skipped
    # at random and notes mixed in, so neither the number nor the position of lines gives a status away.
    events = ["placed"] + [s for s in ("paid", "shipped", "delivered") if rng.random() < 0.6]
    if rng.random() < 0.4:
        if events[-1] != "delivered":
            events.append("delivered")
        events.append("refund")
    else:
        if rng.random() < 0.2 and events[-1] != "delivered":
            events.append("cancelled")
        if rng.random() < 0.5:
            before = events.index("delivered") if "delivered" in events else len(events)
            events.insert(rng.randint(1, max(before, 1)), "refund")
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        events.insert(rng.randint(1, len(events)), "note")
    customer, *agents = _distinct(rng, lambda: _person(rng, split), 3)
    items = _distinct(rng, lambda: rng.choice(LISTED[split]["item"]), rng.randint(1, 3))
    line, header = rng.choice(ORDER_LINES[split]), rng.choice(ORDER_HEADERS[split])
    named_agents = set()
    texts = []
    for event in events:
        if event in STATUSES:
            text = rng.choice(STATUS_PHRASES[split]).format(event)
        elif event == "refund":
            text = rng.choice(REFUND_PHRASES[split]).format(customer=customer)
        else:
            agent = rng.choice(agents)
            text = rng.choice(NOTE_PHRASES[split])
            named_agents |= {agent} if "{agent}" in text else set()
            text = text.format(agent=agent)
        texts.append(text)
    state = "\n".join([header(rng.randint(10, 99999), customer, items)] + [line(i, t) for i, t in enumerate(texts)])
    status = [e for e in events if e in STATUSES][-1]
    late = "delivered" in events and "refund" in events[events.index("delivered") :]
    others = _distinct(rng, lambda: _person(rng, split), rng.randint(0, 2), avoid={customer, *agents})
    options = [customer, *sorted(named_agents), *others]
    if len(options) == 1:
        options += _distinct(rng, lambda: _person(rng, split), 1, avoid={customer, *agents})
    rng.shuffle(options)
    questions = {
        "status": (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "status"),
                "criteria": {s: None for s in rng.sample(STATUSES, 5)},
            },
            status,
        ),
        "late_refund": ({"type": "noul", "instructions": _instruction(rng, split, "late_refund")}, str(late).lower()),
        "customer": (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "customer"),
                "criteria": {o: None for o in options},
            },
            customer,
        ),
    }
    return state, questions


# ---- support tickets -----------------------------------------------------------------------------
TICKET_PHRASES = {
    "train": {
        "greeting": ["Hello,", "Hi team,", "Dear support,", "Good morning.", "Hi!"],
        "who": ["this is {name}.", "{name} here.", "my name is {name}."],
        "problem": [  # {product}, {keyword}
            "I use {product} and there is a problem with the {keyword}.",
            "{product}: the {keyword} is not right.",
            "My {keyword} for {product} is wrong.",
            "I have a question about the {keyword} in {product}.",
            "Something happened with my {keyword} ({product}).",
            "The {keyword} in {product} does not work.",
            "Problem with {product}, see the {keyword}.",
            "We got {product}. Now the {keyword} is a mess.",
        ],
        "neutral": ["Could you take a look?", "Thanks for checking.", "Let me know."],
        "sign_off": ["Best regards, {name}", "Thanks, {name}", "Regards, {name}", "- {name}", "Cheers"],
    },
    "heldout": {
        "greeting": ["Hey folks,", "Greetings."],
        "who": ["{name} writing.", "it is {name} again."],
        "problem": [
            "Trouble with {product}: my {keyword} looks odd.",
            "About {product} - the {keyword} seems off.",
        ],
        "neutral": ["Any idea?", "Appreciate it."],
        "sign_off": ["Kind wishes, {name}", "Yours, {name}"],
    },
}


def _ticket(rng: random.Random, split: str) -> tuple[str, dict[str, tuple[dict, str]]]:
    phrases = TICKET_PHRASES[split]
    department = rng.choice(sorted(DEPARTMENT_KEYWORDS))
    keyword = rng.choice(DEPARTMENT_KEYWORDS[department])
    urgency = rng.choice([0, 1, 2])
    name = _person(rng, split)
    products = _distinct(rng, lambda: _product(rng, split), rng.randint(2, 4))
    product = products[0]
    problem = rng.choice(phrases["problem"]).format(product=product, keyword=keyword)
    problem = problem[0].upper() + problem[1:]
    cue = rng.choice(URGENCY_CUES[urgency]) if urgency != 1 else rng.choice(phrases["neutral"] + [""])
    opening = " ".join(p for p in (rng.choice(phrases["greeting"] + [""]), rng.choice(phrases["who"] + [""])) if p)
    body = [problem, cue] if rng.random() < 0.6 else [cue, problem]
    sign_off = rng.choice(phrases["sign_off"] + [""]).format(name=name)
    state = rng.choice([" ", "\n"]).join(p for p in [opening.format(name=name), *body, sign_off] if p)

    teams = rng.sample(sorted(DEPARTMENT_KEYWORDS), rng.randint(3, 4))
    if department not in teams:
        teams[0] = department
    if rng.random() < 0.5:  # descriptions list the team's words: the ticket's word is among its team's
        ids = teams
        if rng.random() < 0.5:  # teams by made-up names: only the descriptions say what they do
            ids = _distinct(rng, lambda: "Team " + made_up_name(rng, split, capital=True), len(teams))
        criteria = {}
        for team_id, team in zip(ids, teams, strict=True):
            words = [keyword] if team == department else []
            words += rng.sample([w for w in DEPARTMENT_KEYWORDS[team] if w not in words], 2 - len(words) + 1)
            rng.shuffle(words)
            criteria[team_id] = ", ".join(words)
        answer = ids[teams.index(department)]
    else:
        criteria, answer = {t: None for t in teams}, department
    items = list(criteria.items())
    rng.shuffle(items)
    shown = rng.sample(products, len(products))
    questions = {
        "urgency": (
            {
                "type": "score",
                "instructions": _instruction(rng, split, "urgency"),
                "criteria": _score_criteria(rng, split, "urgency"),
            },
            str(urgency),
        ),
        "product": (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "product"),
                "criteria": {p: None for p in shown},
            },
            product,
        ),
        "department": (
            {"type": "choice", "instructions": _instruction(rng, split, "department"), "criteria": dict(items)},
            answer,
        ),
    }
    return state, questions


# ---- examples ------------------------------------------------------------------------------------
def make_example(rng: random.Random, split: str) -> Example:
    """One example of `split`: training asks every question of its state (the most supervision per
    prefill), held-out a random subset."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    kind = rng.choice(["ticket", "log", "order"])
    state, questions = {"ticket": _ticket, "log": _log, "order": _order}[kind](rng, split)
    count = len(questions) if split == "train" else rng.randint(1, len(questions))
    chosen = rng.sample(sorted(questions), count)
    return Example(
        request={"model": "clef-tiny", "state": state, "questions": {q: questions[q][0] for q in chosen}},
        answers={q: questions[q][1] for q in chosen},
        kind=kind,
    )


def dataset(seed: int, count: int, split: str) -> list[Example]:
    rng = random.Random(seed)
    return [make_example(rng, split) for _ in range(count)]


def corpus(seed: int = 0, count: int = 3000) -> list[str]:
    """Training-family text to train a tokenizer on: the segments the encoder tokenises one by one
    (states, question ids and instructions, rendered options). Held-out text is never shown to it."""
    from clef_cuda.request.encoding import question_options, render

    rng = random.Random(seed)
    texts = ["system", "user", "assistant", "noul", "choice", "score"]
    # The syllables every made-up name is spelt from, in both cases, often enough to become tokens: a
    # name is then a few syllable tokens (not a run of letters) in both families.
    texts += [f"{s} {s.capitalize()}" for s in SYLLABLES for _ in range(200)]
    for _ in range(count):
        example = make_example(rng, "train")
        texts.append(render(example.request["state"]))
        for question_id, question in example.request["questions"].items():
            texts += [question_id, render(question.get("instructions"))]
            for option_id, description in question_options(question):
                semantics = {"option_id": option_id} | ({} if description is None else {"description": description})
                texts.append(render(semantics))
    return texts
