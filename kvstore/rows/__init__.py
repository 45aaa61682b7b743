"""Row-sparse keys: tables whose rows are pushed and pulled by id.

- ``sparse.py``: ``RowSparse`` (MXNet's row_sparse) and turning gradients into
  unique sorted (rows, data);
- ``rowinit.py``: ``RowInit``, initial rows computed where they live;
  ``layout.py``: which server holds which row;
- ``keys.py``: what a store sends for a row-sparse init, push or pull, and filling
  the outputs; ``dist.py``: the same over the servers that own the rows;
- ``dynamic.py`` and ``dyntable.py``: ``DynamicRows``, ids anywhere in [0, 2^63)
  created on first push and evicted by age or budget.
"""
