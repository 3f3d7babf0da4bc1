"""A synthetic System One decision task whose answers follow from the state.

Three kinds of state: support tickets, service logs and order timelines, with noul, choice and score
questions. Tickets are read by their words (which team, how urgent; some also ask for a refund). Logs and
orders are read by the order of their lines: is the last log line an ERROR, which component logged the
latest ERROR, what the latest order status is, whether the refund request came after the delivery. A
recurrent memory reads that in one pass; it is also what makes the seed's failure visible: with the delta
nets' key band zeroed, these answers fall apart.

Template families. "train": one format per kind and the first few question wordings; "varied" (drawn
for training examples by train.py's curriculum): many formats, wordings, optional instructions and, for
score questions, sometimes arbitrary labels; "heldout": formats, wordings, names, products and numbers
that training never shows, options without descriptions. All share the task (the facts that decide each
answer and the words that state them), so held-out accuracy measures reading the state, not recalling
templates. Order timelines skip steps and carry notes that change nothing, so neither the number nor the
position of the lines gives the status away.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "heldout")

# ---- support tickets ---------------------------------------------------------------------------
DEPARTMENTS = {
    "billing": [
        "I was charged twice for my subscription",
        "the invoice shows the wrong amount",
        "my card payment failed but money left my account",
        "I was overcharged this month",
    ],
    "technical": [
        "the app crashes when I open settings",
        "I cannot log in since the update",
        "the dashboard page stays blank",
        "I get an error message when I save",
    ],
    "shipping": [
        "my package has not arrived yet",
        "the tracking number does not work",
        "the parcel arrived damaged",
        "the courier left the delivery at the wrong address",
    ],
    "sales": [
        "I want to upgrade to the team plan",
        "can you send me a quote for fifty seats",
        "I would like to buy more licenses",
        "what does the enterprise plan cost",
    ],
}
DEPARTMENT_DESCRIPTIONS = {
    "billing": "payments and invoices",
    "technical": "bugs and errors",
    "shipping": "parcels and delivery",
    "sales": "plans and purchases",
}
REFUND_ASKS = ["Please refund me.", "I want my money back.", "I am asking for a refund.", "Refund this order please."]
URGENCY = {  # score level -> markers
    0: ["No rush, whenever you have time.", "This is not urgent at all."],
    1: ["", "Thanks for looking into it."],
    2: ["This is URGENT, please help immediately.", "I need this fixed right now, it is urgent."],
}
NAMES = {
    "train": ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"],
    "heldout": ["Ines", "Jonas", "Kaito", "Lena", "Mateo", "Nadia", "Omar", "Priya"],
}
PRODUCTS = {
    "train": ["PhotoBox", "TaskFlow", "NoteHub", "CloudDrive"],
    "heldout": ["MailPilot", "ChartMill", "CodeNest", "TimeLedger"],
}


def _ticket_text(
    rng: random.Random, split: str, name: str, product: str, problem: str, refund: str, urgency: str
) -> str:
    """One fixed ticket format ("train"), tickets composed from interchangeable pieces ("varied": greeting,
    who, the problem, the asks in either order, a sign-off), and a format of held-out's own."""
    if split == "heldout":
        parts = [f"Ticket from {name} about {product}:", f"{_capital(problem)}!", urgency, refund, f"-- {name}"]
        return " ".join(p for p in parts if p)
    if split == "train":
        parts = [f"Hello, this is {name}.", f"I use {product} and {problem}.", refund, urgency, "Best regards."]
        return " ".join(p for p in parts if p)
    greeting = rng.choice(["Hello,", "Hi team,", "Dear support,", "Good morning.", ""])
    who = rng.choice([f"this is {name}.", f"{name} here.", f"my name is {name}.", ""])
    context = rng.choice(
        [
            f"I use {product} and {problem}.",
            f"{_capital(problem)} in {product}.",
            f"About {product}: {problem}.",
            f"{_capital(problem)}.",
        ]
    )
    asks = [refund, urgency]
    rng.shuffle(asks)
    sign_off = rng.choice(["Best regards.", f"Thanks, {name}.", "Cheers", f"Regards, {name}", ""])
    filler = rng.choice(["", "", "I have been a customer for years.", "Order details are in my account."])
    lines = [" ".join(p for p in [greeting, who] if p), context, filler, *asks, sign_off]
    return rng.choice([" ", "\n"]).join(p for p in lines if p)


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


# ---- service logs --------------------------------------------------------------------------------
COMPONENTS = ["db", "api", "cache", "queue", "auth"]
MESSAGES = {
    "ERROR": ["connection refused", "timeout after 30s", "out of memory", "write failed"],
    "WARN": ["slow response", "retrying request", "high latency"],
    "INFO": ["request served", "health check ok", "worker started", "config reloaded"],
}


LOG_STAMPS = [  # training's time stamps (the first is the "train" family's); held-out logs use "[t+12s]"
    lambda t: f"10:00:{t:02d}",
    lambda t: f"2026-11-30 10:{t:02d}",
    lambda t: f"{1000 + 7 * t}",
    lambda t: "",
    lambda t: f"[10:00:{t:02d}]",
    lambda t: f"(+{t}s)",
    lambda t: f"t={t}",
]
LOG_LINES = [  # training's line layouts around the facts (level, component, message)
    lambda level, component, message: f"{level} {component}: {message}",
    lambda level, component, message: f"[{level}] {component}: {message}",
    lambda level, component, message: f"{level} {component} - {message}",
    lambda level, component, message: f"{level} [{component}] {message}",
]


def _log_line(split: str, style: tuple[int, int], second: int, level: str, component: str, message: str) -> str:
    """The level word, the component and the message are the facts; the time stamp and the punctuation
    around them vary between training logs, and held-out logs use a stamp format training never shows."""
    if split == "heldout":
        return f"[t+{second}s] {level} {component}: {message}"
    return f"{LOG_STAMPS[style[0]](second)} {LOG_LINES[style[1]](level, component, message)}".strip()


# ---- order timelines -----------------------------------------------------------------------------
STATUSES = ["placed", "paid", "shipped", "delivered", "cancelled"]
ORDER_NOTES = ["address_updated", "note_added", "customer_contacted", "invoice_sent"]  # no status change


ORDER_HEADERS = [  # training's (the first is the "train" family's); held-out: "Purchase no. 12345: a and b"
    lambda n, items: f"Order {n} ({', '.join(items)})",
    lambda n, items: f"Order #{n}: {', '.join(items)}",
    lambda n, items: f"Your order {n}",
    lambda n, items: f"#{n} - {' & '.join(items)}",
    lambda n, items: f"Shipment for order {n}: {' / '.join(items)}",
]
ORDER_LINES = [  # training's event lines; held-out: "day 3 - shipped"
    lambda i, event: f"2026-11-{3 + 2 * i:02d} {event}",
    lambda i, event: f"{event} on Nov {3 + 2 * i}",
    lambda i, event: f"- {event}",
    lambda i, event: f"{i + 1}. {event}",
    lambda i, event: f"Nov {3 + 2 * i} - {event}",
    lambda i, event: f"[step {i + 1}] {event}",
    lambda i, event: f"{9 + i}:00 {event}",
]


def _timeline(rng: random.Random, split: str, order: int, events: list[str], items: list[str]) -> str:
    """One line per event, oldest first; headers and dates vary ("varied"), held-out has its own."""
    words = [e.replace("_", " ") for e in events]
    if split == "heldout":
        head = f"Purchase no. {order}: {' and '.join(items)}"
        return "\n".join([head] + [f"day {i + 1} - {e}" for i, e in enumerate(words)])
    style = (rng.randrange(len(ORDER_HEADERS)), rng.randrange(len(ORDER_LINES))) if split == "varied" else (0, 0)
    return "\n".join(
        [ORDER_HEADERS[style[0]](order, items)] + [ORDER_LINES[style[1]](i, e) for i, e in enumerate(words)]
    )


# ---- questions -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    request: dict[str, Any]
    answers: dict[str, str]  # question id -> correct option id
    kind: str  # ticket | log | order


def _phrase(split: str, train, heldout, rng: random.Random | None = None):
    """The wording for this split: one of several paraphrases where a list of them is given."""
    options = heldout if split == "heldout" else train
    if isinstance(options, tuple):
        return (rng or random).choice(options)
    return options


# Question wordings. Training draws from many (and sometimes none: the encoder then writes the question
# id); held-out uses wordings training never shows.
INSTRUCTIONS = {
    "department": {
        "train": (
            "Which team should handle this ticket?",
            "Which department does this belong to?",
            "Pick the team for this request.",
            "Assign the ticket to a department.",
            "Which group should answer the customer?",
            "Team for this message?",
        ),
        "heldout": ("Route the ticket to a team.", "Who should own this case?"),
    },
    "urgency": {
        "train": (
            "How urgent is the ticket?",
            "Rate how urgent this is.",
            "Urgency of the request?",
            "How quickly must we reply?",
            "Priority of this message?",
        ),
        "heldout": ("Rate the urgency.", "How pressing is this issue?"),
    },
    "last_error": {
        "train": (
            "Is the last log line an ERROR?",
            "Does the log end with an ERROR line?",
            "Is the final line an error?",
            "Was the last entry logged as ERROR?",
        ),
        "heldout": ("Did the log end with an error?", "Is the final entry an error?"),
    },
    "last_level": {
        "train": (
            "How severe is the last log line?",
            "Rate the level of the final line.",
            "Level of the last entry?",
            "How serious is the newest line?",
        ),
        "heldout": ("Severity of the most recent entry?", "How bad is the latest line?"),
    },
    "last_failure": {
        "train": (
            "Which component logged the latest ERROR?",
            "What is the last component to fail?",
            "Which service had the most recent error?",
            "Component of the last ERROR line?",
        ),
        "heldout": ("What failed most recently?", "Which service broke last?"),
    },
    "status": {
        "train": (
            "What is the current order status?",
            "What is the latest status of the order?",
            "Status of the order now?",
            "Which state is the order in?",
        ),
        "heldout": ("Where does the order stand now?", "Current state of the order?"),
    },
    "late_refund": {
        "train": (
            "Was a refund requested after delivery?",
            "Did a refund request come after the delivery?",
            "Refund asked for once delivered?",
            "Did the customer want a refund after receiving it?",
        ),
        "heldout": ("Did the customer ask for money back once it was delivered?", "Refund asked for after it arrived?"),
    },
}


def _instruction(rng: random.Random, split: str, question_id: str) -> str | None:
    if split == "heldout":
        return rng.choice(INSTRUCTIONS[question_id]["heldout"])
    if split == "train":  # the first three wordings only
        return rng.choice(INSTRUCTIONS[question_id]["train"][:3])
    return None if rng.random() < 0.25 else rng.choice(INSTRUCTIONS[question_id]["train"])


NEUTRAL_LABELS = ["alpha", "beta", "gamma", "red", "green", "blue", "one", "two", "three", "A", "B", "C", "x", "y"]


def _score_labels(rng: random.Random, split: str, train: tuple[list[str], ...], heldout: tuple[list[str], ...]):
    """A score question's criteria. Varied training examples sometimes get arbitrary labels, so the model
    reads a score option by its position ("0", "1", "2"), not by the wording of its description."""
    if split == "varied" and rng.random() < 0.3:
        return rng.sample(NEUTRAL_LABELS, 3)
    return _phrase(split, train, heldout, rng)


def _maybe(rng: random.Random, split: str, description: str) -> str | None:
    """Training drops half the descriptions, so the model decides from the option ids alone too;
    held-out options are bare ids (the descriptions are template text the model must not need)."""
    return None if split == "heldout" or rng.random() < 0.5 else description


def _ticket(rng: random.Random, split: str) -> tuple[Any, dict[str, tuple[dict, str]]]:
    department = rng.choice(sorted(DEPARTMENTS))
    refund = rng.random() < 0.5
    urgency = rng.randrange(3)
    state = _ticket_text(
        rng,
        split,
        rng.choice(NAMES["heldout" if split == "heldout" else "train"]),
        rng.choice(PRODUCTS["heldout" if split == "heldout" else "train"]),
        rng.choice(DEPARTMENTS[department]),
        rng.choice(REFUND_ASKS) if refund else "",
        rng.choice(URGENCY[urgency]),
    )
    questions = {
        "department": (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "department"),
                "criteria": {
                    d: _maybe(rng, split, DEPARTMENT_DESCRIPTIONS[d]) for d in rng.sample(sorted(DEPARTMENTS), 4)
                },
            },
            department,
        ),
        "urgency": (
            {
                "type": "score",
                "instructions": _instruction(rng, split, "urgency"),
                "criteria": _score_labels(
                    rng,
                    split,
                    (
                        ["not urgent", "normal", "urgent"],
                        ["low", "medium", "high"],
                        ["later", "soon", "now"],
                        ["whenever", "this week", "today"],
                    ),
                    (["can wait", "regular", "critical"], ["minor", "standard", "severe"]),
                ),
            },
            str(urgency),
        ),
    }
    return state, questions


def _log(rng: random.Random, split: str) -> tuple[Any, dict[str, tuple[dict, str]]]:
    n = rng.randint(3, 8)
    errors = min(rng.choice([0, 1, 1, 2, 2, 3, 4]), n)
    positions = sorted(rng.sample(range(n), errors))
    lines, last_failing, last_level = [], None, "INFO"
    style = (rng.randrange(len(LOG_STAMPS)), rng.randrange(len(LOG_LINES))) if split == "varied" else (0, 0)
    for i in range(n):
        level = "ERROR" if i in positions else rng.choice(["INFO", "INFO", "WARN"])
        component = rng.choice(COMPONENTS)
        if level == "ERROR":
            last_failing = component
        last_level = level
        second = 3 * i + rng.randrange(3)
        lines.append(_log_line(split, style, second, level, component, rng.choice(MESSAGES[level])))
    state = "\n".join(lines)
    questions = {
        "last_error": (
            {
                "type": "noul",
                "instructions": _instruction(rng, split, "last_error"),
            },
            "true" if last_level == "ERROR" else "false",
        ),
    }
    questions["last_level"] = (
        {
            "type": "score",
            "instructions": _instruction(rng, split, "last_level"),
            "criteria": _score_labels(
                rng,
                split,
                (["info", "warning", "error"], ["fine", "warn", "failure"], ["normal", "concerning", "failed"]),
                (["ok", "degraded", "broken"],),
            ),
        },
        str(["INFO", "WARN", "ERROR"].index(last_level)),
    )
    if last_failing is not None:
        questions["last_failure"] = (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "last_failure"),
                "criteria": {c: _maybe(rng, split, f"the {c} service") for c in rng.sample(COMPONENTS, 5)},
            },
            last_failing,
        )
    return state, questions


def _order(rng: random.Random, split: str) -> tuple[Any, dict[str, tuple[dict, str]]]:
    # 40% of the orders get a refund request after delivery; the rest get none, or one before delivery
    # (or before an order that never got delivered): only the order of the events tells them apart.
    # Steps are skipped at random and notes that change nothing are mixed in, so neither the number of
    # lines nor the position of a line gives the status away: the words must be read.
    events = ["placed"] + [s for s in ("paid", "shipped", "delivered") if rng.random() < 0.6]
    if rng.random() < 0.4:
        if events[-1] != "delivered":
            events.append("delivered")
        events.append("refund_requested")
    else:
        if rng.random() < 0.2 and events[-1] != "delivered":
            events.append("cancelled")
        if rng.random() < 0.6:
            before = events.index("delivered") if "delivered" in events else len(events)
            events.insert(rng.randint(1, max(before, 1)), "refund_requested")
    for _ in range(rng.choice([0, 0, 1, 2])):
        events.insert(rng.randint(1, len(events)), rng.choice(ORDER_NOTES))
    items = rng.sample(["lamp", "desk", "chair", "cable", "mouse", "monitor", "stand"], rng.randint(1, 4))
    number = rng.randint(10000, 99999) if split == "heldout" else rng.randint(1000, 9999)
    state = _timeline(rng, split, number, events, items)
    status = [e for e in events if e in STATUSES][-1]
    after_delivery = "delivered" in events and "refund_requested" in events[events.index("delivered") :]
    questions = {
        "status": (
            {
                "type": "choice",
                "instructions": _instruction(rng, split, "status"),
                "criteria": {s: None for s in rng.sample(STATUSES, 5)},
            },
            status,
        ),
        "late_refund": (
            {
                "type": "noul",
                "instructions": _instruction(rng, split, "late_refund"),
            },
            "true" if after_delivery else "false",
        ),
    }
    return state, questions


def make_example(rng: random.Random, split: str, variety: float = 0.0) -> Example:
    """One example of `split`. A `variety` share of training examples use the "varied" templates (many
    formats and wordings; "train" alone has one of each): train.py starts at 0, as one format is learnt
    far faster, then raises it so the model stops depending on any one wording."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    family = "varied" if split == "train" and rng.random() < variety else split
    kind = rng.choice(["ticket", "log", "order"])
    state, questions = {"ticket": _ticket, "log": _log, "order": _order}[kind](rng, family)
    # Training asks every question of the state (the most supervision per prefill); held-out a subset.
    if split == "train":
        chosen = rng.sample(sorted(questions), len(questions))
    else:
        chosen = rng.sample(sorted(questions), rng.randint(1, len(questions)))
    return Example(
        request={"model": "clef-tiny", "state": state, "questions": {q: questions[q][0] for q in chosen}},
        answers={q: questions[q][1] for q in chosen},
        kind=kind,
    )


def dataset(seed: int, count: int, split: str) -> list[Example]:
    rng = random.Random(seed)
    return [make_example(rng, split) for _ in range(count)]


def corpus(seed: int = 0, count: int = 3000, splits: tuple[str, ...] = ("train",)) -> list[str]:
    """Text to train a tokenizer on: the segments the encoder tokenises one by one (states, instructions,
    question types, rendered options) of records from the given template families."""
    from clef_cuda.request.encoding import question_options, render

    rng = random.Random(seed)
    texts = ["system", "user", "assistant", "noul", "choice", "score"]
    for i in range(count):
        example = make_example(rng, splits[i % len(splits)], variety=0.5)
        texts.append(render(example.request["state"]))
        for question_id, question in example.request["questions"].items():
            texts += [question_id, render(question.get("instructions"))]
            for option_id, description in question_options(question):
                semantics = {"option_id": option_id} | ({} if description is None else {"description": description})
                texts.append(render(semantics))
    return texts
