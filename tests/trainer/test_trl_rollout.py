"""``BackendsRollout`` as TRL calls it: the prompts of one generation batch (each repeated ``num_generations`` times
in a row) in, one row per prompt out, with exactly the ids and logprobs the engine generated. The trainer is a
stand-in holding the attributes TRL 1.16's ``GRPOTrainer`` reads; the server is vLLM's emulator in-process.
``test_trl_grpo.py`` runs the real trainer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from backends_core import Client, ClientConfig, SamplingParams, SyncClient
from backends_core.errors import InvalidRequestError
from backends_testkit.engine import ReferenceEngine
from backends_trainer import SyncWeightPusher
from backends_trainer.trl import BackendsRollout, WeightSyncCallback, grpo_kwargs
from backends_vllm_testing import VllmEmulator

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
OTHER = [{"role": "user", "content": "Name a prime."}]


class Served:
    """vLLM's emulator behind a SyncClient (the engine runs on the client's loop), every request recorded."""

    def __init__(self, models: Any) -> None:
        self.emulator = VllmEmulator(ReferenceEngine(models.dense, seed=0))
        self.sent: list[httpx.Request] = []
        self.config = ClientConfig(
            backend="vllm", base_url="http://vllm.test", model="tiny-qwen3", tokenizer=str(models.dense)
        )
        self.client = SyncClient(self.config, transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        response: httpx.Response = await self.emulator.handle(request)
        return response

    def close(self) -> None:
        async def stop(_client: Client) -> None:
            await self.emulator.aclose()

        try:
            self.client.run(stop)
        finally:
            self.client.close()


@pytest.fixture
def served(tiny_models: Any) -> Iterator[Served]:
    s = Served(tiny_models)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def tokenizer(tiny_models: Any) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_models.dense))


def trainer(tokenizer: Any, **changes: Any) -> Any:
    """The attributes of a GRPOTrainer that a rollout function reads, at GRPOConfig's defaults but small."""
    fields: dict[str, Any] = {
        "use_vllm": False,
        "tools": [],
        "environment_factories": None,
        "args": SimpleNamespace(generation_kwargs=None),
        "max_completion_length": 6,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "num_generations": 3,
        "num_generations_eval": 3,
        "model": SimpleNamespace(training=True),
        "chat_template_kwargs": {},
        "processing_class": tokenizer,
        "accelerator": SimpleNamespace(process_index=0),
    }
    fields.update(changes)
    return SimpleNamespace(**fields)


def test_each_row_is_the_sample_the_engine_generated_for_its_group(served: Served, tokenizer: Any) -> None:
    rollout = BackendsRollout(served.client, seed=40)
    out = rollout([QUESTION] * 3 + [OTHER] * 3, trainer(tokenizer))

    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "weight_version", "finish_reason"}
    assert all(len(column) == 6 for column in out.values())
    # the same groups asked for directly: seeds 40.. for the first group, 43.. for the second
    expected = [
        *served.client.generate_group(messages=QUESTION, n=3, sampling=SamplingParams(max_tokens=6, seed=40)),
        *served.client.generate_group(messages=OTHER, n=3, sampling=SamplingParams(max_tokens=6, seed=43)),
    ]
    assert out["prompt_ids"] == [list(s.prompt_ids) for s in expected]
    assert out["completion_ids"] == [list(s.completion_ids) for s in expected]
    for got, sample in zip(out["logprobs"], expected, strict=True):
        assert isinstance(got, list) and all(isinstance(x, float) for x in got)
        assert np.array_equal(np.asarray(got, dtype=np.float32), sample.logprobs)
    assert len(set(map(tuple, out["completion_ids"][:3]))) > 1, "a group of identical samples: seeds not spread"
    # one group is one request with n: the prompt is rendered and sent once
    assert [r.url.path for r in served.sent].count("/inference/v1/generate") == 4
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]
    assert out["prompt_ids"][0] == list(rendered)
    assert out["weight_version"] == [expected[0].weight_version] * 6 and expected[0].weight_version is not None
    assert set(out["finish_reason"]) <= {"stop", "length"}


def test_a_seeded_run_draws_new_seeds_for_every_batch_and_repeats_from_the_same_seed(
    served: Served, tokenizer: Any
) -> None:
    first = BackendsRollout(served.client, seed=7)
    again = BackendsRollout(served.client, seed=7)
    batch = [QUESTION] * 3
    one, two = first(batch, trainer(tokenizer)), first(batch, trainer(tokenizer))
    assert one["completion_ids"] != two["completion_ids"]  # the second batch drew seeds 10..12
    assert again(batch, trainer(tokenizer))["completion_ids"] == one["completion_ids"]


def test_each_training_process_draws_its_own_seeds(served: Served, tokenizer: Any) -> None:
    # a group split over two processes (each holding 2 of its 4 samples) must not draw the same samples twice
    for process in (0, 1):
        BackendsRollout(served.client, seed=5)(
            [QUESTION] * 2, trainer(tokenizer, accelerator=SimpleNamespace(process_index=process))
        )
    seeds = [
        httpx.Response(200, content=r.content).json()["sampling_params"]["seed"]
        for r in served.sent
        if r.url.path == "/inference/v1/generate"
    ]
    assert seeds == [5, 5 + (1 << 24)]


def test_token_id_and_text_prompts(served: Served, tokenizer: Any) -> None:
    rollout = BackendsRollout(served.client)
    ids = [5, 17, 230, 9]
    out = rollout([ids, ids, "plain text prompt", "plain text prompt"], trainer(tokenizer, num_generations=2))
    assert out["prompt_ids"][:2] == [ids, ids]
    # text is tokenized as TRL tokenizes text prompts: the processing class, no chat template
    assert out["prompt_ids"][2:] == [tokenizer(text=["plain text prompt"])["input_ids"][0]] * 2
    assert all(1 <= len(c) <= 6 for c in out["completion_ids"])


def test_the_trainer_sampling_reaches_the_engine(served: Served, tokenizer: Any) -> None:
    rollout = BackendsRollout(served.client)
    rollout([QUESTION] * 2, trainer(tokenizer, num_generations=2, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05))
    (request,) = [r for r in served.sent if r.url.path == "/inference/v1/generate"]
    body = httpx.Response(200, content=request.content).json()
    params = body["sampling_params"]
    assert (params["n"], params["max_tokens"], params["temperature"], params["top_p"], params["top_k"]) == (
        2,
        6,
        0.7,
        0.9,
        20,
    )
    assert params["min_p"] == pytest.approx(0.05)


def test_chat_template_kwargs_of_the_config_reach_the_rendering(served: Served, tokenizer: Any) -> None:
    plain = BackendsRollout(served.client)([QUESTION] * 2, trainer(tokenizer, num_generations=2))
    thinking = BackendsRollout(served.client)(
        [QUESTION] * 2, trainer(tokenizer, num_generations=2, chat_template_kwargs={"enable_thinking": False})
    )
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=False)
    assert thinking["prompt_ids"][0] == list(rendered["input_ids"])
    assert thinking["prompt_ids"][0] != plain["prompt_ids"][0]


# -- refusals: a typed error naming what is wrong, nothing sent ----------------------------------------


def test_a_group_size_other_than_the_trainers_is_refused(served: Served, tokenizer: Any) -> None:
    rollout = BackendsRollout(served.client, num_generations=4)
    with pytest.raises(InvalidRequestError, match=r"num_generations=4 but the trainer uses 3"):
        rollout([QUESTION] * 3, trainer(tokenizer))
    with pytest.raises(InvalidRequestError, match=r"num_generations_eval"):
        rollout([QUESTION] * 3, trainer(tokenizer, num_generations=4, model=SimpleNamespace(training=False)))
    assert served.sent == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_vllm": True}, r"use_vllm is True"),
        ({"tools": [print]}, r"tools or an environment_factory"),
        ({"args": SimpleNamespace(generation_kwargs={"suppress_tokens": [1]})}, r"kwargs \['suppress_tokens'\]"),
        ({"max_completion_length": None}, r"max_completion_length must be a positive int"),
    ],
    ids=["use_vllm", "tools", "generation_kwargs", "unbounded"],
)
def test_a_trainer_config_this_cannot_serve_is_refused(
    served: Served, tokenizer: Any, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        BackendsRollout(served.client)([QUESTION] * 3, trainer(tokenizer, **changes))
    assert served.sent == []


def test_sampling_that_disagrees_with_the_trainer_is_refused(served: Served, tokenizer: Any) -> None:
    hot = BackendsRollout(served.client, sampling=SamplingParams(max_tokens=6, temperature=0.5))
    with pytest.raises(InvalidRequestError, match=r"sampling.temperature is 0.5 but GRPOConfig.temperature is 1.0"):
        hot([QUESTION] * 3, trainer(tokenizer))
    long = BackendsRollout(served.client, sampling=SamplingParams(max_tokens=64))
    with pytest.raises(InvalidRequestError, match=r"max_tokens is 64, more than .*max_completion_length \(6\)"):
        long([QUESTION] * 3, trainer(tokenizer))
    assert served.sent == []


def test_a_prompt_of_another_kind_is_refused_by_index(served: Served, tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"prompts\[3\] must be chat messages"):
        BackendsRollout(served.client)([QUESTION] * 3 + [{"role": "user"}] * 3, trainer(tokenizer))
    assert served.sent == []


def test_bad_construction_is_refused(served: Served, tiny_models: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"got an async Client"):
        BackendsRollout(Client(served.config))
    with pytest.raises(InvalidRequestError, match=r"SyncClient or a ClientConfig, got str"):
        BackendsRollout("http://vllm.test")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"sampling.seed is 3"):
        BackendsRollout(served.client, sampling=SamplingParams(max_tokens=4, seed=3))
    with pytest.raises(InvalidRequestError, match=r"sampling.n must stay 1"):
        BackendsRollout(served.client, sampling=SamplingParams(max_tokens=4, n=2))
    with pytest.raises(InvalidRequestError, match=r"seed must be a non-negative int"):
        BackendsRollout(served.client, seed=-1)
    with pytest.raises(InvalidRequestError, match=r"num_generations must be a positive int"):
        BackendsRollout(served.client, num_generations=0)


def test_the_callback_refuses_an_async_pusher_and_grpo_kwargs_a_pusher_for_other_servers(
    served: Served, tmp_path: Any, tiny_models: Any
) -> None:
    from backends_trainer import WeightPusher

    async def build(client: Client) -> WeightPusher:
        return WeightPusher(client, checkpoint=tmp_path)

    with pytest.raises(InvalidRequestError, match=r"needs a SyncWeightPusher .* got a WeightPusher"):
        WeightSyncCallback(served.client.run(build))
    pusher = SyncWeightPusher(served.client, checkpoint=tmp_path)
    with pytest.raises(InvalidRequestError, match=r"every must be a positive int"):
        WeightSyncCallback(pusher, every=0)

    other = ClientConfig(backend="vllm", base_url=["http://vllm.test", "http://other.test"], model="tiny-qwen3")
    with pytest.raises(InvalidRequestError, match=r"does not update http://other.test"):
        grpo_kwargs(other, pusher)
    kwargs = grpo_kwargs(served.client, pusher)
    assert isinstance(kwargs["rollout_func"], BackendsRollout)
    assert [type(c) for c in kwargs["callbacks"]] == [WeightSyncCallback]
    assert kwargs["rollout_func"].client is served.client


def test_backends_trainer_imports_without_trl_and_the_trl_module_names_the_extra() -> None:
    script = (
        "import sys\n"
        "sys.modules['trl'] = sys.modules['transformers'] = None  # as if neither were installed\n"
        "import backends_trainer\n"
        "try:\n"
        "    import backends_trainer.trl\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == 'backends_trainer.trl needs TRL and transformers: pip install "backends-trainer[trl]"'
