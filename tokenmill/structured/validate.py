"""Checks the frontend runs on a request's constraint before sending it to the engine core.

Parsing the constraint into a grammar needs no tokenizer and takes microseconds to milliseconds, so
the server answers a bad schema, regex or grammar with a 400 at request time; the engine core only
does the expensive compilation against the vocabulary.
"""

from __future__ import annotations

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.manager import check_combination


def validate_structured_outputs(params: SamplingParams) -> None:
    """Raise ValueError naming the problem if ``params.structured_outputs`` cannot be enforced."""
    if params.structured_outputs is None:
        return
    check_combination(params)
    validate_constraint(params.structured_outputs)


def validate_constraint(constraint: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if the constraint does not parse into a grammar."""
    # Imported here: xgrammar loads a native library, which requests without constraints never need.
    from tokenmill.structured.xgrammar_backend import build_grammar

    build_grammar(constraint)
