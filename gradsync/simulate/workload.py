"""What a simulated worker computes: the profile's layers, each with its parameters' sizes.

The same inputs the emulated cluster replays (:mod:`gradsync.emulate`): a compute profile (the
layers in forward order with their forward and backward times; shipped, measured with
``gradsync profile``, or derived from FLOPs) and the real model's parameters, learned by
building the model on the ``meta`` device (no memory for the values). A tied parameter belongs to
the first layer that owns it, as in the emulated model.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Param:
    name: str
    numel: int
    nbytes: int
    layer: int  # index of its layer in forward order


@dataclass
class Layer:
    name: str
    forward_s: float
    backward_s: float
    params: list[Param] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


@dataclass
class Table:
    """An embedding table: the rows a worker's step reads (unique ids of its batch, the mean over
    a few batches of the model's own data), out of ``rows`` of ``row_bytes`` each; ``samples``:
    those batches' unique ids (where the reads fall, for ``hybrid``'s row servers)."""

    rows: int
    row_bytes: int
    read: float
    samples: tuple = field(default=(), compare=False, repr=False)

    @property
    def share(self) -> float:
        return self.read / max(self.rows, 1)

    def host_read(self, ranks: int) -> float:
        """The rows that ``ranks`` workers' steps read together (the union of their batches' ids:
        ``hybrid``'s host pull and push on hosts of several workers): the mean union of ``ranks``
        consecutive :attr:`samples` (in turn); past the samples, each further batch adds as many
        rows as the last sample did; without samples, ``ranks`` times :attr:`read`. At most every row."""
        import torch

        k = len(self.samples)
        if ranks <= 1 or not k:
            return min(float(self.rows), ranks * self.read)

        def union(j: int) -> float:
            return sum(torch.unique(torch.cat([torch.as_tensor(self.samples[(i + m) % k]) for m in range(j)])).numel()
                       for i in range(k)) / k

        if ranks <= k:
            return float(union(ranks))
        whole = union(k)
        return min(float(self.rows), whole + (ranks - k) * (whole - union(k - 1)))

    def server_shares(self, index: int, partitions: int, servers: int) -> list[float]:
        """Of the rows a step reads, the share each server holds when this is table ``index`` of
        ``hybrid``'s layout with ``partitions`` partitions per table over ``servers`` servers
        (:meth:`~gradsync.strategies.hybrid.layout.Layout.make`, the strategy's own). Ids drawn
        from a Zipf law put most reads on the server of the first range. Without ``samples``: an
        even spread."""
        import torch

        from gradsync.strategies.hybrid.layout import Layout

        if not self.samples:
            return [1.0 / servers] * servers
        # table t's range j is on server (j + t) mod S: as table 0 over the servers turned by t
        layout = Layout.make([self.rows], partitions, [(k + index) % servers for k in range(servers)])
        held = [0] * servers
        for ids in self.samples:
            for server, where in layout.split(0, torch.as_tensor(ids)).items():
                held[server] += where.numel()
        total = sum(held)
        return [h / total for h in held] if total else [1.0 / servers] * servers


@dataclass
class Workload:
    model: str
    batch_size: int
    layers: list[Layer]
    device: str = ""
    source: str = ""
    tables: dict[str, Table] = field(default_factory=dict)
    """The parameters that are embedding tables read only through their lookup (``hybrid``'s
    candidates), by parameter name."""

    @property
    def params(self) -> list[Param]:
        """Every parameter, in forward order."""
        return [p for layer in self.layers for p in layer.params]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """One step's forward and backward without communication."""
        return sum(layer.forward_s + layer.backward_s for layer in self.layers)


def load(model: str, batch_size: int, profile: str | None = None) -> Workload:
    """The workload of ``model`` at ``batch_size`` under compute profile ``profile`` (as
    ``--compute emulated:PROFILE``, spelled either way; None or ``emulated``: the shipped one for
    the model)."""
    from gradsync.emulate.derive import resolve
    from gradsync.emulate.profile import check_covers, layer_modules
    from gradsync.models import get_model

    spec = get_model(model)
    if profile is not None:  # gradsync bench's spelling of the same profile
        profile = None if profile == "emulated" else profile.removeprefix("emulated:")
    prof = resolve(model, batch_size, profile)
    real = spec.build_meta()
    check_covers(prof, real)
    owned = layer_modules(real)
    seen: set[int] = set()
    tables = _tables(spec, real, batch_size)
    layers = []
    for index, entry in enumerate(prof.layers):
        layer = Layer(entry.name, entry.forward_ms / 1e3, entry.backward_ms / 1e3)
        module = owned[entry.name]
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            full = f"{entry.name}.{pname}" if entry.name else pname
            layer.params.append(Param(full, p.numel(), p.numel() * p.element_size(), index))
        layers.append(layer)
    workload = Workload(model, batch_size, layers, prof.device, prof.source)
    trained = {p.name for p in workload.params}  # a frozen table has no gradient to move
    workload.tables = {name: t for name, t in tables.items() if name in trained}
    return workload


TABLE_BATCHES = 4
"""Batches whose unique ids are averaged for :attr:`Table.read`."""


def _tables(spec, model, batch_size: int) -> dict[str, Table]:
    """The embedding tables the model's own data reads (its spec's ``lookups``), and how many rows
    a step of ``batch_size`` reads. A weight shared with another module (a tied output layer) is
    read outside its lookup: not a table here, as ``hybrid`` measures it."""
    from torch import nn

    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    found = {}
    modules = dict(model.named_modules())
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    for name, ids_of in spec.lookups.items():
        module = modules.get(name)
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or users.get(id(module.weight), 0) > 1:
            continue
        samples = tuple(ids_of(spec.batch(batch_size, seed)[0]).unique() for seed in range(TABLE_BATCHES))
        weight = module.weight
        found[f"{name}.weight"] = Table(weight.shape[0], weight[0].numel() * weight.element_size(),
                                        sum(ids.numel() for ids in samples) / len(samples), samples)
    # in the model's parameter order, the order in which hybrid numbers its tables
    return dict(sorted(found.items(), key=lambda item: order.get(item[0], len(order))))


def synthetic(layers: list[tuple[float, float, list[int]]], batch_size: int = 32, name: str = "synthetic") -> Workload:
    """A workload from ``(forward_s, backward_s, [bytes of each parameter])`` per layer (tests, what-ifs)."""
    out = []
    for i, (fwd, bwd, sizes) in enumerate(layers):
        out.append(Layer(f"layer{i}", fwd, bwd, [Param(f"layer{i}.p{j}", n // 4, n, i) for j, n in enumerate(sizes)]))
    return Workload(name, batch_size, out, "synthetic", "given")
