"""Serving a policy through JetStream (the ``serve`` extra): ``engine.Engine``, ``server.Server``.

Requires ``pip install -e ".[serve]"``.
"""

import os

# JetStream imports tensorflow (through seqio), which logs its start-up to stderr by default.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
