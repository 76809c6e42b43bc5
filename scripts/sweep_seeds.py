#!/usr/bin/env python3
"""False-alarm sweep: the default contract over N seeds, every FAIL listed.

For each seed offset ``k`` (0, 1, ..., N - 1, or the ``--offsets`` given) a variant of the
contract is written into a directory of its own, with ``model.seed`` and ``sampling.seed``
both moved by ``k`` (another random model and another rollout together) and the name
``<name>-seed<k>`` (its references and evidence stay apart); ``k = 0`` is the contract's own
seeds. Each variant runs through ``qualify run`` (reference, every cell, compare), one after
the other, and the script prints, per seed, every FAIL row (cell, family, round, class,
margin) of its ``report.json`` and the NOT_RUN counts (cells and rows).

A conforming engine should pass on every seed: a FAIL on one seed only is either a real
difference the other seeds do not exercise (explain it from the evidence) or a bound rule
that under-states the noise (fix the rule, never the number).

Usage::

    python scripts/sweep_seeds.py --seeds 5 --out /tmp/sweep        # 5 seeds, ~5 min each
    python scripts/sweep_seeds.py --offsets 3 --out /tmp/sweep      # seed offset 3 only
    python scripts/sweep_seeds.py --seeds 5 --out /tmp/sweep --report-only   # tabulate again

Exit status: 0 when every seed's run produced a report (whatever its verdict), 1 when a
run produced none.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONTRACT = REPO / "contracts" / "tiny-qwen3.toml"


def _set_in_section(text: str, section: str, key: str, value: str) -> str:
    """Replace ``key = ...`` inside ``[section]`` (up to the next header); exactly once."""
    pattern = re.compile(
        rf"(?m)(^\[{re.escape(section)}\]\n(?:(?!^\[).*\n)*?)^{re.escape(key)} = .*$")
    new, n = pattern.subn(lambda m: f"{m.group(1)}{key} = {value}", text, count=1)
    if n != 1:
        raise SystemExit(f"sweep_seeds: no '{key} = ...' in [{section}] of the contract")
    return new


def _get_in_section(text: str, section: str, key: str) -> str:
    m = re.search(
        rf"(?m)^\[{re.escape(section)}\]\n(?:(?!^\[).*\n)*?^{re.escape(key)} = (.*)$", text)
    if m is None:
        raise SystemExit(f"sweep_seeds: no '{key} = ...' in [{section}] of the contract")
    return m.group(1).strip()


def variant_text(text: str, offset: int) -> tuple[str, str]:
    """The contract text with both seeds moved by ``offset``; returns ``(name, text)``."""
    name = json.loads(re.search(r'(?m)^name = (".*")$', text).group(1))  # type: ignore[union-attr]
    new_name = f"{name}-seed{offset}"
    text = re.sub(r'(?m)^name = ".*"$', f'name = "{new_name}"', text, count=1)
    for section in ("model", "sampling"):
        seed = int(_get_in_section(text, section, "seed"))
        text = _set_in_section(text, section, "seed", str(seed + offset))
    return new_name, text


def _latest_report(evidence: Path, name: str) -> Path | None:
    runs = sorted(p for p in (evidence / name).glob("*/report.json") if p.is_file())
    return runs[-1] if runs else None


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def summarize(report: dict[str, Any]) -> str:
    """Every FAIL row and the NOT_RUN counts of one ``report.json``."""
    rows = report["rows"]
    fails = sorted((r for r in rows if r["verdict"] == "FAIL"),
                   key=lambda r: (r["cell"], r["family"], r.get("round") or 0,
                                  r.get("class") or "", -(r.get("margin") or 0)))
    cells = report["cells"]
    verdicts: dict[str, int] = {}
    for c in cells:
        verdicts[c["verdict"]] = verdicts.get(c["verdict"], 0) + 1
    not_run_rows = sum(r["verdict"] == "NOT_RUN" for r in rows)
    out = [f"cells: {', '.join(f'{k} {v}' for k, v in sorted(verdicts.items()))}; "
           f"rows: {len(rows)}, FAIL {len(fails)}, NOT_RUN {not_run_rows}"]
    if fails:
        out.append(_table(
            [[r["cell"], r["family"], str(r.get("round") or ""), r.get("class") or "",
              r.get("metric") or "", "inf" if r.get("margin") is None else
              f"{r['margin']:.3g}"] for r in fails],
            ["cell", "family", "round", "class", "metric", "margin"]))
    else:
        out.append("no FAIL row")
    nr = [c for c in cells if c["verdict"] == "NOT_RUN"]
    if nr:
        out.append("NOT_RUN cells: " + ", ".join(
            f"{c['cell']} ({c['rows'].get('NOT_RUN', 0)} rows)" for c in nr))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run (or tabulate) the sweep; the exit status of the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contract", type=Path, default=DEFAULT_CONTRACT)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--seeds", type=int, default=5, help="seed offsets 0 .. N-1 (default 5)")
    g.add_argument("--offsets", type=int, nargs="+", help="explicit seed offsets")
    ap.add_argument("--out", type=Path, required=True,
                    help="working directory: contracts/, references/, evidence/, logs/")
    ap.add_argument("--cells", nargs="+", help="cell id globs passed to qualify run")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing; tabulate the reports already under --out")
    args = ap.parse_args(argv)
    offsets = args.offsets if args.offsets is not None else list(range(args.seeds))
    text = args.contract.read_text(encoding="utf-8")
    out = args.out.resolve()
    for d in ("contracts", "references", "evidence", "logs"):
        (out / d).mkdir(parents=True, exist_ok=True)
    missing = 0
    for k in offsets:
        name, vtext = variant_text(text, k)
        path = out / "contracts" / f"{name}.toml"
        path.write_text(vtext, encoding="utf-8")
        rc = None
        wall = None
        if not args.report_only:
            cmd = [sys.executable, "-m", "qualify", "run", str(path),
                   "--references", str(out / "references"), "--evidence",
                   str(out / "evidence"), "--quiet"]
            if args.cells:
                cmd += ["--cells", *args.cells]
            t0 = time.monotonic()
            with (out / "logs" / f"{name}.log").open("w") as log:
                rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    check=False).returncode
            wall = time.monotonic() - t0
        report = _latest_report(out / "evidence", name)
        model_seed = _get_in_section(vtext, "model", "seed")
        sampling_seed = _get_in_section(vtext, "sampling", "seed")
        head = (f"## seed offset {k}: {name} (model.seed {model_seed}, sampling.seed "
                f"{sampling_seed})" + (f", qualify run exit {rc}" if rc is not None else "")
                + (f", {wall:.0f} s" if wall is not None else ""))
        print(head)
        if report is None:
            missing += 1
            print(f"no report.json under {out / 'evidence' / name}"
                  + (f" (log: {out / 'logs' / (name + '.log')})" if rc is not None else ""))
        else:
            print(f"report: {report}")
            print(summarize(json.loads(report.read_text(encoding="utf-8"))))
        print(flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
