"""tokenmill.lang: programs of prompts, generations, choices, forks and tool calls over one model.

```python
from tokenmill.lang import Runtime, assistant, function, gen, select, set_default_backend, user

@function
def classify(s, review):
    s += user(f"Is this review positive or negative? {review}")
    s += assistant(select("label", choices=["positive", "negative"]))

set_default_backend(Runtime("smollm2-135m"))
print(classify.run(review="Great phone.")["label"])
```

Backends: ``Runtime`` (the engine in this process), ``Endpoint`` (a tokenmill or SGLang server,
``/generate``), ``OpenAIEndpoint`` (any OpenAI-compatible server). See docs/architecture.md.
"""

from tokenmill.lang.backend import Backend, CallResult, ChoiceScores
from tokenmill.lang.endpoint import Endpoint
from tokenmill.lang.expr import assistant, gen, select, system, user
from tokenmill.lang.openai_endpoint import OpenAIEndpoint
from tokenmill.lang.program import Program, function, get_default_backend, set_default_backend
from tokenmill.lang.runtime import Runtime
from tokenmill.lang.state import Forks, ProgramError, ProgramState
from tokenmill.lang.trace import CallRecord, Trace

__all__ = [
    "Backend",
    "CallRecord",
    "CallResult",
    "ChoiceScores",
    "Endpoint",
    "Forks",
    "OpenAIEndpoint",
    "Program",
    "ProgramError",
    "ProgramState",
    "Runtime",
    "Trace",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "user",
]
