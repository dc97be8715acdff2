"""Pictures of a network: its tensors and bonds, and the forward contraction tree it runs.

A view takes values: the network and the tree it runs (the caller, ``tncomp.draw_network`` or
the CLI, compiles). Layouts come from networkx, figures from :mod:`tncomp.views.figures`.
:func:`network_drawing` returns what a picture shows (labels, tree, FLOPs) so callers and tests
can check the numbers behind it; :func:`draw` draws it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tncomp.compiler.cost import step_infos
from tncomp.compiler.ir import Dim, Network, Role, bind_dims
from tncomp.compiler.problem import Tree, problem_for
from tncomp.errors import SizeError
from tncomp.views.figures import check_output_path, format_count, new_figure, save_figure

DEFAULT_BATCH = 4096  # the batch a picture's FLOPs are shown at (as in ``tncomp inspect``)
ROLE_COLOURS = {Role.INPUT: "#f4a261", Role.PARAMETER: "#8ecae6"}
HUB_COLOUR = "#264653"
OPEN_COLOUR = "#2a9d8f"
SUMMED_COLOUR = "#9a9a9a"
STEP_COLOUR = "#fefae0"
BOX_ASPECT = 1.8  # width / height of a tensor's label box, roughly


def representative_batch(net: Network, batch: int | None, where: str) -> int | None:
    """The size every symbolic size takes in a picture: ``batch``, or 4096 within the bounds.

    None for a network without symbolic sizes (where giving ``batch`` is an error).
    """
    dims = net.dims
    if not dims:
        if batch is not None:
            raise SizeError(f"{where}: batch={batch!r} was given but the network has no "
                            "symbolic size to set; leave the batch out.")
        return None
    if batch is None:
        lo = max(d.min for d in dims)
        his = [d.max for d in dims if d.max is not None]
        batch = max(min(DEFAULT_BATCH, *his), lo) if his else max(DEFAULT_BATCH, lo)
    if isinstance(batch, bool) or not isinstance(batch, int):
        raise SizeError(f"{where}: batch={batch!r}; give an int such as 4096.")
    for d in dims:
        d.check(batch, where)
    return batch


def size_text(size: int | Dim) -> str:
    return size.name if isinstance(size, Dim) else str(size)


@dataclass(frozen=True)
class NetworkDrawing:
    """What :func:`draw_network` draws: the index labels, the tree and its FLOPs (and the file,
    once drawn)."""

    network: Network
    batch: int | None  # the symbolic sizes' value in the tree panel; None if none is symbolic
    bond_labels: Mapping[str, str]  # index -> its label, e.g. {"r1": "r1=12", "b": "b=B"}
    open_indices: tuple[str, ...]  # drawn as dangling edges (the output's indices)
    summed_indices: tuple[str, ...]  # on one operand only and not in the output
    hyperedges: tuple[str, ...]  # drawn as a hub joining three or more tensors
    tree: Tree
    step_flops: tuple[int, ...]  # forward FLOPs of each pairwise contraction at ``batch``
    path: Path | None = None


def network_drawing(net: Network, tree: Tree, batch: int | None) -> NetworkDrawing:
    """Everything a picture of ``net`` running ``tree`` shows, with the symbolic sizes at
    ``batch`` (from :func:`representative_batch`), computed without drawing (no matplotlib)."""
    sizes = bind_dims(net, batch)
    infos = step_infos(problem_for(net, sizes), tree, (True,) * len(net.operands))
    _, kinds = _graph(net)
    labels = {i: f"{i}={size_text(s)}" for i, s in net.sizes}
    return NetworkDrawing(net, batch, labels, kinds["open"], kinds["summed"], kinds["hyper"],
                          tree, tuple(int(s.flops) for s in infos))


def draw(drawing: NetworkDrawing, path: str | Path) -> NetworkDrawing:
    """Draw the network (tensors, labelled bonds, dangling open indices) and, beside it, its
    forward contraction tree with each step's FLOPs; write ``path``; return ``drawing`` with
    the path."""
    path = check_output_path(path)
    fig, (ax_net, ax_tree) = new_figure(15, 6.5, 2)
    _draw_graph(ax_net, drawing.network)
    _draw_tree(ax_tree, drawing.network, drawing.tree, drawing.step_flops, drawing.batch)
    save_figure(fig, path)
    return replace(drawing, path=path)


# -- the network panel ------------------------------------------------------------------------

def _graph(net: Network):
    """The networkx graph of the picture: tensors, hubs of hyperedges, ends of open indices."""
    import networkx as nx

    g = nx.Graph()
    for t in net.operands:
        g.add_node(("t", t.name), kind="tensor", role=t.role)
    sizes = net.size_dict
    out = set(net.output.indices)
    kinds: dict[str, list[str]] = {"open": [], "summed": [], "hyper": []}
    for index in sizes:
        holders = [t.name for t in net.operands if index in t.indices]
        label = f"{index}={size_text(sizes[index])}"
        is_open = index in out
        if len(holders) == 2 and not is_open:
            a, b = (("t", h) for h in holders)
            if g.has_edge(a, b):  # two tensors sharing several indices: one edge, all labels
                g.edges[a, b]["label"] += f"\n{label}"
            else:
                g.add_edge(a, b, kind="bond", label=label)
            continue
        if len(holders) == 1:
            end = ("t", holders[0])
        else:
            end = ("hub", index)
            kinds["hyper"].append(index)
            g.add_node(end, kind="hub", label=label)
            for h in holders:
                g.add_edge(("t", h), end, kind="hyper", label="")
        if is_open:
            kinds["open"].append(index)
            g.add_node(("open", index), kind="open", label=label)
            g.add_edge(end, ("open", index), kind="open", label="")
        elif len(holders) == 1:
            kinds["summed"].append(index)
            g.add_node(("sum", index), kind="sum", label=f"{label}\n(summed)")
            g.add_edge(end, ("sum", index), kind="sum", label="")
    return g, {k: tuple(v) for k, v in kinds.items()}


def _upright(pos: dict) -> dict[Any, tuple[float, float]]:
    """Turn a layout so its long axis is vertical, then widen it: the labels are wide boxes,
    so neighbours side by side need more room than neighbours one above the other."""
    import numpy as np

    nodes = list(pos)
    xy = np.array([pos[v] for v in nodes], dtype=float)  # (n, 2)
    xy -= xy.mean(axis=0)
    _, vecs = np.linalg.eigh(xy.T @ xy)  # ascending: vecs[:, 1] is the long axis
    xy = xy @ vecs  # (n, 2): column 0 across, column 1 along the long axis
    xy[:, 0] *= BOX_ASPECT
    return {v: (float(x), float(y)) for v, (x, y) in zip(nodes, xy, strict=True)}


_CANDIDATE_ANGLES = tuple(2 * math.pi * k / 72 for k in range(72))


def _angle_gap(a: float, b: float) -> float:
    d = abs(a - b) % (2 * math.pi)
    return min(d, 2 * math.pi - d)


def graph_layout(g) -> dict[Any, tuple[float, float]]:
    """Positions of the picture's nodes: tensors and hubs by a force layout (Kamada-Kawai where
    scipy is present, else a seeded spring layout), then each dangling end placed at the angle
    farthest from its tensor's other edges (leaning outwards), so open legs stay clear."""
    import networkx as nx

    core = g.subgraph(v for v, d in g.nodes(data=True) if d["kind"] in ("tensor", "hub"))
    if core.number_of_nodes() == 1:
        pos = {next(iter(core.nodes)): (0.0, 0.0)}
    else:
        try:
            pos = nx.kamada_kawai_layout(core)
        except ImportError:  # networkx needs scipy for Kamada-Kawai
            pos = nx.spring_layout(core, seed=0, iterations=300)
        pos = _upright(pos)
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    span = max(max(xs) - min(xs), max(ys) - min(ys), 1.0)
    centre = (sum(xs) / len(xs), sum(ys) / len(ys))
    for anchor in list(core.nodes):
        legs = sorted((v for v in g.neighbors(anchor) if v not in core), key=str)
        ax_, ay = pos[anchor]
        taken = [math.atan2(pos[v][1] - ay, pos[v][0] - ax_) for v in core.neighbors(anchor)]
        outward = math.atan2(ay - centre[1], ax_ - centre[0])
        for leg in legs:
            theta = max(_CANDIDATE_ANGLES, key=lambda t, taken=taken, out=outward: (
                min((_angle_gap(t, u) for u in taken), default=math.pi)
                + 0.1 * (math.pi - _angle_gap(t, out))))
            taken.append(theta)
            pos[leg] = (ax_ + 0.18 * span * math.cos(theta), ay + 0.18 * span * math.sin(theta))
    return pos


def _draw_graph(ax, net: Network) -> None:
    import networkx as nx
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    g, kinds = _graph(net)
    pos = graph_layout(g)
    shapes = {t.name: ", ".join(size_text(s) for s in net.shape(t)) for t in net.operands}

    def edges(kind):
        return [(u, v) for u, v, d in g.edges(data=True) if d["kind"] == kind]

    nx.draw_networkx_edges(g, pos, edgelist=edges("bond") + edges("hyper"), ax=ax, width=2.0,
                           edge_color="#555555")
    nx.draw_networkx_edges(g, pos, edgelist=edges("open"), ax=ax, width=2.0,
                           edge_color=OPEN_COLOUR)
    nx.draw_networkx_edges(g, pos, edgelist=edges("sum"), ax=ax, width=1.5, style="dashed",
                           edge_color=SUMMED_COLOUR)
    bond_labels = {(u, v): d["label"] for u, v, d in g.edges(data=True) if d["kind"] == "bond"}
    nx.draw_networkx_edge_labels(g, pos, edge_labels=bond_labels, ax=ax, font_size=8,
                                 rotate=False, bbox={"boxstyle": "round,pad=0.15", "fc": "white",
                                                     "ec": "none", "alpha": 0.85})
    hubs = [v for v, d in g.nodes(data=True) if d["kind"] == "hub"]
    nx.draw_networkx_nodes(g, pos, nodelist=hubs, ax=ax, node_size=90, node_color=HUB_COLOUR)
    for v in hubs:
        if ("open", v[1]) in g:  # its open leg carries the label
            continue
        x, y = pos[v]
        ax.annotate(g.nodes[v]["label"], (x, y), xytext=(6, 6), textcoords="offset points",
                    fontsize=8, color=HUB_COLOUR)
    for t in net.operands:
        x, y = pos[("t", t.name)]
        ax.text(x, y, f"{t.name}\n({shapes[t.name]})", ha="center", va="center", fontsize=8,
                zorder=5, bbox={"boxstyle": "round,pad=0.4", "fc": ROLE_COLOURS[t.role],
                                "ec": "#333333"})
    for v, d in g.nodes(data=True):
        if d["kind"] in ("open", "sum"):
            x, y = pos[v]
            (anchor,) = g.neighbors(v)
            dx, dy = x - pos[anchor][0], y - pos[anchor][1]
            norm = math.hypot(dx, dy) or 1.0
            colour = OPEN_COLOUR if d["kind"] == "open" else SUMMED_COLOUR
            ax.annotate(d["label"], (x, y), xytext=(14 * dx / norm, 14 * dy / norm),
                        textcoords="offset points", ha="center", va="center", fontsize=8,
                        color=colour, fontstyle="italic", zorder=5)
    out = net.output
    n_ops = len(net.operands)
    ax.set_title(f"network: {out.name}({', '.join(out.indices)}) from {n_ops} "
                 f"tensor{'s' if n_ops > 1 else ''}", fontsize=11)
    roles = {t.role for t in net.operands}
    handles = [Patch(fc=ROLE_COLOURS[r], ec="#333333", label=r.value)
               for r in (Role.INPUT, Role.PARAMETER) if r in roles]
    if any(d["kind"] in ("bond", "hyper") for _, _, d in g.edges(data=True)):
        handles.append(Line2D([], [], color="#555555", lw=2, label="bond (index=size)"))
    if kinds["open"]:
        handles.append(Line2D([], [], color=OPEN_COLOUR, lw=2, label=f"open index of {out.name}"))
    if kinds["summed"]:
        handles.append(Line2D([], [], color=SUMMED_COLOUR, lw=1.5, ls="--",
                              label="index summed within one tensor"))
    if kinds["hyper"]:
        handles.append(Line2D([], [], color=HUB_COLOUR, marker="o", lw=0,
                              label="hyperedge (shared by 3+ tensors)"))
    ax.legend(handles=handles, loc="lower left", fontsize=7, framealpha=0.9)
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    pad = 0.2 * max(max(xs) - min(xs), max(ys) - min(ys), 1.0)  # room for the labels
    ax.update_datalim([(min(xs) - pad, min(ys) - pad), (max(xs) + pad, max(ys) + pad)])
    ax.autoscale_view()
    ax.set_aspect("equal", adjustable="datalim")  # leg angles as computed
    ax.set_axis_off()


# -- the tree panel ---------------------------------------------------------------------------

def tree_layout(tree: Tree) -> dict[int, tuple[float, float]]:
    """Leaves evenly spaced on the bottom row in tree order; a step above its two children,
    at the height of its taller child plus one."""
    n = tree.n_leaves
    order: list[int] = []  # leaves, left to right (an explicit stack: no recursion limit)
    stack = [tree.root]
    while stack:
        node = stack.pop()
        if node < n:
            order.append(node)
        else:
            a, b = tree.steps[node - n]
            stack += [b, a]
    pos = {leaf: (float(x), 0.0) for x, leaf in enumerate(order)}
    for k, (a, b) in enumerate(tree.steps):  # SSA order: children are placed first
        (xa, ya), (xb, yb) = pos[a], pos[b]
        pos[n + k] = ((xa + xb) / 2, max(ya, yb) + 1.0)
    return pos


def _draw_tree(ax, net: Network, tree: Tree, flops: tuple[int, ...], batch: int | None) -> None:
    from tncomp.views.report import describe_tree

    pos = tree_layout(tree)
    n = tree.n_leaves
    for k, (a, b) in enumerate(tree.steps):
        xp, yp = pos[n + k]
        for child in (a, b):
            xc, yc = pos[child]
            ax.plot([xp, xc], [yp, yc], color="#555555", lw=1.5, zorder=1)
    for k, t in enumerate(net.operands):
        x, y = pos[k]
        ax.text(x, y, t.name, ha="center", va="top", fontsize=8, zorder=5, rotation=0,
                bbox={"boxstyle": "round,pad=0.35", "fc": ROLE_COLOURS[t.role], "ec": "#333333"})
    for k, f in enumerate(flops):
        x, y = pos[n + k]
        ax.text(x, y, f"#{k + 1}\n{format_count(f, 'FLOP')}", ha="center", va="center",
                fontsize=7, zorder=5,
                bbox={"boxstyle": "round,pad=0.3", "fc": STEP_COLOUR, "ec": "#bc6c25"})
    at = ", ".join(f"{d.name}={batch}" for d in net.dims) or "fixed sizes"
    ax.set_title(f"forward contraction tree (chosen for training), FLOPs at {at}\n"
                 f"pairwise contractions {format_count(sum(flops), 'FLOP')}: "
                 f"{_wrap(describe_tree(net, tree), 90)}", fontsize=10)
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(min(ys) - 0.8, max(ys) + 0.6)
    ax.set_axis_off()


def _wrap(text: str, width: int) -> str:
    return "\n".join(text[k:k + width] for k in range(0, len(text), width))
