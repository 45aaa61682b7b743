"""THE table of transports: each is a pair, the worker's link and the server's endpoint.

:data:`TRANSPORTS` maps a name to the ``"module:Class"`` of its worker side (a
:class:`~kvstore.transport.links.base.Link`, in ``links/``) and of its server side
(a :class:`~kvstore.transport.endpoints.base.Endpoint`, in ``endpoints/``), most
preferred first. A module that starts with a dot is relative to
``kvstore.transport``; classes are imported when first used, so a transport's
optional dependencies (e.g. CuPy) cost nothing where it is not used.

The order is the fall-back order and ``KVSTORE_TRANSPORT`` names where in it a job
starts (:func:`chosen`; ``auto``: at the first): a worker tries, per server, that
transport and each after it whose link reaches the server's advert; a server
serves that one and each after it, and advertises those that work here. The
valid values of ``KVSTORE_TRANSPORT`` are ``auto`` and these names
(:func:`check`, from ``kvstore.Config``; ``tracker`` cannot import kvstore, so it
only checks the variable's syntax).

A new transport is a ``Link`` file in ``links/``, an ``Endpoint`` file in
``endpoints/`` (each with ``kind`` = its name) and one line here, at its place in
the order (docs/architecture.md §4.1).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Transport:
    link: str          # "module:Class" of the worker's Link
    endpoint: str      # "module:Class" of the server's Endpoint


TRANSPORTS: dict[str, Transport] = {
    # co-located, values on GPUs: device memory by CUDA IPC, host memory as shm
    "cuda_ipc": Transport(".links.cuda_ipc_link:CudaIpcLink", ".endpoints.cuda_ipc_endpoint:CudaIpcEndpoint"),
    # co-located: shared memory for array data, control messages on the tcp endpoint
    "shm": Transport(".links.shm_link:ShmLink", ".endpoints.shm_endpoint:ShmEndpoint"),
    # co-located: ZeroMQ frames through the server's abstract ipc endpoint
    "ipc": Transport(".links.ipc_link:IpcLink", ".endpoints.ipc_endpoint:IpcEndpoint"),
    # anywhere: ZeroMQ frames over tcp, large replies on a data channel
    "tcp": Transport(".links.tcp_link:TcpLink", ".endpoints.tcp_endpoint:TcpEndpoint"),
}

AUTO = "auto"   # KVSTORE_TRANSPORT's value for "from the first registered transport on"


def names() -> list[str]:
    """The registered transports, most preferred first."""
    return list(TRANSPORTS)


def check(name: str) -> str:
    """``name`` if it is a valid ``KVSTORE_TRANSPORT`` (auto or a registered name);
    ConfigError naming the valid ones otherwise."""
    if name != AUTO and name not in TRANSPORTS:
        raise ConfigError(f"unknown transport {name!r} (KVSTORE_TRANSPORT); choose from "
                          f"{', '.join([AUTO, *TRANSPORTS])}")
    return name


def chosen(name: str) -> list[str]:
    """The transports a job with ``KVSTORE_TRANSPORT=name`` uses, in the order
    workers try them: the one it names and those after it (``auto``: all)."""
    order = names()
    return order if check(name) == AUTO else order[order.index(name):]


def link(name: str, base: type[T]) -> type[T]:
    """The worker's Link class of transport ``name``, which must subclass ``base``
    (the caller's ``links.base.Link``: this table imports neither end)."""
    return _load(name, _entry(name).link, base)


def endpoint(name: str, base: type[T]) -> type[T]:
    """The server's Endpoint class of transport ``name``, which must subclass ``base``
    (the caller's ``endpoints.base.Endpoint``)."""
    return _load(name, _entry(name).endpoint, base)


def _entry(name: str) -> Transport:
    if check(name) == AUTO:
        raise ConfigError("'auto' chooses among the transports and is none itself")
    return TRANSPORTS[name]


def _load(name: str, where: str, base: type):
    module, _, attr = where.partition(":")
    cls: Any = getattr(importlib.import_module(module, __package__), attr)
    if not (isinstance(cls, type) and issubclass(cls, base)) or getattr(cls, "kind", None) != name:
        raise ConfigError(f"transport {name!r}: {where} must be a {base.__name__} subclass whose "
                          f"kind is {name!r}")
    return cls
