"""The control routes of the emulated SGLang server, with the semantics and traps of 0.5.23.

* ``/pause_generation`` modes: ``abort`` ends in-flight requests (finish ``abort``), ``in_place`` freezes them,
  ``retract`` is emulated as ``in_place`` (SGLang recomputes retracted requests after continue; the tokens are
  the same, only ``num_retractions`` differs). New requests queue until ``/continue_generation``.
* ``/flush_cache`` refuses (400 ``Flush cache failed.``) while requests run, wait or are paused in place.
* A weight update asked to flush while requests are pending, and ``/release_memory_occupation`` while not idle,
  hit an assertion in SGLang's scheduler and the server dies: the emulator "crashes" too (the answer's
  connection drops and every later request is refused).
* ``/update_weights_from_disk`` rewrites ``model_path`` and ``served_model_name`` to the new checkpoint.
* ``/update_weight_version`` aborts every request unless ``abort_all_requests: false``.
* ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` only run between
  ``/begin_weight_update`` and ``/end_weight_update``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import httpx

from backends_sglang_testing._generation import Generation
from backends_sglang_testing._info import Identity
from backends_sglang_testing._replies import empty, json_reply, text_reply, validation_error
from backends_sglang_testing._weights import WeightRejected, WeightSource, WeightStore
from backends_testkit.engine import EngineRequestError, ReferenceEngine

__all__ = ["Control"]

_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)
_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
_REQUIRED = object()
_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "list": (list,),
    "str?": (str, type(None)),
    "list?": (list, type(None)),
}


def _field(body: Mapping[str, Any], key: str, kind: str, default: Any = _REQUIRED) -> Any:
    if key not in body or (body[key] is None and not kind.endswith("?")):
        if default is _REQUIRED:
            raise validation_error(f"{key}: Field required")
        return default
    value = body[key]
    if not isinstance(value, _KINDS[kind]) or (isinstance(value, bool) and kind == "int"):
        raise validation_error(f"{key}: Input should be a valid {kind.rstrip('?')}, got {value!r}")
    return value


def _success(message: str, **extra: Any) -> httpx.Response:
    return json_reply(200, {"success": True, "message": message, **extra})


def _failure(message: str, **extra: Any) -> httpx.Response:
    return json_reply(400, {"success": False, "message": message, **extra})


class Control:
    """Handlers of the control routes; each takes the decoded JSON body and returns the answer."""

    def __init__(
        self,
        engine: ReferenceEngine,
        generation: Generation,
        identity: Identity,
        weights: WeightStore,
        *,
        weight_source: WeightSource | None,
        crash: Callable[[str], NoReturn],
    ) -> None:
        self.engine = engine
        self.generation = generation
        self.identity = identity
        self.weights = weights
        self.weight_source = weight_source
        self._crash = crash
        self.update_session = False
        self.groups: dict[str, dict[str, Any]] = {}

    def _idle(self) -> bool:
        state = self.engine.state()
        return state.in_flight == 0 and state.queued == 0

    def _flush_after_update(self, flush: bool) -> None:
        if flush and not self.engine.flush_cache():
            self._crash("AssertionError: Cache flush failed after updating weights (requests were pending)")

    # -- scheduling -------------------------------------------------------------------------------------

    async def pause_generation(self, body: Mapping[str, Any]) -> httpx.Response:
        mode = _field(body, "mode", "str", "abort")
        if mode not in _PAUSE_MODES:
            raise validation_error(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
        await self.engine.pause(_PAUSE_MODES[mode])  # type: ignore[arg-type]
        return json_reply(200, {"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, body: Mapping[str, Any]) -> httpx.Response:
        _field(body, "torch_empty_cache", "bool", True)
        await self.engine.resume()
        return json_reply(200, {"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, body: Mapping[str, Any]) -> httpx.Response:
        if self.engine.flush_cache():
            return text_reply(200, _FLUSHED)
        return text_reply(400, "Flush cache failed.\n")

    async def abort_request(self, body: Mapping[str, Any]) -> httpx.Response:
        rid = _field(body, "rid", "str", "")
        self.generation.abort(rid, abort_all=_field(body, "abort_all", "bool", False))
        return empty(200)

    # -- weights ----------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, body: Mapping[str, Any]) -> httpx.Response:
        path = _field(body, "model_path", "str")
        version = _field(body, "weight_version", "str?", None)
        if _field(body, "abort_all_requests", "bool", False):
            self.engine.abort()
        try:
            self.engine.load_weights(path, flush_cache=False, weight_version=version)
        except EngineRequestError as exc:
            return _failure(f"Failed to get weights iterator: {exc}", num_paused_requests=0)
        self.weights.current = Path(path)
        self.identity.model_path = self.identity.tokenizer_path = path
        self._flush_after_update(_field(body, "flush_cache", "bool", True))
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return _success(message, num_paused_requests=0)

    async def update_weight_version(self, body: Mapping[str, Any]) -> httpx.Response:
        version = _field(body, "new_version", "str")
        if _field(body, "abort_all_requests", "bool", True):
            self.engine.abort()
        self.engine.update_weight_version(version)
        return _success(f"Weight version updated to {version}", new_version=version)

    async def begin_weight_update(self, body: Mapping[str, Any]) -> httpx.Response:
        _field(body, "selector", "str", "all")
        if self.update_session:
            return _failure("a weight-update session is already open; call end_weight_update() first")
        self.update_session = True
        return _success("Success")

    async def end_weight_update(self, body: Mapping[str, Any]) -> httpx.Response:
        if not self.update_session:
            return _failure("no weight-update session is open; call begin_weight_update() first")
        self.update_session = False
        return _success("Success")

    async def init_weights_update_group(self, body: Mapping[str, Any]) -> httpx.Response:
        group = {
            "master_address": _field(body, "master_address", "str"),
            "master_port": _field(body, "master_port", "int"),
            "rank_offset": _field(body, "rank_offset", "int"),
            "world_size": _field(body, "world_size", "int"),
            "backend": _field(body, "backend", "str", "nccl"),
        }
        name = _field(body, "group_name", "str", "weight_update_group")
        if name in self.groups:
            return _failure(f"The group {name} already exists.")
        self.groups[name] = group
        return _success("Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, body: Mapping[str, Any]) -> httpx.Response:
        name = _field(body, "group_name", "str", "weight_update_group")
        if self.groups.pop(name, None) is None:
            return _failure("The group to be destroyed does not exist.")
        return _success("Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(self, body: Mapping[str, Any]) -> httpx.Response:
        names = _field(body, "names", "list")
        dtypes = _field(body, "dtypes", "list")
        shapes = _field(body, "shapes", "list")
        group = _field(body, "group_name", "str", "weight_update_group")
        version = _field(body, "weight_version", "str?", None)
        if not len(names) == len(dtypes) == len(shapes):
            raise validation_error("names, dtypes and shapes must have the same length")
        if not self.update_session:
            return _failure(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        if group not in self.groups:
            return _failure(f"The group {group} is not initialized: call init_weights_update_group first.")
        if self.weight_source is None:
            return _failure(f"the SGLang emulator has no trainer on group {group} (pass weight_source=)")
        announced = [(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        if _field(body, "abort_all_requests", "bool", False):
            self.engine.abort()
        try:
            target = self.weights.merge(announced, self.weight_source(group, announced))
            self.engine.load_weights(target, flush_cache=False, weight_version=version)
        except (WeightRejected, EngineRequestError) as exc:
            return _failure(f"Failed to update parameter online: {exc}")
        self.weights.current = target
        self._flush_after_update(_field(body, "flush_cache", "bool", True))
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return _success(message)

    async def update_weights_from_tensor(self, body: Mapping[str, Any]) -> httpx.Response:
        _field(body, "serialized_named_tensors", "list")
        if not self.update_session:
            return _failure("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        return _failure("the SGLang emulator cannot deserialize torch tensors")

    # -- LoRA -------------------------------------------------------------------------------------------

    def _lora_answer(self, status: int, error: str = "", *, loaded: bool = True) -> httpx.Response:
        adapters = {name: str(path) for name, path in self.engine.loras.items()} if loaded else None
        return json_reply(
            status,
            {
                "rid": None,
                "http_worker_ipc": None,
                "success": status == 200,
                "error_message": error,
                "loaded_adapters": adapters,
            },
        )

    async def load_lora_adapter(self, body: Mapping[str, Any]) -> httpx.Response:
        name = _field(body, "lora_name", "str")
        path = _field(body, "lora_path", "str")
        if not self.identity.enable_lora:
            return self._lora_answer(400, "LoRA is not enabled: start the server with --enable-lora")
        if name in self.engine.loras:
            return self._lora_answer(400, f"Failed to load LoRA adapter {name} because it is already loaded")
        try:
            self.engine.load_lora(name, path)
        except EngineRequestError as exc:
            return self._lora_answer(400, f"Failed to load LoRA adapter {name}: {exc}")
        return self._lora_answer(200)

    async def unload_lora_adapter(self, body: Mapping[str, Any]) -> httpx.Response:
        name = _field(body, "lora_name", "str")
        if name not in self.engine.loras:
            names = list(self.engine.loras)
            return self._lora_answer(
                400, f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({names!r})", loaded=False
            )
        self.engine.unload_lora(name)
        return self._lora_answer(200)

    # -- memory -----------------------------------------------------------------------------------------

    async def release_memory_occupation(self, body: Mapping[str, Any]) -> httpx.Response:
        _field(body, "tags", "list?", None)
        if not self._idle():
            self._crash("AssertionError: release_memory_occupation needs an idle scheduler (requests were pending)")
        await self.engine.sleep(1, mode="abort")
        return json_reply(200, None)

    async def resume_memory_occupation(self, body: Mapping[str, Any]) -> httpx.Response:
        _field(body, "tags", "list?", None)
        await self.engine.wake()
        return json_reply(200, None)
