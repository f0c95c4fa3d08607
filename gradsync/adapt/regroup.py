"""How an elastic job regroups around the :class:`~gradsync.adapt.policy.Controller`.

When a worker dies, the survivors restore their last commit and wait for the launcher's next
generation; when the job is resized, every worker goes there after the same step. Either way each
worker leaves its process group, enters the new one, reattaches the strategy, and the worker with
the newest state hands it to all (joiners have none; after a failure survivors may differ by a step).
"""
from __future__ import annotations

import copy
import time

import torch

from gradsync import runtime
from gradsync.adapt import elastic
from gradsync.consistency import broadcast_model, check_models_match
from gradsync.diagnosis import PEER_TROUBLE
from gradsync.errors import GradsyncError, PeerFailureError
from gradsync.optimizer import detach, reattach


def _peer_failure(exc: RuntimeError) -> PeerFailureError | None:
    """``exc`` as a peer's failure: gradsync's own, or one raised inside PyTorch's communication
    (DDP's reducer), explained; None for any other error (the script's own: it propagates)."""
    if isinstance(exc, PeerFailureError):
        return exc
    if isinstance(exc, GradsyncError) or not PEER_TROUBLE.search(str(exc)) or not runtime.is_initialized():
        return None
    return runtime.current().explain("a collective inside PyTorch (DDP's all-reduce, or the script's own)", exc)


class Regrouping:
    """The Controller's elastic regrouping (a mixin of it): its commits (:class:`~gradsync.adapt.commits.Commits`),
    counters, ``policies``, ``strategy_spec`` and the ``optimizer`` it detaches and reattaches."""

    def run(self, train) -> None:
        """Run ``train(ctl)``; in an elastic job, when a worker dies, restore the last commit, regroup
        without it and run ``train`` again (it continues from ``ctl.epoch``, ``ctl.step`` and the data
        position, as the ``epochs``/``steps`` iterators do). Returns when ``train`` returns, or when this
        worker was removed from the job (``ctl.detached``)."""
        member = elastic.current()
        try:
            if member is None:
                return train(self)
            if self.detached:  # a joiner whose first generation ended without it
                return
            while True:
                try:
                    if self._commit is None:
                        self.commit()  # collective where the optimizer state is spread: a peer may die in it
                    train(self)
                    return
                except RuntimeError as exc:
                    failure = _peer_failure(exc)
                    if failure is None:
                        raise
                    self._recover(failure)
                    del failure  # its traceback holds the old generation: let go now (teardown.collect_before_forks)
                    if self.detached:
                        return
        finally:
            self.close()

    def _between_steps(self) -> None:
        member = elastic.current()
        if self._regrouped_at == self.step:
            return  # a policy resized after this step (and committed): a worker that just joined does not ask again
        self._commit_step()
        gen = member.agree()
        if gen > member.gen:
            self._regroup(gen, cause="resize")

    def _commit_step(self) -> None:
        """The step's commit (every ``commit_every`` steps), once: between steps, or first thing in a
        resize a policy asks for, whose detach then finds the spread optimizer state gathered."""
        if self.step % self.commit_every or (self._commit is not None and self._commit["counters"]["step"] == self.step):
            return
        self.commit()
        self._persist()

    def _recover(self, exc: Exception) -> None:
        member = elastic.current() or self._member
        start = time.perf_counter()
        if self._commit is not None:
            self._restore()  # without one (a peer died in the first commit) the hand-over brings the state
        gen = member.wait_for(member.gen, runtime.current().timeout_s if runtime.is_initialized() else 60.0)
        self._regroup(gen, cause=f"failure: {exc}".splitlines()[0][:200], failed=True, start=start)

    def _regroup(self, gen: int, *, cause: str, failed: bool = False, start: float | None = None,
                 asked: dict | None = None) -> None:
        start = time.perf_counter() if start is None else start
        phases, mark = {}, [time.perf_counter()]
        if asked is not None:  # a resize asked for: waiting for the others' step, then the launcher
            phases.update(asked)
        elif failed:
            phases["restore and wait for the launcher"] = mark[0] - start

        def done(phase: str) -> None:
            now = time.perf_counter()
            phases[phase] = now - mark[0]
            mark[0] = now

        member = self._member = elastic.current() or self._member
        before = len(member.members)
        if runtime.is_initialized():
            self._where = (runtime.current().topology.rank, before)
        previous = self.optimizer._gradsync.strategy
        detach(self.optimizer, failed=failed)
        done("detach")
        try:
            runtime.leave()
        except Exception:
            if not failed:
                raise
        done("leave")
        if not member.enter(gen, needs_state=failed):
            self.detached = self.stop_requested = True
            return
        done("new group")
        if self.shares is not None and len(self.shares) != len(member.members):
            self.shares = None  # per-worker shares were for the old workers: equal shares again
        sync = self.optimizer._gradsync
        if member.any_new:  # what the new workers are doing in distribute(), in the same order
            check_models_match(sync.model, runtime.current().transport, world=False)
            broadcast_model(sync.model, runtime.current().transport, world=False, compare_first=False)
            done("model check and broadcast")
            reattach(self.optimizer, copy.deepcopy(sync.original))  # theirs; the hand-over switches all alike
        else:  # a shrink: the survivors' strategy keeps what the group does not change
            reattach(self.optimizer, copy.deepcopy(sync.template), previous=None if failed else previous)
        if sync.observer is not None:
            for m in sync.observer:
                m.attach(sync.params, sync.names, m.every)
        done("strategy")
        if member.needs_state:  # a new worker, or restored commits that may differ; not after a shrink
            self._hand_over(joining=False)
            done("state hand-over")
        self._regrouped_at = self.step
        seconds = time.perf_counter() - start
        # The job stands still from the moment the last worker asked: before it, the others were
        # ending their step, as the next step's first collective would have waited for them.
        self.resizes.append({"generation": gen, "from": before, "to": len(member.members), "cause": cause,
                             "step": self.step, "seconds": seconds,
                             "pause": seconds - phases.get(elastic.OTHERS_STEP, 0.0), "phases": phases})
        if runtime.current().topology.rank == 0:
            print(f"gradsync: generation {gen} regrouped, {before} -> {len(member.members)} workers after step "
                  f"{self.step}, in {self.resizes[-1]['seconds']:.2f} s ({cause.split(':')[0]})", flush=True)
        self.commit()  # the state to come back to (the step's own commit, which this replaces, is not timed either)

    def _hand_over(self, *, joining: bool) -> None:
        """Collective in a new generation: the worker with the newest state sends it to all (parameters,
        buffers, optimizer state, counters). Joiners have none, nor has a worker whose first commit
        failed; after a failure, survivors may differ by a step. Where no worker has a commit (a peer
        died in the job's first), the state is the start's, the same everywhere, and rank 0 sends it."""
        transport = runtime.current().transport
        newest = -1 if joining or self._commit is None else self.step
        seen = torch.full((runtime.current().topology.world_size,), -2, dtype=torch.int64)
        seen[self.rank] = newest
        transport.allreduce(seen, op="max", what="elastic: newest state")
        holders = [r for r, step in enumerate(seen.tolist()) if step == int(seen.max())]
        src = holders[0]
        sync = self.optimizer._gradsync
        member = elastic.current()
        if src != 0 or not member.any_new:  # with new workers, distribute() just broadcast rank 0's model
            transport.broadcast_tensors([*sync.model.parameters(), *sync.model.buffers()], src, what="elastic: model")
        extra = {"counters": self._counters(), "strategy": self.strategy_spec,
                 "policies": [p.state() for p in self.policies],
                 "monitors": [m.state() for m in (sync.observer or [])]}
        # Where every worker updates alike, every worker with the newest state holds the same one:
        # they share the sending. (Averaging strategies' workers differ: all take src's.)
        alike = sync.strategy.mean_over_workers and sync.strategy.state_location == "optimizer"
        got = elastic.share_state(self.optimizer, extra, src, holders if alike else None)
        self._load_counters(got["counters"])
        for policy, state in zip(self.policies, got["policies"]):
            policy.load_state(state)
        for m, state in zip(sync.observer or [], got["monitors"]):
            m.load_state(state)
        self.strategy_spec = got["strategy"]
        if member.any_new and self.strategy_spec is not None:  # everyone attached the script's strategy
            self.optimizer.switch_strategy(self.strategy_spec[0], **self.strategy_spec[1])
