"""Training what the engine runs beside a model (``eagle.py``: an EAGLE draft head)."""
