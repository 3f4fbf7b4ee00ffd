"""gem_parallel.recat_cache: torchrec's input-distribution permutation made once per shape, the same
tensor torchrec makes, and through a real KJTAllToAll over a gloo group. (The two-process run with
the option on reproduces the pinned losses: test_loss_pin.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed import dist_data
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_parallel import recat_cache
from gem_parallel.sharded import TorchrecDDPConfig


@pytest.fixture(autouse=True)
def no_cache_before() -> object:
    """Each test starts without a cache (a planner that ran in this process keeps its own in place), and
    leaves things as it found them."""
    put_back = recat_cache.uninstall()
    yield
    recat_cache.uninstall()
    put_back()


@pytest.fixture
def cache():
    undo = recat_cache.install()
    try:
        yield dist_data._get_recat
    finally:
        undo()


def test_each_shape_is_made_once_and_equals_torchrecs(cache) -> None:
    original = recat_cache._installed[0][0]
    shapes = [dict(local_split=3, num_splits=4, stagger=1), dict(local_split=2, num_splits=4, stagger=2),
              dict(local_split=2, num_splits=2, stagger=1, batch_size_per_rank=[3, 5]),
              dict(local_split=2, num_splits=2, stagger=1, batch_size_per_rank=[5, 3])]  # fmt: skip
    first = [cache(**shape, device=torch.device("cpu")) for shape in shapes]
    for shape, made in zip(shapes, first, strict=True):
        assert torch.equal(made, original(**shape, device=torch.device("cpu"))), shape
        # positionally, as torchrec 1.6 passes them by keyword and others may not: the same tensor again
        again = cache(shape["local_split"], shape["num_splits"], shape["stagger"], torch.device("cpu"),
                      shape.get("batch_size_per_rank"))  # fmt: skip
        assert again is made, shape
    assert len({id(t) for t in first}) == len(shapes)  # different shapes, different permutations
    assert cache(local_split=0, num_splits=4, stagger=1, device=None) is None  # an empty local split, as torchrec


def test_the_cache_keeps_the_shapes_used_last(cache, monkeypatch) -> None:
    """Variable batch sizes per rank need not repeat: the least recently used shape goes first."""
    monkeypatch.setattr(recat_cache, "MAX_ENTRIES", 2)
    shape = dict(local_split=2, num_splits=2, stagger=1, device=torch.device("cpu"))
    a, b = cache(**shape, batch_size_per_rank=[1, 2]), cache(**shape, batch_size_per_rank=[2, 2])
    assert cache(**shape, batch_size_per_rank=[1, 2]) is a  # used again: now the most recent
    c = cache(**shape, batch_size_per_rank=[3, 2])  # b goes
    assert list(cache.cache.values()) == [a, c]
    again = cache(**shape, batch_size_per_rank=[2, 2])
    assert again is not b and torch.equal(again, b)


def test_uninstall_puts_torchrecs_function_back_and_a_second_install_is_a_no_op() -> None:
    original = dist_data._get_recat
    undo = recat_cache.install()
    assert dist_data._get_recat is not original and recat_cache.installed()
    recat_cache.install()()  # already in: its undo leaves the first one's cache in place
    assert recat_cache.installed()
    undo()
    assert dist_data._get_recat is original and not recat_cache.installed()


def test_a_torchrec_whose_function_changed_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(dist_data, "_get_recat", lambda local_split, num_splits, device=None: None)
    with pytest.raises(RuntimeError, match=r"cache_recat: torchrec .*'s dist_data._get_recat has parameters "
                       r"\('local_split', 'num_splits', 'device'\)"):  # fmt: skip
        recat_cache.install()
    assert not recat_cache.installed()


def _all_to_all(kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
    tensors = dist_data.KJTAllToAll(dist.group.WORLD, [3], stagger=1)(kjt).wait()
    return tensors.wait(), tensors._recat


def test_a_kjt_all_to_all_over_gloo_reuses_its_permutation_with_the_same_result(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(5)
        lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
        kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.randint(0, 100, (int(lengths.sum()),), generator=gen),
                                lengths=lengths)  # fmt: skip
        plain, _ = _all_to_all(kjt)
        undo = recat_cache.install()
        try:
            first, recat_1 = _all_to_all(kjt)
            second, recat_2 = _all_to_all(kjt)
        finally:
            undo()
        assert recat_1 is not None and recat_2 is recat_1  # made once, read by both forwards
        for out in (first, second):
            assert out.keys() == plain.keys()
            assert torch.equal(out.values(), plain.values()) and torch.equal(out.lengths(), plain.lengths())
    finally:
        dist.destroy_process_group()


def test_the_planner_option_is_auto_by_default_and_typed() -> None:
    assert TorchrecDDPConfig().cache_recat is None
    assert TorchrecDDPConfig(cache_recat=True).cache_recat is True
    assert TorchrecDDPConfig(cache_recat=False).cache_recat is False
    with pytest.raises(ValueError, match="cache_recat"):
        TorchrecDDPConfig(cache_recat="sometimes")


def _incompatible(monkeypatch) -> None:
    monkeypatch.setattr(dist_data, "_get_recat", lambda local_split, num_splits, device=None: None)


@pytest.mark.parametrize("wanted", [None, True, False])
def test_the_planner_installs_the_cache_as_asked_where_torchrec_fits(wanted) -> None:
    from gem_parallel.sharded import _install_recat_cache

    original = dist_data._get_recat
    try:
        _install_recat_cache(wanted)
        assert recat_cache.installed() is (wanted is not False)
    finally:
        recat_cache.uninstall()
    assert dist_data._get_recat is original and not recat_cache.installed()


def test_where_torchrec_does_not_fit_the_default_warns_and_runs_without_and_true_refuses(monkeypatch) -> None:
    from gem_parallel.sharded import _install_recat_cache

    _incompatible(monkeypatch)
    with pytest.warns(UserWarning, match=r"cache_recat: torchrec .* has parameters .*: running without the recat cache"):
        _install_recat_cache(None)
    assert not recat_cache.installed()
    with pytest.raises(RuntimeError, match=r"has parameters \('local_split', 'num_splits', 'device'\).*turn "
                       r"parallel.planner.options.cache_recat off"):  # fmt: skip
        _install_recat_cache(True)
    _install_recat_cache(False)  # nothing to check: off
    assert not recat_cache.installed()


def test_uninstall_takes_out_a_cache_installed_elsewhere_and_gives_back_its_reinstall() -> None:
    original = dist_data._get_recat
    recat_cache.install()  # as the planner does, keeping no undo
    put_back = recat_cache.uninstall()
    assert not recat_cache.installed() and dist_data._get_recat is original
    recat_cache.uninstall()()  # none installed: a no-op pair
    put_back()
    assert recat_cache.installed() and dist_data._get_recat is not original
    put_back()  # already back: no second cache
    recat_cache.uninstall()
    assert dist_data._get_recat is original and not recat_cache.installed()
