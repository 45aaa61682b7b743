"""Peer contenders (MXNet, Ray) that live in their own virtual environments.

Each peer needs packages that cannot share an environment with ours (MXNet 1.9.1
needs numpy 1.23.5; Ray brings its own world), so ``--setup-peers`` creates
``benchmarks/.venv-<name>`` and installs them there. A peer whose environment is
missing or broken is skipped with the reason, never silently.
"""
