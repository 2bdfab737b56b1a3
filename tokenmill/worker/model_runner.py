"""Runs the model for one scheduled step: builds the ForwardBatch, runs the forward, samples.

The runner owns the device state: model weights, the paged KV cache tensors and per-request seeded
generators. It sees only block tables and slot mappings, never the allocator.

Under tensor parallelism (``tp``) each rank's runner holds its shard of the weights and a KV cache of
its heads, and runs every plan's forward (the layers' collectives keep the ranks in step); only
rank 0 gets the full logits and samples, so only its output carries tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.step_io import (
    GrammarBitmask,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepStatus,
)
from tokenmill.layers.attention import SequenceStep, select_backend
from tokenmill.layers.attention.deterministic import DeterministicBackend
from tokenmill.layers.batch_invariant import make_batch_invariant
from tokenmill.layers.cpu_gemm import cpu_computes_bfloat16
from tokenmill.layers.cpu_isa import apply_torch_environment, bfloat16_kernels
from tokenmill.layers.cpu_kernels import load_error
from tokenmill.layers.embedding import LMHead
from tokenmill.layers.forward_batch import ForwardBatch
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.quantization import quantize_modules
from tokenmill.layers.tensor_parallel import SINGLE, TensorParallel
from tokenmill.loader import ModelSource
from tokenmill.loader.gguf_k4 import keep_exact_k4
from tokenmill.lora.manager import LoRAManager
from tokenmill.models.base import prepare_for_inference
from tokenmill.protocol import PositionLogprobs
from tokenmill.sample.build import (
    RowSamplingInput,
    build_sampling_metadata,
    draws_random,
    make_generator,
    position_generator,
)
from tokenmill.sample.sampler import Sampler, compute_prompt_logprobs, skip_draws
from tokenmill.spec.proposer import Proposer
from tokenmill.step_control import NEVER_STOP, InterruptFlag, LayerProgress
from tokenmill.worker.cpu_malloc import keep_large_buffers_in_heap
from tokenmill.worker.drafters import make_drafter
from tokenmill.worker.kv_setup import log_kv_cache, make_prefaulter, new_kv_caches, plan_kv_pool
from tokenmill.worker.model_load import load_model
from tokenmill.worker.spec_step import draft_contexts, verify_entries
from tokenmill.worker.state_cache import make_state_cache
from tokenmill.worker.tp_step_control import step_control_for
from tokenmill.worker.weight_update import WeightUpdater, drop_derived_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 where the hardware computes it natively and (on a CPU) the kernels' path
    has our bfloat16 kernels (``cpu_isa.bfloat16_kernels``: not on ``avx512`` without BF16), float32
    elsewhere. An explicit bfloat16 on a CPU without bfloat16 instructions is kept, with a warning
    that it is slow there."""
    native_bf16 = device.type == "cuda" or cpu_computes_bfloat16()
    if name != "auto":
        if name == "bfloat16" and not native_bf16:
            logger.warning(
                "this CPU has no bfloat16 instructions for oneDNN (AVX-512 BW/VL/DQ, AMX or AVX-NE-CONVERT): "
                "bfloat16 matrix products are emulated and run many times slower than float32 here "
                "(--dtype auto picks float32 on such a CPU)"
            )
        return _DTYPES[name]
    if device.type == "cpu" and not bfloat16_kernels():
        return torch.float32
    return torch.bfloat16 if native_bf16 else torch.float32


class ModelRunner:
    """Loads the model, owns the KV cache tensors and executes scheduled steps."""

    def __init__(self, config: EngineConfig, source: ModelSource, tp: TensorParallel = SINGLE) -> None:
        self.config = config
        self.tp = tp
        self.device = torch.device(config.model.device)
        if self.device.type == "cpu":
            apply_torch_environment()  # TOKENMILL_CPU_ISA's hold on torch, before its first CPU kernel
        self.dtype = resolve_dtype("float32" if config.rl_exact_logprobs else config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.interrupt: InterruptFlag | None = None  # see set_interrupt
        self.interrupt_tensor: torch.Tensor | None = None
        if self.device.type == "cpu":
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            keep_large_buffers_in_heap()
        torch.manual_seed(config.model.seed)

        start = time.perf_counter()
        self.model, self.model_impl, description = load_model(config, source, tp, self.dtype, self.device)
        if self.model_impl == "native":
            quantized, exact_int4, exact_q8 = self._derive_weights(source.gguf_path)
            if quantized:
                description += f", {config.model.quantization} weights in {quantized} layers"
            if exact_int4:
                description += f", the int4 kernel on {exact_int4} exactly 4-bit layers (lossless)"
            if exact_q8:
                description += f", the 8-bit kernel on {exact_q8} exactly 8-bit layers and heads (lossless)"
        self.lora = self._make_lora(config)
        logger.info(
            "model %s (%s implementation: %s, %s) ready in %.1f s",
            source.name,
            self.model_impl,
            description,
            self.dtype,
            time.perf_counter() - start,
        )

        kv_dtype = (
            self.dtype if config.cache.kv_cache_dtype == "auto" else _DTYPES[config.cache.kv_cache_dtype]
        )
        # The model's layers made the same choice (select_backend is cached); the runner needs the
        # class to build each step's attention metadata.
        self.attn_backend = (
            DeterministicBackend
            if config.deterministic
            else select_backend(self.device, self.dtype, kv_dtype)
        )
        self.state_cache = make_state_cache(self.model, config, self.device)
        self.num_blocks, self.kv_cache_bytes, self.window_group = plan_kv_pool(
            config, source, self.model, self.device, kv_dtype, self.state_cache
        )
        self.kv_caches = self._new_kv_caches(kv_dtype)
        self.kv_prefaulter = make_prefaulter(config, self.device, self.kv_caches, self.window_group)
        log_kv_cache(self.num_blocks, self.block_size, self.kv_cache_bytes, kv_dtype)
        # The model-wide window (Mistral: every layer) and each layer's own (Gemma 3 mixes sliding
        # and global layers); one attention metadata is built per distinct window.
        self.sliding_window: int | None = self.model.sliding_window
        self.layer_sliding_windows: list[int | None] = list(self.model.layer_sliding_windows)
        # What the KV manager may release: blocks outside the widest window, when no layer is global.
        windows = self.layer_sliding_windows
        self.kv_window: int | None = None if None in windows else max(w for w in windows if w is not None)
        self.sampler = Sampler(config.logprobs_mode)
        self._generators: dict[str, torch.Generator] = {}
        # Speculative decoding's drafter (spec/), run after each step's sampling; None when off.
        spec = config.speculative_config
        self.proposer: Proposer | None = make_drafter(config, source, self.model, self.num_blocks, kv_dtype)
        self.num_speculative_tokens = 0 if spec is None else spec.num_speculative_tokens
        # The step the interrupt paused between layers, until the engine resumes or discards it.
        self._paused: SuspendedStep | None = None
        # Weight updates in place and memory release for RL (worker/weight_update.py).
        self.weights = WeightUpdater(self.model, source, self._rederive_weights, self.device)
        self._kv_dtype = kv_dtype
        self._released_weights: dict[str, torch.Size] | None = None

    def _derive_weights(self, gguf: str | None = None) -> tuple[int, int, int]:
        """Derive what the layers keep beside their loaded weights: quantized copies (or the exact
        int4 / 8-bit ones, and at load from ``gguf``, the file's exact Q4_K groups:
        ``loader/gguf_k4.py``), then packed matrices and fused stacks. Returns the quantized layers,
        the exact int4 layers (Q4_K ones included) and the exact 8-bit heads. Run at load and after
        every weight update."""
        kind = self.config.model.quantization
        quantized = self._quantize(kind)
        keep_exact = (
            kind is None
        )  # the deterministic mode runs them on their row kernels (batch_invariant.py)
        exact_int4, exact_q8 = self._keep_exact_copies() if keep_exact else (0, 0)
        if (
            keep_exact
            and gguf is not None
            and self.device.type == "cpu"
            and self.dtype in (torch.bfloat16, torch.float32)
        ):
            exact_int4 += keep_exact_k4(self.model, gguf)
        prepare_for_inference(self.model)
        if self.config.deterministic:
            make_batch_invariant(self.model)
        return quantized, exact_int4, exact_q8

    def _quantize(self, kind: str | None) -> int:
        """Quantize every layer that supports it (``quantize_modules``); returns how many did."""
        return quantize_modules(self.model, kind, self.dtype, self.device)

    def _keep_exact_copies(self) -> tuple[int, int]:
        """On CPU in bfloat16 or float32 (not under rl_exact_logprobs, whose float32 products keep
        torch's order), give the int4 kernel to every linear layer whose loaded values are
        exactly 4-bit groups (a Q4_0 / Q4_1 GGUF's layers, also through the converted-GGUF cache; any
        other weight fails a one-row screen at once), and the 8-bit kernel to every LM head whose
        weight is exactly 8-bit groups (a Q8_0 tensor, such as the bundled SmolLM2's tied embedding,
        layers/q8.py): small steps then stream a quarter / half of the bytes and compute with the
        same weight values, so nothing is lost. Returns how many layers and heads; (0, 0) when the
        kernels are unavailable (then nothing changes: this is not an opt-in mode)."""
        exact_dtypes = (torch.bfloat16,) if self.config.rl_exact_logprobs else (torch.bfloat16, torch.float32)
        if self.device.type != "cpu" or self.dtype not in exact_dtypes or load_error() is not None:
            return 0, 0
        layers = heads = 0
        for module in self.model.modules():
            if isinstance(module, LinearBase) and module.quantize_weights("int4", lossless_only=True) is None:
                layers += 1
            elif isinstance(module, LinearBase) and module.keep_exact_q8():
                heads += 1  # a Q8_0 / Q5_0 projection (layers/q8.py)
            if isinstance(module, LMHead) and module.keep_exact_q8():
                heads += 1
        return layers, heads

    # ------------------------------------------------------------------ weights and memory (RL)

    def _rederive_weights(self) -> None:
        drop_derived_weights(self.model)
        self._derive_weights()

    def _check_updatable(self) -> None:
        if self.model_impl != "native":
            raise ValueError("weight updates need model_impl='native' (the transformers fallback has none)")
        if self.lora is not None:
            raise ValueError("weight updates with LoRA enabled are not supported yet")
        if self.tp.size > 1:
            raise ValueError("weight updates with tensor parallelism are not supported yet")
        if self._released_weights is not None:
            raise ValueError("the weights are released; resume_memory_occupation first")

    def update_weights_from_disk(self, folder: str) -> int:
        """Load every tensor of the safetensors model folder ``folder`` (same architecture); returns
        how many. ValueError, with the old weights intact, on a name or shape mismatch."""
        self._check_updatable()
        return self.weights.load_folder(folder)

    def update_weights_from_tensor(self, data: bytes) -> int:
        """Load the named tensors of one safetensors blob; returns how many (ValueError as above)."""
        self._check_updatable()
        return self.weights.load_safetensors_bytes(data)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's weight-broadcast group (``open_weight_group``) as rank ``rank_offset``
        (this runner is the executor's only rank)."""
        if self.tp.size > 1:
            raise ValueError("weight-update groups with tensor parallelism are not supported yet")
        self.weights.init_group(master_address, master_port, rank_offset, world_size, group_name, backend)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.weights.destroy_group(group_name)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str | None
    ) -> int:
        """Receive the named tensors the trainer (rank 0) broadcasts, in order, then load them."""
        self._check_updatable()
        return self.weights.receive_broadcast(names, dtypes, shapes, group_name)

    def release_memory(self, kv_cache: bool, weights: bool) -> None:
        """Free the KV cache tensors and/or the weights (for a trainer sharing the machine); the
        engine runs no step until ``resume_memory``."""
        if kv_cache and self.kv_caches:
            self.kv_caches = []
            self.kv_prefaulter = None
        if weights and self.model_impl != "native":
            raise ValueError("releasing the weights needs model_impl='native' (they are reloaded through it)")
        if weights and self._released_weights is None:
            self._released_weights = {n: p.shape for n, p in self.model.named_parameters()}
            drop_derived_weights(self.model)
            for parameter in self.model.parameters():
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=self.device)

    def resume_memory(self, kv_cache: bool, weights: bool) -> None:
        """Allocate what ``release_memory`` freed again: an empty KV cache of the same size, and the
        weights of the folder they last came from whole (push newer ones with an update)."""
        if weights and self._released_weights is not None:
            for name, parameter in self.model.named_parameters():
                parameter.data = torch.empty(
                    self._released_weights[name], dtype=parameter.dtype, device=self.device
                )
            self._released_weights = None
            self.weights.reload()
        if kv_cache and not self.kv_caches:
            self.kv_caches = self._new_kv_caches(self._kv_dtype)

    def _make_lora(self, config: EngineConfig) -> LoRAManager | None:
        """Wrap the projections for LoRA (``lora/manager.py``) when enabled; a ValueError for a model
        it cannot adapt (the transformers fallback runs its own modules)."""
        lora = config.lora
        if not lora.enable_lora:
            return None
        if self.model_impl == "transformers":
            raise ValueError(
                "LoRA with the transformers model implementation is not supported; use a native model"
            )
        return LoRAManager(
            self.model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras or lora.max_loras, self.dtype
        )

    def _lora_or_fail(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled in this model runner")
        return self.lora

    def add_lora(self, lora_id: int, path: str) -> int:
        """Read and check the PEFT adapter at ``path`` as ``lora_id`` (ValueError when it does not fit
        the model); returns its rank. Reached through ``Executor.collective_rpc``."""
        return self._lora_or_fail().add(lora_id, path)

    def load_lora_slot(self, slot: int, lora_id: int) -> float:
        """Put adapter ``lora_id`` in device slot ``slot``; returns the seconds it took."""
        return self._lora_or_fail().load_slot(slot, lora_id)

    def remove_lora(self, lora_id: int) -> None:
        """Forget adapter ``lora_id`` (no request uses it any more)."""
        self._lora_or_fail().remove(lora_id)

    # ------------------------------------------------------------------ one step

    def recurrent_state_info(self) -> list[int]:
        """``[num_state_slots, bytes per slot]``; ``[0, 0]`` for a model without recurrent state."""
        if self.state_cache is None:
            return [0, 0]
        return [self.state_cache.num_slots, self.state_cache.slot_bytes]

    def sliding_kv_pool_info(self) -> list[int]:
        """``[window, blocks of the window pool]`` when the sliding layers form their own KV group
        (``worker/kv_groups.py``), else ``[0, 0]``."""
        group = self.window_group
        return [0, 0] if group is None else [group.window, group.num_window_blocks]

    def _new_kv_caches(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Zeroed cache tensors: one pool for all layers, or the window group's two."""
        return new_kv_caches(
            self.model, self.block_size, self.num_blocks, self.window_group, dtype, self.device
        )

    def prefault_while_idle(self) -> bool:
        """Map the next few KV blocks' pages (``IdlePrefaulter.step``); whether more remain."""
        return self.kv_prefaulter is not None and self.kv_prefaulter.step()

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run ``plan``: its forward, then its sampling. A pausable plan the interrupt stops before a
        layer comes back ``PAUSED`` and is kept here (one at most) until ``resume`` or
        ``discard_paused``; an interruptible one comes back ``ABANDONED`` (step_control.py). Plans
        run while one is kept must not be pausable (the engine's arrivals' passes are not)."""
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        if self.proposer is not None and plan.finished_request_ids:
            self.proposer.drop(plan.finished_request_ids)
        if plan.is_empty:
            return ModelRunnerOutput()
        if plan.pausable and self._paused is not None:
            raise RuntimeError("a pausable step was sent while another paused step is kept")
        batch, sample_entries, prompt_rows = self._build_batch(plan.scheduled)
        if (plan.interruptible or plan.pausable) and self.interrupt is not None:
            batch.control = step_control_for(self.interrupt, self.interrupt_tensor, self.tp)
        return self._finish(SuspendedStep(plan, batch, sample_entries, prompt_rows))

    @torch.inference_mode()
    def resume(self, may_pause: bool) -> ModelRunnerOutput:
        """Go on with the step ``execute`` paused, from the layer it stopped before; with
        ``may_pause`` it may pause again (and stay kept), else it runs to the end."""
        if self._paused is None:
            raise RuntimeError("resume without a paused step")
        step, self._paused = self._paused, None
        if not may_pause:
            step.batch.control = NEVER_STOP
        return self._finish(step)

    def discard_paused(self) -> None:
        """Drop the paused step (the engine put its plan back); a no-op when none is kept."""
        self._paused = None

    def _finish(self, step: SuspendedStep) -> ModelRunnerOutput:
        """Run ``step``'s forward (from where it stopped, if it did), then its sampling. Where the
        interrupt stops the forward, a stop becomes a status here: a pausable plan is kept and comes
        back ``PAUSED``, any other ``ABANDONED``."""
        batch, sample_entries, prompt_rows = step.batch, step.sample_entries, step.prompt_rows
        logits = self._compute_logits(batch, step.plan.scheduled)  # [rows, vocab] f32 or activation dtype
        if isinstance(logits, LayerProgress):  # the step's control stopped the forward before a layer
            if step.plan.interruptible:
                return ModelRunnerOutput(status=StepStatus.ABANDONED, layers_done=0.0)
            batch.resume_from = logits
            self._paused = step
            return ModelRunnerOutput(status=StepStatus.PAUSED, layers_done=step.fraction_done)
        batch.resume_from = None
        output = ModelRunnerOutput()
        if not self.tp.is_first:  # rank 0 got the full logits and samples; this rank is done
            return output
        num_sampling = sum(1 + len(entry.draft_token_ids) for entry in sample_entries)
        if num_sampling:
            self._sample(
                logits[:num_sampling],
                sample_entries,
                output,
                step.plan.grammar_bitmask,
                step.plan.propose_drafts,
            )
        offset = num_sampling
        for request_id, targets, num_top in prompt_rows:
            rows = logits[offset : offset + len(targets)]
            offset += len(targets)
            target_tensor = torch.tensor(targets, dtype=torch.long, device=self.device)
            ids, logprobs, ranks = compute_prompt_logprobs(rows, target_tensor, num_top)
            output.prompt_logprobs[request_id] = _to_position_logprobs(ids, logprobs, ranks, num_top)
        return output

    def _compute_logits(
        self, batch: ForwardBatch, entries: list[ScheduledRequest]
    ) -> torch.Tensor | LayerProgress:
        """Logits ``[num_logit_rows, vocab_size]`` for ``batch.logits_rows``, or the ``LayerProgress``
        where ``batch.control`` stopped the forward (``models/base.py``: native models and the
        transformers fallback share this interface). A drafter that reads the target's hidden states
        (``mtp``, EAGLE) gets every row's, and the layer inputs it asks for."""
        record = getattr(self.proposer, "record", None)
        if self.lora is not None:
            with self.lora.state.bound(batch.lora):
                return self.model.forward_logits(batch)
        if record is None:
            return self.model.forward_logits(batch)
        batch.aux_layers = getattr(self.proposer, "aux_layers", ())
        hidden = self.model(batch)  # [num_tokens, hidden_size] or LayerProgress
        if isinstance(hidden, LayerProgress):
            return hidden
        record(entries, hidden, batch)
        return self.model.compute_logits(hidden[batch.logits_rows])

    def _sample(
        self,
        logits: torch.Tensor,
        entries: list[ScheduledRequest],
        output: ModelRunnerOutput,
        grammar: GrammarBitmask | None,
        propose: bool = True,
    ) -> None:
        """Sample ``entries`` from their rows of ``logits`` (one per entry, ``1 + len(drafts)`` for an
        entry with drafts, in order): plain rows through the sampler, drafted ones through the
        rejection sampler; then, when ``propose`` (the plan's ``propose_drafts``), draft for the
        next step (a hidden-state drafter has recorded this step's features either way, and catches
        up over them when it drafts again)."""
        drafted = [entry for entry in entries if entry.draft_token_ids]
        if not drafted:
            self._sample_plain(logits, entries, output, grammar)
        else:
            plain_rows: list[int] = []
            drafted_rows: list[int] = []
            row = 0
            for entry in entries:
                num_rows = 1 + len(entry.draft_token_ids)
                (drafted_rows if entry.draft_token_ids else plain_rows).extend(range(row, row + num_rows))
                row += num_rows
            plain = [entry for entry in entries if not entry.draft_token_ids]
            if plain:
                rows = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
                self._sample_plain(logits[rows], plain, output, grammar)
            rows = torch.tensor(drafted_rows, dtype=torch.long, device=logits.device)
            verify_entries(logits[rows], drafted, self._row_generators, output, self.device, grammar)
        if self.proposer is not None and propose:
            contexts = draft_contexts(entries, output, self.num_speculative_tokens)
            output.draft_token_ids = self.proposer.propose(contexts)

    def _row_generators(self, entry: ScheduledRequest) -> list[torch.Generator | None]:
        """The generators of a drafted entry's ``1 + len(drafts)`` sampling rows: in the deterministic
        mode each row's own, seeded by the position it samples (so a row draws what plain sampling
        at that position draws, however many drafts the step verified); else the request's one."""
        num_rows = 1 + len(entry.draft_token_ids)
        if self.config.deterministic:
            seed = self.config.model.seed
            return [position_generator(entry, seed, self.device, row) for row in range(num_rows)]
        return [self._generator_for(entry)] * num_rows

    def _generator_for(self, entry: ScheduledRequest) -> torch.Generator | None:
        """The request's seeded generator (made on first use, kept until it finishes), advanced past
        the draws of tokens jump-forward appended; None for an unseeded request."""
        if self.config.deterministic:
            return position_generator(entry, self.config.model.seed, self.device)
        if entry.seed is None:
            return None
        generator = self._generators.get(entry.request_id)
        if generator is None:
            generator = make_generator(entry.seed, self.device)
            self._generators[entry.request_id] = generator
        if entry.skipped_draws and draws_random(entry.sampling_params):
            skip_draws(generator, entry.skipped_draws, self.device)
        return generator

    def _sample_plain(
        self,
        logits: torch.Tensor,
        entries: list[ScheduledRequest],
        output: ModelRunnerOutput,
        grammar: GrammarBitmask | None,
    ) -> None:
        rows = []
        for entry in entries:
            generator = self._generator_for(entry)
            bitmask_row = None
            if grammar is not None and entry.request_id in grammar.rows:
                bitmask_row = grammar.bitmask[grammar.rows[entry.request_id]]  # [words]
            rows.append(
                RowSamplingInput(
                    params=entry.sampling_params,
                    generator=generator,
                    prompt_token_ids=entry.prompt_token_ids,
                    output_token_ids=entry.output_token_ids,
                    block_ids_for_min_tokens=entry.forbidden_token_ids,
                    grammar_bitmask=bitmask_row,
                )
            )
        metadata = build_sampling_metadata(rows, self.device)
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        for i, entry in enumerate(entries):
            output.sampled_token_ids[entry.request_id] = sampled[i]
        if result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.sampled_rank is not None
            ids = result.logprob_token_ids.tolist()
            values = result.logprobs.tolist()
            ranks = result.sampled_rank.tolist()
            for i, entry in enumerate(entries):
                num = entry.sampling_params.logprobs
                if num is None:
                    continue
                output.logprobs[entry.request_id] = PositionLogprobs(
                    token_ids=ids[i][: num + 1], logprobs=values[i][: num + 1], rank=ranks[i]
                )

    # ------------------------------------------------------------------ batch construction

    def _build_batch(
        self, entries: list[ScheduledRequest]
    ) -> tuple[ForwardBatch, list[ScheduledRequest], list[tuple[str, list[int], int]]]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        sequences: list[SequenceStep] = []
        for entry in entries:
            offsets.append(len(token_ids))
            start, n = entry.start_position, len(entry.token_ids)
            table = entry.block_table
            sequences.append(SequenceStep(len(token_ids), start, n, table))
            token_ids.extend(entry.token_ids)
            positions.extend(range(start, start + n))
            seq_lens.extend([start + n] * n)
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        if self.kv_prefaulter is not None and slots:
            self.kv_prefaulter.note_written(max(slots) // bs)

        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        # The backend turns the step's plain facts into what its forward reads (masks, gather
        # indices, block tables), once per step for every window the model's layers use.
        attn_by_window = self.attn_backend.build_metadata(
            sequences, slot_mapping, bs, self.layer_sliding_windows
        )
        if self.window_group is not None:  # the sliding layers read their own table
            attn_by_window.update(
                self.window_group.build_metadata(self.attn_backend, entries, offsets, bs, self.device)
            )
        if any(entry.draft_token_ids for entry in entries):
            for metadata in attn_by_window.values():
                metadata.rows_as_decodes_preferred = True

        sample_entries: list[ScheduledRequest] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[str, list[int], int]] = []
        prompt_row_ids: list[int] = []
        for entry, offset in zip(entries, offsets):
            if entry.sample:
                sample_entries.append(entry)
                end = offset + len(entry.token_ids)
                sample_rows.extend(range(end - 1 - len(entry.draft_token_ids), end))
            if entry.prompt_logprobs_range is not None:
                lo, hi = entry.prompt_logprobs_range
                prompt_row_ids.extend(offset + p - entry.start_position for p in range(lo, hi))
                num_top = entry.sampling_params.prompt_logprobs or 0
                prompt_rows.append((entry.request_id, entry.prompt_token_ids[lo + 1 : hi + 1], num_top))

        device = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            attn=attn_by_window.get(self.sliding_window) or next(iter(attn_by_window.values())),
            kv_caches=self.kv_caches,
            logits_rows=torch.tensor(sample_rows + prompt_row_ids, dtype=torch.long, device=device),
            attn_by_window=attn_by_window,
        )
        if self.state_cache is not None:
            batch.recurrent = self.state_cache.prepare(entries, offsets, device)
        if self.lora is not None:
            batch.lora = self.lora.batch_for([(e.lora_slot, len(e.token_ids)) for e in entries], device)
        return batch, sample_entries, prompt_rows

    def set_interrupt(self, flag: InterruptFlag | None) -> None:
        """Let steps the scheduler marks ``interruptible`` be abandoned between layers when ``flag`` is
        raised (``step_control.py``); ``execute`` then returns ``ABANDONED`` (or ``PAUSED``)."""
        self.interrupt = flag
        self.interrupt_tensor = None if flag is None else torch.frombuffer(flag.buffer, dtype=torch.uint8)


@dataclass
class SuspendedStep:
    """A step under way: its plan, its batch (with where a paused forward goes on) and what its
    sampling needs once the forward is done."""

    plan: SchedulerOutput
    batch: ForwardBatch
    sample_entries: list[ScheduledRequest]
    prompt_rows: list[tuple[str, list[int], int]]

    @property
    def fraction_done(self) -> float:
        """The share of the model's layers a paused forward has run (0.0 when it has not started)."""
        progress = self.batch.resume_from
        return 0.0 if progress is None else progress.next_layer / len(self.batch.kv_caches)


def _to_position_logprobs(
    ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor, num_top: int
) -> list[PositionLogprobs]:
    id_rows, value_rows, rank_list = ids.tolist(), logprobs.tolist(), ranks.tolist()
    return [
        PositionLogprobs(
            token_ids=id_rows[i][: num_top + 1], logprobs=value_rows[i][: num_top + 1], rank=rank_list[i]
        )
        for i in range(len(rank_list))
    ]
