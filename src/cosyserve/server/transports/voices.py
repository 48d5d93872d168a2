"""Voices over the model's persistent registry, per tenant (the API key's): list, register from an upload, delete.

- ``GET /v1/audio/voices?model=``: the model's pre-defined speakers, then the voices registered for the caller's
  tenant (the pool's list, :meth:`cosyserve.engine.pool.ModelPool.voices`), each with ``id`` and ``name`` (what
  ``voice`` takes; Open WebUI's shape), ``voice_id`` (the same, as before), ``kind``, ``language`` (what the name
  states, else null), and ``consent``, ``ref_text``, ``created_at`` when it was registered here; ``aliases``: each
  OpenAI voice name -> the voice it stands for on this model (:mod:`cosyserve.engine.voicemap`). A model not
  loaded yet lists nothing (``state`` says so).
- ``POST /v1/audio/voices`` (multipart, as OpenAI's and vLLM-Omni's): ``audio_sample`` (the recording, within the
  upload limit), ``name``, ``consent`` (the speaker's consent, as the client records it: an id or a statement),
  ``ref_text`` (the recording's transcript: CosyVoice clones in zero-shot mode from the two), and optionally
  ``model`` and ``type`` (``audio_sample``). The prompt features are extracted once (the zero-shot tier) and kept
  across restarts; the voice is then usable by name as ``voice`` on every route. Answers OpenAI's voice object.
- ``DELETE /v1/audio/voices/{name}?model=``: removes a registered voice of the caller's tenant (404 when it has
  none of that name); answers OpenAI's ``audio.voice.deleted``.

A tenant never sees, uses or deletes another tenant's voices: the registry keeps one folder per tenant. Consent is
recorded in an append-only ledger beside the tenant's voices (``consent.jsonl``: who registered which recording,
its sha256, the consent given, when; and when it was deleted), which outlives the voice it is about
(:mod:`cosyserve.voices.consent`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cosyserve.core.errors import (
    ClientError,
    InternalError,
    NotReadyError,
    OverloadedError,
    RegistryError,
    shown,
)
from cosyserve.engine.voicemap import is_openai_voice, language_of
from cosyserve.server.errors import VoiceNotFoundError
from cosyserve.server.schemas import MAX_NAME_CHARS
from cosyserve.server.transports.reference_api import form_file, form_text, read_form
from cosyserve.voices.consent import ConsentLedger

if TYPE_CHECKING:
    from cosyserve.runtime import Runtime

__all__ = ["FIELDS", "PARAMS", "routes"]

# the runtime's field names -> this route's
PARAMS = {"prompt_wav": "audio_sample", "prompt_text": "ref_text", "speaker": "name"}
FIELDS = ("audio_sample", "name", "consent", "ref_text", "model", "type")


def _ledger(runtime: Runtime) -> ConsentLedger:
    root = runtime.registry_root
    if root is None:
        raise RegistryError("this model has no voice registry")
    return ConsentLedger(root)


def _voice_object(entry: dict[str, Any]) -> dict[str, Any]:
    """A registration record as OpenAI's voice object (``audio.voice``), with what cosyserve keeps besides."""
    return {
        "id": entry["name"],
        "object": "audio.voice",
        "name": entry["name"],
        "type": "audio_sample",
        "created_at": entry["created_at"],
        "consent": entry["consent"],
        "ref_text": entry["ref_text"],
        "model": entry["model"],
    }


async def _runtime_of(state: Any, model: str) -> Runtime:
    engine = await state.pool.load(model)  # at once when it is loaded; else loaded, as a request would
    runtime = engine.runtime
    assert runtime is not None, "a loaded engine holds its runtime"
    return runtime


async def _list_voices(state: Any, request: Request) -> Response:
    tenant = state.tenant_of(request)
    model = state.resolve_model(request.query_params.get("model"), tenant)
    listed = state.pool.voices(model, tenant)
    voices: list[dict[str, Any]] = []
    if listed is not None:  # none while the model is not loaded
        kept = {}
        eng = state.pool.engine(model)
        runtime = eng.runtime if eng is not None else None
        if runtime is not None and runtime.registry_root is not None:
            kept = await asyncio.to_thread(_ledger(runtime).current, tenant or "default")
        for v in listed.voices:
            item: dict[str, Any] = {
                "id": v.name,
                "name": v.name,
                "voice_id": v.name,
                "kind": v.kind,
                "language": language_of(v.name),
            }
            entry = kept.get(v.name) if v.kind == "registered" else None
            if entry is not None:
                item |= {k: entry[k] for k in ("consent", "ref_text", "created_at")}
            voices.append(item)
    return JSONResponse(
        {
            "model": model,
            "state": state.describe_models()[model]["state"],
            "voices": voices,
            "aliases": listed.openai if listed is not None else {},
        }
    )


async def _read_voice_form(request: Request, cfg: Any) -> tuple[str, str, str, str | None, bytes]:
    """The registration form's name, consent, ref_text, model and audio_sample, each checked alone."""
    form = await read_form(request, cfg, files=1, types=("multipart/form-data",))
    try:
        unknown = sorted(set(form.keys()) - set(FIELDS))
        if unknown:
            raise ClientError(
                f"unknown form field {shown(unknown[0])}; accepted: {', '.join(FIELDS)}",
                param=unknown[0][:64],
            )
        name = form_text(form, "name")
        consent = form_text(form, "consent")
        ref_text = form_text(form, "ref_text")
        kind = form_text(form, "type", required=False)
        model_name = form_text(form, "model", required=False)
        audio = await form_file(form, "audio_sample", cfg.max_upload_bytes)
    finally:
        await form.close()
    assert name is not None and consent is not None and ref_text is not None
    if kind not in (None, "audio_sample"):
        raise ClientError(
            f"type {shown(kind)} is not supported: voices are made from an audio_sample", param="type"
        )
    return name, consent, ref_text, model_name, audio


def _check_new_voice(state: Any, name: str, consent: str, ref_text: str, audio: bytes) -> None:
    # the name, transcript and sample within the limits every request's are (cosyserve.core.limits): a voice whose
    # name no request may give could never speak
    state.limits.check(names=PARAMS, speaker=name, prompt_text=ref_text, prompt_wav=audio)
    from cosyserve.voices.registry import validate_name

    try:
        validate_name(name)
    except RegistryError as e:
        raise RegistryError(str(e), param="name") from None
    if is_openai_voice(name):
        raise ClientError(
            f"{shown(name)} is an OpenAI voice name, which stands for one of the model's voices: choose another "
            "name",
            param="name",
        )
    if len(consent) > MAX_NAME_CHARS:
        raise ClientError(f"consent is {len(consent)} characters; at most {MAX_NAME_CHARS}", param="consent")


async def _create_voice(state: Any, registering: asyncio.Lock, request: Request) -> Response:
    if state.draining:
        raise NotReadyError("the server is shutting down")
    tenant = state.tenant_of(request) or "default"
    name, consent, ref_text, model_name, audio = await _read_voice_form(request, state.config)
    _check_new_voice(state, name, consent, ref_text, audio)
    model = state.resolve_model(model_name, tenant, param="model")
    runtime = await _runtime_of(state, model)
    ledger = _ledger(runtime)
    if runtime.voice(name, tenant) is not None:
        raise ClientError(
            f"the name {shown(name)} is taken (a speaker of the model, or a voice registered for this API key): "
            "delete it first or choose another",
            param="name",
            code="voice_exists",
        )
    if registering.locked():
        raise OverloadedError("another voice is being registered: try again in a moment", retry_after=1.0)
    async with registering:
        await asyncio.to_thread(runtime.add_voice, name, audio, ref_text, tenant=tenant)
    entry = {
        "event": "create",
        "name": name,
        "tenant": tenant,
        "model": model,
        "consent": consent,
        "ref_text": ref_text,
        "created_at": int(time.time()),
        "audio_bytes": len(audio),
        "audio_sha256": hashlib.sha256(audio).hexdigest(),
        "request_id": request.headers.get("x-request-id"),
    }
    try:
        await asyncio.to_thread(ledger.record, tenant, entry)
    except OSError as e:  # no voice without its consent record
        await asyncio.to_thread(runtime.remove_voice, name, tenant=tenant)
        raise InternalError(
            f"cannot record the consent of voice {name!r}: {e}",
            public="cannot record the consent of the voice; it was not registered (details in the server log)",
        ) from e
    return JSONResponse(_voice_object(entry))


async def _delete_voice(state: Any, request: Request) -> Response:
    tenant = state.tenant_of(request) or "default"
    name = request.path_params["name"]
    model = state.resolve_model(request.query_params.get("model"), state.tenant_of(request))
    runtime = await _runtime_of(state, model)
    voice = runtime.voice(name, tenant)
    if voice is None:
        raise VoiceNotFoundError(f"no voice {shown(name)} is registered for this API key", param="name")
    if voice.kind != "registered":
        raise ClientError(f"{shown(name)} is a speaker of the model: it cannot be deleted", param="name")
    await asyncio.to_thread(runtime.remove_voice, name, tenant=tenant)
    entry = {
        "event": "delete",
        "name": name,
        "tenant": tenant,
        "model": model,
        "deleted_at": int(time.time()),
    }
    await asyncio.to_thread(_ledger(runtime).record, tenant, entry)
    return JSONResponse({"id": name, "object": "audio.voice.deleted", "deleted": True})


def routes(state: Any) -> list[Route]:
    registering = asyncio.Lock()  # one extraction at a time per process: it takes a core for about a second

    async def voices(request: Request) -> Response:
        if request.method == "POST":
            return await _create_voice(state, registering, request)
        return await _list_voices(state, request)

    async def delete_voice(request: Request) -> Response:
        return await _delete_voice(state, request)

    return [
        Route("/v1/audio/voices", voices, methods=["GET", "POST"]),
        Route("/v1/audio/voices/{name}", delete_voice, methods=["DELETE"]),
    ]
