"""A hand-made MovieLens-1M in the files' format, shared by the MovieLens tests (not a test module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_model.data import movielens
from gem_model.data.batch import Batch
from gem_model.data.movielens import MovieLensConfig, MovieLensSource, package_data_dir

ITEMS = [  # title, genres; G is never rated but is still in the catalogue
    ("A (2000)", "Action Comedy"),
    ("B (2001)", "Drama"),
    ("C (2002)", "Comedy"),
    ("D (2003)", "Action"),
    ("E (2004)", "Drama Romance"),
    ("F (2005)", "Horror"),
    ("G (2006)", "Comedy"),
]
A, B, C, D, E, F, G = range(7)
USERS = [("1m_1", "25", "F", "10", "48067"), ("1m_2", "1", "M", "3", "55117"), ("1m_3", "56", "M", "10", "48100")]
RATINGS = (
    [  # user, item, rating, timestamp; users interleaved, ties at t=100 for user 1
        ("1m_1", "A (2000)", 5, 100),
        ("1m_2", "F (2005)", 4, 10),
        ("1m_1", "B (2001)", 3, 50),
        ("1m_1", "C (2002)", 4, 100),
        ("1m_2", "A (2000)", 3, 20),
        ("1m_1", "D (2003)", 2, 200),
        ("1m_2", "B (2001)", 5, 30),
        ("1m_1", "E (2004)", 1, 150),
        ("1m_2", "C (2002)", 2, 5),
    ]
    + [("1m_3", title, 3, t) for t, (title, _) in enumerate(ITEMS[:6], start=1)]
)
# time order: user 1: B A C E D (A before C: file order on the tie); user 2: C F A B; user 3: A..F
SEQUENCES = [[B, A, C, E, D], [C, F, A, B], [A, B, C, D, E, F]]

real_data = pytest.mark.skipif(
    package_data_dir() is None, reason=f"MovieLens-1M needs the data package: {movielens.INSTALL_HINT}"
)


def write_dataset(folder: Path, ratings=RATINGS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ml-1m.item").write_text(
        "item_id:token\tmovie_title:token\trelease_year:float\tgenre:token\n"
        + "".join(f"{t}\t{t[:1]}\t{2000 + i}\t{g}\n" for i, (t, g) in enumerate(ITEMS))
    )
    (folder / "ml-1m.user").write_text(
        "user_id:token\tage:float\tgender:token\toccupation:float\tzip_code:token\n"
        + "".join("\t".join(u) + "\n" for u in USERS)
    )
    (folder / "ml-1m.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ratings)
    )
    return folder


def source_factory(folder: Path):
    """``make(**options)`` builds a source over the dataset written to ``folder``."""
    write_dataset(folder)

    def make(**options) -> MovieLensSource:
        return MovieLensSource(MovieLensConfig(data_dir=str(folder), **options))

    return make


def items_of(batch: Batch) -> list[list[int]]:
    jt = batch.sequence["seq_item"]
    return [t.tolist() for t in jt.values().split(jt.lengths().tolist())]
