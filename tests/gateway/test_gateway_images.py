"""Images through the gateway, on a scripted engine that widens each image placeholder as a vision-language engine
does: image parts of every API reach the client, each turn extends the previous turn's exact ids with its images at
their known spans, the trajectory carries the spans and the images, and a backend or model that takes no images is
answered 400 in the API's error shape naming the harness's part, before anything is sent."""

from __future__ import annotations

import base64
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pyarrow.parquet as pq
import pytest
from served_gateway import OFF, Served

from backends_core import Client, ClientConfig, Image, ImageSpan, cli
from backends_core.multiturn.rendering import load_tokenizer
from backends_gateway import Gateway, SQLiteStore, Trajectories, serve
from backends_testkit.tinymodel import default_models_dir
from backends_testkit.tinymodel_vl import IMAGE_PAD_ID, build_tiny_vl_model
from scripted_vision import WIDTH, VisionScript

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////DAAe9gT9Ce00PgAAAABJRU5ErkJggg=="
)
URL = Image(data=PNG).data_url()
REPLIES = ["A small picture.<|im_end|>", "Red and green.<|im_end|>", "Blue.<|im_end|>"]


def question(text: str, url: str = URL) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
    }


@pytest.fixture
def vl_gateway(tiny_models: Any, tmp_path: Path) -> Any:
    """``async with vl_gateway(replies, sends_images=..., tokenizer=...) as served``: a gateway over
    :class:`VisionScript` on the tiny VL model's tokenizer (or another)."""

    @contextlib.asynccontextmanager
    async def make(
        replies: list[str], *, sends_images: bool = True, tokenizer: str | None = None
    ) -> AsyncIterator[Served]:
        path = tokenizer or str(build_tiny_vl_model(default_models_dir()))
        script = VisionScript(load_tokenizer(path), replies, sends_images=sends_images)
        config = ClientConfig(
            backend="scripted", base_url="http://scripted", model="tiny", tokenizer=path, stateless=OFF
        )
        store = tmp_path / "vl.db"
        async with (
            Client(config, plugin=script) as client,
            Gateway(client, SQLiteStore(store)) as gateway,
            serve(gateway) as url,
        ):
            yield Served(url, gateway, client, "tiny", store, script)

    return make


async def get(url: str) -> Any:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.get(url)
    assert response.status_code == 200, response.text
    return response.json()


async def test_an_image_conversation_extends_each_turns_exact_ids_and_the_trajectory_carries_the_image(
    vl_gateway,
) -> None:
    async with vl_gateway(REPLIES) as served:
        script = served.script
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/s/pic/v1", api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "system", "content": "Be brief."}, question("What is this?")]
        for i, follow in enumerate(["Which colours?", "And the last one?", None]):
            completion = await sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=False)
            assert completion.choices[0].message.content == REPLIES[i].removesuffix("<|im_end|>")
            messages.append(completion.choices[0].message.model_dump(exclude_none=True))
            if follow is not None:
                messages.append({"role": "user", "content": follow})
        await sdk.close()
        first, second, third = script.requests
        image = Image(data=PNG)
        assert [r.images for r in script.requests] == [(image,)] * 3
        # turn 1 sends the image as one placeholder; later turns send turn 1's widened ids, the image at its span
        assert first.image_spans == () and first.prompt_ids.count(IMAGE_PAD_ID) == 1
        trajectory = await get(f"{served.url}/v1/sessions/pic/trajectory")
        turns = trajectory["turns"]
        span = turns[0]["image_spans"]
        assert len(span) == 1 and span[0]["end"] - span[0]["start"] == WIDTH
        assert [t["image_spans"] for t in turns] == [span] * 3
        assert [t["images"] for t in turns] == [[URL]] * 3
        assert second.image_spans == third.image_spans == (ImageSpan(span[0]["start"], span[0]["end"]),)
        for before, after in itertools.pairwise(turns):
            exact = before["prompt_ids"] + before["completion_ids"]
            assert after["prompt_ids"][: len(exact)] == exact and after["reused_ids"] == len(exact)
        assert list(second.prompt_ids[: len(turns[0]["prompt_ids"])]) == turns[0]["prompt_ids"]
        assert (trajectory["bridged"], trajectory["branched"], trajectory["rerendered"]) == (2, 0, 0)
        (branch,) = trajectory["branches"]
        assert branch["image_spans"] == span and branch["images"] == [URL]
        start, end = span[0]["start"], span[0]["end"]
        assert set(branch["input_ids"][start:end]) == {IMAGE_PAD_ID} and not any(branch["loss_mask"][start:end])
        assert sum(branch["loss_mask"]) == sum(len(t["completion_ids"]) for t in turns)
        (sample,) = Trajectories(served.store).get("pic").samples
        assert sample.images == (image,) and sample.images[0].data == PNG
        assert sample.image_spans == (ImageSpan(start, end),)
        assert sample.input_ids.tolist() == branch["input_ids"]
        parquet = served.store.parent / "rows.parquet"
        assert (
            cli.main(
                [
                    "gateway",
                    "export",
                    "--store",
                    str(served.store),
                    "--status",
                    "all",
                    "--format",
                    "parquet",
                    "-o",
                    str(parquet),
                ]
            )
            == 0
        )
        (row,) = pq.read_table(parquet).to_pylist()
        assert (row["image_spans"], row["images"], row["input_ids"]) == ([[start, end]], [URL], branch["input_ids"])


async def test_a_changed_image_in_the_history_starts_a_new_branch_rendered_whole(vl_gateway) -> None:
    flipped = Image(data=_png_of(np.array([[[0, 0, 255], [255, 255, 255]], [[255, 0, 0], [0, 255, 0]]], np.uint8)))
    async with vl_gateway(REPLIES) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            first = [question("What is this?")]
            one = await http.post(
                "/s/b/v1/chat/completions", json={"model": "tiny", "messages": first, "max_tokens": 8}
            )
            reply = one.json()["choices"][0]["message"]
            # the same image re-sent (the same data URL): the turn extends turn 0
            same = [*first, reply, {"role": "user", "content": "More?"}]
            two = await http.post("/s/b/v1/chat/completions", json={"model": "tiny", "messages": same, "max_tokens": 8})
            # the first image replaced in the history: no turn is extended, its ids hold the old image
            changed = [question("What is this?", flipped.data_url()), reply, {"role": "user", "content": "More?"}]
            three = await http.post(
                "/s/b/v1/chat/completions", json={"model": "tiny", "messages": changed, "max_tokens": 8}
            )
        assert [r.status_code for r in (one, two, three)] == [200, 200, 200], three.text
        trajectory = await get(f"{served.url}/v1/sessions/b/trajectory")
        turns = trajectory["turns"]
        assert [t["parent"] for t in turns] == [None, 0, None] and [t["branch"] for t in turns] == [0, 0, 1]
        assert trajectory["branches"][1]["reason"] == "rewritten"
        assert turns[2]["images"] == [flipped.data_url()] and turns[2]["reused_ids"] == 0
        assert served.script.requests[2].image_spans == () and served.script.requests[2].images == (flipped,)


def _png_of(array: np.ndarray) -> bytes:
    import io

    import PIL.Image

    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


async def test_responses_input_image_reaches_the_client_and_the_next_response_extends_it(vl_gateway) -> None:
    async with vl_gateway(REPLIES[:2]) as served:
        sdk = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        part = {"type": "input_image", "image_url": URL, "detail": "auto"}
        one = await sdk.responses.create(
            model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "What?"}, part]}]
        )
        two = await sdk.responses.create(model="tiny", input="Colours?", previous_response_id=one.id)
        await sdk.close()
        assert two.output_text == "Red and green."
        first, second = served.script.requests
        assert first.images == second.images == (Image(data=PNG),)
        (span,) = second.image_spans
        assert (
            span.length == WIDTH
            and second.prompt_ids[: span.end] == first.prompt_ids[: span.start] + (IMAGE_PAD_ID,) * WIDTH
        )


async def test_an_anthropic_image_block_reaches_the_client_and_the_trajectory(vl_gateway) -> None:
    async with vl_gateway(REPLIES[:1]) as served:
        sdk = anthropic.AsyncAnthropic(base_url=f"{served.url}/s/a", api_key="x", max_retries=0)
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
        message = await sdk.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "?"}]}
            ],
        )
        await sdk.close()
        assert message.content[0].text == "A small picture."  # type: ignore[union-attr]
        (request,) = served.script.requests
        assert request.images == (Image(data=PNG),)
        (turn,) = (await get(f"{served.url}/v1/sessions/a/trajectory"))["turns"]
        assert turn["images"] == [URL] and turn["image_spans"][0]["end"] - turn["image_spans"][0]["start"] == WIDTH


TEXT_BLOCK = {"type": "text", "text": "?"}
IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": URL.split(",")[1]}}
# each API's request with an image, the route, and the part the refusal names
REQUESTS = [
    ("chat", "/v1/chat/completions", {"model": "tiny", "max_tokens": 8, "messages": [question("?")]}),
    (
        "responses",
        "/v1/responses",
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": URL}]}]},
    ),
    (
        "anthropic",
        "/v1/messages",
        {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [TEXT_BLOCK, IMAGE_BLOCK]}]},
    ),
]
PARTS = {"chat": "messages[0].content[1]", "responses": "input[0].content[0]", "anthropic": "messages[0].content[1]"}


def error_of(api: str, response: httpx.Response) -> dict[str, Any]:
    """The error in the API's shape (Anthropic's wraps it in ``{"type": "error"}``)."""
    body = response.json()
    if api == "anthropic":
        assert body["type"] == "error"
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(("api", "route", "payload"), REQUESTS, ids=[r[0] for r in REQUESTS])
@pytest.mark.parametrize("why", ["backend", "model"])
async def test_images_the_backend_or_model_cannot_take_are_a_400_naming_the_part(
    vl_gateway, tiny_models, api, route, payload, why
) -> None:
    if why == "backend":
        opened = vl_gateway(["never<|im_end|>"], sends_images=False)
        said = "this scripted engine takes no images"
    else:  # a text model: its config.json names no image placeholder
        opened = vl_gateway(["never<|im_end|>"], tokenizer=str(tiny_models.dense))
        said = "names no image placeholder"
    async with opened as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post(route, json=payload)
            sessions = (await http.get("/v1/sessions")).json()
        assert response.status_code == 400, response.text
        error = error_of(api, response)
        assert (error["param"], error["code"], error["type"]) == (
            PARTS[api],
            "unsupported_content",
            "invalid_request_error",
        )
        assert said in error["message"] and PARTS[api] in error["message"]
        assert served.script.requests == [] and sessions["data"] == []


async def test_count_tokens_refuses_an_image_naming_it(vl_gateway) -> None:
    async with vl_gateway([]) as served:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False) as http:
            response = await http.post(
                "/v1/messages/count_tokens", json={"model": "tiny", "messages": REQUESTS[2][2]["messages"]}
            )
        assert response.status_code == 400
        assert error_of("anthropic", response)["param"] == "messages[0].content[1]"
