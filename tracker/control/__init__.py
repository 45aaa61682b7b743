"""The tracker's control plane: what every node of a job runs.

Rendezvous (the scheduler: ranks, address book, barriers, liveness), a node's
membership client, the wire format, authentication, the environment contract and
the errors. Launchers (``tracker/*.py``) import this package; nothing here
imports a launcher (tests/test_layering.py checks it).
"""
