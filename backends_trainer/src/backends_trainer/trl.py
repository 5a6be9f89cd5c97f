"""TRL's ``GRPOTrainer`` on any backend: generation through a :class:`~backends_core.SyncClient`, weights pushed
back after every optimizer step.

Two of TRL's own extension points carry it, and nothing of TRL is patched:

* ``rollout_func`` (:class:`BackendsRollout`): TRL hands it the prompts of one generation batch, each repeated
  ``num_generations`` times in a row, and takes back one row per prompt: ``prompt_ids``, ``completion_ids`` and
  ``logprobs`` (the engine's own, one per completion id). Each run of equal prompts is one
  ``client.generate_group`` (one rendering, one server, its prefix cache holding the prompt once), all runs of a
  batch concurrently. Any other field of the returned dict reaches the reward functions as a keyword argument:
  ``weight_version`` (which weights generated each row) and ``finish_reason``.
* a callback (:class:`WeightSyncCallback`): after each optimizer step, ``model.state_dict()`` goes to every
  server with a :class:`~backends_trainer.sync.SyncWeightPusher` as version ``step-<global_step>``, over a group
  or through a checkpoint directory, as the pusher was built.

``GRPOConfig(use_vllm=False)`` (its default) is what this runs under: TRL's ``use_vllm=True`` means TRL's own
vLLM client, which needs vLLM importable and a ``trl vllm-serve`` server, and syncs weights its own way. The
consequence, in TRL 1.16: the vLLM importance-sampling correction (``vllm_importance_sampling_correction``) is
applied only under ``use_vllm=True``, so with a rollout function the sampling logprobs feed TRL's off-policy
sequence mask (``off_policy_mask_threshold``) and nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from backends_core import Client, ClientConfig, SamplingParams, SyncClient
from backends_core.errors import InvalidRequestError
from backends_core.types import GenerateResult
from backends_trainer.checkpoint import CheckpointDir
from backends_trainer.pusher import PushReport, WeightPusher
from backends_trainer.sync import SyncWeightPusher

try:
    import torch.distributed as dist
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only where transformers is missing
    raise ImportError('backends_trainer.trl needs TRL and transformers: pip install "backends-trainer[trl]"') from exc

# CheckpointDir and SyncWeightPusher are re-exported: a TRL script imports everything it needs from here
__all__ = ["BackendsRollout", "CheckpointDir", "SyncWeightPusher", "WeightSyncCallback", "grpo_kwargs"]

#: Seeds of different training processes lie this far apart, so their groups never share a seed.
_PROCESS_SEED_STRIDE = 1 << 24


class BackendsRollout:
    """TRL's ``rollout_func``: every prompt's group generated through ``client.generate_group``.

    ::

        rollout = BackendsRollout(client)            # a SyncClient, or a ClientConfig to build one
        trainer = GRPOTrainer(..., rollout_func=rollout)

    A prompt is chat messages (rendered by the client with the server's chat template and
    ``GRPOConfig.chat_template_kwargs``), token ids (sent as they are), or text (tokenized by the trainer's
    ``processing_class`` as TRL tokenizes text prompts, no chat template).

    :param client: the fleet to generate on: a :class:`~backends_core.SyncClient`, or a
        :class:`~backends_core.ClientConfig` for a client this rollout owns (and :meth:`close` closes).
    :param sampling: the sampling to use. ``None``: built from the trainer's ``GRPOConfig`` at each call
        (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``).
        Given, its ``temperature`` must be the config's (TRL scores completions at that temperature) and its
        ``max_tokens`` at most ``max_completion_length``; engine fields TRL's ``generation_kwargs`` would carry go
        in its ``extra``.
    :param seed: ``None``: unseeded samples. An int: the groups of a run are drawn with consecutive seeds from it
        (sample ``i`` of a group with seed ``s`` is drawn with ``s + i``; no two samples share a seed), so a run
        that restarts from the same seed generates the same completions where the engine is deterministic.
    :param num_generations: the group size the trainer must use, checked at each call; ``None``: the trainer's.
    """

    def __init__(
        self,
        client: SyncClient | ClientConfig,
        *,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        num_generations: int | None = None,
    ) -> None:
        if isinstance(client, ClientConfig):
            self.client = SyncClient(client)
            self._owned = True
        elif isinstance(client, SyncClient):
            self.client = client
            self._owned = False
        elif isinstance(client, Client):
            raise InvalidRequestError(
                "BackendsRollout needs a backends_core.SyncClient (TRL generates from synchronous code), got an "
                "async Client: build a SyncClient from the same config"
            )
        else:
            raise InvalidRequestError(
                f"BackendsRollout needs a backends_core.SyncClient or a ClientConfig, got {type(client).__name__}"
            )
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling is not None and sampling.seed is not None:
            raise InvalidRequestError(
                f"sampling.seed is {sampling.seed}: every group would be drawn with the same seeds; pass "
                "BackendsRollout(seed=...) instead, which gives each group its own"
            )
        if sampling is not None and sampling.n != 1:
            raise InvalidRequestError(f"sampling.n must stay 1 (the group size is num_generations), got {sampling.n}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise InvalidRequestError(f"seed must be a non-negative int or None, got {seed!r}")
        if num_generations is not None and (
            not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations < 1
        ):
            raise InvalidRequestError(f"num_generations must be a positive int or None, got {num_generations!r}")
        self.sampling = sampling
        self.seed = seed
        self.num_generations = num_generations
        self._drawn = 0  # samples drawn so far: the next group's seed offset

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Generate one completion per entry of ``prompts`` (TRL repeats each prompt ``num_generations`` times in
        a row) and return TRL's rollout dict, rows in the order of ``prompts``.

        :param trainer: the ``trl.GRPOTrainer`` calling (its config decides the sampling and the group size).
        :raises InvalidRequestError: the trainer is configured in a way this cannot serve (named), or a prompt is
            neither messages, ids nor text (nothing is sent).
        """
        sampling = self._sampling(trainer)
        runs = _runs(prompts)
        mode_generations = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        if self.num_generations is not None and self.num_generations != mode_generations:
            raise InvalidRequestError(
                f"BackendsRollout was built for num_generations={self.num_generations} but the trainer uses "
                f"{mode_generations} (GRPOConfig.num_generations{'' if trainer.model.training else '_eval'})"
            )
        requests = [self._request(prompt, trainer, index) for index, prompt in runs]
        seeds = self._seeds([count for count, _ in requests], trainer)
        template_kwargs = dict(trainer.chat_template_kwargs or {}) or None

        async def generate(client: Client) -> list[list[GenerateResult]]:
            return await asyncio.gather(
                *(
                    client.generate_group(
                        n=count,
                        sampling=attrs.evolve(sampling, seed=seed),
                        chat_template_kwargs=template_kwargs if "messages" in request else None,
                        **request,
                    )
                    for (count, request), seed in zip(requests, seeds, strict=True)
                )
            )

        groups = self.client.run(generate)
        samples = [sample for group in groups for sample in group]
        return {
            "prompt_ids": [list(s.prompt_ids) for s in samples],
            "completion_ids": [list(s.completion_ids) for s in samples],
            "logprobs": [s.logprobs.astype(float).tolist() for s in samples],
            "weight_version": [s.weight_version for s in samples],
            "finish_reason": [s.finish_reason for s in samples],
        }

    def close(self) -> None:
        """Close the client if this rollout built it."""
        if self._owned:
            self.client.close()

    # -- what to send ---------------------------------------------------------------------------------

    def _sampling(self, trainer: Any) -> SamplingParams:
        if trainer.use_vllm:
            raise InvalidRequestError(
                "GRPOConfig.use_vllm is True: TRL would generate and sync weights through its own vLLM client; "
                "set use_vllm=False (the default) to generate with BackendsRollout"
            )
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise InvalidRequestError(
                "the trainer has tools or an environment_factory: TRL would run the tool turns with its own "
                "generation after the rollout; BackendsRollout generates single-turn completions only"
            )
        generation_kwargs = trainer.args.generation_kwargs
        max_tokens = trainer.max_completion_length
        if self.sampling is None:
            if generation_kwargs:
                raise InvalidRequestError(
                    f"GRPOConfig.generation_kwargs {sorted(generation_kwargs)} cannot be mapped to an engine: pass "
                    "BackendsRollout(sampling=SamplingParams(..., extra={...})) with the engine's own field names"
                )
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise InvalidRequestError(
                    f"GRPOConfig.max_completion_length must be a positive int to bound generation, got {max_tokens!r}"
                )
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=float(trainer.temperature),
                top_p=float(trainer.top_p),
                top_k=int(trainer.top_k) if trainer.top_k else -1,
                min_p=float(trainer.min_p or 0.0),
                repetition_penalty=float(trainer.repetition_penalty),
            )
        if self.sampling.temperature != trainer.temperature:
            raise InvalidRequestError(
                f"sampling.temperature is {self.sampling.temperature} but GRPOConfig.temperature is "
                f"{trainer.temperature}: TRL scores the completions at its own temperature, so both must agree"
            )
        if isinstance(max_tokens, int) and self.sampling.max_tokens > max_tokens:
            raise InvalidRequestError(
                f"sampling.max_tokens is {self.sampling.max_tokens}, more than GRPOConfig.max_completion_length "
                f"({max_tokens})"
            )
        return self.sampling

    def _request(self, prompt: Any, trainer: Any, index: int) -> tuple[int, dict[str, Any]]:
        count, value = prompt
        if isinstance(value, str):
            ids = trainer.processing_class(text=[value])["input_ids"][0]
            return count, {"prompt_ids": [int(i) for i in ids]}
        if _is_ids(value):
            return count, {"prompt_ids": [int(i) for i in value]}
        if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
            return count, {"messages": list(value)}
        raise InvalidRequestError(
            f"prompts[{index}] must be chat messages (a list of dicts), token ids or text, got {value!r:.80}"
        )

    def _seeds(self, counts: list[int], trainer: Any) -> list[int | None]:
        if self.seed is None:
            return [None] * len(counts)
        base = self.seed + trainer.accelerator.process_index * _PROCESS_SEED_STRIDE + self._drawn
        offsets = [0, *itertools.accumulate(counts)]
        self._drawn += offsets[-1]
        return [base + offset for offset in offsets[:-1]]


class WeightSyncCallback(TrainerCallback):
    """After each optimizer step (every ``every``-th), push the trained model's weights to every server with
    ``pusher``: ``pusher.push(model.state_dict(), version=f"step-{global_step}")``.

    The pusher decides the path: a :class:`~backends_trainer.sync.SyncWeightPusher` built with ``group=`` joins
    the group when training begins (unless started already) and leaves it when training ends (a ``Trainer`` that
    raises never calls ``on_train_end``: to leave the group whatever happens, run ``trainer.train()`` inside
    ``with pusher:``); one built with ``checkpoint=`` writes a directory per version. Only the main process
    pushes; other processes wait for it (when ``torch.distributed`` is initialized), so no process generates the
    next batch from old weights. A push that fails raises its :class:`~backends_core.errors.AdminError` out of
    ``trainer.train()``.

    :param pusher: the pusher (a :class:`SyncWeightPusher`; an async :class:`WeightPusher` is refused).
    :param every: push after every ``every``-th optimizer step (the last step always pushes).
    :param push_at_start: also push the initial weights as ``step-0`` when training begins, so the first batch
        is generated from exactly the trainer's weights.
    :ivar reports: every push's :class:`~backends_trainer.pusher.PushReport`, in order.
    """

    def __init__(self, pusher: SyncWeightPusher, *, every: int = 1, push_at_start: bool = False) -> None:
        if isinstance(pusher, WeightPusher):
            raise InvalidRequestError(
                "WeightSyncCallback needs a SyncWeightPusher (TRL's training loop is synchronous), got a "
                "WeightPusher: build SyncWeightPusher(sync_client, ...) with the same arguments"
            )
        if not isinstance(pusher, SyncWeightPusher):
            raise InvalidRequestError(f"pusher must be a SyncWeightPusher, got {type(pusher).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidRequestError(f"every must be a positive int, got {every!r}")
        self.pusher = pusher
        self.every = every
        self.push_at_start = push_at_start
        self.reports: list[PushReport] = []
        self._started_here = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and not self.pusher.pusher.started:
            self.pusher.start()
            self._started_here = True
        if self.push_at_start:
            self._push(state, model, 0)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        step = state.global_step
        if step % self.every == 0 or step >= state.max_steps:
            self._push(state, model, step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._started_here:
            self._started_here = False
            self.pusher.close()

    def _push(self, state: Any, model: Any, step: int) -> None:
        if model is None:
            raise InvalidRequestError("the trainer passed no model to WeightSyncCallback: nothing to push")
        if state.is_world_process_zero:
            self.reports.append(self.pusher.push(model.state_dict(), version=f"step-{step}"))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def grpo_kwargs(
    client: SyncClient | ClientConfig,
    pusher: SyncWeightPusher | None = None,
    *,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    every: int = 1,
    push_at_start: bool = False,
) -> dict[str, Any]:
    """What to add to ``GRPOTrainer(...)``: ``rollout_func`` (a :class:`BackendsRollout` over ``client``) and
    ``callbacks`` (a :class:`WeightSyncCallback` over ``pusher``, when given)::

        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
                              **grpo_kwargs(client, SyncWeightPusher(client, checkpoint="/shared/ckpt")))

    :raises InvalidRequestError: a bad argument, or a pusher whose fleet lacks servers ``client`` generates on
        (they would go on serving old weights).
    """
    rollout = BackendsRollout(client, sampling=sampling, seed=seed)
    kwargs: dict[str, Any] = {"rollout_func": rollout}
    if pusher is not None:
        callback = WeightSyncCallback(pusher, every=every, push_at_start=push_at_start)
        missing = sorted(set(rollout.client.base_urls) - set(pusher.client.base_urls))
        if missing:
            rollout.close()
            raise InvalidRequestError(
                f"the pusher does not update {', '.join(missing)}, where the rollout generates: those servers "
                "would keep serving the old weights"
            )
        kwargs["callbacks"] = [callback]
    return kwargs


def _runs(prompts: Sequence[Any]) -> list[tuple[int, tuple[int, Any]]]:
    """Consecutive equal prompts, as ``(index of the first, (count, prompt))``."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        raise InvalidRequestError(f"prompts must be a non-empty list, got {prompts!r:.80}")
    runs: list[tuple[int, tuple[int, Any]]] = []
    for index, prompt in enumerate(prompts):
        if runs and runs[-1][1][1] == prompt:
            first, (count, value) = runs[-1]
            runs[-1] = (first, (count + 1, value))
        else:
            runs.append((index, (1, prompt)))
    return runs


def _is_ids(value: Any) -> bool:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence) or not value:
        return False
    return all(isinstance(i, int) and not isinstance(i, bool) for i in value)
