"""Images over HTTP: every wire form (Cloudflare data URLs and objects, ollama base64, TypeSafe assets with
placeholders, multipart uploads, the official SDK's Image) answers as the reference does for the same
image; every bad input is a 422/413 naming the image, with no socket or file opened on a client's
behalf and nothing decoded before the cheap limits pass."""

from __future__ import annotations

import sys

import pytest
from fastapi.testclient import TestClient
from images import animated_png, b64, data_url, jpeg, png, png16, png_bomb, webp
from parity import HALF_UNIT, PARITY_BOUND, assert_answers_match, reference_response
from prometheus_client.parser import text_string_to_metric_families
from releases import reference_model, tiny_release

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.default_model import default_release
from clef_cuda.serving.engine import Engine, EngineConfig

PLACEHOLDER = "<image:" + "0123456789abcdef" * 2 + ">"
QUESTIONS = {
    "dented": {"type": "noul", "instructions": "Is the car dented?"},
    "where": {"type": "choice", "criteria": {"front": "Front bumper", "rear": None, "side": "A door"}},
}


def body(**extra) -> dict:
    return {
        "model": "clef-flash",
        "state": "Claim 1182: photos of the damage attached.",
        "questions": QUESTIONS,
    } | extra


@pytest.fixture(scope="module")
def decider():
    return Decider.from_release(tiny_release(), device="cpu", progress=False)


@pytest.fixture(scope="module")
def client(decider):
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02))
    with TestClient(create_app(ServerSettings(), engine=engine)) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return reference_model(tiny_release())


def assert_answers_as_the_reference(response, reference, request) -> None:
    """A 200 whose answers match the reference's on `request` (tests/parity.py: within the bound)."""
    assert response.status_code == 200, response.text
    expected, unrounded = reference_response(reference, request)
    assert_answers_match(response.json()["answers"], expected["answers"], unrounded)


def assert_422(response, loc_prefix: list, words: str = "") -> None:
    assert response.status_code == 422, response.text
    (item,) = response.json()["detail"]
    assert item["loc"][: len(loc_prefix)] == loc_prefix, item
    assert words in item["msg"], item


# ---- the wire forms -------------------------------------------------------------------------------
def test_every_wire_form_answers_as_the_reference(client, reference):
    a, b = png(220, 140, 1), jpeg(90, 200, 2)
    expected, unrounded = reference_response(reference, body(images=[data_url(a), data_url(b, "jpeg")]))
    forms = {
        "cloudflare data urls": body(images=[data_url(a), data_url(b, "jpeg").replace("data:", "DATA:", 1)]),
        "cloudflare objects": body(
            images=[{"content_type": "image/png", "base64": b64(a)}, {"content_type": "image/jpeg", "base64": b64(b)}]
        ),
        "ollama base64": body(images=[b64(a), b64(b)]),
    }
    answers = {}
    for name, request in forms.items():
        response = client.post("/v1/systemone", json=request)
        assert response.status_code == 200, (name, response.text)
        assert_answers_match(response.json()["answers"], expected["answers"], unrounded, where=name)
        answers[name] = response.json()["answers"]
    # The same images and text through our own code: the forms' answers are one another's exactly.
    first = next(iter(answers.values()))
    assert all(a == first for a in answers.values()), answers


def test_assets_with_placeholders_are_rendered_as_image_numbers(client, reference):
    a, b = png(220, 140, 1), png(60, 60, 3)
    other = "<image:" + "f" * 32 + ">"
    request = body(
        state=f"Before: {PLACEHOLDER}; after: {other}.",
        assets={
            other: {"type": "image", "format": "png", "data_base64": b64(b)},  # listed first, appears second
            PLACEHOLDER: {"type": "image", "format": "png", "data_base64": b64(a)},
        },
    )
    response = client.post("/v1/systemone", json=request)
    rendered = body(state="Before: [image 1]; after: [image 2].", images=[data_url(a), data_url(b)])
    assert_answers_as_the_reference(response, reference, rendered)


def multipart(request_json: bytes, parts: dict[str, bytes]) -> tuple[bytes, str]:
    boundary = "b0undary7f3a"
    chunks = []
    for name, content, kind in [("request", request_json, "application/json")] + [
        (n, c, "image/png") for n, c in parts.items()
    ]:
        chunks.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
            f"Content-Type: {kind}\r\n\r\n".encode()
            + content
            + b"\r\n"
        )
    return b"".join(chunks) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_multipart_uploads(client, reference):
    import json

    a = png(220, 140, 1)
    request = body(state=f"Photo: {PLACEHOLDER}", assets={PLACEHOLDER: {"type": "image", "part": "asset-0"}})
    content, content_type = multipart(json.dumps(request).encode(), {"asset-0": a})
    response = client.post("/v1/systemone", content=content, headers={"Content-Type": content_type})
    assert_answers_as_the_reference(response, reference, body(state="Photo: [image 1]", images=[data_url(a)]))
    unclaimed, ct = multipart(json.dumps(request).encode(), {"asset-0": a, "asset-9": a})
    assert_422(client.post("/v1/systemone", content=unclaimed, headers={"Content-Type": ct}), ["body"], "asset-9")
    missing, ct = multipart(json.dumps(request).encode(), {})
    assert_422(
        client.post("/v1/systemone", content=missing, headers={"Content-Type": ct}), ["body", "assets"], "asset-0"
    )
    no_request, ct = multipart(b"", {})
    broken = no_request.replace(b'name="request"', b'name="other"')
    assert_422(client.post("/v1/systemone", content=broken, headers={"Content-Type": ct}), ["body"], "request")


def test_the_official_client_uploads_images_unchanged(decider, reference):
    from live import live_server
    from typesafe_sdk import Choice, Image, Noul, RetryPolicy, TypeSafeClient

    a = png(220, 140, 1)
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02))
    with live_server(engine, ServerSettings()) as (url, _):
        with TypeSafeClient(base_url=url, api_key="unused", retry=RetryPolicy(max_retries=0), timeout=60) as sdk:
            image = Image(a)
            result = sdk.system_one(
                state={"claim": "photos of the damage attached", "photo": image},
                questions={
                    "dented": Noul(instructions="Is the car dented?"),
                    "where": Choice(criteria={"front": "Front bumper", "rear": None, "side": "A door"}),
                },
                model="clef-flash",
            )
    expected, unrounded = reference_response(
        reference,
        {
            "model": "clef-flash",
            "state": {"claim": "photos of the damage attached", "photo": "[image 1]"},
            "questions": {
                "dented": {"type": "noul", "instructions": "Is the car dented?"},
                "where": QUESTIONS["where"],
            },
            "images": [data_url(a)],
        },
    )
    noul = unrounded["dented"]["true"]
    assert abs(result.nouls["dented"].noul - noul) <= HALF_UNIT + PARITY_BOUND
    assert result.choices["where"].choice == expected["answers"]["where"]["choice"]


# ---- refusals -------------------------------------------------------------------------------------
@pytest.fixture
def no_fetch_no_open():
    """Records every socket connection and every file opened for reading while a request is served."""
    seen: list[tuple] = []
    active = [True]

    def hook(event, args):
        if active[0] and event in ("socket.connect", "socket.getaddrinfo"):
            seen.append((event, args))
        if active[0] and event == "open" and isinstance(args[0], str) and args[0].startswith(("/etc", "/tmp/secret")):
            seen.append((event, args))

    sys.addaudithook(hook)  # audit hooks cannot be removed: this one is switched off instead
    yield seen
    active[0] = False


@pytest.mark.parametrize(
    "image, words",
    [
        ("http://127.0.0.1:9/a.png", "never fetched"),
        ("https://example.com/a.png", "never fetched"),
        ("file:///etc/passwd", "never fetched"),
        ("/etc/passwd", "never fetched"),
        ("ftp://host/a.png", "never fetched"),
        ("data:text/plain;base64,aGVsbG8=", "data URL"),
        ("data:image/png,raw", "data URL"),
        ("iVBORw0KGgo@@@@", "base64"),
        ("aGVsbG8", "base64"),  # missing padding
        (b64(b"not an image at all"), "not a PNG, JPEG or WebP"),
        (b64(png(40, 40)[:60]), "decoded"),  # truncated
        (b64(png16(20, 20)), "16-bit"),
        (b64(animated_png(20, 20)), "animated"),
        (b64(png(1, 250)), "200:1"),
        (b64(webp(30, 30)[:30]), "WebP"),
    ],
)
def test_bad_images_are_422_naming_the_image(client, no_fetch_no_open, image, words):
    response = client.post("/v1/systemone", json=body(images=[data_url(png(20, 20)), image]))
    assert_422(response, ["body", "images", 1], words)
    assert not no_fetch_no_open, no_fetch_no_open


@pytest.mark.parametrize(
    "where",
    ["state", "state dict", "instructions", "criteria description", "criteria key", "no image request"],
)
def test_a_placeholder_without_its_asset_is_a_422_naming_it(client, where):
    """Text that names an image the request does not carry (an SDK f-string whose Image was not attached)
    would otherwise be answered as text: a wrong decision for the caller."""
    other = "<image:" + "e" * 32 + ">"
    attached = {PLACEHOLDER: {"type": "image", "format": "png", "data_base64": b64(png(40, 40, 1))}}
    request = body(state=f"Photo: {PLACEHOLDER}", assets=attached)
    loc = ["body", "state"]
    if where == "state":
        request["state"] = f"Photo: {PLACEHOLDER}, and {other}"
    elif where == "state dict":
        request["state"] = {"photo": PLACEHOLDER, "second": other}
    elif where == "instructions":
        request["questions"] = {"q": {"type": "noul", "instructions": f"Is {other} dented?"}}
        loc = ["body", "questions", "q", "instructions"]
    elif where == "criteria description":
        request["questions"] = {"q": {"type": "choice", "criteria": {"a": f"like {other}", "b": None}}}
        loc = ["body", "questions", "q", "criteria", "a"]
    elif where == "criteria key":
        request["questions"] = {"q": {"type": "choice", "criteria": {other: None, "b": None}}}
        loc = ["body", "questions", "q", "criteria", other]
    else:
        request = body(state=f"see {other}")
    response = client.post("/v1/systemone", json=request)
    assert_422(response, loc, other)
    assert "attach" in response.json()["detail"][0]["msg"]


def test_the_official_client_gets_a_422_for_an_image_it_did_not_attach(decider):
    """The SDK renders an Image in an f-string as its placeholder and uploads it only when attached."""
    from live import live_server
    from typesafe_sdk import Image, Noul, RetryPolicy, TypeSafeClient

    image = Image(png(60, 60, 2))
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02))
    question = {"dented": Noul(instructions="Is the car dented?")}
    with live_server(engine, ServerSettings()) as (url, _):
        with TypeSafeClient(base_url=url, api_key="unused", retry=RetryPolicy(max_retries=0), timeout=60) as sdk:
            with pytest.raises(Exception) as refused:
                sdk.system_one(state=f"the photo: {image}", questions=question, model="clef-flash")
            assert "422" in str(refused.value) or getattr(refused.value, "status_code", None) == 422, refused.value
            with sdk.attach_assets(image):  # attached: the same request is answered
                result = sdk.system_one(state=f"the photo: {image}", questions=question, model="clef-flash")
    assert 0 <= result.nouls["dented"].noul <= 1


def test_limits(client):
    assert_422(
        client.post("/v1/systemone", json=body(images=[b64(png(20, 20, i)) for i in range(5)])),
        ["body", "images"],
        "at most 4",
    )
    big = b64(bytes(5 * 2**20))
    too_big = client.post("/v1/systemone", json=body(images=[big]))
    assert too_big.status_code == 413 and "4 MiB" in too_big.json()["detail"]["message"]
    three_mib = b64(png(20, 20) + bytes(3 * 2**20))  # PNG with trailing bytes: each under 4 MiB, 9 MiB in all
    total = client.post("/v1/systemone", json=body(images=[three_mib] * 3))
    assert total.status_code == 413 and "8 MiB" in total.json()["detail"]["message"]
    assert_422(client.post("/v1/systemone", json=body(videos=["x"])), ["body", "videos"], "video")
    assert_422(
        client.post("/v1/systemone", json=body(assets={PLACEHOLDER: {"type": "image", "part": "asset-0"}})),
        ["body", "assets", PLACEHOLDER, "part"],
        "not multipart",
    )
    assert_422(
        client.post("/v1/systemone", json=body(state="x <|image_pad|> y", images=[b64(png(20, 20))])),
        ["body", "state"],
        "<|image_pad|>",
    )


def test_a_decompression_bomb_is_refused_from_its_header(client, monkeypatch):
    import tracemalloc

    from clef_cuda.request import images

    def never(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(images, "decode_image", never)
    bomb = png_bomb(20000, 20000)
    assert len(bomb) < 200  # 1.2 GB of pixels if decoded
    tracemalloc.start()
    response = client.post("/v1/systemone", json=body(images=[b64(bomb)]))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert response.status_code == 413 and "20000x20000" in response.json()["detail"]["message"]
    assert peak < 50 * 2**20


def test_image_tokens_count_toward_the_budget(decider):
    limit = decider.encode(body()).num_tokens + 50  # the text fits; 300 image tokens do not
    engine = Engine(decider, EngineConfig(max_model_len=limit, kv_fraction=0.02))
    with TestClient(create_app(ServerSettings(), engine=engine, warm_up=False)) as c:
        assert c.post("/v1/systemone", json=body()).status_code == 200
        response = c.post("/v1/systemone", json=body(images=[b64(png(640, 480))]))
        assert (
            response.status_code == 413
            and f"maximum context length of {limit} tokens" in response.json()["detail"]["message"]
        )


def test_a_release_without_a_vision_tower_refuses_images():
    decider = Decider.from_release(default_release(), device="cpu", progress=False)
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02))
    with TestClient(create_app(ServerSettings(), engine=engine)) as c:
        assert c.post("/v1/systemone", json=body()).status_code == 200
        assert_422(
            c.post("/v1/systemone", json=body(images=[b64(png(20, 20))])), ["body", "images"], "does not accept images"
        )


def test_image_metrics(client):
    assert client.post("/v1/systemone", json=body(images=[b64(png(64, 64, 9))])).status_code == 200
    values = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
    assert values["clef_images_total"] >= 1 and values["clef_image_tokens_total"] >= 4
    assert values["clef_vision_seconds_total"] > 0


def test_the_probe_sees_a_fetch_and_an_open(no_fetch_no_open):
    """The refusal tests above can fail: what the reference's processor would do with a URL or a path
    (a connection, a read) is exactly what the probe records."""
    import contextlib
    import socket

    with contextlib.suppress(OSError):
        socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    with contextlib.suppress(OSError), open("/etc/passwd", "rb"):
        pass
    assert {event for event, _ in no_fetch_no_open} >= {"socket.connect", "open"}


def test_readme_image_example_answers_as_printed(decider):
    """docs/clients.md's image example, against the same upstream test release (seed 0), in-process."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "clients.md").read_text()
    block = re.search(r"<!-- readme-image-example -->\s*```\n(.*?)```", text, re.S).group(1)
    image = b64((root / "docs" / "dented-car.png").read_bytes())
    raw = re.search(r"-d '(.*?)'\n", block, re.S).group(1).replace("'$(base64 -w0 docs/dented-car.png)'", image)
    request, printed = json.loads(raw), json.loads(block.strip().splitlines()[-1])
    engine = Engine(decider, EngineConfig(max_model_len=4096, kv_fraction=0.02))
    with TestClient(create_app(ServerSettings(), engine=engine)) as c:
        response = c.post("/v1/systemone", json=request)
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["usage"] == printed["usage"] and list(got["answers"]) == list(printed["answers"])
    assert abs(got["answers"]["dented"]["noul"] - printed["answers"]["dented"]["noul"]) <= 2e-3
    for option, p in printed["answers"]["part"]["probabilities"].items():
        assert abs(got["answers"]["part"]["probabilities"][option] - p) <= 2e-3
