"""How the controller moves the workers to a new weight version after each train step: a refit (the exported
buckets), a relabel (the weights did not change), or the two halves around a transfer the trainer does itself;
and the validation runs that must finish on the old weights first.
Invariant: a refit completes on every live worker or fails naming the hung ones; a dead worker is refreshed
before its next request instead."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from screl.data.core import RolloutCore
from screl.data.core_types import Effects
from screl.rewards.stats import RewardStats

log = logging.getLogger("screl.controller.controller")  # the controller's own log: its warnings read as one

__all__ = ["Refits"]


class Refits:
    """The refit half of :class:`~screl.controller.controller.RolloutController` (its Ray methods)."""

    core: RolloutCore
    workers: list[Any]
    validation: Any
    latest_weights: list[Any] | None
    external_refit: bool
    reward_stats: RewardStats

    async def _execute(self, eff: Effects) -> None:
        raise NotImplementedError  # the controller runs a transition's effects

    async def _refit_workers(self, weights: list[Any], version: int, timeout_s: float = 600.0) -> None:
        """Push ``weights`` to every live worker within ``timeout_s``."""
        await self._on_live_workers(lambda w: w.update_weights.remote(weights, version), version, timeout_s,
                                    "load the weights of")

    async def _relabel_workers(self, version: int, timeout_s: float = 600.0) -> None:
        """Tell every live worker its unchanged weights now serve ``version`` (PPO's critic warmup)."""
        await self._on_live_workers(lambda w: w.set_version.remote(version), version, timeout_s,
                                    "relabel its weights as")

    async def _on_live_workers(self, call: Callable[[Any], Any], version: int, timeout_s: float, what: str) -> None:
        """``call`` on every live worker within ``timeout_s``: a dead or restarting one is refreshed before its
        next request, one that hangs fails the refit naming it."""
        import ray

        async def one(w: Any) -> Any:
            return await call(w)

        live = [i for i in range(len(self.workers)) if i not in self.core.dead]
        calls = {i: asyncio.ensure_future(one(self.workers[i])) for i in live}
        if not calls:  # every worker is dead for good: the pump's WorkersLostError reaches the trainer next
            return
        _, pending = await asyncio.wait(calls.values(), timeout=timeout_s)
        if pending:
            for t in pending:
                t.cancel()
            hung = [i for i, t in calls.items() if t in pending]
            raise TimeoutError(f"generation worker(s) {hung} did not {what} version {version} within "
                               f"{timeout_s:.0f} s (data.init_args.step_timeout_s): a hung engine, see the workers' "
                               "logs (screl fit --verbose)")
        for worker_index, task in calls.items():
            res = task.exception()
            if isinstance(res, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                self.core.metrics["refit_skipped"] = self.core.metrics.get("refit_skipped", 0) + 1
                log.warning("screl: worker %d missed the refit to version %d (%s); it is refreshed before its "
                            "next request", worker_index, version, type(res).__name__)
            elif isinstance(res, BaseException):
                raise res

    async def complete_step(self, weights: list[Any] | None, timeout_s: float = 600.0,
                            in_place: bool = False) -> dict[str, Any]:
        """The open step's optimizer update is done: retire it, bump the version, refit the workers (after the
        validation of the old weights, if one runs, has finished: at most ``timeout_s``). ``in_place``: the
        engines decode with the trainer's own module (colocated), so the new weights are already theirs and the
        refit is the relabel."""
        version = await self.begin_refit(timeout_s)
        t0 = time.perf_counter()
        if weights is not None:
            self.latest_weights = weights
            await self._refit_workers(weights, version, timeout_s)
        else:  # the policy did not change (PPO critic warmup), or changed in place: the label moves
            await self._relabel_workers(version, timeout_s)
        return await self.end_refit(time.perf_counter() - t0, refitted=weights is not None or in_place)

    async def begin_refit(self, timeout_s: float = 600.0) -> int:
        """The first half of :meth:`complete_step`, for a trainer that moves the weights itself (vLLM's NCCL
        transfer): retire the step, wait for the validation of the old weights; returns the version to serve."""
        await self._execute(self.core.complete_step())
        if self.validation is not None:  # its tokens must all come from the weights it validates
            await self.validation.wait(timeout_s)
        return self.core.trainer_version

    def use_external_refit(self) -> None:
        """The trainer moves the weights (NCCL): a restarted worker, outside the weight group, fails the run."""
        self.external_refit = True

    async def end_refit(self, refit_s: float, refitted: bool = True) -> dict[str, Any]:
        """The second half of :meth:`complete_step`: the workers serve the new version."""
        await self._execute(self.core.refit_done(refit_s, refitted=refitted))
        runner, version = self.validation, self.core.trainer_version
        if runner is not None and runner.due(version, final=self.core.train_steps >= self.core.max_steps):
            runner.start(version)
        return {"trainer_version": version, "aborted": self.core.last_aborted,
                "validation": runner.take() if runner is not None else [],
                "rewards": self.reward_stats.take()}  # train/rewards/<name>/mean and /std (screl.rewards)

    async def validation_idle(self, timeout_s: float = 600.0) -> None:
        """Wait for the running validation, if any (a colocated engine validates before it stands down: the
        weights it validates change in the train step)."""
        if self.validation is not None:
            await self.validation.wait(timeout_s)

    async def finish_validation(self, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        """The end of training: validate the final weights (``val_at_end``) if not done yet, wait for every
        validation, and hand the trainer the results it has not had."""
        runner = self.validation
        if runner is None:
            return []
        if runner.at_end and runner.due(self.core.trainer_version, final=True):
            runner.start(self.core.trainer_version)
        await runner.wait(timeout_s)
        return runner.take()
