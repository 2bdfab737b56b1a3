"""Structured outputs: constraints compiled to grammars whose token bitmasks steer sampling.

``backend.py`` is the interface any grammar engine implements, ``xgrammar_backend.py`` the one we
ship, ``schema_check.py`` the JSON-schema keywords it can enforce, ``manager.py`` what the engine core
runs (compilation off the step loop, per-request matchers, jump-forward, step bitmasks) and
``validate.py`` the cheap checks the frontend makes before a request is sent.
"""
