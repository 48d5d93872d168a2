"""The reference CosyVoice FastAPI server's endpoints, so its client works against us unchanged.

``/inference_sft`` (tts_text, spk_id), ``/inference_zero_shot`` (tts_text, prompt_text, prompt_wav file),
``/inference_cross_lingual`` (tts_text, prompt_wav), ``/inference_instruct`` (tts_text, spk_id, instruct_text);
GET and POST, form fields (multipart or urlencoded; the reference client sends a GET with a form body). The
response is the reference's: raw int16 PCM at the model's rate, one piece per sentence (its ``stream=False``).
The default model serves them; ``X-Model`` (a header) picks another.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cosyserve.errors import CosyserveError
from cosyserve.server.errors import HTTPError, from_engine_error
from cosyserve.server.openai_api import unknown_voice, voice_known
from cosyserve.server.synth import engine_request, new_request_id, synthesize_response

__all__ = ["routes"]

# endpoint -> (mode, text fields, file fields)
_ENDPOINTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "sft": ("sft", ("tts_text", "spk_id"), ()),
    "zero_shot": ("zero_shot", ("tts_text", "prompt_text"), ("prompt_wav",)),
    "cross_lingual": ("cross_lingual", ("tts_text",), ("prompt_wav",)),
    "instruct": ("instruct", ("tts_text", "spk_id", "instruct_text"), ()),
}
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
# the engine's request fields -> the form's (prompt_wav, prompt_text and instruct_text are named alike)
_PARAMS = {"text": "tts_text", "speaker": "spk_id"}


def routes(state: Any) -> list[Route]:
    cfg = state.config

    def make(endpoint: str) -> Any:
        mode, text_fields, file_fields = _ENDPOINTS[endpoint]

        async def handler(request: Request) -> Response:
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype not in _FORM_TYPES:
                raise HTTPError(
                    415,
                    f"send the fields as a form ({' or '.join(_FORM_TYPES)}), got {ctype or 'no content type'!r}",
                )
            declared = request.headers.get("content-length")
            if (
                declared is not None
                and declared.isdigit()
                and int(declared) > cfg.max_upload_bytes + (1 << 20)
            ):
                raise HTTPError(
                    413, f"the body is {declared} bytes; uploads are limited to {cfg.max_upload_bytes}"
                )
            try:
                form = await request.form(
                    max_files=len(file_fields) or 1, max_fields=16, max_part_size=cfg.max_upload_bytes
                )
            except HTTPError:
                raise
            except Exception as e:  # noqa: BLE001 - multipart parser errors: a malformed body
                raise HTTPError(400, f"cannot parse the form: {getattr(e, 'detail', e)}") from None
            try:
                values: dict[str, Any] = {}
                for name in text_fields:
                    v = form.get(name)
                    if v is None:
                        raise HTTPError(400, f"form field {name} is required", param=name)
                    if not isinstance(v, str):
                        raise HTTPError(400, f"form field {name} must be text, not a file", param=name)
                    if not v.strip():
                        raise HTTPError(400, f"form field {name} is empty", param=name)
                    if len(v) > cfg.max_text_chars:
                        raise HTTPError(
                            400,
                            f"{name} is {len(v)} characters; the limit is {cfg.max_text_chars}",
                            param=name,
                        )
                    values[name] = v
                for name in file_fields:
                    f = form.get(name)
                    if not isinstance(f, UploadFile):
                        raise HTTPError(400, f"form field {name} must be an uploaded audio file", param=name)
                    data = await f.read(cfg.max_upload_bytes + 1)
                    if len(data) > cfg.max_upload_bytes:
                        raise HTTPError(
                            413,
                            f"{name} is over the upload limit of {cfg.max_upload_bytes} bytes",
                            param=name,
                        )
                    if not data:
                        raise HTTPError(400, f"{name} is an empty file", param=name)
                    values[name] = data
            finally:
                await form.close()
            tenant = state.tenant_of(request)
            model = state.resolve_model(request.headers.get("x-model"), tenant, param="X-Model")
            eng = state.pool.engine(model)
            if "spk_id" in values and eng is not None and voice_known(eng, values["spk_id"], tenant) is False:
                raise unknown_voice(values["spk_id"], model, "spk_id")
            fields: dict[str, Any] = {}
            for src, dst in (
                ("prompt_text", "prompt_text"),
                ("prompt_wav", "prompt_wav"),
                ("instruct_text", "instruct_text"),
            ):
                if src in values:
                    fields[dst] = values[src]
            ereq = engine_request(
                state,
                new_request_id(request),
                text=values["tts_text"],
                speaker=values.get("spk_id"),
                mode=mode,
                stream=False,
                tenant=tenant,
                **fields,
            )
            try:
                return await synthesize_response(
                    state,
                    request,
                    route=f"/inference_{endpoint}",
                    model=model,
                    ereq=ereq,
                    fmt="raw",
                    tenant=tenant,
                )
            except CosyserveError as e:
                raise from_engine_error(e, _PARAMS) from e

        return handler

    return [Route(f"/inference_{ep}", make(ep), methods=["GET", "POST"]) for ep in _ENDPOINTS]
