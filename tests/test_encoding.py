"""Encoding rules that do not need a model: JSON rendering, option order, the documented sample."""

from __future__ import annotations

from clef_cuda.encoding import question_options, render


def test_render_matches_the_reference_rules():
    value = {"b": [1, 2.0, 1e-05, 1e16, None, True], "a": 'café "q"\n\u0001'}
    assert render(value) == '{"a":"café \\"q\\"\\n\\u0001","b":[1,2.0,1e-05,1e+16,null,true]}'
    assert render("as is {") == "as is {"
    assert render({"z": {"b": 1, "a": 2}, "é": 0, "E": 1}) == '{"E":1,"z":{"a":2,"b":1},"é":0}'
    assert render(float("nan")) == "NaN" and render(float("inf")) == "Infinity"


def test_option_order():
    assert [o for o, _ in question_options({"type": "choice", "criteria": {"b": 1, "B": 2, "é": 3, "a": 4}})] == [
        "B",
        "a",
        "b",
        "é",
    ]
    noul = question_options({"type": "noul", "criteria": {"false": None, "extra": "x"}})
    assert noul == [("true", "The proposition is true or the answer is yes."), ("false", None)]
    assert question_options({"type": "score", "criteria": ["x", None]}) == [("0", "x"), ("1", None)]


def test_documented_sample_text(tmp_path):
    """The record text of the spec's sample request, rendered by our encoder's segments."""
    from clef_cuda import encoding

    class Echo:  # a "tokenizer" whose ids are the characters, so ids -> text is exact
        def encode_many(self, texts):
            return [[ord(c) for c in t] for t in texts]

    request = {
        "model": "clef-flash",
        "state": {"a": 'café "q"\n\u0001', "b": [1, 2.0, 1e-05, 1e16, None, True]},
        "questions": {
            "department": {
                "type": "choice",
                "instructions": "Which team should handle the message?",
                "criteria": {"billing": "Payments, invoices, or refunds", "sales": None},
            },
            "outage": {"type": "noul", "instructions": {"z": 1, "a": [1, 2]}},
        },
    }
    record = encoding.encode_request(Echo(), request)
    text = "".join(map(chr, record.input_ids))
    assert text.startswith(encoding.PREFIX + '{"a":"café \\"q\\"\\n\\u0001","b":[1,2.0,1e-05,1e+16,null,true]}')
    assert (
        "\n\nSCHEMA FIELDS:\n\nFIELD 1\nID: department\nTYPE: choice\n"
        "INSTRUCTION: Which team should handle the message?\nALLOWED OPTIONS:\n"
        'OPTION 1: {"description":"Payments, invoices, or refunds","option_id":"billing"}\n'
        'OPTION 2: {"option_id":"sales"}\nEND FIELD\n\nFIELD 2\nID: outage\nTYPE: noul\n'
        'INSTRUCTION: {"a":[1,2],"z":1}\n'
    ) in text
    assert text.endswith("END FIELD\n" + encoding.SUFFIX)
    first = record.questions[0]
    assert text[first.span[0] : first.span[1]] == "Which team should handle the message?"
    assert text[slice(*first.option_spans[1])] == '{"option_id":"sales"}'
