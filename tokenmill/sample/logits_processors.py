"""Logits processors: pure functions over a batch of logits.

Every function takes ``logits`` of shape ``[num_rows, vocab]`` in float32, one row per sequence, and
returns the processed logits. A function may write into ``logits`` and return it, so callers must use
the return value and must not rely on the input staying unchanged. Per-row parameters arrive as
``[num_rows]`` tensors on the logits' device; a row whose parameter has its neutral value (bias absent,
penalty 1 or 0, ``top_k`` -1/0, ``top_p`` 1, ``min_p`` 0) comes back exactly as it went in.
"""

from __future__ import annotations

import itertools

import torch

_NEG_INF = float("-inf")


def pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    """Pack ragged per-row token id lists into one ``[num_rows, max_len]`` int64 tensor.

    Short rows are filled with ``pad_id``. The ids are converted in one flat ``torch.tensor`` call and
    placed with a mask, so the cost is one C-level conversion rather than a Python loop per element.
    """
    num_rows = len(token_ids)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64, device=device)  # [num_rows]
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((num_rows, max_len), pad_id, dtype=torch.int64, device=device)  # [num_rows, max_len]
    if max_len == 0:
        return padded
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    positions = torch.arange(max_len, device=device)  # [max_len]
    filled = positions[None, :] < lengths[:, None]  # [num_rows, max_len]
    # Boolean-mask assignment fills row-major, which is exactly the order of the flattened lists.
    padded[filled] = flat
    return padded


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> torch.Tensor:
    """Add ``logit_bias[row][token]`` to ``logits[row, token]``; a None entry leaves its row alone.

    Token ids must lie in ``[0, vocab)``; request validation is expected to check them against the
    model's vocabulary, and this function raises ValueError rather than index out of bounds.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(logit_bias):
        if not bias:
            continue
        for token, value in bias.items():
            if not 0 <= token < vocab:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})")
            rows.append(row)
            cols.append(token)
            values.append(value)
    if not rows:
        return logits
    device = logits.device
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)  # [num_biases]
    col_index = torch.tensor(cols, dtype=torch.int64, device=device)  # [num_biases]
    bias_values = torch.tensor(values, dtype=logits.dtype, device=device)  # [num_biases]
    logits.index_put_((row_index, col_index), bias_values, accumulate=True)
    return logits


def apply_min_tokens_block(logits: torch.Tensor, block: dict[int, list[int]]) -> torch.Tensor:
    """Set ``logits[row, token]`` to -inf for every token in ``block[row]``.

    Used to keep EOS and stop tokens from being chosen before a request has produced ``min_tokens``.
    Token ids at or beyond ``vocab`` are ignored: the model cannot produce them anyway.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, tokens in block.items():
        for token in tokens:
            if 0 <= token < vocab:
                rows.append(row)
                cols.append(token)
    if not rows:
        return logits
    row_index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [num_blocked]
    col_index = torch.tensor(cols, dtype=torch.int64, device=logits.device)  # [num_blocked]
    logits[row_index, col_index] = _NEG_INF
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token a grammar forbids in the given rows; other rows are untouched.

    ``rows`` (``[num_constrained]``) are row indices into ``logits``; ``bitmask`` is
    ``[num_constrained, words]`` int32 where bit ``t % 32`` of word ``t // 32`` allows token ``t``.
    Tokens past ``32 * words`` are forbidden; bits past the logits' vocabulary are ignored.
    """
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [num_constrained, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [num_constrained, words * 32]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]  # [num_constrained, vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
    return logits


def _token_counts(padded_ids: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Count each token per row of a padded id tensor (pad id ``vocab``); returns ``[num_rows, vocab]``."""
    num_rows = padded_ids.shape[0]
    # One spare column absorbs the padding (and any id past the logits' vocabulary) and is dropped.
    ids = padded_ids.clamp(max=vocab)  # [num_rows, max_len]
    counts = torch.zeros(num_rows, vocab + 1, dtype=dtype, device=padded_ids.device)  # [num_rows, vocab + 1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties, in that order.

    ``prompt_token_ids`` and ``output_token_ids`` are ``[num_rows, len]`` int64 tensors padded with
    ``vocab`` (see :func:`pad_token_ids`); the prompt ids are only read for the repetition penalty and
    may be None when it is. Any penalty tensor may be None, meaning no row uses it.

    - repetition (transformers' definition): for every token seen in the prompt or the output, a
      positive logit is divided by the penalty and any other logit multiplied by it;
    - frequency (OpenAI/vLLM): subtract ``frequency_penalty * count`` of the token in the output;
    - presence (OpenAI/vLLM): subtract ``presence_penalty`` once if the token occurs in the output.
    """
    num_rows, vocab = logits.shape
    output_counts = _token_counts(output_token_ids, vocab, logits.dtype)  # [num_rows, vocab]

    if repetition_penalty is not None:
        seen = output_counts > 0  # [num_rows, vocab]
        if prompt_token_ids is not None:
            seen |= _token_counts(prompt_token_ids, vocab, logits.dtype) > 0
        penalty = repetition_penalty[:, None]  # [num_rows, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)  # [num_rows, vocab]
        logits = torch.where(seen, penalized, logits)

    if frequency_penalty is not None:
        logits -= frequency_penalty[:, None] * output_counts
    if presence_penalty is not None:
        logits -= presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature. Every entry of ``temperature`` must be > 0.

    Greedy rows (temperature 0) do not come here: the sampler gives them 1.0 before calling.
    """
    return logits.div_(temperature[:, None])


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then its smallest nucleus of mass >= ``top_p``.

    ``top_k`` of -1 or 0 (or >= vocab) and ``top_p`` of 1.0 disable the filter for that row; a row with
    both disabled is returned untouched. Removed tokens get -inf. Exactly ``k`` tokens survive top-k
    even when logits tie (ties are broken by sort order), and top-p always keeps the most likely
    token. Both filters work on a single ascending sort of each row.
    """
    if top_k is None and top_p is None:
        return logits
    num_rows, vocab = logits.shape
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)  # [num_rows, vocab]

    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [num_rows]
        positions = torch.arange(vocab, device=logits.device)  # [vocab]
        # Ascending order: the k survivors are the last k positions.
        outside_k = positions[None, :] < (vocab - k)[:, None]  # [num_rows, vocab]
        sorted_logits.masked_fill_(outside_k, _NEG_INF)

    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab]
        # cumulative[i] is the mass of token i and everything less likely; the token can go when that
        # tail fits inside 1 - p, because the more likely tokens alone then already reach p.
        cumulative = sorted_probs.cumsum(dim=-1)  # [num_rows, vocab]
        outside_p = cumulative <= (1.0 - top_p)[:, None]  # [num_rows, vocab]
        # Rows with p == 1 stay untouched even where a probability underflowed to zero.
        outside_p &= (top_p < 1.0)[:, None]
        outside_p[:, -1] = False
        sorted_logits.masked_fill_(outside_p, _NEG_INF)

    return logits.scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least ``min_p`` times the row's largest probability.

    Removed tokens get -inf; a row with ``min_p`` 0 is untouched and the most likely token always stays.
    """
    probs = logits.softmax(dim=-1)  # [num_rows, vocab]
    max_probs = probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    below = probs < min_p[:, None] * max_probs  # [num_rows, vocab]
    return logits.masked_fill_(below, _NEG_INF)
