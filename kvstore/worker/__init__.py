"""The worker's store: what ``kvstore.create`` returns and everything it composes.

- ``store.py``: ``KVStore``, the public API every store type shares (argument checks
  in ``arguments.py``); ``types.py``: the store type names, aliases and registry;
- ``local.py`` (``local``), ``device.py`` (``device``, ``dist_device_sync``),
  ``dist.py`` (``dist_sync``, ``dist_async``, ``dist_ssp``): the store types;
- a dist store's collaborators: ``exchange.py`` (sending calls to the servers and
  filling their outputs), ``client.py`` (a link per server, request ids,
  deadlines), ``job.py`` (the worker's calls to the scheduler), ``leaving.py``
  (finishing or failing), ``checkpoints.py`` (checkpoint sets and resuming),
  ``remote_states.py`` and ``states_file.py`` (optimizer states and their file).

Row-sparse keys are :mod:`kvstore.rows`, host groups :mod:`kvstore.hostgroup`, the
GPUs :mod:`kvstore.devices`.
"""
