"""SGLang's and vLLM's extension fields on the OpenAI routes, and the unknown-field policy.

Routers and clients written for SGLang or vLLM send their own fields with every OpenAI request (SGLang's
router re-serialises a chat request with ``no_stop_trim``, ``skip_special_tokens``,
``separate_reasoning``, ``stream_reasoning``, ``continue_final_message``, ``return_hidden_states``...).
Their meaning here:

- ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
  ``skip_special_tokens``, ``spaces_between_special_tokens``: the ``SamplingParams`` fields of the
  same names (``server/sampling.py``).
- ``no_stop_trim``: keep the matched stop string in the output (``include_stop_str_in_output``).
- ``regex`` / ``ebnf``: a structured-output constraint, like ``guided_regex`` / ``guided_grammar``.
- ``chat_template_kwargs``, ``continue_final_message``: passed to the chat template.
- ``separate_reasoning``: false keeps the model's reasoning in ``content`` although the server runs a
  reasoning parser; ``stream_reasoning`` false (stream reasoning only at the end) is refused while a
  reasoning parser splits a stream.
- ``rid``: the request's id, so SGLang's ``POST /abort_request {"rid"}`` ends it; 400 while a running
  request already has it.
- ``lora_path``, ``return_hidden_states``, ``use_beam_search``, ``allowed_token_ids``, ``bad_words``,
  ``truncate_prompt_tokens``: 400 naming the field when set (nothing here serves them).

Unknown top-level fields follow ``ServerSettings.unknown_fields``: ``reject`` (the default) answers 400
``<name>: unrecognized request argument``; ``warn`` logs their names (never their values), answers
normally and lists them, comma-separated, in the ``X-Ignored-Fields`` response header.
"""

from __future__ import annotations

import logging

from starlette.responses import Response

from tokenmill.server.context import ServerContext
from tokenmill.server.errors import bad_request
from tokenmill.server.native_protocol import unsupported_fields_set
from tokenmill.server.openai_protocol import SamplingRequest

logger = logging.getLogger(__name__)

UNKNOWN_FIELD_POLICIES = ("reject", "warn")
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"


def check_unknown_fields(body: SamplingRequest, policy: str) -> list[str]:
    """The unknown top-level fields ``body`` carries, to ignore (``warn``); 400 under ``reject``."""
    unknown = sorted(body.model_extra or {})
    if not unknown:
        return []
    if policy == "reject":
        raise bad_request(f"{unknown[0]}: unrecognized request argument", param=unknown[0])
    logger.warning("ignoring unrecognized request arguments: %s", ", ".join(unknown))
    return unknown


def with_ignored_fields(response: Response, ignored: list[str]) -> Response:
    """``response`` with the ``X-Ignored-Fields`` header when fields were ignored."""
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = ",".join(ignored)
    return response


def check_extensions(body: SamplingRequest, ctx: ServerContext) -> None:
    """400 for an extension field that is set but cannot be honoured here."""
    unsupported = unsupported_fields_set(body)
    if unsupported:
        name = unsupported[0]
        raise bad_request(f"{name} is not supported by this server", param=name)
    if body.rid is not None:
        if not body.rid:
            raise bad_request("rid must not be empty", param="rid")
        if any(rid == body.rid or rid.startswith(f"{body.rid}-p") for rid in ctx.engine.request_ids):
            raise bad_request(f"rid {body.rid!r} is already used by a running request", param="rid")


def request_id_for(body: SamplingRequest, ctx: ServerContext, prefix: str) -> str:
    """The client's ``rid`` when given, else a fresh ``{prefix}-...`` id."""
    return body.rid if body.rid else ctx.new_request_id(prefix)
