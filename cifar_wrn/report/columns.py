"""A PDF table's column widths from its content: the page's width shared in proportion to each column's widest
text (fpdf's get_string_width), no column under its widest word, so no word is broken."""

CELL_PADDING = 0.8  # mm inside a table cell, each side
CELL_SLACK = 2 * CELL_PADDING + 0.6  # a cell's width beyond its text: the padding, and room for rounding
MIN_COLUMN = 8.0  # mm: no column narrower
SMALLEST = 4.5  # points: no table set smaller


def _text_width(pdf, text: str, style: str, size: float) -> float:
    pdf.set_font("Helvetica", style, size)
    return pdf.get_string_width(text)


def measure(pdf, columns: list[list[tuple[str, str]]], size: float) -> tuple[list[float], list[float]]:
    """Per column of (text, font style) cells: its natural width (the widest text on one line) and its floor
    (the widest word), in mm, padding included."""
    natural, floor = [], []
    for cells in columns:
        words = [(word, style) for text, style in cells for word in text.split()]
        natural.append(max(_text_width(pdf, text, style, size) for text, style in cells) + CELL_SLACK)
        floor.append(max([_text_width(pdf, w, style, size) for w, style in words], default=0) + CELL_SLACK)
    return natural, floor


def share_widths(natural: list[float], floor: list[float], total: float, minimum: float = MIN_COLUMN) -> list[float]:
    """Widths summing to `total`, in proportion to each column's natural width, none under its floor (or
    `minimum`): a column held at its floor leaves the rest to the others. When even the floors do not fit,
    they are shrunk alike."""
    floor = [max(f, minimum) for f in floor]
    natural = [max(n, f) for n, f in zip(natural, floor)]
    if sum(floor) >= total:
        return [f * total / sum(floor) for f in floor]
    held: set[int] = set()
    while True:
        free = total - sum(floor[i] for i in held)
        weight = sum(natural[i] for i in range(len(natural)) if i not in held)
        widths = [floor[i] if i in held else natural[i] * free / weight for i in range(len(natural))]
        short = {i for i, w in enumerate(widths) if i not in held and w < floor[i]}
        if not short:
            return widths
        held |= short


def column_widths(pdf, columns: list[list[tuple[str, str]]], size: float) -> tuple[float, ...]:
    """The widths of a table of `columns` ((text, font style) cells, the heading first) at `size` points,
    sharing the page's width between the margins."""
    natural, floor = measure(pdf, columns, size)
    return tuple(share_widths(natural, floor, pdf.epw))


def fitting(pdf, columns: list[list[tuple[str, str]]], size: float) -> tuple[float, tuple[float, ...]]:
    """The largest size up to `size` (in quarter points, not under SMALLEST) at which every column's widest word
    fits beside the others', and the widths there: a crowded table is set smaller, its words never broken."""
    while size > SMALLEST and sum(max(f, MIN_COLUMN) for f in measure(pdf, columns, size)[1]) > pdf.epw:
        size -= 0.25
    return size, column_widths(pdf, columns, size)
