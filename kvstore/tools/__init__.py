"""Command-line tools: ``python -m kvstore.tools.parse_log LOG... [--plot FILE.png]``."""
