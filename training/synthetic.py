"""A synthetic System One decision task whose answers follow from the state.

Three kinds of state: support tickets, service logs and order timelines, with noul, choice and score
questions. Tickets are read by their words (which team, how urgent; some also ask for a refund). Logs and
orders are read by the order of their lines: is the last log line an ERROR, which component logged the
latest ERROR, what the latest order status is, whether the refund request came after the delivery. A
recurrent memory reads that in one pass; it is also what makes the seed's failure visible: with the delta
nets' key band zeroed, these answers fall apart.

Two template families: "train" and "heldout". They share the task (the facts that decide each answer
and the words that state them) but not the wording around them: sentence structure, log format,
timeline format, question phrasing, names, numbers and products all differ, and held-out options carry
no descriptions, so held-out accuracy measures reading the state, not recalling templates.
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
    if split == "train":
        parts = [f"Hello, this is {name}.", f"I use {product} and {problem}.", refund, urgency, "Best regards."]
    else:
        parts = [
            f"Ticket from {name} about {product}:",
            f"{problem[0].upper()}{problem[1:]}!",
            urgency,
            refund,
            f"-- {name}",
        ]
    return " ".join(p for p in parts if p)


# ---- service logs --------------------------------------------------------------------------------
COMPONENTS = ["db", "api", "cache", "queue", "auth"]
MESSAGES = {
    "ERROR": ["connection refused", "timeout after 30s", "out of memory", "write failed"],
    "WARN": ["slow response", "retrying request", "high latency"],
    "INFO": ["request served", "health check ok", "worker started", "config reloaded"],
}


def _log_line(split: str, second: int, level: str, component: str, message: str) -> str:
    """The level, component and message read the same in both families; the time stamp differs."""
    stamp = f"10:00:{second:02d}" if split == "train" else f"[t+{second}s]"
    return f"{stamp} {level} {component}: {message}"


# ---- order timelines -----------------------------------------------------------------------------
STATUSES = ["placed", "paid", "shipped", "delivered", "cancelled"]


def _timeline(split: str, order: int, events: list[str], items: list[str]) -> str:
    """One line per event, oldest first; the header and the dates differ between the families."""
    if split == "train":
        head = f"Order {order} ({', '.join(items)})"
        return "\n".join([head] + [f"2026-11-{3 + 2 * i:02d} {e.replace('_', ' ')}" for i, e in enumerate(events)])
    head = f"Purchase no. {order}: {' and '.join(items)}"
    return "\n".join([head] + [f"day {i + 1} - {e.replace('_', ' ')}" for i, e in enumerate(events)])


# ---- questions -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    request: dict[str, Any]
    answers: dict[str, str]  # question id -> correct option id
    kind: str  # ticket | log | order


def _phrase(split: str, train, heldout, rng: random.Random | None = None):
    """The wording for this split: one of several paraphrases where a list of them is given."""
    options = train if split == "train" else heldout
    if isinstance(options, tuple):
        return (rng or random).choice(options)
    return options


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
        rng.choice(NAMES[split]),
        rng.choice(PRODUCTS[split]),
        rng.choice(DEPARTMENTS[department]),
        rng.choice(REFUND_ASKS) if refund else "",
        rng.choice(URGENCY[urgency]),
    )
    questions = {
        "department": (
            {
                "type": "choice",
                "instructions": _phrase(
                    split,
                    (
                        "Which team should handle this ticket?",
                        "Which department does this belong to?",
                        "Pick the team for this request.",
                    ),
                    ("Route the ticket to a team.", "Who should own this case?"),
                    rng,
                ),
                "criteria": {
                    d: _maybe(rng, split, DEPARTMENT_DESCRIPTIONS[d]) for d in rng.sample(sorted(DEPARTMENTS), 4)
                },
            },
            department,
        ),
        "urgency": (
            {
                "type": "score",
                "instructions": _phrase(
                    split,
                    ("How urgent is the ticket?", "Rate how urgent this is.", "Urgency of the request?"),
                    ("Rate the urgency.", "How pressing is this issue?"),
                    rng,
                ),
                "criteria": _phrase(
                    split,
                    (["not urgent", "normal", "urgent"], ["low", "medium", "high"], ["later", "soon", "now"]),
                    (["can wait", "regular", "critical"], ["minor", "standard", "severe"]),
                    rng,
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
    for i in range(n):
        level = "ERROR" if i in positions else rng.choice(["INFO", "INFO", "WARN"])
        component = rng.choice(COMPONENTS)
        if level == "ERROR":
            last_failing = component
        last_level = level
        second = 3 * i + rng.randrange(3)
        lines.append(_log_line(split, second, level, component, rng.choice(MESSAGES[level])))
    state = "\n".join(lines)
    questions = {
        "last_error": (
            {
                "type": "noul",
                "instructions": _phrase(
                    split,
                    ("Is the last log line an ERROR?", "Does the log end with an ERROR line?"),
                    ("Did the log end with an error?", "Is the final entry an error?"),
                    rng,
                ),
            },
            "true" if last_level == "ERROR" else "false",
        ),
    }
    questions["last_level"] = (
        {
            "type": "score",
            "instructions": _phrase(
                split,
                ("How severe is the last log line?", "Rate the level of the final line."),
                ("Severity of the most recent entry?", "How bad is the latest line?"),
                rng,
            ),
            "criteria": _phrase(
                split, (["info", "warning", "error"], ["fine", "warn", "failure"]), (["ok", "degraded", "broken"],), rng
            ),
        },
        str(["INFO", "WARN", "ERROR"].index(last_level)),
    )
    if last_failing is not None:
        questions["last_failure"] = (
            {
                "type": "choice",
                "instructions": _phrase(
                    split,
                    ("Which component logged the latest ERROR?", "What is the last component to fail?"),
                    ("What failed most recently?", "Which service broke last?"),
                    rng,
                ),
                "criteria": {c: _maybe(rng, split, f"the {c} service") for c in rng.sample(COMPONENTS, 5)},
            },
            last_failing,
        )
    return state, questions


def _order(rng: random.Random, split: str) -> tuple[Any, dict[str, tuple[dict, str]]]:
    # 40% of the orders get a refund request after delivery; the rest get none, or one before delivery
    # (or before an order that never got delivered): only the order of the events tells them apart.
    if rng.random() < 0.4:
        events = STATUSES[:4] + ["refund_requested"]
    else:
        events = STATUSES[: rng.randint(1, 4)]
        if rng.random() < 0.2 and events[-1] != "delivered":
            events = events + ["cancelled"]
        if rng.random() < 0.6:
            events.insert(rng.randint(1, len(events) - 1) if len(events) > 1 else 1, "refund_requested")
    items = rng.sample(["lamp", "desk", "chair", "cable", "mouse", "monitor", "stand"], rng.randint(1, 4))
    number = rng.randint(1000, 9999) if split == "train" else rng.randint(10000, 99999)
    state = _timeline(split, number, events, items)
    status = [e for e in events if e != "refund_requested"][-1]
    after_delivery = "delivered" in events and "refund_requested" in events[events.index("delivered") :]
    questions = {
        "status": (
            {
                "type": "choice",
                "instructions": _phrase(
                    split,
                    ("What is the current order status?", "What is the latest status of the order?"),
                    ("Where does the order stand now?", "Current state of the order?"),
                    rng,
                ),
                "criteria": {s: None for s in rng.sample(STATUSES, 5)},
            },
            status,
        ),
        "late_refund": (
            {
                "type": "noul",
                "instructions": _phrase(
                    split,
                    ("Was a refund requested after delivery?", "Did a refund request come after the delivery?"),
                    (
                        "Did the customer ask for money back once it was delivered?",
                        "Refund asked for after it arrived?",
                    ),
                    rng,
                ),
            },
            "true" if after_delivery else "false",
        ),
    }
    return state, questions


def make_example(rng: random.Random, split: str) -> Example:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    kind = rng.choice(["ticket", "log", "order"])
    state, questions = {"ticket": _ticket, "log": _log, "order": _order}[kind](rng, split)
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
    """Text to train a tokenizer on: rendered records of the given template families and the fixed prompt."""
    from clef_cuda.encoding import PREFIX, SUFFIX, render

    rng = random.Random(seed)
    texts = [PREFIX, SUFFIX]
    for i in range(count):
        example = make_example(rng, splits[i % len(splits)])
        texts.append(render(example.request["state"]))
        for qid, question in example.request["questions"].items():
            texts.append(f"{qid} {render(question.get('instructions'))} {render(question.get('criteria'))}")
    return texts
