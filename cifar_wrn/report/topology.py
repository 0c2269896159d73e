"""The process topology: nodes, the processes in each with local and global rank, and the ring all-reduce
drawn simply, as text and as a diagram (a matplotlib Figure; figures.py saves it)."""

import re
from dataclasses import dataclass

NODE_BLUE, RANK0_YELLOW, WITHIN_GREEN, BETWEEN_RED = "#35597f", "#ffe9b3", "#2c7a3f", "#c0392b"


def global_rank(node_id: int, num_gpus: int, local_rank: int) -> int:
    """The rank arithmetic of raw_ddp.py (R1.2): node 0 holds ranks 0..num_gpus-1, node 1 the next, ..."""
    return node_id * num_gpus + local_rank


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def topology_name(config: tuple) -> str:
    """The diagram's file name for a run's (nodes, GPUs per node, backend, device)."""
    nodes, gpus, backend, device = config
    return f"topology_{nodes}x{gpus}_{safe_name(str(backend))}_{safe_name(str(device))}.png"


def topology_text(num_nodes: int, num_gpus: int, backend: str, device: str) -> str:
    """Nodes, the processes in each with local and global rank, and the ring 0 -> 1 -> ... -> 0."""
    world = num_nodes * num_gpus
    slot = "cuda:{l}" if device == "cuda" else "cpu"
    lines = [f"{num_nodes} node(s) x {num_gpus} process(es) per node = world size {world} ({backend} on {device})"]
    for node in range(num_nodes):
        cells = [
            f"[{slot.format(l=lr)} local_rank {lr} = rank {global_rank(node, num_gpus, lr)}]" for lr in range(num_gpus)
        ]
        lines.append(f"node {node}: " + " ".join(cells))
    if world == 1:
        lines.append("one process: no all-reduce")
    else:
        ring = "0"
        for rank in range(world):
            nxt = (rank + 1) % world
            ring += (" => " if rank // num_gpus != nxt // num_gpus else " -> ") + str(nxt)
        lines.append(f"ring: {ring}")
        lines.append(
            "(-> within a node, => between nodes; a simple picture of a ring all-reduce: "
            f"{backend} picks its own rings/trees)"
        )
    return "\n".join(lines)


@dataclass
class Geometry:
    """The diagram's sizes, in its own units: a process box w x h, the gaps, the padding inside a node."""

    num_nodes: int
    num_gpus: int
    w: float = 1.6
    h: float = 1.0
    gap: float = 0.7
    pad: float = 0.45
    node_gap: float = 0.9
    title_h: float = 0.35  # room for the node's name
    margin: float = 0.5  # room around the nodes for the closing arrow

    @property
    def node_w(self) -> float:
        return max(self.num_gpus * self.w + (self.num_gpus - 1) * self.gap + 2 * self.pad, 3.2)  # fits its name

    @property
    def node_h(self) -> float:
        return self.h + 2 * self.pad + self.title_h

    def node_y(self, node: int) -> float:
        return -node * (self.node_h + self.node_gap)

    def box_x(self, local: int) -> float:
        """The left edge of a process box, the row centred in its node."""
        row = self.num_gpus * self.w + (self.num_gpus - 1) * self.gap
        return (self.node_w - row) / 2 + local * (self.w + self.gap)


def _draw_node(ax, g: Geometry, node: int, device: str, boxes: dict) -> None:
    from matplotlib.patches import FancyBboxPatch

    y0 = g.node_y(node)
    style = "round,pad=0.02,rounding_size=0.15"
    ax.add_patch(
        FancyBboxPatch(
            (0, y0), g.node_w, g.node_h, boxstyle=style, facecolor="#eef3fa", edgecolor=NODE_BLUE, linewidth=1.5
        )
    )
    name = f"node {node}" + (" (MASTER_ADDR)" if node == 0 else "")
    ax.text(g.pad, y0 + g.node_h - 0.25, name, ha="left", va="center", fontsize=9, fontweight="bold", color=NODE_BLUE)
    for local in range(g.num_gpus):
        rank = global_rank(node, g.num_gpus, local)
        x0 = g.box_x(local)
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0 + g.pad),
                g.w,
                g.h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=RANK0_YELLOW if rank == 0 else "white",
                edgecolor="black",
            )
        )
        where = f"cuda:{local}" if device == "cuda" else "CPU process"
        label = f"rank {rank}\nlocal_rank {local}\n{where}"
        ax.text(x0 + g.w / 2, y0 + g.pad + g.h / 2, label, ha="center", va="center", fontsize=8)
        boxes[rank] = (x0, y0 + g.pad)


def _ring_path(g: Geometry, rank: int, nxt: int, boxes: dict) -> list[tuple[float, float]]:
    """The points of the arrow from `rank`'s box to the next rank's."""
    (x1, y1), (x2, y2) = boxes[rank], boxes[nxt]
    w, h, pad = g.w, g.h, g.pad
    between = rank // g.num_gpus != nxt // g.num_gpus
    if g.num_nodes == 1 and g.num_gpus == 2:  # one node, two processes: two parallel arrows
        dy = 0.2 * h if nxt == 1 else -0.2 * h
        return [(x1 + (w if nxt == 1 else 0), y1 + h / 2 + dy), (x2 + (0 if nxt == 1 else w), y2 + h / 2 + dy)]
    if nxt == rank + 1 and not between:  # the next box in the same node
        return [(x1 + w, y1 + h / 2), (x2, y2 + h / 2)]
    if nxt == rank + 1:  # last process of a node -> first of the next node
        mid = y1 - pad - g.node_gap / 2
        return [(x1 + w / 2, y1), (x1 + w / 2, mid), (x2 + w / 2, mid), (x2 + w / 2, y2 + h)]
    if g.num_nodes == 1:  # close the ring under the row of one node
        low = y1 - pad / 2
        return [(x1 + w / 2, y1), (x1 + w / 2, low), (x2 + w / 2, low), (x2 + w / 2, y2)]
    right, top, left = g.node_w + g.margin / 2, g.node_h + g.margin / 2, -g.margin / 2  # around the nodes
    return [(x1 + w, y1 + h / 2), (right, y1 + h / 2), (right, top), (left, top), (left, y2 + h / 2), (x2, y2 + h / 2)]


def _draw_ring(ax, g: Geometry, boxes: dict) -> None:
    """Arrows 0 -> 1 -> ... -> world_size-1 -> 0, red where one crosses between nodes."""
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.path import Path as MplPath

    world = g.num_nodes * g.num_gpus
    for rank in range(world if world > 1 else 0):
        nxt = (rank + 1) % world
        between = rank // g.num_gpus != nxt // g.num_gpus
        path = MplPath(_ring_path(g, rank, nxt, boxes))
        color = BETWEEN_RED if between else WITHIN_GREEN
        ax.add_patch(
            FancyArrowPatch(path=path, arrowstyle="-|>", mutation_scale=12, linewidth=1.4, color=color, zorder=3)
        )


def _title(num_nodes: int, num_gpus: int, backend: str, device: str) -> str:
    world = num_nodes * num_gpus
    if world == 1:
        ring = "one process: no all-reduce"
    elif world <= 8:
        ring = "ring all-reduce drawn simply: " + " → ".join(str(r) for r in [*range(world), 0])
    else:
        ring = f"ring all-reduce drawn simply: 0 → 1 → … → {world - 1} → 0"
    return (
        f"{num_nodes} node(s) × {num_gpus} per node = world size {world}, {backend} on {device}\n{ring}\n"
        "global rank = node_id × num_gpus + local_rank" + ("; red: between nodes" if num_nodes > 1 else "")
    )


def draw_topology(Figure, num_nodes: int, num_gpus: int, backend: str, device: str):
    """Nodes as boxes, one box per process inside with its local and global rank, and the ring drawn
    simply as arrows 0 -> 1 -> ... -> world_size-1 -> 0 (red where an arrow crosses between nodes)."""
    g = Geometry(num_nodes, num_gpus)
    height = 0.9 * (num_nodes * (g.node_h + g.node_gap)) + 0.8
    fig = Figure(figsize=(max(4.5, 0.9 * (g.node_w + 2 * g.margin)), height))
    ax = fig.add_subplot()
    ax.set_aspect("equal")
    ax.axis("off")
    boxes: dict[int, tuple[float, float]] = {}  # rank -> (x0, y0) of its box
    for node in range(num_nodes):
        _draw_node(ax, g, node, device, boxes)
    _draw_ring(ax, g, boxes)
    ax.set_xlim(-g.margin, g.node_w + g.margin)
    ax.set_ylim(g.node_y(num_nodes - 1) - 0.2, g.node_h + g.margin)
    ax.set_title(_title(num_nodes, num_gpus, backend, device), fontsize=9)
    return fig
