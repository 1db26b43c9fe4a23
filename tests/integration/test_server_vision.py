"""Images through the HTTP API, with the OpenAI SDK: chat's `image_url` parts and
Responses' `input_image` parts as base64 data URLs, answered as transformers answers the
same conversation; bad images refused with a 400 naming the part, nothing leaked."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from jpaged.config import EngineConfig
from jpaged.engine.engine import Engine
from server.media import MediaOptions
from server.parse import Options

CONFIG = dict(dtype="float32", warmup=False, max_seq_len=96, max_batch_size=4, block_size=4)
MEDIA = MediaOptions(allowed_domains=("images.example",), max_images=2, max_image_bytes=8000)
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def picture(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def server(tiny_gemma3_vision: Any, serve: Any) -> Any:
    engine = Engine(tiny_gemma3_vision.loaded, EngineConfig(**CONFIG))
    with serve(engine, options=Options(media=MEDIA)) as served:
        yield served


@pytest.fixture(scope="module")
def sdk(server: Any) -> Any:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def reference(tiny: Any, content: str, images: list[Image.Image]) -> str:
    """transformers' answer: its chat template, its processor's expansion of each image
    placeholder, its image processor's pixels, its greedy generation."""
    import torch
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tiny.path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    run = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    prompt = prompt.replace("<start_of_image>", run)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    pixels = Gemma3ImageProcessorPil.from_pretrained(tiny.path)(images, return_tensors="pt")
    with torch.no_grad():
        out = tiny.hf.generate(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            token_type_ids=(ids == tiny.hf.config.image_token_id).long(),
            max_new_tokens=5,
            do_sample=False,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_and_responses_with_images(tiny_gemma3_vision: Any, server: Any, sdk: Any) -> None:
    a, b = picture(0), picture(1, (17, 23))
    messages = user(text("Look: "), image_part(data_url(a)), text(" and "),
                    image_part(data_url(b, "JPEG")), text(" - what?"))  # fmt: skip
    got = sdk.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    # transformers decodes the JPEG as the server does (Pillow): the same pixels
    jpeg = Image.open(io.BytesIO(base64.b64decode(data_url(b, "JPEG").split(",")[1])))
    want = reference(tiny_gemma3_vision, "Look: <start_of_image> and <start_of_image> - what?",
                     [a, jpeg])  # fmt: skip
    assert want and got.choices[0].message.content == want
    # 3 text tokens, then per image: 2 newlines, boi, 4 image tokens, eoi, 2 newlines
    assert got.usage.prompt_tokens > 2 * 9
    # Responses' input_image parts: the same conversation, the same answer
    reply = sdk.responses.create(
        model="tiny",
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Look: "},
            {"type": "input_image", "image_url": data_url(a)},
            {"type": "input_text", "text": " and "},
            {"type": "input_image", "image_url": data_url(b, "JPEG")},
            {"type": "input_text", "text": " - what?"},
        ]}],
        max_output_tokens=5, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.output_text == want
    webp = sdk.chat.completions.create(
        model="tiny", messages=user(image_part(data_url(a, "WEBP"))), **GREEDY
    )
    assert webp.usage.prompt_tokens > 6  # the image's 4 tokens and its 2 markers at least
    server.assert_idle()


@pytest.mark.parametrize(
    "parts,where,says",
    [
        ([text("x"), image_part("data:image/png;base64," + base64.b64encode(b"hi").decode())],
         "messages[0].content[1].image_url", "not a PNG, JPEG or WebP image"),
        ([text("x"), image_part("data:image/png;base64,@@@")],
         "messages[0].content[1].image_url", "not valid base64"),
        ([text("x"), image_part(data_url(picture(2, (80, 80))))],
         "messages[0].content[1].image_url", "exceeds 8000 bytes"),
        ([image_part(data_url(picture(3)))] * 3,
         "messages[0].content[2].image_url", "more than 2 images"),
        ([text("x"), image_part("https://elsewhere.example/cat.png")],
         "messages[0].content[1].image_url", "not allowed"),
        ([text("x"), image_part("file:///etc/passwd")],
         "messages[0].content[1].image_url", "data: URL or an http(s) URL"),
        ([text("x"), image_part("data:text/plain;base64,aGk=")],
         "messages[0].content[1].image_url", "unsupported media type"),
    ],
    ids=["not-an-image", "bad-base64", "too-large", "too-many", "remote", "file", "text"],
)  # fmt: skip
def test_bad_images_answer_400_naming_the_part(
    server: Any, sdk: Any, parts: list[dict], where: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="tiny", messages=user(*parts), **GREEDY)
    assert bad.value.param == "messages"
    assert where in bad.value.message and says in bad.value.message, bad.value.message
    server.assert_idle()


def test_responses_bad_image_names_its_input(server: Any, sdk: Any) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.create(
            model="tiny",
            input=[{"role": "user", "content": [
                {"type": "input_text", "text": "x"},
                {"type": "input_image", "image_url": "https://elsewhere.example/a.png"},
            ]}],
        )  # fmt: skip
    assert bad.value.param == "input"
    assert "input[0].content[1].image_url" in bad.value.message
    server.assert_idle()


def test_a_text_model_refuses_images(model: Any, serve: Any) -> None:
    """A text-only model answers an image part with a 400 naming it (text parts still
    serve)."""
    engine = Engine(model, EngineConfig(dtype="float32", warmup=False, max_seq_len=64))
    with (
        serve(engine) as served,
        openai.OpenAI(
            base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client,
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="tiny", messages=user(text("x"), image_part(data_url(picture(0)))), **GREEDY
            )
        assert bad.value.param == "messages"
        # (its published schema has text parts only, as before images came)
        assert "messages[0].content[1].type: Input should be 'text'" in str(bad.value)
        ok = client.chat.completions.create(model="tiny", messages=user(text("hi")), **GREEDY)
        assert ok.choices[0].finish_reason == "length"
        served.assert_idle()


def test_allowed_domains_are_fetched_without_redirects() -> None:
    """An http URL on a listed host is fetched (here a local server), within the byte
    limit; a redirect is not followed (it could lead anywhere); other hosts are refused."""
    import http.server
    import threading

    from server.errors import APIError
    from server.media import read_images

    png = io.BytesIO()
    picture(4).save(png, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(png.getvalue())))
                self.end_headers()
                self.wfile.write(png.getvalue())
            else:
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        local = MediaOptions(allowed_domains=("127.0.0.1",))
        (image,) = read_images([("p", f"{base}/cat.png")], local, "messages")
        assert image.size == (40, 30)
        with pytest.raises(APIError, match="p: fetching the image failed"):
            read_images([("p", f"{base}/moved.png")], local, "messages")
        with pytest.raises(APIError, match="p: the image exceeds 100 bytes"):
            read_images([("p", f"{base}/cat.png")], MediaOptions(("127.0.0.1",), 4, 100), "m")
        with pytest.raises(APIError, match="not allowed"):
            read_images([("p", f"{base}/cat.png")], MediaOptions(), "messages")
    finally:
        httpd.shutdown()
