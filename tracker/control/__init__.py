"""The tracker's control plane: what every node of a job runs.

The scheduler (``scheduler_state``: a pure state machine for ranks, address
book, barriers and liveness; ``rendezvous``: its socket loop), a node's
membership client, the wire format, authentication, the environment contract
(``env``: every variable, its default, and the ``Settings`` object) and the errors. Launchers (``tracker/*.py``) import this package; nothing here
imports a launcher (tests/project/test_layering.py checks it).
"""
