"""EpochShuffleSampler and PinnedShardSampler: the order is a function of (seed, epoch), a state resumes an
epoch, and pinned shards keep each row on one rank."""

from __future__ import annotations

from torch.utils.data import DistributedSampler

from train.data.samplers import EpochShuffleSampler, PinnedShardSampler


def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    sampler = EpochShuffleSampler(50, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(50))
    assert list(sampler) == first  # iterating again without set_epoch repeats the epoch
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(50)) and second != first
    fresh = EpochShuffleSampler(50, seed=3)
    fresh.set_epoch(1)
    assert list(fresh) == second  # no hidden generator state: a new sampler agrees
    assert list(EpochShuffleSampler(50, seed=4)) != first


def test_state_resumes_the_interrupted_epoch_where_it_stopped() -> None:
    sampler = EpochShuffleSampler(20, seed=0)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(7)]
    state = sampler.state_dict()
    assert state == {"epoch": 2, "yielded": 7}

    resumed = EpochShuffleSampler(20, seed=0)
    resumed.load_state_dict(state)
    assert head + list(resumed) == sampler.permutation(2)
    assert list(resumed) == sampler.permutation(2)  # the next full pass starts the epoch again


def test_pinned_shards_give_each_rank_the_same_rows_every_epoch_and_every_row_to_one_rank() -> None:
    """Issue 43, item 5: with Lightning's DistributedSampler rows move between ranks every epoch, so a
    rank's feature cache (EAGLE-3) served 0-1 of 256 batches in a 4-rank simulation; pinned, every batch
    after the first epoch is a row the rank has seen."""
    world, rows = 4, 1000
    shares = [PinnedShardSampler(rows, seed=3, num_replicas=world, rank=r) for r in range(world)]
    first = [set(s) for s in shares]
    assert set().union(*first) == set(range(rows)) and all(len(f) == rows // world for f in first)
    for sampler, seen in zip(shares, first, strict=True):
        sampler.set_epoch(1)
        epoch_one = list(sampler)
        assert set(epoch_one) == seen  # the same rows: every lookup after the first epoch hits
        sampler.set_epoch(0)
        assert list(sampler) != epoch_one  # in another order
    # Lightning's way, for contrast: a DistributedSampler deals the rows out afresh each epoch
    dealt = DistributedSampler(range(rows), num_replicas=world, rank=0, shuffle=True, seed=3)
    before = set(dealt)
    dealt.set_epoch(1)
    assert len(before & set(dealt)) < rows // world // 2


def test_pinned_shards_pad_short_shares_group_by_length_and_resume_mid_epoch() -> None:
    uneven = [list(PinnedShardSampler(10, num_replicas=4, rank=r)) for r in range(4)]
    assert [len(u) for u in uneven] == [3, 3, 3, 3]  # 10 rows: the short shares repeat a row of their own
    assert all(set(u) <= set(range(r, 10, 4)) for r, u in enumerate(uneven))
    lengths = [1 + (7 * i) % 50 for i in range(64)]

    def spread(order: list[int]) -> int:  # summed over batches of 4: longest minus shortest row
        return sum(
            max(lengths[i] for i in order[k : k + 4]) - min(lengths[i] for i in order[k : k + 4])
            for k in range(0, 64, 4)
        )

    grouped = list(PinnedShardSampler(64, seed=1, lengths=lengths, batch_size=4))
    assert spread(grouped) < spread(list(PinnedShardSampler(64, seed=1))) / 2
    sampler = PinnedShardSampler(64, seed=1, lengths=lengths, batch_size=4)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(10)]
    resumed = PinnedShardSampler(64, seed=1, lengths=lengths, batch_size=4)
    resumed.load_state_dict(sampler.state_dict())
    assert head + list(resumed) == PinnedShardSampler(64, seed=1, lengths=lengths, batch_size=4).permutation(
        2
    )
