"""``dadfl.protos`` — the wire schema (``dadfl.v1``, sources in ``protos/dadfl/v1/``), its generated modules and the codec.

Regenerate the ``*_pb2*.py`` modules with ``python -m dadfl.protos.generate``.
"""
