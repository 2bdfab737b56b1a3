"""``ServerSettings``: how the HTTP server behaves. A module of its own with no heavy imports, so that
``tokenmill serve`` can read its arguments and start the engine process before importing the server
(FastAPI, transformers, torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServerSettings:
    """How the HTTP server behaves (the engine's own settings live in ``EngineConfig``)."""

    model: str
    served_model_names: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_requests: bool = False
    log_level: str = "info"
    access_log: bool = False
    engine_start_timeout: float = 600.0
    shutdown_timeout: float = 5.0
    header_timeout: float = 10.0  # a connection must send a whole request head within this
    body_timeout: float = 60.0  # ...and then the whole body within this (408 otherwise)
    engine_death_exit_delay: float = 5.0  # 503s for this long after the engine dies, then exit 1
    tool_call_parser: str | None = None  # None: detected from the chat template / architecture
    reasoning_parser: str | None = None  # None: reasoning stays in the content
    webui: bool = True  # the chat page at / and the dashboard at /dashboard (--no-webui: off)
    unknown_fields: str = "reject"  # unknown OpenAI request fields: "reject" (400) or "warn" (ignored)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = [self.model]

    @property
    def model_name(self) -> str:
        """The name responses report and ``/v1/models`` lists first."""
        return self.served_model_names[0]
