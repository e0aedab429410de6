"""Route sets of the remote-store launches beyond one pair (issue 6): a record's ``routes`` column
(``"0>1,2;1>0"``: each source GPU with its destinations) and each source's drain share when they
run at once (the fluid picture that scales R for the no-refit prediction)."""
from __future__ import annotations


Routes = tuple[tuple[int, tuple[int, ...]], ...]


def format_routes(routes: Routes) -> str:
    """``((0, (1, 2)), (1, (0,)))`` → ``"0>1,2;1>0"``: a route set as a record column value."""
    return ";".join(f"{s}>{','.join(str(d) for d in dsts)}" for s, dsts in routes)


def parse_routes(label: str) -> Routes:
    """Inverse of ``format_routes``; raises ValueError on a malformed label."""
    try:
        routes = tuple((int(s), tuple(int(d) for d in dsts.split(",")))
                       for s, dsts in (part.split(">") for part in label.split(";")))
    except ValueError as e:
        raise ValueError(f"malformed routes {label!r}: want 'src>dst,dst;src>dst'") from e
    return routes


def drain_share(routes: Routes) -> dict[int, float]:
    """Each source's share of its one-to-one drain rate when the routes run at once, in the
    fluid picture: a source splits its producers evenly over its destinations, a destination
    drains at most one source's one-to-one rate, and a source is slowed by its busiest
    destination. all-to-one over P GPUs gives 1/(P−1); one-to-all and all-to-all give 1."""
    load: dict[int, float] = {}
    for _, dsts in routes:
        for d in dsts:
            load[d] = load.get(d, 0.0) + 1.0 / len(dsts)
    return {s: min(1.0, min(1.0 / load[d] for d in dsts)) for s, dsts in routes}
