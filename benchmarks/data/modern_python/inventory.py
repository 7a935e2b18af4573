"""An in-memory inventory service with typed records, validation and a small query API."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Iterable, Iterator, Protocol


class Category(str, Enum):
    TOOLS = "tools"
    FOOD = "food"
    BOOKS = "books"


@dataclass(frozen=True, slots=True)
class Item:
    sku: str
    name: str
    category: Category
    price_cents: int
    quantity: int = 0
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.price_cents < 0:
            raise ValueError(f"{self.sku}: price must be >= 0, got {self.price_cents}")
        if not self.sku.isalnum():
            raise ValueError(f"{self.sku!r}: a SKU is letters and digits only")

    @property
    def value_cents(self) -> int:
        return self.price_cents * self.quantity


class Clock(Protocol):
    def now(self) -> datetime: ...


class UtcClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)


@dataclass
class Inventory:
    clock: Clock = field(default_factory=UtcClock)
    _items: dict[str, Item] = field(default_factory=dict)
    _log: list[tuple[datetime, str, int]] = field(default_factory=list)

    def add(self, item: Item) -> None:
        if item.sku in self._items:
            raise KeyError(f"duplicate SKU {item.sku}")
        self._items[item.sku] = item
        self._log.append((self.clock.now(), item.sku, item.quantity))

    def restock(self, sku: str, amount: int) -> Item:
        match self._items.get(sku):
            case None:
                raise KeyError(f"unknown SKU {sku}")
            case Item() as old if amount > 0:
                new = Item(old.sku, old.name, old.category, old.price_cents, old.quantity + amount, old.tags)
                self._items[sku] = new
                self._log.append((self.clock.now(), sku, amount))
                return new
            case _:
                raise ValueError(f"restock amount must be positive, got {amount}")

    def by_category(self) -> dict[Category, list[Item]]:
        groups: dict[Category, list[Item]] = defaultdict(list)
        for item in self._items.values():
            groups[item.category].append(item)
        return {k: sorted(v, key=lambda it: it.name) for k, v in groups.items()}

    def search(self, text: str, *, limit: int = 10) -> list[Item]:
        needle = text.casefold()
        hits = [it for it in self._items.values() if needle in it.name.casefold() or needle in it.tags]
        return sorted(hits, key=lambda it: (-it.quantity, it.sku))[:limit]

    def total_value(self) -> int:
        return sum(it.value_cents for it in self._items.values())

    def __iter__(self) -> Iterator[Item]:
        yield from self._items.values()

    def to_json(self) -> str:
        return json.dumps([asdict(it) | {"category": it.category.value} for it in self], indent=2)


def summarize(items: Iterable[Item]) -> str:
    rows = [f"{it.sku:<8} {it.name:<24} {it.quantity:>5} x {it.price_cents / 100:>8.2f}" for it in items]
    return "\n".join(rows) if rows else "(empty)"
