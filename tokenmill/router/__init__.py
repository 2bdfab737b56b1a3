"""Spreading requests over several engines: the dispatch policies (``policy.py``) and the approximate
prefix index they read (``prefix_index.py``), shared by the data-parallel engine client
(``core/dp_client.py``) and the standalone HTTP router (``router/app.py``).

``policy.py`` and ``prefix_index.py`` are pure Python (of tokenmill they import only ``config.py``); the HTTP
router imports nothing of the server or the core, so ``tokenmill router`` starts without torch.
"""
