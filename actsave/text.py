"""Plain-text tables, for ``describe()`` and the planner's printouts."""


def format_table(rows: list) -> str:
    """Left-aligned columns, two spaces apart; ``rows[0]`` is the header."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def mib(nbytes) -> str:
    """Bytes as MiB, two decimals."""
    return f"{nbytes / 2**20:.2f}"


def ms(seconds: float) -> str:
    """Seconds as milliseconds, three decimals."""
    return f"{seconds * 1e3:.3f}"
