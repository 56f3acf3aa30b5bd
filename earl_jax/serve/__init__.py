"""Serving a policy through JetStream (the ``serve`` extra): ``engine.Engine``, ``server.Server``.

Requires ``pip install -e ".[serve]"``.
"""
