"""The one-GPU copy of a contract (``scripts/gpu/acceptance.py``), as TOML text.

Edits the committed contract's text section by section, so its comments stay, then lets
qualify's own loader validate the result (:func:`contract_cells`).
"""

from __future__ import annotations

import json
import re
from typing import Final

ENGINES: Final = ("torch_tp", "deepspeed", "megatron")
"""The engines the copy keeps (the ones that train on CUDA at TP 1; no vLLM there)."""

_HEADER: Final = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-]+)\s*\]\]?\s*(#.*)?$")


def _sections(text: str) -> list[tuple[str, bool, list[str]]]:
    """``[(name, is_array_table, lines)]``; the preamble before any header has name ``""``."""
    out: list[tuple[str, bool, list[str]]] = [("", False, [])]
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            out.append((m.group(2), m.group(1) == "[[", [line]))
        else:
            out[-1][2].append(line)
    return out


def _value_end(lines: list[str], start: int) -> int:
    """Index of the last line of the value that begins on ``lines[start]`` (arrays may span)."""
    depth, quote = 0, ""
    for i in range(start, len(lines)):
        line = lines[i] if i > start else lines[i].split("=", 1)[1]
        j = 0
        while j < len(line):
            ch = line[j]
            if quote:
                if ch == "\\":
                    j += 1
                elif ch == quote:
                    quote = ""
            elif ch in "\"'":
                quote = ch
            elif ch == "#":
                break
            elif ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
            j += 1
        if depth <= 0:
            return i
    raise ValueError(f"unterminated value starting at {lines[start]!r}")


def _set_key(lines: list[str], key: str, literal: str) -> None:
    """Replace ``key = ...`` (a value of one or more lines) in a section, or append it."""
    pat = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i, line in enumerate(lines):
        if pat.match(line):
            end = _value_end(lines, i)
            lines[i:end + 1] = [f"{key} = {literal}"]
            return
    at = len(lines)
    while at > 1 and not lines[at - 1].strip():
        at -= 1
    lines.insert(at, f"{key} = {literal}")


def gpu_contract_text(text: str, overrides: dict[str, dict[str, str]] | None = None) -> str:
    """The one-GPU copy of a contract's TOML text (comments kept).

    Engines restricted to :data:`ENGINES` (order kept), ``matrix.tp_sizes = [1]``, every
    ``[[matrix.topologies]]`` replaced by ``a1c1`` (Actor TP1 + Critic TP1), the
    ``[sampler]`` stage dropped, ``sampling.engine = "hf"``, ``name`` suffixed ``-gpu``, then
    ``overrides`` (``{section: {key: literal}}``).

    Raises:
        ValueError: no ``[matrix]`` section, or none of :data:`ENGINES` in it.
    """
    secs = [s for s in _sections(text)
            if s[0] != "sampler" and not s[0].startswith("sampler.")
            and s[0] != "matrix.topologies"]
    names = [s[0] for s in secs]
    if "matrix" not in names:
        raise ValueError("the contract has no [matrix] section")
    matrix = secs[names.index("matrix")][2]
    found = next((ln for ln in matrix if re.match(r"^\s*engines\s*=", ln)), "")
    engines = [e for e in ENGINES if f'"{e}"' in found]
    if not engines:
        raise ValueError(f"[matrix] engines names none of {list(ENGINES)}")
    _set_key(matrix, "engines", json.dumps(engines))
    _set_key(matrix, "tp_sizes", "[1]")
    edits: dict[str, dict[str, str]] = {"sampling": {"engine": '"hf"'}}
    for sec, kv in (overrides or {}).items():
        edits.setdefault(sec, {}).update(kv)
    preamble = secs[0][2]
    name_line = next((ln for ln in preamble if re.match(r"^\s*name\s*=", ln)), None)
    if name_line is not None:
        name = json.loads(name_line.split("=", 1)[1].strip())
        _set_key(preamble, "name", json.dumps(f"{name}-gpu"))
    for sec, kv in edits.items():
        if sec not in names:
            raise ValueError(f"override of [{sec}]: the contract has no such section")
        for key, literal in kv.items():
            _set_key(secs[names.index(sec)][2], key, literal)
    # the topology goes after the last [matrix...] table
    last = max(i for i, n in enumerate(names) if n == "matrix" or n.startswith("matrix."))
    topo = ("matrix.topologies", True,
            ["[[matrix.topologies]]", 'name = "a1c1"', "actor_tp = 1", "critic_tp = 1", ""])
    secs.insert(last + 1, topo)
    header = ["# GPU acceptance copy written by scripts/gpu/acceptance.py: engines "
              f"{engines}, TP 1 (a1c1), no [sampler], HF sampling; not a committed contract."]
    return "\n".join(header + [ln for _, _, lines in secs for ln in lines]) + "\n"


def contract_cells(text: str) -> list[str]:
    """Cell ids of a contract text (validated by qualify's own loader)."""
    from qualify.contract import loads_contract

    return [c.cell_id for c in loads_contract(text).matrix.cells()]
