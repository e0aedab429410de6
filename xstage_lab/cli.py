"""What every command line of the package shares: one list syntax (``list_option``).

An option that takes a list takes its items as separate words, comma-separated, or both, and may
be repeated: ``--tokens 1 8 64``, ``--tokens 1,8,64``, ``--tokens 1,8 --tokens 64`` are the same
list. Each item is converted (``int``, ``float``, a path...) and checked against the choices as it
is parsed; a bad one is one argparse error line naming the option and the item. An option names
at least one item unless it declares ``nargs="*"``: then ``--knee-models`` alone, or with ``""``,
is the empty list (a sweep turned off, say).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

# What an item must be, for the error line, by its converter.
_KINDS = {int: "an integer", float: "a number"}


def list_option(item: Callable[[str], object] = str, choices: Iterable | None = None,
                **kwargs) -> dict:
    """The keywords of ``parser.add_argument`` for a list option of ``item``s (out of
    ``choices`` where given): ``p.add_argument("--tokens", **list_option(int, default=[4096]))``.
    The parsed value is a list; a default is kept as given until the option appears."""
    allowed = None if choices is None else list(choices)

    def items(text: str) -> list:
        out = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            try:
                value = item(part)
            except ValueError as e:  # a converter of the package's own says why
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not {_KINDS[item]}" if item in _KINDS else str(e)) from None
            if allowed is not None and value not in allowed:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {part!r} (choose from {' '.join(map(str, allowed))})")
            out.append(value)
        return out

    kwargs.setdefault("nargs", "+")
    if allowed is not None and "metavar" not in kwargs:
        kwargs["metavar"] = "{" + ",".join(map(str, allowed)) + "}"
    return dict(type=items, action=_Items, **kwargs)


class _Items(argparse.Action):
    """Every item of every word of the option, and of its earlier appearances (the default
    replaced at the first)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = [v for word in values for v in word]
        if not given and self.nargs != "*":  # only commas: no item, as no word would be
            raise argparse.ArgumentError(self, "expected at least one item")
        so_far = getattr(namespace, self.dest, None)
        so_far = [] if so_far is None or so_far is self.default else list(so_far)
        setattr(namespace, self.dest, so_far + given)
