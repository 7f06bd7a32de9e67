"""``watch(loader=)``: the agent records each batch's sample ids itself and the loader yields exactly what it did.

The dataset hands each sample's own index back beside its input, so the batch itself says which samples it
holds: a skip's ``samples`` must be those, whatever the workers, prefetching and epochs did. Sample 13's input
is inf, so every iteration whose batch holds it skips (a real GradScaler("cpu"), bfloat16 autocast).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torch.utils.data import dataloader as torch_dataloader

BAD = 13
_ORIGINAL = {name: torch_dataloader._BaseDataLoaderIter.__dict__[name] for name in ("__next__", "_next_index")}


class Indexed(Dataset):
    """40 samples of 8 values; each item is ``(x, its index)``; sample 13 holds an inf."""

    def __init__(self) -> None:
        self.x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
        self.x[BAD, 0] = float("inf")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], index


class Stream(IterableDataset):
    """12 samples, streamed: no indices to draw."""

    def __iter__(self):
        data = Indexed()
        for k in range(12):
            yield data.x[k], k


def _loader(kind: str) -> DataLoader:
    data = Indexed()
    if kind == "workers=0":
        return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    if kind == "workers=2":
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(2))
    if kind == "persistent":
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                          prefetch_factor=3, generator=torch.Generator().manual_seed(2))
    assert kind == "distributed"
    return DataLoader(data, batch_size=3, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=3))


def _train(kind: str, watching, *, follow: bool, epochs: int = 3):
    """Train on the loader for ``epochs``; return what it yielded, the weights, the RNG state and the events.

    The first epoch is cut short after 5 batches (``break``): the indices its workers had drawn ahead are
    never yielded, and must not be taken for the next epoch's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    loader = _loader(kind)
    w = watching(scaler, opt, model=model, loader=loader if follow else None)
    yielded = []
    for epoch in range(epochs):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for k, (x, index) in enumerate(loader):
            if epoch == 0 and k == 5:
                break
            yielded.append((x, index))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x + torch.randn_like(x) * 1e-3).float().pow(2).mean()  # draws from the global RNG
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    events = w._recorder.events.drain()
    w.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return yielded, weights, torch.get_rng_state(), events


@pytest.mark.parametrize("kind", ["workers=0", "workers=2", "persistent", "distributed"])
def test_a_followed_loader_yields_the_same_batches_and_each_skip_names_its_batch(kind, watching):
    plain, plain_weights, plain_rng, _ = _train(kind, watching, follow=False)
    yielded, weights, rng, events = _train(kind, watching, follow=True)
    assert len(yielded) == len(plain)
    for (x, index), (px, pindex) in zip(yielded, plain, strict=True):
        assert torch.equal(index, pindex) and torch.equal(x.nan_to_num(), px.nan_to_num())
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))  # bit-identical training
    assert torch.equal(rng, plain_rng)  # the same random draws
    skips = {e["iteration"]: e["samples"]["ids"] for e in events if e["kind"] == "skip"}
    truth = {i: index.tolist() for i, (_, index) in enumerate(yielded) if BAD in index.tolist()}
    assert skips == truth and len(truth) >= 2  # every batch holding the inf sample, named by its indices


def test_a_batch_of_an_iterable_dataset_is_named_by_rank_epoch_and_position(watching):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    loader = DataLoader(Stream(), batch_size=4)
    w = watching(scaler, opt, model=model, loader=loader)
    for epoch in range(2):
        for position, (x, _) in enumerate(loader):
            if (epoch, position) in ((0, 2), (1, 1)):
                x[0, 0] = float("inf")
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    skips = [(e["iteration"], e["samples"]["ids"]) for e in w._recorder.events.drain() if e["kind"] == "skip"]
    assert skips == [(2, ["r0:e0:b2"]), (4, ["r0:e1:b1"])]


def test_a_loader_not_followed_is_not_recorded_while_another_is(watching):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    followed, other = _loader("workers=0"), _loader("workers=0")
    w = watching(torch.amp.GradScaler("cpu"), opt, model=model, loader=followed)
    for _ in other:
        pass
    w.batch([1])
    w._recorder.samples.end(0)
    ((iteration, ids),) = list(w._recorder.samples._ring)
    assert ids == [[1]]


def test_nothing_of_ampwatch_is_in_the_loader_or_left_on_torch_after_close(watching):
    loader, twin = _loader("workers=0"), _loader("workers=0")
    model = torch.nn.Linear(8, 1)
    w = watching(torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.01), loader=loader)
    next(iter(loader))
    next(iter(twin))
    assert b"ampwatch" not in pickle.dumps(loader) and b"ampwatch" not in pickle.dumps(loader.batch_sampler)
    assert vars(loader).keys() == vars(twin).keys() and type(loader) is type(twin) is DataLoader
    assert type(loader._index_sampler) is type(twin._index_sampler)
    assert torch_dataloader._BaseDataLoaderIter.__dict__["__next__"] is not _ORIGINAL["__next__"]
    w.close()
    assert {name: torch_dataloader._BaseDataLoaderIter.__dict__[name] for name in _ORIGINAL} == _ORIGINAL


def test_a_loader_whose_batches_come_back_out_of_order_is_refused_and_nothing_stays(watching):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    loader = DataLoader(Indexed(), batch_size=4, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match="in_order=False"):
        watching(scaler, opt, loader=loader)
    with pytest.raises(TypeError, match="takes a torch.utils.data.DataLoader"):
        watching(scaler, opt, loader=[[1, 2]])
    assert {name: torch_dataloader._BaseDataLoaderIter.__dict__[name] for name in _ORIGINAL} == _ORIGINAL
    w = watching(scaler, opt, loader=_loader("workers=0"))  # the failed watches left the scaler free
    w.close()


def test_a_failure_inside_the_recording_is_counted_and_the_loader_goes_on(watching, monkeypatch):
    from ampwatch.agent import _loader as loader_module

    def broken(self, iterator, index):
        raise RuntimeError("planted")

    monkeypatch.setattr(loader_module.LoaderTap, "drawn", broken)
    loader = _loader("workers=0")
    model = torch.nn.Linear(8, 1)
    w = watching(torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.01), loader=loader)
    assert sum(len(index) for _, index in loader) == 40
    assert w.snapshot()["state"]["delivery"]["agent_errors"] == 10


def test_a_torch_whose_loader_iterator_cannot_be_followed_trains_on_without_ids(watching, monkeypatch, caplog):
    # A future torch that renamed the iterator's methods: the job must not die at watch(), only lose its ids.
    from torch.utils.data import dataloader as torch_loader

    monkeypatch.delattr(torch_loader._BaseDataLoaderIter, "_next_index")
    loader = _loader("workers=0")
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with caplog.at_level("WARNING", logger="ampwatch.agent"):
        w = watching(scaler, opt, loader=loader)
    assert "cannot follow this torch's DataLoader" in caplog.text
    assert w.snapshot()["state"]["delivery"]["agent_errors"] == 1
    assert "_next_index" not in torch_loader._BaseDataLoaderIter.__dict__  # nothing wrapped
