"""A race a Triton kernel can hide from every CPU check: a word every thread of a program
loads, one thread then rewrites, and the program then branches on.

Triton runs a scalar `tl.load` in every thread and a scalar `tl.store` in one. With no barrier
between the two, a warp that loads after that thread stored sees the new value; if the program
branches on it, that warp takes the other path, skips the barriers of the path the others take,
and their layout conversions through shared memory then read what it never wrote (garbage
addresses: the selection's count of misses, zeroed for the next call, did this,
benchmarks/NOTES.md thirty-third pass). The interpreter runs a program as one thread and cannot
show it; the PTX can. `reset_races` scans a kernel's PTX in order: a global load by every thread,
then a store through the same address register by one thread (a predicate `tid == 0` or one
derived from it), with no CTA barrier between, and a later branch on a predicate computed from
the loaded value. Shared-memory loads end the value's trail (what a barrier-ordered reduction
returns is the same in every thread).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_INSTRUCTION = re.compile(r"^(?:@!?(%p\d+)\s+)?([a-z][\w.:]*)\s*(.*?);?\s*$")
_ADDRESS = re.compile(r"\[\s*(%rd\d+)\s*(?:\+\s*0\s*)?\]")
_BARRIERS = ("bar.sync", "barrier.sync", "bar.cta.sync", "barrier.cta.sync")


@dataclass(frozen=True)
class ResetRace:
    """PTX line numbers (from 1) of the load, the one thread's store and the branch."""

    load_line: int
    store_line: int
    branch_line: int


@dataclass
class _Reset:
    load_line: int
    store_line: int
    tainted: set[str] = field(default_factory=set)


def reset_races(ptx: str) -> list[ResetRace]:
    """The races of the module docstring in `ptx`, one per (load, store, branch)."""
    from_tid: set[str] = set()  # registers computed from the thread index
    one_thread: set[str] = set()  # predicates true in one thread (tid-derived == 0)
    loaded: dict[str, tuple[int, set[str]]] = {}  # address -> (line, destinations) since a barrier
    resets: list[_Reset] = []
    found: set[ResetRace] = set()
    for number, raw in enumerate(ptx.splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith(("//", ".", "$", "{", "}")):
            continue
        match = _INSTRUCTION.match(text)
        if match is None:
            continue
        predicate, op, rest = match.groups()
        if op.startswith(_BARRIERS):
            loaded.clear()
            continue
        if op.startswith(("ld.global", "st.global")):
            address = _ADDRESS.search(rest)
            if address is None:
                continue
            if op.startswith("ld") and predicate not in one_thread:
                targets = set(re.findall(r"%r\w*\d+", rest.split("[")[0]))
                loaded.setdefault(address.group(1), (number, targets))
            elif op.startswith("st") and predicate in one_thread and address.group(1) in loaded:
                line, targets = loaded[address.group(1)]
                resets.append(_Reset(line, number, set(targets)))
            continue
        if op == "bra":
            found.update(ResetRace(r.load_line, r.store_line, number) for r in resets
                         if predicate is not None and predicate in r.tainted)
            continue
        operands = [o.strip() for o in rest.split(",")] if rest else []
        if not operands:
            continue
        target, sources = operands[0], " ".join(operands[1:])
        registers = set(re.findall(r"%\w+", sources))
        if "%tid" in sources or registers & from_tid:
            from_tid.add(target)
        if (op.startswith("setp.eq") and registers & from_tid
                and re.search(r"(^|\s)0$", sources.strip())) or (
                op.startswith("and.pred") and registers & one_thread):
            one_thread.add(target)
        if not op.startswith("ld.shared"):
            for reset in resets:
                if registers & reset.tainted:
                    reset.tainted.add(target)
    return sorted(found, key=lambda r: (r.load_line, r.store_line, r.branch_line))
