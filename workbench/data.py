"""Every file in ``data/`` is made by package code; ``python -m workbench.data`` regenerates them.

Each generator is a function in ``GENERATORS`` that writes its files and returns their paths.
Add a case's generator to the list; ``python -m workbench.data NAME ...`` runs only the named ones.
Generators import their case lazily, so importing this module stays cheap.
"""
from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable

DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data"


def addition_lm() -> list[pathlib.Path]:
    """Case 05: the split-KV decoder LM trained on multi-digit addition (a few minutes on 2 CPU cores)."""
    from .cases.lazy_attention_state_capture import task

    return [task.write_checkpoint(DATA_DIR / task.CHECKPOINT_NAME)]


GENERATORS: list[Callable[[], list[pathlib.Path]]] = [addition_lm]


def main(argv: list[str] | None = None) -> None:
    names = {g.__name__: g for g in GENERATORS}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"generators to run (default: all): {', '.join(names)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(names))
    if unknown:
        parser.error(f"unknown generator(s) {unknown}; choose from {sorted(names)}")
    for name in args.names or list(names):
        for path in names[name]():
            print(f"{name}: wrote {path}")


if __name__ == "__main__":
    main()
