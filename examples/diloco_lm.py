"""A small language model trained with rare communication: loss against tokens, time and bytes.

    gradsync run -np 4 -- python examples/diloco_lm.py --strategy allreduce
    gradsync run -np 4 --net 100mbit -- python examples/diloco_lm.py --strategy diloco --H 50
    gradsync run -np 4 -- python examples/diloco_lm.py --strategy diloco:fragments=4,delay=1,compression=int4

The model is gradsync's LSTM language model in the shape of its tiny size (``lstm-lm:tiny``: one
LSTM layer of 256 cells projected to 64) over a vocabulary of ``--vocab`` tokens. The text is generated: a seeded
Markov chain whose next-token law after each token is a Zipf law (exponent 1.1) over its own
random order of the vocabulary, so there is structure to learn and a known floor (the chain's
entropy rate, reported as ``floor``). Every worker draws its own sequences; the held-out set is
fixed. The inner optimizer is AdamW, for every strategy (DiLoCo's choice).

Worker 0 evaluates its model on the held-out set every ``--eval-every`` steps and at the end, and
prints one JSON line: the final held-out loss, the curve ``[[tokens, seconds, loss], ...]``
(tokens over all workers; seconds of training, evaluations left out), the bytes its transport
sent, and ``seconds_to_target``: when the held-out loss first reached ``--target`` (null if never).
"""
from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import torch
import torch.nn.functional as F

import gradsync
from gradsync.compress import parse_spec
from gradsync.models.lstm import LSTMLanguageModel

ZIPF = 1.1


def chain(vocab: int) -> torch.Tensor:
    """The language: row ``a`` is the law of the token after ``a`` (a Zipf law over a random order)."""
    gen = torch.Generator().manual_seed(0)
    zipf = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-ZIPF)
    zipf /= zipf.sum()
    rows = torch.stack([zipf[torch.randperm(vocab, generator=gen)] for _ in range(vocab)])
    return rows.float()


def entropy_rate(rows: torch.Tensor) -> float:
    """Nats per token of the chain at its stationary law (every row has the same entropy here)."""
    p = rows[0].double()
    return float(-(p * p.log()).sum())


def sequences(rows: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    out = torch.empty(count, length, dtype=torch.long)
    out[:, 0] = torch.randint(rows.shape[0], (count,), generator=gen)
    for t in range(1, length):
        out[:, t] = torch.multinomial(rows[out[:, t - 1]], 1, generator=gen).squeeze(1)
    return out


def loss_of(model, text: torch.Tensor) -> torch.Tensor:
    logits = model(text[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, 1:].reshape(-1))


def strategy(args) -> tuple[str, dict]:
    """``--strategy NAME[:OPTION=VALUE,...]``, with ``--H`` for the strategies that take it."""
    name, made = parse_spec(args.strategy)
    if name in ("local-sgd", "diloco"):
        made.setdefault("H", args.H)
    return name, made


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="diloco", help="NAME[:OPTION=VALUE,...]: allreduce, local-sgd, diloco, "
                   "diloco:fragments=4,delay=1,compression=int4 (streaming), or any strategy")
    p.add_argument("--H", type=int, default=50, help="inner steps between synchronizations (local-sgd, diloco)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's (the inner optimizer's) learning rate")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--target", type=float, default=0.0, help="held-out loss whose first reaching is timed")
    args = p.parse_args()

    topo = gradsync.init()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="LSTM with projections is not supported with oneDNN")
    rows = chain(args.vocab)
    held_out = sequences(rows, 128, args.seq_len + 1, torch.Generator().manual_seed(10_000))
    mine = torch.Generator().manual_seed(1 + topo.rank)
    torch.manual_seed(0)
    model = LSTMLanguageModel(vocab_size=args.vocab, embed_dim=64, hidden=256)  # lstm-lm:tiny, a smaller vocabulary
    name, chosen = strategy(args)
    opt = gradsync.distribute(model, torch.optim.AdamW(model.parameters(), lr=args.lr), name, **chosen)
    transport = gradsync.runtime.current().transport
    sent_before = transport.bytes_sent
    curve, reached, trained = [], None, 0.0

    def evaluate(step: int) -> None:
        nonlocal reached
        model.eval()
        with torch.no_grad():
            loss = float(loss_of(model, held_out))
        model.train()
        tokens = step * args.batch_size * args.seq_len * topo.num_workers
        curve.append([tokens, round(trained, 3), round(loss, 4)])
        if reached is None and loss <= args.target:
            reached = trained

    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss_of(model, sequences(rows, args.batch_size, args.seq_len + 1, mine)).backward()
        opt.step()
        opt.zero_grad()
        if topo.rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            trained += time.perf_counter() - began
            evaluate(step)
            began = time.perf_counter()
    trained += time.perf_counter() - began
    opt.close()
    if topo.rank == 0:
        sent = transport.bytes_sent - sent_before
        print(json.dumps({"strategy": opt.strategy.describe(), "workers": topo.num_workers, "loss": curve[-1][2],
                          "floor": round(entropy_rate(rows), 4), "tokens": curve[-1][0],
                          "seconds": round(trained, 2), "tokens_per_s": round(curve[-1][0] / trained, 1),
                          "bytes_sent": sent, "mb_sent": round(sent / 1e6, 3),
                          "seconds_to_target": None if reached is None else round(reached, 2),
                          "curve": curve, "perplexity": round(math.exp(curve[-1][2]), 3)}))
    gradsync.shutdown()


if __name__ == "__main__":
    main()
