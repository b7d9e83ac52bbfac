"""The paper's and torchgpipe's numbers per cell, and the targets this reproduction sets itself."""
from __future__ import annotations

from typing import Any

from gpipe_repro import paper
from gpipe_repro.repro.throughput.rows import Row


def table2_paper(model: str) -> dict[tuple[int, int], float]:
    return dict(paper.TABLE2[model])


def table2_peer(model: str) -> dict[tuple[int, int], float] | None:
    return dict(paper.TORCHGPIPE_TABLE2_AMOEBANET) if model == "amoebanet" else None


def table3_paper(model: str, m: int = 32) -> dict[tuple[int, int], float]:
    return {(k, m): v for k, v in paper.TABLE3[model].items()}




CLAIMS = {
    "transformer": ("paper", 6.3),
    "amoebanet": ("torchgpipe", paper.TORCHGPIPE_TABLE2_AMOEBANET[(8, 32)]),
}


def check_claims(table2: dict[str, list[Row]]) -> list[dict[str, Any]]:
    """The targets this reproduction sets itself: simulated K=8, M=32 at least the reference's."""
    out = []
    for model, (source, target) in CLAIMS.items():
        row = next((r for r in table2.get(model, []) if (r.K, r.M) == (8, 32)), None)
        if row is None:
            continue
        value = row.simulated["normalized"]
        out.append({"model": model, "K": 8, "M": 32, "simulated": value, "target": target,
                    "target_source": source, "met": value >= target})
    return out


