"""Host groups (``KVSTORE_HOST_REDUCE=1``): the workers of one host hand their
gradients to the lowest rank among them, which sums them and pushes once for all.

- ``group.py``: ``HostGroup``, forming a group and its calls (leader and members);
- ``link.py``: ``HostLink``, the socket between a host's workers (bounded waits
  that watch the peers' processes).
- ``wire.py``: the ops of the messages between them (hello, welcome, sum, result,
  error, bye).
"""
