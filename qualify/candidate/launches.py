"""How the candidate stage groups a contract's cells into harness launches.

One launch runs one topology (Actor TP ``a`` + Critic TP ``c``, separate process groups,
``a + c`` ranks, times the degrees of the cells' other axes) and yields the outputs of its
cells; an engine whose spec groups variants (:attr:`qualify.registry.EngineSpec.groups_variants`)
runs every precision x options variant of a topology in one launch, and one that groups
topologies (:attr:`~qualify.registry.EngineSpec.groups_topologies`) every topology of one
world size. The candidate stage (:mod:`qualify.candidate.stage`) launches what
:func:`plan_launches` returns; ``qualify plan`` (:mod:`qualify.candidate.plan`) plans the
same launches. Imports neither torch nor any engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from qualify.contract import CellSpec, Contract
from qualify.matrix import Precision
from qualify.protocol import variant_tag

__all__ = ["Launch", "LaunchPart", "in_stage_order", "launches_for", "plan_launches"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPart:
    """One precision x options x other-axes variant of a launch and the cells it produces.

    Attributes:
        precision, options, axes: as in :class:`qualify.contract.CellSpec`.
        actor: the Actor cell it produces (``None`` if the Actor is not run).
        critic: the Critic cell it produces (``None`` if not run).
        own_topology: the part names its topology in ``cell.json`` and in its tag (a
            launch of several topologies).
    """

    precision: str
    options: tuple[tuple[str, int], ...]
    actor: CellSpec | None
    critic: CellSpec | None
    axes: tuple[tuple[str, int], ...] = ()
    own_topology: bool = False

    @property
    def harness_options(self) -> dict[str, int]:
        """The cell.json ``options``: the engine options, then the non-TP axis degrees."""
        return {**dict(self.options), **dict(self.axes)}

    @property
    def actor_tp(self) -> int:
        """The Actor's TP size in this part (0: the Actor is not run)."""
        return self.actor.tp if self.actor is not None else 0

    @property
    def critic_tp(self) -> int:
        """The Critic's TP size in this part (0: the Critic is not run)."""
        return self.critic.tp if self.critic is not None else 0

    @property
    def tag(self) -> str:
        """Output subdirectory of this part in a grouped launch (``bf16-zero1``).

        A part that carries its own topology (``own_topology``): ``bf16-zero1-a2c1``.
        """
        topo = (self.actor_tp, self.critic_tp) if self.own_topology else None
        return variant_tag(self.precision, self.harness_options, topo)

    def variant(self, export_weights: bool) -> dict[str, Any]:
        """This part's ``cell.json`` ``variants`` entry (:class:`HarnessCell`)."""
        out: dict[str, Any] = {"precision": self.precision, "options": self.harness_options}
        if self.own_topology:
            out.update(actor_tp=self.actor_tp, critic_tp=self.critic_tp,
                       export_weights=export_weights)
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """One harness launch: one or several topologies of one engine, one or several variants.

    An engine whose spec has ``groups_variants`` gets one launch per topology carrying
    every precision x options variant (one process group serves them all); with
    ``groups_topologies`` as well, one launch per world size carrying every topology of
    that size (topology-major, each topology's variants in matrix order; each part names
    its topology, the harness builds that topology's role groups). Any other engine gets
    one launch per topology x precision x options.

    Attributes:
        engine: engine name.
        topology: topology name, or the names joined by ``-`` (``a1c2-a2c1``) for a launch
            of several topologies.
        parts: the variants, in launch order (one for a non-grouped engine).
        grouped: outputs are per-variant subdirectories (``HarnessCell.variants``).
    """

    engine: str
    topology: str
    parts: tuple[LaunchPart, ...]
    grouped: bool = False

    @property
    def precision(self) -> str:
        """Precision of the first variant (the cell.json's ``precision``)."""
        return self.parts[0].precision

    @property
    def options(self) -> tuple[tuple[str, int], ...]:
        """Options of the first variant, then its non-TP axis degrees (cell.json ``options``)."""
        return tuple(self.parts[0].harness_options.items())

    @property
    def actor(self) -> CellSpec | None:
        """An Actor cell of the launch (``None``: no variant runs the Actor)."""
        return next((p.actor for p in self.parts if p.actor is not None), None)

    @property
    def critic(self) -> CellSpec | None:
        """A Critic cell of the launch (``None``: no variant runs the Critic)."""
        return next((p.critic for p in self.parts if p.critic is not None), None)

    @property
    def actor_tp(self) -> int:
        """The cell.json ``actor_tp``: the first part's (every part has the same world)."""
        return self.parts[0].actor_tp

    @property
    def critic_tp(self) -> int:
        """The cell.json ``critic_tp``: the first part's."""
        return self.parts[0].critic_tp

    @property
    def launch_id(self) -> str:
        """``torch_tp-fp32-a2c1`` (``deepspeed-bf16-zero1-a2c1``; grouped: ``deepspeed-a2c1``).

        A launch of several topologies: ``megatron-a1c2-a2c1``.
        """
        if self.grouped:
            return f"{self.engine}-{self.topology}"
        opts = "".join(f"-{k}{v}" for k, v in self.options)
        return f"{self.engine}-{self.precision}{opts}-{self.topology}"

    @property
    def cells(self) -> list[CellSpec]:
        """The cells this launch produces."""
        return [c for p in self.parts for c in (p.actor, p.critic) if c is not None]

    def part_of(self, cell: CellSpec) -> LaunchPart:
        """The variant that produces ``cell``."""
        return next(p for p in self.parts if cell in (p.actor, p.critic))


def launches_for(contract: Contract, wanted: Sequence[CellSpec]) -> list[Launch]:
    """:func:`plan_launches` with each engine's grouping taken from the registry.

    Engines whose :attr:`~qualify.registry.EngineSpec.groups_variants` is set launch their
    variants together, those also ``groups_topologies`` one launch per world size. The
    candidate stage and ``qualify plan`` both group cells here.

    Raises:
        ContractError: an engine of ``wanted`` is not registered
            (:func:`qualify.registry.get_engine`).
    """
    from qualify.registry import get_engine  # the engine table loads the harnesses' specs

    grouped = sorted({c.engine for c in wanted if get_engine(c.engine).groups_variants})
    by_world = [e for e in grouped if get_engine(e).groups_topologies]
    return plan_launches(contract, wanted, grouped_engines=grouped, topology_engines=by_world)


def in_stage_order(contract: Contract, launches: Sequence[Launch]) -> list[Launch]:
    """``launches`` in the order the candidate stage runs them.

    The launch holding the cell that exports the sampler's weights
    (``sampler.weights_from``) first, so that the sampler cells can run beside the others;
    the rest in the order given.
    """
    source = contract.sampler.weights_from if contract.sampler is not None else ""
    return sorted(launches, key=lambda lc: source not in {c.cell_id for c in lc.cells})


def plan_launches(contract: Contract, wanted: Sequence[CellSpec],
                  grouped_engines: Sequence[str] = (),
                  topology_engines: Sequence[str] = ()) -> list[Launch]:
    """Group the wanted cells into launches, each cell in exactly one launch.

    Topologies are taken in contract order; a topology launches only the roles whose cell
    is still wanted (the other role gets TP 0). Engines in ``grouped_engines`` get one
    launch per topology holding all their variants; those also in ``topology_engines``
    one launch per world size (``actor_tp + critic_tp`` of the roles launched, and the
    same non-TP axes) holding every topology of it, topology-major; in a launch of several
    topologies each part carries its own (``own_topology``; see :class:`Launch`).
    """
    todo = {c.cell_id: c for c in wanted}
    order = [c.cell_id for c in wanted]

    def key(x: CellSpec) -> tuple[str, Precision, tuple[tuple[str, int], ...],
                                  tuple[tuple[str, int], ...]]:
        return x.engine, x.precision, x.options, x.axes

    keys = sorted({key(c) for c in wanted},
                  key=lambda k: order.index(next(x.cell_id for x in wanted if key(x) == k)))
    singles: list[tuple[str, int, str, LaunchPart]] = []
    for engine, precision, options, axes in keys:
        for t, topo in enumerate(contract.matrix.topologies):
            actor = CellSpec(engine=engine, precision=precision,
                             role="actor", tp=topo.actor_tp, options=options, axes=axes)
            critic = CellSpec(engine=engine, precision=precision,
                              role="critic", tp=topo.critic_tp, options=options, axes=axes)
            a = todo.pop(actor.cell_id, None)
            c = todo.pop(critic.cell_id, None)
            if a or c:
                singles.append((engine, t, topo.name, LaunchPart(
                    precision=precision, options=options, actor=a, critic=c, axes=axes)))
    assert not todo, f"cells not covered by any topology: {sorted(todo)}"
    # a launch of its own, or the key of a grouped launch (its parts gathered below)
    slots: list[Launch | tuple[Any, ...]] = []
    grouped: dict[tuple[Any, ...], list[tuple[int, str, LaunchPart]]] = {}
    for engine, t, topo_name, part in singles:
        if engine not in grouped_engines:
            slots.append(Launch(engine=engine, topology=topo_name, parts=(part,)))
            continue
        gkey: tuple[Any, ...] = ((engine, part.actor_tp + part.critic_tp, part.axes)
                                 if engine in topology_engines else (engine, topo_name))
        if gkey not in grouped:
            grouped[gkey] = []
            slots.append(gkey)
        grouped[gkey].append((t, topo_name, part))
    out: list[Launch] = []
    for slot in slots:
        if isinstance(slot, Launch):
            out.append(slot)
            continue
        members = sorted(grouped[slot], key=lambda m: m[0])  # topology-major, stable
        names = list(dict.fromkeys(name for _, name, _ in members))
        # several topologies: each part names its own (a one-topology launch is unchanged)
        parts = tuple(dataclasses.replace(p, own_topology=len(names) > 1)
                      for _, _, p in members)
        name = "-".join(names)
        if any(lc.launch_id == f"{slot[0]}-{name}" for lc in out):  # same topologies, other
            name += f"-w{parts[0].actor_tp + parts[0].critic_tp}"  # roles: a distinct id
        out.append(Launch(engine=slot[0], topology=name, parts=parts, grouped=True))
    return out
