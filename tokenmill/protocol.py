"""Messages that cross the boundary between the frontend and the engine core.

Only these msgspec structs travel between processes (encoded with msgspec, never pickle). The
offline API passes the same objects in-process. They hold ints, floats, strings and lists.
"""

from __future__ import annotations

import enum

import msgspec

from tokenmill.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the values are what the OpenAI API reports."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # an engine fault hit this request
    # The request's deadline (``timeout``) passed. OpenAI has no such reason, so the HTTP API reports
    # ``finish_reason: "length"`` (the answer was cut short) with ``stop_reason: "timeout"``.
    TIMEOUT = "timeout"


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """One sequence for the engine core to generate.

    ``eos_token_ids`` end generation unless ``sampling_params.ignore_eos``. ``group_id`` and
    ``sibling_index`` tie the n samples of one user request together so siblings share the
    prompt's KV blocks. ``cache_salt`` keeps requests from sharing cached KV with other salts.
    ``service_tier`` names the tier that schedules it (``auto`` means ``default``); lower
    ``priority`` values go first within a tier (vLLM's convention). ``user`` identifies whose fair
    share it uses. ``deadline`` is an absolute ``time.time()`` after which the request ends with
    ``FinishReason.TIMEOUT`` wherever it is, its blocks freed. ``lora_name`` names the loaded
    LoRA adapter to generate with (None: the base model).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    group_id: str | None = None
    sibling_index: int = 0
    cache_salt: str | None = None
    service_tier: str = "default"
    user: str | None = None
    deadline: float | None = None
    lora_name: str | None = None


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position.

    ``token_ids[0]`` is the chosen token (sampled, or the actual next prompt token) and the rest are
    the top alternatives in descending order; ``rank`` is the chosen token's rank (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one sequence.

    ``prompt_logprobs`` arrives once, with the first output of the request; its first entry is None
    (the first prompt token has no context). ``num_cached_tokens`` is the prompt prefix served from
    the prefix cache. ``finish_reason`` is set on the sequence's last output.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # The weight version (``get_weight_version``) of the step that produced ``new_token_ids``.
    weight_version: str | None = None


class KVEvent(msgspec.Struct, array_like=True):
    """One change to an engine's prefix cache (``core/kv/kv_events.py``): ``kind`` is ``stored``
    (the blocks named by ``block_hashes`` are now cached), ``removed`` (they no longer are) or
    ``cleared`` (nothing is cached any more; ``block_hashes`` empty)."""

    kind: str
    block_hashes: list[int]


class EngineCoreOutputs(msgspec.Struct, kw_only=True):
    """A batch of outputs from one engine step, plus gauges the frontend exports as metrics."""

    outputs: list[EngineCoreOutput]
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    # Running totals since start-up: prompt tokens looked up in the prefix cache and tokens it served.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Per service tier: sequences running and waiting now.
    num_running_by_tier: dict[str, int] = {}
    num_waiting_by_tier: dict[str, int] = {}
    # Tokens appended this step by jump-forward (forced by a grammar, not sampled).
    num_forced_tokens: int = 0
    # Running totals of speculative decoding: draft tokens verified, accepted, and accepted per
    # draft position (index 0: the first draft of a step).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # Changes to the prefix cache since the last outputs, oldest first (for a data-parallel
    # frontend's prefix index; empty unless the engine collects them).
    kv_events: list[KVEvent] = []


# ---------------------------------------------------------------------------------------------------
# Messages between the server process and the engine-core process (ZMQ, msgpack). Each direction is a
# tagged union, so a receiver decodes any frame with one typed decoder and dispatches on the type.


class AddRequests(msgspec.Struct, tag="add", kw_only=True):
    """Frontend → engine: admit these core requests together (the n samples of one user request).

    The engine answers every ``AddRequests`` with exactly one ``AddResult``: all are admitted or none.
    """

    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", kw_only=True):
    """Frontend → engine: stop these core requests and free their blocks; unknown ids are ignored."""

    request_ids: list[str]


class UtilityBytes(msgspec.Struct, tag="bytes"):
    """Raw bytes as a utility argument (a safetensors blob of named tensors): msgpack ``bin``, never
    pickle. A wrapper, because msgspec cannot tell ``str`` from ``bytes`` in one union."""

    data: bytes


# A utility call's arguments and its result's values: scalars, flat lists (tensor names, dtypes)
# and lists of int lists (shapes), or bytes; all cross as msgpack.
UtilityValue = int | float | bool | str | list[int | float | str | list[int]] | UtilityBytes | None
# The utility methods the engine core answers (``EngineCore.call_utility``; the RL ones are in
# core/weights.py and core/pause.py), and those reserved for features to come, which it refuses
# with "not supported yet" rather than with "unknown".
UTILITY_METHODS = (
    "reset_prefix_cache",
    "kv_stats",
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "get_weight_version",
    "pause_generation",
    "continue_generation",
    "release_memory_occupation",
    "resume_memory_occupation",
    "load_lora",
    "unload_lora",
)
RESERVED_UTILITY_METHODS: tuple[str, ...] = ()


class UtilityCall(msgspec.Struct, tag="call", kw_only=True):
    """Frontend → engine: run a named engine method (``UTILITY_METHODS``) with keyword ``args``.

    The engine answers with a ``UtilityResult`` carrying the same ``call_id``.
    """

    call_id: int
    method: str
    args: dict[str, UtilityValue] = {}


class ShutdownEngine(msgspec.Struct, tag="shutdown", kw_only=True):
    """Frontend → engine: leave the loop and exit cleanly."""


FrontendMessage = AddRequests | AbortRequests | UtilityCall | ShutdownEngine


class EngineReady(msgspec.Struct, tag="ready", kw_only=True):
    """Engine → frontend, once: the model is loaded and the loop is about to start."""

    max_model_len: int
    num_blocks: int
    block_size: int
    pid: int
    kv_cache_bytes: int = 0  # the KV pool's size in bytes (num_blocks × block_size tokens)


class EngineStartFailed(msgspec.Struct, tag="start_failed", kw_only=True):
    """Engine → frontend, instead of ``EngineReady``: building the engine failed (then it exits)."""

    error: str


class AddResult(msgspec.Struct, tag="added", kw_only=True):
    """Engine → frontend: the answer to one ``AddRequests``.

    ``error`` is None when every request was admitted. Otherwise none was, and ``overloaded`` tells a
    full waiting queue (retry later, after about ``retry_after`` seconds) from a request that can
    never run (the client's mistake).
    """

    request_ids: list[str]
    error: str | None = None
    overloaded: bool = False
    retry_after: float | None = None


class StepOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """Engine → frontend: one step's outputs, or a gauge update while idle (empty ``outputs``)."""

    outputs: EngineCoreOutputs


class UtilityResult(msgspec.Struct, tag="result", kw_only=True):
    """Engine → frontend: the answer to ``UtilityCall`` ``call_id``; ``error`` set if it raised."""

    call_id: int
    result: dict[str, UtilityValue] = {}
    error: str | None = None


class EngineFault(msgspec.Struct, tag="fault", kw_only=True):
    """Engine → frontend: a step raised; every in-flight request is lost and the engine exits."""

    error: str


EngineMessage = EngineReady | EngineStartFailed | AddResult | StepOutputs | UtilityResult | EngineFault


# ---------------------------------------------------------------------------------------------------
# The worker wire format: between the engine core's executor and its worker processes
# (executor/multiproc.py, executor/worker_proc.py). A request's data is sent once (``NewRequestData``,
# again after preemption, which restarts it with a shorter table), then each step only what
# changed (``CachedRequestData``); the worker keeps its own per-request state and rebuilds the step's
# ``ScheduledRequest``s (executor/plan_delta.py). Each direction is a tagged union.


class NewRequestData(msgspec.Struct, kw_only=True):
    """Everything a worker keeps about one request, sent the first time it is scheduled. ``block_ids``
    is the whole block table (entries -1 were released out of the sliding window);
    ``output_token_ids`` are the tokens generated so far (a preempted request has some)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None
    block_ids: list[int]
    lora_slot: int = -1  # the request's LoRA device slot (-1: the base model)


class CachedRequestData(msgspec.Struct, kw_only=True, array_like=True):
    """One request's share of a step, as a change to what the worker keeps: output tokens appended
    since it was last sent (several after jump-forward), table entries that changed as
    ``(index, block id)`` (-1: released out of the sliding window; a sibling's copy of a block
    swapped for the shared one), and blocks appended to the table. The
    step computes the tokens at ``start_position`` .. ``start_position + num_tokens - 1`` of prompt +
    outputs; the other fields are as in ``ScheduledRequest``."""

    request_id: str
    new_output_token_ids: list[int]
    changed_blocks: list[tuple[int, int]]
    new_block_ids: list[int]
    start_position: int
    num_tokens: int
    sample: bool
    forbidden_token_ids: list[int]
    prompt_logprobs_range: tuple[int, int] | None
    skipped_draws: int
    # Speculative drafts to verify: computed after the real tokens, never kept as outputs.
    draft_token_ids: list[int] = []
    # Recurrent-state models: the slot, the snapshot to resume from, the checkpoints to take
    # (``ScheduledRequest.state_slot``, ``state_source``, ``state_checkpoints``).
    state_slot: int = -1
    state_source: int = -1
    state_checkpoints: list[tuple[int, int]] = []
    # Models with a sliding-window KV group (core/kv/window_group.py): that group's table, sent whole
    # each step as the number of released leading entries and the blocks held after them (-1: none).
    window_released: int = -1
    window_blocks: list[int] = []


class GrammarBitmaskData(msgspec.Struct, kw_only=True):
    """A step's grammar bitmask: ``rows`` maps request ids to rows of an int32 tensor of ``shape``
    whose bytes (native order, C-contiguous) are ``data``."""

    rows: dict[str, int]
    shape: list[int]
    data: bytes


class StepPlanData(msgspec.Struct, kw_only=True):
    """A ``SchedulerOutput`` as a delta: ``new_requests`` first (state to keep), then ``scheduled``
    in the plan's order; ``finished_request_ids`` are dropped before either is applied."""

    new_requests: list[NewRequestData]
    scheduled: list[CachedRequestData]
    finished_request_ids: list[str]
    num_preempted: int = 0
    grammar_bitmask: GrammarBitmaskData | None = None
    first_token_exclusive: bool = False
    interruptible: bool = False
    pausable: bool = False
    shared_sources: list[str] = []
    propose_drafts: bool = True


class ExecuteStep(msgspec.Struct, tag="execute", kw_only=True):
    """Executor → worker: run this step; answered by ``StepDone``."""

    plan: StepPlanData


class ResumeStep(msgspec.Struct, tag="resume", kw_only=True):
    """Executor → worker: go on with the paused step (``may_pause``: it may pause again); ``StepDone``."""

    may_pause: bool


class DiscardPausedStep(msgspec.Struct, tag="discard", kw_only=True):
    """Executor → worker: drop the paused step; answered by ``WorkerCallResult``."""


class SetInterruptFlag(msgspec.Struct, tag="interrupt", kw_only=True):
    """Executor → worker: map the interrupt flag file in ``folder`` (None: stop checking one)."""

    folder: str | None


class WorkerCall(msgspec.Struct, tag="call", kw_only=True):
    """Executor → worker: ``ModelRunner.<method>(*args)``; answered by ``WorkerCallResult``."""

    method: str
    args: list[object] = []


class ShutdownWorker(msgspec.Struct, tag="shutdown", kw_only=True):
    """Executor → worker: exit now (no answer)."""


WorkerRequest = ExecuteStep | ResumeStep | DiscardPausedStep | SetInterruptFlag | WorkerCall | ShutdownWorker


class WorkerReady(msgspec.Struct, tag="ready", kw_only=True):
    """Worker → executor, once: the model is loaded and the KV cache allocated."""

    num_blocks: int
    kv_window: int | None
    pid: int
    kv_cache_bytes: int = 0


class StepDone(msgspec.Struct, tag="done", kw_only=True):
    """Worker → executor: a ``ModelRunnerOutput`` (``status`` is a ``StepStatus`` value)."""

    status: str
    layers_done: float
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, PositionLogprobs]
    prompt_logprobs: dict[str, list[PositionLogprobs]]
    draft_token_ids: dict[str, list[int]]
    verified_token_ids: dict[str, list[int]] = {}
    verified_logprobs: dict[str, list[PositionLogprobs]] = {}


class WorkerCallResult(msgspec.Struct, tag="result", kw_only=True):
    """Worker → executor: what a ``WorkerCall`` (or ``DiscardPausedStep``) returned, or the error it
    raised (a failed call leaves the worker serving: it changed no step state)."""

    result: object = None
    error: str | None = None


class WorkerFailed(msgspec.Struct, tag="failed", kw_only=True):
    """Worker → executor: starting or a request raised (the error and its traceback); it then exits."""

    error: str


WorkerReply = WorkerReady | StepDone | WorkerCallResult | WorkerFailed
