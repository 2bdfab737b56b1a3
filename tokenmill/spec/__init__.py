"""Speculative decoding's drafters: a ``Proposer`` proposes draft tokens per request after each step
(``proposer.py``); the scheduler plans them as extra tokens to compute (``core/spec_decode.py``) and
the rejection sampler (``sample/rejection.py``) verifies them against the target model."""
