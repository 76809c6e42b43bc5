"""The qualification matrix: cells, their ids, topologies and the sampler cells.

A cell is engine x precision x options x role x parallel degrees; its id
(``deepspeed-bf16-zero0-actor-tp2``) is used in paths, reports and gate policies. Every
engine named here is looked up in :mod:`qualify.registry`, and ``matrix.engine_options`` is
checked against the options and axes its spec declares (``harnesses/<engine>/spec.py``):
no engine name is written in this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

from qualify import registry
from qualify.errors import ContractError
from qualify.lanes import lane_of, lanes

Precision = Literal["fp32", "bf16"]
Role = Literal["actor", "critic"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """One placement: Actor TP size, Critic TP size, rollout TP size."""

    name: str
    actor_tp: int
    critic_tp: int
    rollout_tp: int = 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellSpec:
    """One qualification cell: engine x precision x options x role x parallel degrees.

    Attributes:
        engine: registered engine name.
        precision: ``fp32`` or ``bf16`` (BF16 compute, FP32 master weights, grads, state).
        role: ``actor`` or ``critic``.
        tp: tensor-parallel size (the role's degree in its topology).
        options: engine options that change the numbers, as ``(key, value)`` in the
            engine's declared order (e.g. ``(("zero", 1),)``).
        axes: the engine's other parallel axes as ``(name, degree)`` in its declared
            order (e.g. ``(("dp", 2),)``); empty for an engine with the TP axis only.
    """

    engine: str
    precision: Precision
    role: Role
    tp: int
    options: tuple[tuple[str, int], ...] = ()
    axes: tuple[tuple[str, int], ...] = ()

    @property
    def cell_id(self) -> str:
        """Stable, human-readable id, e.g. ``deepspeed-bf16-zero0-actor-tp2`` (``...-tp1-dp2``)."""
        opts = "".join(f"-{k}{v}" for k, v in self.options)
        axes = "".join(f"-{a}{d}" for a, d in self.axes)
        return f"{self.engine}-{self.precision}{opts}-{self.role}-tp{self.tp}{axes}"

    @property
    def harness_options(self) -> dict[str, int]:
        """The ``options`` of this cell's ``cell.json``: its options, then its other axes."""
        return {**dict(self.options), **dict(self.axes)}

    @property
    def is_base(self) -> bool:
        """Every parallel axis is at its base degree (TP 1, ...)."""
        return self.tp == registry.BASE_DEGREE and all(
            d == registry.BASE_DEGREE for _, d in self.axes)

    def base_cell(self) -> CellSpec:
        """The same cell with every parallel axis at its base degree (the TP=n vs TP=1 side)."""
        return dataclasses.replace(self, tp=registry.BASE_DEGREE,
                                   axes=tuple((a, registry.BASE_DEGREE) for a, _ in self.axes))

    def base_cell_id(self) -> str:
        """Id of :meth:`base_cell` (``deepspeed-bf16-zero0-actor-tp2`` -> ``...-actor-tp1``)."""
        return self.base_cell().cell_id

    @property
    def lane(self) -> str:
        """The reference lane this cell is compared in (:func:`qualify.lanes.lane_of`).

        ``fp32``; at BF16 ``bf16``, ``bf16-castmasters`` or ``bf16-autocast`` by the
        engine's declared :attr:`~qualify.registry.EngineSpec.bf16_style`.

        Raises:
            UsageError: the engine is not registered.
        """
        return lane_of(self.precision, registry.get_engine(self.engine).bf16_style)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedNotRun:
    """A row the contract expects an engine not to run (``matrix.expected_not_run``).

    A ``NOT_RUN`` row of a cell of ``engine`` in ``family`` (and ``round``, when given) is
    listed with :attr:`reason` and leaves the cell's verdict to its other rows
    (:func:`qualify.compare.verdicts.cell_verdict`); a row of that family that ran and
    failed still fails the cell, and any other ``NOT_RUN`` row still makes it ``NOT_RUN``.

    Attributes:
        engine: a matrix engine.
        family: the row family (``rewards``, ``losses``, ``dtypes``...).
        reason: why the engine cannot run it (shown with the row).
        round: the round (``None``: every round).
    """

    engine: str
    family: str
    reason: str
    round: int | None = None

    def matches(self, engine: str, family: str, round_: int | None) -> bool:
        """Whether a row of ``engine``, ``family`` and ``round_`` is this expectation's."""
        return (engine, family) == (self.engine, self.family) and \
            (self.round is None or self.round == round_)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MatrixSpec:
    """The engine x precision x TP x role matrix, its topologies and its engine options.

    Attributes:
        engines: registered trainer engines.
        precisions: precisions of every engine.
        tp_sizes: the TP sizes the topologies use.
        roles: the roles qualified.
        topologies: the placements (Actor TP, Critic TP, rollout TP).
        engine_options: per engine, per option or non-TP axis of its spec (by its contract
            field name), the values to qualify; an option or axis not named takes its
            spec's default (an axis: its base degree).
        required_cells: the cells a report must hold (``None``: every cell).
        expected_not_run: rows the contract expects an engine not to run
            (:class:`ExpectedNotRun`; empty when the contract names none).

    Raises:
        ContractError: an unknown engine, a value its spec does not allow, or a topology
            inconsistent with the TP sizes; the message names the field.
    """

    engines: tuple[str, ...]
    precisions: tuple[Precision, ...]
    tp_sizes: tuple[int, ...]
    roles: tuple[Role, ...]
    topologies: tuple[Topology, ...]
    engine_options: Mapping[str, Mapping[str, tuple[int, ...]]] = dataclasses.field(
        default_factory=dict)
    required_cells: tuple[str, ...] | None = None
    expected_not_run: tuple[ExpectedNotRun, ...] = ()

    def __post_init__(self) -> None:
        for i, e in enumerate(self.expected_not_run):
            if e.engine not in self.engines:
                raise ContractError(f"matrix.expected_not_run[{i}].engine: {e.engine!r} is not "
                                    f"in matrix.engines {list(self.engines)}")
        names = [t.name for t in self.topologies]
        if len(set(names)) != len(names):
            raise ContractError(f"matrix.topologies: duplicate topology names {names}")
        for i, topo in enumerate(self.topologies):
            for field in ("actor_tp", "critic_tp"):
                tp = getattr(topo, field)
                if tp not in self.tp_sizes:
                    raise ContractError(
                        f"matrix.topologies[{i}].{field}: {tp} is not in "
                        f"matrix.tp_sizes {list(self.tp_sizes)}"
                    )
        covered = {t.actor_tp for t in self.topologies} | {t.critic_tp for t in self.topologies}
        missing = sorted(set(self.tp_sizes) - covered)
        if missing:
            raise ContractError(
                f"matrix.tp_sizes: TP sizes {missing} are used by no topology"
            )
        for i, engine in enumerate(self.engines):
            spec = _engine_spec(engine, f"matrix.engines.{i}")
            if spec.kind != "trainer":
                raise ContractError(f"matrix.engines.{i}: {engine!r} is a {spec.kind} "
                                    f"engine, not a trainer")
            bad = sorted(set(self.tp_sizes) - set(spec.tp_degrees))
            if bad:
                raise ContractError(f"matrix.tp_sizes: {engine!r} does not run TP {bad} "
                                    f"(its TP degrees: {', '.join(map(str, spec.tp_degrees))})")
        for engine, chosen in self.engine_options.items():
            _check_engine_options(_engine_spec(engine, f"matrix.engine_options.{engine}"),
                                  chosen)

    def _values(self, engine: str) -> tuple[registry.EngineSpec, Mapping[str, tuple[int, ...]]]:
        return registry.get_engine(engine), self.engine_options.get(engine, {})

    def engine_options_of(self, engine: str) -> list[tuple[tuple[str, int], ...]]:
        """Option combinations that change the numbers for ``engine``, in matrix order.

        The product of the engine's declared options (its order), each over the values the
        contract lists (its order) or the option's default: ``[(("zero", 0),), ...]``;
        ``[()]`` for an engine without options.
        """
        spec, chosen = self._values(engine)
        per_option = [[(o.key, v) for v in chosen.get(o.name, o.default)] for o in spec.options]
        return [tuple(combo) for combo in itertools.product(*per_option)]

    def axis_degrees(self, engine: str) -> list[tuple[tuple[str, int], ...]]:
        """Degree combinations of ``engine``'s non-TP axes (``[(("dp", 1),), (("dp", 2),)]``).

        ``[()]`` for an engine whose only axis is TP.
        """
        spec, chosen = self._values(engine)
        per_axis = [[(a.name, d) for d in chosen.get(a.name, (registry.BASE_DEGREE,))]
                    for a in spec.extra_axes]
        return [tuple(combo) for combo in itertools.product(*per_axis)]

    def lanes(self) -> list[str]:
        """The reference lanes the matrix's cells are compared in (:func:`qualify.lanes.lanes`)."""
        styles = [registry.get_engine(e).bf16_style for e in self.engines]
        return lanes(self.precisions, styles)

    def cells(self) -> list[CellSpec]:
        """Every cell, in a stable order (engine, precision, options, role, TP, other axes)."""
        out: list[CellSpec] = []
        for engine in self.engines:
            axes = self.axis_degrees(engine)
            for precision in self.precisions:
                for opts in self.engine_options_of(engine):
                    for role in self.roles:
                        tps = sorted({t.actor_tp if role == "actor" else t.critic_tp
                                      for t in self.topologies})
                        out.extend(
                            CellSpec(engine=engine, precision=precision, role=role, tp=tp,
                                     options=opts, axes=ax)
                            for tp in tps for ax in axes
                        )
        return out


def _check_engine_options(spec: registry.EngineSpec,
                          chosen: Mapping[str, Sequence[int]]) -> None:
    """Check ``matrix.engine_options.<engine>`` against the engine's declared options and axes.

    Raises:
        ContractError: a field the engine does not declare, or a value it does not allow.
    """
    where = f"matrix.engine_options.{spec.name}"
    fields = [o.name for o in spec.options] + [a.name for a in spec.extra_axes]
    for key, values in chosen.items():
        option, axis = spec.option(key), spec.axis(key)
        if option is not None:
            allowed: tuple[int, ...] = option.values
            what = "values"
        elif axis is not None and axis.name != registry.TOPOLOGY_AXIS:
            allowed, what = axis.degrees, f"{key} degrees"
        else:
            if key == registry.TOPOLOGY_AXIS:
                why = "the TP degrees come from matrix.topologies"
            else:
                close = difflib.get_close_matches(key, fields, n=2, cutoff=0.5)
                hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
                why = f"{hint}it takes: {', '.join(fields) or 'no options'}"
            raise ContractError(f"{where}.{key}: {spec.name!r} has no option or axis "
                                f"{key!r}; {why}")
        for i, value in enumerate(values):
            if value not in allowed:
                raise ContractError(
                    f"{where}.{key}.{i}: {value!r} is not one of the {what} {spec.name!r} "
                    f"takes ({', '.join(map(str, allowed))})")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplerSpec:
    """The candidate-stage sampler cells (:mod:`qualify.candidate.sampler_stage`).

    Attributes:
        engine: a registered engine of kind ``sampler``.
        tp_sizes: one sampler cell per TP size (``{engine}-fp32-sampler-tp{n}``), each
            one of the engine's TP degrees.
        weights_from: the Actor cell whose round-1-updated weights are installed.
        required: the sampler cells are required cells of the report.

    Raises:
        ContractError: an unknown engine, one that is not a sampler, or a TP size it
            does not run.
    """

    engine: str
    tp_sizes: tuple[int, ...]
    weights_from: str
    required: bool = True

    def __post_init__(self) -> None:
        spec = _engine_spec(self.engine, "sampler.engine")
        if spec.kind != "sampler":
            raise ContractError(f"sampler.engine: {self.engine!r} is a {spec.kind} engine, "
                                f"not a sampler")
        for i, tp in enumerate(self.tp_sizes):
            if tp not in spec.tp_degrees:
                raise ContractError(f"sampler.tp_sizes.{i}: {tp} is not a TP degree of "
                                    f"{self.engine!r} ({', '.join(map(str, spec.tp_degrees))})")

    def cell_ids(self) -> list[str]:
        """``vllm-fp32-sampler-tp1``... one per TP size, in order."""
        return [f"{self.engine}-fp32-sampler-tp{tp}" for tp in self.tp_sizes]


def _engine_spec(name: str, field: str) -> registry.EngineSpec:
    """The registered engine ``name``; an unknown name is a :class:`ContractError` at ``field``."""
    if name not in registry.ENGINES:
        raise ContractError(f"{field}: {registry.ENGINES.unknown_message(name)}")
    return registry.get_engine(name)


RESUME_SUFFIX: Final = "-resume"
"""Appended to a trainer cell's id to name its resume cell (``<cell id>-resume``)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResumeSpec:
    """The resume-equivalence cells (:mod:`qualify.candidate.resume_stage`, issue #18).

    Each selected trainer cell ``C`` gets a cell ``C-resume``: one launch runs rounds
    ``1..after_round`` and saves a checkpoint in the engine's own format, a second launch
    (a fresh interpreter) loads it and runs rounds ``after_round + 1..rounds``; the
    comparator holds those rounds against ``C``'s own (:mod:`qualify.compare.resume`).

    Attributes:
        after_round: rounds before the checkpoint (``1 <= after_round < rounds``, checked by
            :class:`qualify.contract.Contract`).
        cells: ``fnmatch`` globs on trainer cell ids (``None``: every matrix cell).
        required: the resume cells are required cells of the report.
    """

    after_round: int
    cells: tuple[str, ...] | None = None
    required: bool = True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, rounds: int,
                  cells: Sequence[CellSpec]) -> ResumeSpec:
        """The ``[resume]`` section (schema-checked), checked against the contract.

        Raises:
            ContractError: as :meth:`check`.
        """
        spec = cls(after_round=int(d["after_round"]),
                   cells=tuple(d["cells"]) if "cells" in d else None,
                   required=bool(d.get("required", True)))
        spec.check(rounds, [c.cell_id for c in cells])
        return spec

    def matching(self, cells: Sequence[CellSpec], glob: str,
                 engine: str | None) -> list[CellSpec]:
        """The trainer cells whose resume cell ``glob`` (of ``engine``, if given) names."""
        return [c for c in cells if engine in (None, c.engine) and self.selects(c.cell_id)
                and fnmatch.fnmatch(c.cell_id + RESUME_SUFFIX, glob)]

    def check(self, rounds: int, cell_ids: Sequence[str]) -> None:
        """Check the section against the contract's rounds and matrix cell ids.

        Raises:
            ContractError: ``after_round`` not below ``rounds``, or a glob that matches no
                cell (the message names the field).
        """
        if not self.after_round < rounds:
            raise ContractError(f"resume.after_round: {self.after_round} must be below "
                                f"algorithm.rounds = {rounds} (the resumed launch runs the "
                                "rounds after it)")
        for i, glob in enumerate(self.cells or ()):
            if not any(fnmatch.fnmatch(cid, glob) for cid in cell_ids):
                raise ContractError(f"resume.cells.{i}: {glob!r} matches no cell of the "
                                    f"matrix ({', '.join(cell_ids)})")

    def selects(self, cell_id: str) -> bool:
        """Whether the trainer cell ``cell_id`` gets a resume cell."""
        return self.cells is None or any(fnmatch.fnmatch(cell_id, g) for g in self.cells)

    def cell_ids(self, cells: Sequence[CellSpec]) -> list[str]:
        """The resume cell ids of ``cells`` this spec selects, in their order."""
        return [c.cell_id + RESUME_SUFFIX for c in cells if self.selects(c.cell_id)]
