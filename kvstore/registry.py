"""Classes found by name: the one table behind every ``register`` decorator.

Optimizers and learning-rate schedulers cross the wire as a name plus
parameters, and ``kvstore.create`` finds user store types by name, so each
keeps a :class:`Registry`. Names match case-insensitively. Registering the same
class again (a module reloaded) is harmless; a different class taking a name
that is already taken is an error, because it would silently change what a
name (in a config already on the wire, or in a user's ``create`` call) means.

Example::

    >>> from kvstore.registry import Registry, own_name
    >>> class Base: pass
    >>> table = Registry("widget", Base, "register_widget", own_name)
    >>> @table.add
    ... class Knob(Base):
    ...     name = "knob"
    >>> table.lookup("KNOB") is Knob
    True
"""

from __future__ import annotations

from typing import Callable

from .errors import ConfigError


def own_name(cls: type) -> str:
    """``cls.name``, defined on ``cls`` itself (a subclass does not inherit its
    parent's name). Raises ConfigError when it is missing or not a non-empty str."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{cls.__name__} needs its own non-empty str class attribute 'name'")
    return name


class Registry:
    """A case-insensitive ``name -> class`` table for subclasses of ``base``.

    ``kind`` names the entries in messages ("optimizer"), ``decorator`` the
    public function that registers them, ``name_of(cls)`` gives a class's name
    (it may raise ConfigError).
    """

    def __init__(self, kind: str, base: type, decorator: str, name_of: Callable[[type], str]):
        self.kind, self.base, self.decorator, self._name_of = kind, base, decorator, name_of
        self._classes: dict[str, type] = {}

    def add(self, cls):
        """Register ``cls`` under its lower-cased name and return it (a class
        decorator). Raises ConfigError for a class that is not a ``base``
        subclass, has no valid name, or whose name another class holds."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ConfigError(f"{self.decorator} expects a {self.base.__name__} subclass, got {cls!r}")
        key = self._name_of(cls).lower()
        old = self._classes.get(key)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ConfigError(f"{self.kind} name {key!r} is already registered by "
                              f"{old.__module__}.{old.__qualname__}")
        self._classes[key] = cls
        return cls

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._classes)

    def get(self, name: str) -> type | None:
        """The class registered as ``name`` (any case), or None."""
        return self._classes.get(name.lower())

    def pop(self, name: str, default=None):
        """Forget ``name`` (any case) and return its class, or ``default`` (tests use
        it to undo their registrations)."""
        return self._classes.pop(name.lower(), default)

    def lookup(self, name) -> type:
        """The class registered as ``name`` (any case). Raises ConfigError for a
        name that is not a str or not registered (listing the valid names)."""
        if not isinstance(name, str):
            raise ConfigError(f"{self.kind} name must be a str, got {type(name).__name__}")
        cls = self.get(name)
        if cls is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid names are {', '.join(self.names())}")
        return cls
