"""The reference CosyVoice FastAPI server's endpoints, so its client works against us unchanged.

``/inference_sft`` (tts_text, spk_id), ``/inference_zero_shot`` (tts_text, prompt_text, prompt_wav file),
``/inference_cross_lingual`` (tts_text, prompt_wav), ``/inference_instruct`` (tts_text, spk_id, instruct_text),
and CosyVoice2's ``/inference_instruct2`` (tts_text, instruct_text, prompt_wav);
GET and POST, form fields (multipart or urlencoded; the reference client sends a GET with a form body; a urlencoded
form is read as UTF-8, raw or percent-encoded, as browsers and curl send it). The
response is the reference's: raw int16 PCM at the model's rate, one piece per sentence (its ``stream=False``).
The default model serves them; ``X-Model`` (a header) picks another.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cosyserve.core.errors import (
    ClientError,
    CosyserveError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    shown,
)
from cosyserve.server.audiofile import RAW
from cosyserve.server.responses import synthesize_response
from cosyserve.server.synth import caller, order
from cosyserve.server.transports.openai_api import read_body

__all__ = ["ENDPOINTS", "PARAMS", "form_file", "form_text", "read_form", "routes"]

# endpoint -> (mode, text fields, file fields)
ENDPOINTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "sft": ("sft", ("tts_text", "spk_id"), ()),
    "zero_shot": ("zero_shot", ("tts_text", "prompt_text"), ("prompt_wav",)),
    "cross_lingual": ("cross_lingual", ("tts_text",), ("prompt_wav",)),
    "instruct": ("instruct", ("tts_text", "spk_id", "instruct_text"), ()),
    "instruct2": ("instruct2", ("tts_text", "instruct_text"), ("prompt_wav",)),
}
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
# the engine's request fields -> the form's (prompt_wav, prompt_text and instruct_text are named alike)
PARAMS = {"text": "tts_text", "speaker": "spk_id"}
_MAX_FIELDS = 16


def parse_urlencoded(body: bytes) -> FormData:
    """An ``application/x-www-form-urlencoded`` body, as UTF-8 (raw bytes and %-escapes alike).

    Starlette reads the raw bytes as latin-1, so ``tts_text=你好`` as curl sends it arrived as mojibake.

    Raises:
        ClientError: bytes or %-escapes that are not UTF-8, or more than 16 fields.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClientError(
            f"the form is not UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}): send it as UTF-8, as "
            "browsers do",
            code="invalid_form",
        ) from None
    try:
        pairs = parse_qsl(text, keep_blank_values=True, errors="strict", max_num_fields=_MAX_FIELDS)
    except UnicodeDecodeError:
        raise ClientError(
            "a %-escaped value of the form is not UTF-8: send it as UTF-8, as browsers do",
            code="invalid_form",
        ) from None
    except ValueError:  # more fields than max_num_fields
        raise ClientError(f"the form has more than {_MAX_FIELDS} fields", code="invalid_form") from None
    return FormData(pairs)


async def read_form(
    request: Request, config: Any, *, files: int, types: tuple[str, ...] = _FORM_TYPES
) -> FormData:
    """The form of ``request`` (one of ``types``), with at most ``files`` files, each within the upload limit.

    Raises:
        UnsupportedMediaTypeError: another content type.
        PayloadTooLargeError: a declared body or a part over the upload limit.
        ClientError: a malformed body.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in types:
        raise UnsupportedMediaTypeError(
            f"send the fields as a form ({' or '.join(types)}), got "
            f"{shown(ctype) if ctype else 'no content type'}",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > config.max_upload_bytes + (1 << 20):
        raise PayloadTooLargeError(
            f"the body is {declared} bytes; uploads are limited to {config.max_upload_bytes}"
        )
    try:
        if ctype == "application/x-www-form-urlencoded":
            return parse_urlencoded(await read_body(request, config.max_body_bytes))
        return await request.form(
            max_files=files or 1, max_fields=_MAX_FIELDS, max_part_size=config.max_upload_bytes
        )
    except CosyserveError:
        raise
    except Exception as e:  # noqa: BLE001 - multipart parser errors: a malformed body
        raise ClientError(f"cannot parse the form: {getattr(e, 'detail', e)}") from None


def form_text(form: FormData, name: str, *, required: bool = True) -> str | None:
    """Form field ``name`` as text: None when absent and not ``required``.

    Raises:
        ClientError: absent (when required), a file, or blank.
    """
    v = form.get(name)
    if v is None:
        if required:
            raise ClientError(f"form field {name} is required", param=name)
        return None
    if not isinstance(v, str):
        raise ClientError(f"form field {name} must be text, not a file", param=name)
    if not v.strip():
        raise ClientError(f"form field {name} is empty", param=name)
    return v


async def form_file(form: FormData, name: str, limit: int) -> bytes:
    """The bytes of the form's uploaded file ``name``.

    Raises:
        ClientError: not a file, or an empty one.
        PayloadTooLargeError: over ``limit`` bytes.
    """
    f = form.get(name)
    if not isinstance(f, UploadFile):
        raise ClientError(f"form field {name} must be an uploaded audio file", param=name)
    data = await f.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLargeError(f"{name} is over the upload limit of {limit} bytes", param=name)
    if not data:
        raise ClientError(f"{name} is an empty file", param=name)
    return data


def routes(state: Any) -> list[Route]:
    cfg = state.config

    def make(endpoint: str) -> Any:
        mode, text_fields, file_fields = ENDPOINTS[endpoint]

        async def handler(request: Request) -> Response:
            form = await read_form(request, cfg, files=len(file_fields))
            try:
                values: dict[str, Any] = {name: form_text(form, name) for name in text_fields}
                for name in file_fields:
                    values[name] = await form_file(form, name, cfg.max_upload_bytes)
            finally:
                await form.close()
            fields = {f: values[f] for f in ("prompt_text", "prompt_wav", "instruct_text") if f in values}
            asked = order(
                state,
                **caller(state, request),
                params=PARAMS,
                model=request.headers.get("x-model"),
                model_param="X-Model",
                fmt=RAW,
                formats=(RAW,),
                mode=mode,
                text=values["tts_text"],
                speaker=values.get("spk_id"),
                stream=False,
                **fields,
            )
            return await synthesize_response(state, request, route=f"/inference_{endpoint}", order=asked)

        return handler

    return [Route(f"/inference_{ep}", make(ep), methods=["GET", "POST"]) for ep in ENDPOINTS]
