"""A small name registry: case-insensitive, fails on duplicate names and on unknown names.

Used for the model catalog, the GPU and link tables, topology presets and sources. Lookup of an unknown name raises
``UnknownNameError``, which suggests the closest valid names ("did you mean ...?").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from toposched.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Values by canonical name plus aliases; names compare case-insensitively."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._by_key: dict[str, T] = {}
        self._canonical: dict[str, str] = {}  # lower-case canonical name -> canonical spelling
        self._aliases: dict[str, str] = {}  # lower-case alias -> lower-case canonical name

    def register(self, name: str, value: T, aliases: Iterable[str] = ()) -> None:
        """Add ``value`` under ``name`` and ``aliases``; any name already taken is an error."""
        for label in (name, *aliases):
            if label.lower() in self._by_key or label.lower() in self._aliases:
                raise ValueError(f"{self.kind} {label!r} is registered twice")
        key = name.lower()
        self._by_key[key] = value
        self._canonical[key] = name
        for alias in aliases:
            self._aliases[alias.lower()] = key

    def get(self, name: str) -> T:
        """The value for ``name`` or an alias of it; unknown names raise ``UnknownNameError``."""
        key = name.strip().lower()
        key = self._aliases.get(key, key)
        if key not in self._by_key:
            raise UnknownNameError(self.kind, name, self.all_names())
        return self._by_key[key]

    def canonical(self, name: str) -> str:
        """The canonical spelling of ``name`` (or of the entry its alias points at)."""
        self.get(name)
        key = name.strip().lower()
        return self._canonical[self._aliases.get(key, key)]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = name.strip().lower()
        return key in self._by_key or key in self._aliases

    def names(self) -> list[str]:
        """Canonical names in registration order."""
        return list(self._canonical.values())

    def all_names(self) -> list[str]:
        """Canonical names and aliases (for "did you mean")."""
        aliases = [a for a in self._aliases if a not in self._by_key]
        return [*self._canonical.values(), *aliases]

    def items(self) -> Iterator[tuple[str, T]]:
        """(canonical name, value) pairs in registration order."""
        for key, value in self._by_key.items():
            yield self._canonical[key], value

    def __len__(self) -> int:
        return len(self._by_key)
