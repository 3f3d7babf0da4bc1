"""training/vocabulary.py: the training and held-out families share no surface vocabulary (names,
messages, formats, wordings), made-up names never spell a word, and every label follows from the text
alone (re-derived here by rules written apart from the generator, each shown to catch a wrong label)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from clef_cuda.request.encoding import question_options
from training import vocabulary

# Words both families may use: the record's own words (the noul options' default descriptions), the
# templates' function words, and the question wordings' common words. Names, message words, items and
# products are never here: a word that is not in this list or the task vocabulary belongs to one family.
GLUE_WORDS = set(
    """a about after current did does entry failure had how in last latest log most my name of on once or
    order product question rate recent s service severe should t team the ticket to what which who with
    proposition answer true false yes is no it state urgency newest""".split()
)


def _words(text: str) -> set[str]:
    return {w.lower() for w in vocabulary.WORD.findall(text)}


def _text_words(examples: list[vocabulary.Example]) -> set[str]:
    """Every word a model is shown: states, instructions, option ids and descriptions."""
    seen: set[str] = set()
    for example in examples:
        seen |= _words(example.request["state"])
        for question in example.request["questions"].values():
            seen |= _words(question.get("instructions") or "")
            for option, description in question_options(question):
                seen |= _words(option) | _words(description if isinstance(description, str) else "")
    return seen


def shared_surface_words(count: int = 1500) -> set[str]:
    """Words of held-out examples that training examples use too, beyond the task vocabulary and glue."""
    train = _text_words(vocabulary.dataset(1, count, "train"))
    heldout = _text_words(vocabulary.dataset(2, count, "heldout"))
    return (train & heldout) - vocabulary.TASK_WORDS - GLUE_WORDS


def test_the_families_share_no_surface_vocabulary():
    assert shared_surface_words() == set()
    listed = {split: {w.lower() for ws in vocabulary.LISTED[split].values() for w in ws} for split in vocabulary.SPLITS}
    assert not listed["train"] & listed["heldout"]
    assert not (listed["train"] | listed["heldout"]) & vocabulary.TASK_WORDS
    train_text = _text_words(vocabulary.dataset(3, 1500, "train"))
    assert not listed["heldout"] & train_text  # no held-out word inside a training template either


def test_the_disjointness_check_catches_a_shared_word(monkeypatch):
    """Injected: a held-out component name added to training's list."""
    heldout_component = vocabulary.LISTED["heldout"]["component"][0]
    train_lists = dict(vocabulary.LISTED["train"], component=[heldout_component])
    monkeypatch.setitem(vocabulary.LISTED, "train", train_lists)
    assert heldout_component.lower() in shared_surface_words(300)


def made_up_names_spelling_words(count: int = 4000) -> list[str]:
    rng = random.Random(4)
    bad = []
    for split in vocabulary.SPLITS:
        for _ in range(count):
            name = vocabulary.made_up_name(rng, split, capital=rng.random() < 0.5)
            lowered = name.lower()
            if vocabulary.family_of(name) != split or lowered in vocabulary.LISTED_WORDS:
                bad.append(name)
            elif any(len(w) >= 3 and w in lowered for w in vocabulary.TASK_WORDS):
                bad.append(name)
    return bad


def test_made_up_names_never_spell_a_listed_or_task_word():
    assert made_up_names_spelling_words() == []


def test_the_made_up_name_check_catches_a_listed_word(monkeypatch):
    """Injected: no filter. Syllables spell listed names ("da" + "na") and task words ("pa" + ...)."""
    monkeypatch.setattr(vocabulary, "spells_a_known_word", lambda name: False)
    assert made_up_names_spelling_words(20000)


def test_heldout_formats_and_wordings_never_appear_in_training():
    train = vocabulary.dataset(5, 1500, "train")
    heldout = vocabulary.dataset(6, 1500, "heldout")
    train_states = "\n".join(e.request["state"] for e in train)
    held_out_only = ("[t+", "Dec 01", "000ms", " :: ", " ~ ", "svc=", "» ", '"severity"', "Purchase no.", "basket")
    for marker in (*held_out_only, "day 1 - ", "(1) "):
        assert marker not in train_states, marker
        assert any(marker in e.request["state"] for e in heldout), marker
    train_wordings = {q.get("instructions") for e in train for q in e.request["questions"].values()}
    for example in heldout:
        for question in example.request["questions"].values():
            assert question["instructions"] not in train_wordings


# ---- labels, re-derived from the text alone ------------------------------------------------------
LEVEL_OF = {  # this test's own table of level spellings
    **dict.fromkeys(["error", "err", "e", "fatal", "critical", "crit"], 2),
    **dict.fromkeys(["warn", "warning", "wrn", "w"], 1),
    **dict.fromkeys(["info", "inf", "i"], 0),
}
TEAM_OF = {  # this test's own table: the words that name each team's business
    **dict.fromkeys(["invoice", "charge", "payment", "receipt", "overcharge"], "billing"),
    **dict.fromkeys(["crash", "bug", "login", "password", "freeze"], "technical"),
    **dict.fromkeys(["parcel", "tracking", "delivery", "courier", "package"], "shipping"),
    **dict.fromkeys(["quote", "upgrade", "seats", "licence", "discount"], "sales"),
    **dict.fromkeys(["username", "profile", "email", "avatar"], "accounts"),
    **dict.fromkeys(["freight", "pallet", "warehouse", "container"], "logistics"),
    **dict.fromkeys(["warranty", "repair", "return", "replacement"], "care"),
}
URGENT = re.compile(r"\b(urgent|asap|immediately|right now|critical|emergency|as soon as possible)\b", re.I)
NOT_URGENT = re.compile(r"\b(not urgent|no rush|no hurry|low priority|take your time|whenever you|can wait)\b", re.I)


def _level(line: str) -> int:
    """The first level word of a line (levels come before the message in every layout)."""
    return next(LEVEL_OF[w.lower()] for w in vocabulary.WORD.findall(line) if w.lower() in LEVEL_OF)


def _first_named(text: str, names: list[str]) -> str:
    """The name that occurs first in text, as a whole name (not inside a longer one)."""
    found = []
    for name in names:
        match = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
        if match:
            found.append((match.start(), name))
    return min(found)[1]


def derived_answers(example: vocabulary.Example) -> dict[str, str]:
    state, questions = example.request["state"], example.request["questions"]
    options = {qid: [o for o, _ in question_options(q)] for qid, q in questions.items()}
    lines = state.splitlines()
    derived: dict[str, str] = {}
    if example.kind == "log":
        levels = [_level(line) for line in lines]
        derived["last_error"] = "true" if levels[-1] == 2 else "false"
        derived["last_level"] = str(levels[-1])
        if "last_failure" in questions:
            last_error_line = [line for line, level in zip(lines, levels, strict=True) if level == 2][-1]
            derived["last_failure"] = _first_named(last_error_line, options["last_failure"])
    elif example.kind == "order":
        said = [[w for w in vocabulary.WORD.findall(line) if w in vocabulary.STATUSES] for line in lines[1:]]
        derived["status"] = [s for words in said for s in words][-1]
        delivered = [i for i, words in enumerate(said) if "delivered" in words]
        refunds = [i for i, line in enumerate(lines[1:]) if "refund" in line.lower()]
        derived["late_refund"] = "true" if delivered and any(r > delivered[0] for r in refunds) else "false"
        if "customer" in questions:
            derived["customer"] = _first_named(lines[0], options["customer"])
    else:
        derived["urgency"] = "0" if NOT_URGENT.search(state) else "2" if URGENT.search(state) else "1"
        if "product" in questions:
            derived["product"] = _first_named(state, options["product"])
        if "department" in questions:
            ticket_words = _words(state)
            criteria = questions["department"]["criteria"]
            described = {o: set(re.split(r",\s*", d)) for o, d in criteria.items() if d}
            if described:
                (derived["department"],) = [o for o, words in described.items() if words & ticket_words]
            else:
                (derived["department"],) = {TEAM_OF[w] for w in ticket_words if w in TEAM_OF}
    return {qid: derived[qid] for qid in questions}


def _examples() -> list[vocabulary.Example]:
    return vocabulary.dataset(7, 1500, "train") + vocabulary.dataset(8, 1500, "heldout")


def test_every_label_follows_from_the_text():
    asked: dict[str, int] = {}
    for example in _examples():
        assert derived_answers(example) == example.answers, example.request["state"]
        for qid in example.answers:
            asked[qid] = asked.get(qid, 0) + 1
    assert set(asked) == set(vocabulary.STRUCTURAL) | set(vocabulary.SEMANTIC)


def _swap_error_and_warning_spellings(monkeypatch):
    """The level styles with their error and warning spellings swapped: error lines say WARN."""
    swapped = [(warn, error, info) for error, warn, info in vocabulary.LEVEL_STYLES]
    monkeypatch.setattr(vocabulary, "LEVEL_STYLES", swapped)


def _error_lines_name_another_component(monkeypatch):
    """The log layouts write an error line's component reversed: the line no longer names the labelled one."""
    real = vocabulary._log_format

    def layout(rng, split):
        line = real(rng, split)
        return lambda stamp, lv, c, m: line(stamp, lv, c[::-1] if vocabulary.LEVELS[lv] == 2 else c, m)

    monkeypatch.setattr(vocabulary, "_log_format", layout)


def _delivered_written_as_shipped(monkeypatch):
    """The order timelines write a delivery as "shipped": the text's last status is not the labelled one."""
    for split, formats in vocabulary.ORDER_LINES.items():
        wrapped = [lambda i, e, f=f: f(i, e.replace("delivered", "shipped")) for f in formats]
        monkeypatch.setitem(vocabulary.ORDER_LINES, split, wrapped)


def _urgency_cues_swapped(monkeypatch):
    """The ticket cues for "urgent" and "no rush" swapped: the tickets say the opposite of their label."""
    cues = vocabulary.URGENCY_CUES
    monkeypatch.setattr(vocabulary, "URGENCY_CUES", {0: cues[2], 2: cues[0]})


GENERATOR_FAULTS = {
    "error and warning spellings swapped": (_swap_error_and_warning_spellings, {"last_error", "last_level"}),
    "error lines name another component": (_error_lines_name_another_component, {"last_failure"}),
    "delivered written as shipped": (_delivered_written_as_shipped, {"status"}),
    "urgency cues swapped": (_urgency_cues_swapped, {"urgency"}),
}


@pytest.mark.parametrize("fault", sorted(GENERATOR_FAULTS))
def test_the_label_check_catches_a_broken_generator(monkeypatch, fault):
    """The generator broken, not the derivation: the label test's re-derivation from the text disagrees with
    the labels the broken generator wrote, on the questions the fault touches."""
    inject, touched = GENERATOR_FAULTS[fault]
    inject(monkeypatch)
    wrong: set[str] = set()
    for example in vocabulary.dataset(7, 400, "train") + vocabulary.dataset(8, 400, "heldout"):
        try:
            derived = derived_answers(example)
        except (StopIteration, ValueError, IndexError):  # the text no longer holds the fact at all
            wrong |= touched & set(example.answers)
            continue
        wrong |= {qid for qid, answer in example.answers.items() if derived[qid] != answer}
    assert touched <= wrong, (fault, wrong)


@pytest.mark.parametrize("split", vocabulary.SPLITS)
def test_names_are_passed_in_the_options_and_change_with_every_example(split):
    """No name question can be answered from memory: its answer is one of several names drawn for the
    example, and no name is the answer often (listed names repeat; made-up ones hardly ever)."""
    answers: dict[str, list[str]] = {"last_failure": [], "customer": [], "product": []}
    for example in vocabulary.dataset(9, 1500, split):
        for qid in answers.keys() & example.answers.keys():
            options = [o for o, _ in question_options(example.request["questions"][qid])]
            assert len(options) >= 2 and example.answers[qid] in options
            answers[qid].append(example.answers[qid])
    for qid, names in answers.items():
        assert max(Counter(names).values()) <= 0.06 * len(names), qid
