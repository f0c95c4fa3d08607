"""Hosts of several ranks: local aggregation around a strategy's model (BytePS, Parallax).

On a host of ``R`` ranks behind one NIC, the topology-aware parameter-server and compressed
strategies (``ps``, ``ps-sliced``, ``p3``, ``casync-ps``, ``casync-ring``,
``compressed-allgather``) sum the host's gradients inside the host and exchange one
host's share across the network: the host is one peer of the exchange (one push per host to the
servers, one co-located server per host, compression only of what crosses hosts), and what comes
back (the pull, the decoded sum) is shared inside the host. :class:`LocalAggregation` wraps the
strategy's own model, which then plays the job of hosts (``Worker.np`` is the hosts'
count), and adds the two hops inside the host on its :attr:`~gradsync.simulate.worker.Worker.intra`
link: each layer's gradients reduced from the host's other ranks once ready, and each layer's
parameters shared back before its forward. ``ps`` shares its pulls at ``optimizer.step()``
instead, as its code does (:class:`StepShare`): one broadcast of every parameter. The ring
strategies' two levels are :meth:`~gradsync.simulate.worker.Worker.ring`'s own; ``hybrid``'s
dense buckets take them too, and its model sums its tables' rows inside the host itself
(:mod:`gradsync.simulate.hybrid`).
"""
from __future__ import annotations

from typing import Callable

from gradsync.simulate.worker import StrategyModel, Worker


class LocalAggregation(StrategyModel):
    """``model`` on a host of several ranks: gradients summed inside the host before the model sees
    them ready, the model's result shared inside the host before each layer's forward."""

    def __init__(self, model: StrategyModel):
        super().__init__(model.strategy)
        self.inner = model
        self.name, self.updates_locally, self.row_tables = model.name, model.updates_locally, model.row_tables
        self.hosts = model.hosts

    def __getattr__(self, name: str):  # what the records read of a model (dense_bytes, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def bind(self, worker: Worker) -> None:
        super().bind(worker)
        self.inner.bind(worker)
        self.reduces = worker.thread("host reduce")  # the layers' reduces, in the order they are ready

    def describe(self) -> str:
        return self.inner.describe()

    def _layer_bytes(self, layer: int) -> int:
        return sum(p.nbytes for p in self.wk.w.layers[layer].params)

    def before_forward(self, step: int, go: Callable[[], None]) -> None:
        self.inner.before_forward(step, go)

    def before_layer(self, step: int, layer: int, go: Callable[[], None]) -> None:
        # the host's result (its pull, its decoded sum) shared with its other ranks, layer by layer
        share = (lambda: self.wk.inside(self._layer_bytes(layer), go, f"share layer {layer}")) if step > 0 else go
        self.inner.before_layer(step, layer, share)

    def on_layer_ready(self, step: int, layer: int) -> None:
        self.reduces.submit(lambda finish: self.wk.inside(self._layer_bytes(layer), finish, f"reduce layer {layer}"),
                            lambda: self.inner.on_layer_ready(step, layer), what=f"reduce layer {layer}")

    def after_backward(self, step: int, go: Callable[[], None]) -> None:
        # the last layers' reduces are in before the model's end of backward
        self.reduces.submit(lambda finish: finish(), lambda: self.inner.after_backward(step, go), what="reduces done")

    def step(self, step: int, go: Callable[[], None]) -> None:
        self.inner.step(step, go)

    def step_times(self, ends: list[float]) -> list[float]:
        return self.inner.step_times(ends)


class StepShare(LocalAggregation):
    """``model`` on a host of several ranks whose code sums each group inside the host during
    backward and shares the result in ``optimizer.step()`` (``ps``,
    :meth:`gradsync.strategies.ps.base.ParameterServerBase._share_host`): after the model's exchange
    (its pushes, its update, the pulls) the host's first rank packs every parameter into one buffer,
    broadcasts it inside the host, and every rank copies it back into its parameters."""

    def before_layer(self, step: int, layer: int, go: Callable[[], None]) -> None:
        self.inner.before_layer(step, layer, go)

    def step(self, step: int, go: Callable[[], None]) -> None:
        wk, model = self.wk, self.wk.w.nbytes

        def share() -> None:
            wk.host.run(wk.copy_s(model), lambda: wk.inside(model, lambda: wk.host.run(
                wk.copy_s(model), go, what="parameters from the host's first rank"),
                "parameters broadcast in host"), what="pack parameters")

        self.inner.step(step, share)


def aggregation(model: StrategyModel) -> LocalAggregation:
    """``model`` under local aggregation, as its code sums a host's gradients."""
    return (StepShare if model.shares_host_at_step else LocalAggregation)(model)
