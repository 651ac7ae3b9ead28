"""Gradient averaging for the DDP wrappers: buckets reduced in a fixed order, finished inside backward.

Every rank issues the same collectives in the same order: buckets are launched strictly in
bucket order, each as soon as it and every bucket before it are complete, or all at the end of
backward for the strategies that do not overlap. The buckets first fill in reverse parameter
order, roughly the order backward produces gradients; after the first averaged backward they are
rebuilt, once, in the order it produced them (rank 0's, on every rank), as torch DDP does: a
parameter registered in another order than forward uses it would otherwise hold back its bucket,
and every bucket after it, until the end of backward.

When autograd has computed every gradient, a callback queued on the engine launches what is
left (a parameter without a gradient counts as zeros), waits for every bucket and writes the
averages into ``.grad``, so ``loss.backward()`` returns with averaged gradients, as with torch
DDP.

Each averaged backward is a round of collectives that every rank completes, even one whose
forward or backward raised: an *open* flag before the first bucket (which ranks take part) and
a *close* flag after the last (which ranks completed their backward). A rank that did not finish
its last averaged backward (an exception it caught, or no backward at all) completes the round
at its next forward with zeros and a "skipped" mark. Unless every rank skipped the round, every
rank then raises: the ones that completed it when their backward ends, the others at that
forward. No rank steps with gradients averaged over different iterations, and the collectives
stay matched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minddp.backward_callback import queue_at_end_of_backward
from minddp.buckets import Bucket, assign_buckets_in_order

CommHook = Callable[[Any, Any], torch.futures.Future]


class Reducer:
    """Averages the gradients of ``named_params`` over ``process_group``, in ``buckets`` (lists of indices).

    Per iteration: :meth:`prepare_for_backward` at a forward whose backward is to be averaged,
    then the parameters' post-accumulate-grad hooks, then the end-of-backward callback.
    ``rebuild_limits``: the bucket limits (see :func:`~minddp.buckets.assign_buckets`) to rebuild the
    buckets with after the first averaged backward, in the order it produced the gradients (torch
    DDP's rebuild; not with ``find_unused_parameters``, as in torch); ``None`` keeps ``buckets``.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], buckets: list[list[int]],
                 process_group: dist.ProcessGroup, average_in_collective: bool, overlap: bool,
                 gradient_as_bucket_view: bool, find_unused_parameters: bool,
                 comm_device: torch.device, rebuild_limits: Sequence[float] | None = None) -> None:
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.buckets = self.make_buckets(buckets)
        self.rebuild_limits = rebuild_limits
        # The parameters in the order their gradients arrive, during averaged backward passes until the
        # first one completes; None once the buckets were rebuilt in that order, or when they never are.
        self.ready_order: list[int] | None = (
            [] if rebuild_limits is not None and not find_unused_parameters else None)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.average_in_collective = average_in_collective  # the backend has ReduceOp.AVG
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.comm_device = comm_device
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.divisor = self.world_size  # fewer under join(divide_by_initial_world_size=False)
        self.rank = dist.get_rank(process_group)
        # Per iteration.
        self.expecting = False  # a forward asked for this backward's gradients to be averaged
        self.averaged = False  # they were, since the last forward
        self.opened: tuple[torch.Tensor, dist.Work] | None = None  # this round's open flags, in flight
        self.reset()
        # The hooks hold the reducer weakly, and go away with it: a dropped wrapper leaves no hooks behind.
        this = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(_grad_ready_hook(this, i))
                   for i, p in enumerate(self.params)]
        weakref.finalize(self, _remove_hooks, handles)

    # --- the iteration ----------------------------------------------------------------------

    def prepare_for_backward(self) -> None:
        """A forward whose backward is to be averaged (after :meth:`settle_last_round`)."""
        self.expecting, self.averaged = True, False

    def settle_last_round(self) -> None:
        """At every forward: if this rank did not finish its last averaged backward, complete that round.

        The forward or the backward raised (and the caller went on), or no backward ran. If no
        rank opened the round, one flag settles it; otherwise the buckets this rank did not
        launch go out as zeros, and the close flag says this rank skipped. Unless every rank
        skipped, this raises (the ranks that completed the round raise at its end, in
        :meth:`finish`).
        """
        if not self.expecting:
            return
        self.expecting = False
        if self.opened is None:
            self.open_round(taking_part=False)
            if not any(self.read_open()):  # nobody began this backward: e.g. a forward under grad mode alone
                self.reset()
                return
        self.shadow_buckets(self.buckets[self.next_to_launch:])
        skipped = self.close_round(completed=False)[1]
        self.reset()
        if len(skipped) < self.world_size:
            raise RuntimeError(
                f"rank {self.rank} skipped its last averaged step after an exception in its forward or "
                f"backward pass (or ran forward without backward), while rank(s) "
                f"{_ranks(set(range(self.world_size)) - skipped)} completed it: that step's gradients were "
                f"not averaged over every rank, and every rank raises this error. {_SKIP_ADVICE}")

    def reset(self) -> None:
        """No gradient arrived, no bucket launched: waits for any launched by a backward that then failed."""
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
                bucket.pending = bucket.reduced = None
            bucket.remaining = len(bucket.params)
        self.arrived = [False] * len(self.params)
        if self.ready_order:  # a backward that failed: the next one records the order afresh
            self.ready_order.clear()
        self.next_to_launch = 0
        self.finish_queued = False
        if self.opened is not None:
            self.opened[1].wait()
            self.opened = None

    def accumulate_locally(self) -> None:
        """A forward under ``no_sync()``: its backward accumulates gradients without communicating."""
        self.averaged = False

    def first_gradient(self, index: int) -> bool:
        """The first gradient of a backward pass (parameter ``index``'s): whether this backward's gradients
        are to be averaged; if so, the averaging is queued for its end."""
        if not self.expecting:
            if self.averaged:
                raise RuntimeError(
                    f"parameter {self.names[index]!r} got a second gradient after this iteration's "
                    "gradients were averaged: run forward again before another backward, or, to "
                    "accumulate several backward passes, run all but the last forward inside no_sync()")
            return False
        self.queue_finish()
        return True

    def launch_ready(self) -> None:
        """Launch, in order, the complete buckets that are next (the hooks call it when one completes)."""
        buckets = self.buckets
        while self.next_to_launch < len(buckets) and buckets[self.next_to_launch].remaining == 0:
            self.launch(buckets[self.next_to_launch])

    def queue_finish(self) -> None:
        """Have the backward pass now running average the gradients before it returns (once per pass)."""
        if self.expecting and not self.finish_queued:
            queue_at_end_of_backward(self.finish)
            self.finish_queued = True

    def launch(self, bucket: Bucket) -> None:
        if self.opened is None:
            self.open_round(taking_part=True)
        bucket.pending = self.communicate(bucket, bucket.gather())
        self.next_to_launch += 1

    def finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, store the averages."""
        if self.opened is None:
            self.open_round(taking_part=True)
        for bucket in self.buckets[self.next_to_launch:]:
            self.launch(bucket)
        used, skipped = self.close_round(completed=True, local_used=[p.grad is not None for p in self.params])
        missing = [] if all(self.arrived) else [
            name for name, arrived in zip(self.names, self.arrived, strict=True) if not arrived]
        for bucket in self.buckets:
            bucket.scatter(self.wait(bucket.pending, bucket.reduced), used)
        self.rebuild_buckets(skipped)
        self.reset()
        self.expecting, self.averaged = False, True
        if skipped:
            raise RuntimeError(
                f"rank(s) {_ranks(skipped)} skipped this step after an exception in their forward or "
                "backward pass (or ran forward without backward): this step's gradients are not averaged "
                f"over every rank, and every rank raises this error. {_SKIP_ADVICE}")
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient in this backward pass: "
                f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}. With "
                "find_unused_parameters=False (the default, as in torch DDP) every trainable parameter "
                "must take part in the loss on every rank; pass find_unused_parameters=True if some "
                "ranks or steps leave parameters unused")

    def shadow_backward(self, divide_by_initial_world_size: bool) -> None:
        """On a rank that has joined: the collectives of a backward pass, contributing zeros.

        They must use the same reduction as the ranks still training: those divide by the world
        size, or by how many of them are left (fewer than the world size, while one has joined).
        """
        self.divisor = self.world_size if divide_by_initial_world_size else 1
        self.open_round(taking_part=True)
        self.shadow_buckets(self.buckets)
        skipped = self.close_round(completed=True)[1]
        self.rebuild_buckets(skipped)  # as the ranks still training do at this round's end
        self.reset()

    def shadow_buckets(self, buckets: list[Bucket]) -> None:
        """The collectives of ``buckets``, contributing zeros; waits for them."""
        pending = []
        for bucket in buckets:
            zeros = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
            pending.append((self.communicate(bucket, zeros), zeros))
        for work, zeros in pending:
            self.wait(work, zeros)

    def make_buckets(self, buckets: list[list[int]]) -> list[Bucket]:
        """Buckets of the parameters at ``buckets``' indices, in that order; each parameter's is noted."""
        made = [Bucket(b, [self.params[i] for i in indices], [self.names[i] for i in indices], indices,
                       self.gradient_as_bucket_view) for b, indices in enumerate(buckets)]
        owner = {i: bucket for bucket in made for i in bucket.indices}
        self.bucket_of = [owner[i] for i in range(len(self.params))]
        return made

    def rebuild_buckets(self, skipped: set[int]) -> None:
        """Rebuild the buckets in the order the gradients arrived (one broadcast, once): rank 0's order on
        every rank, so their collectives match; a parameter that got no gradient comes last. Not after a
        round some rank skipped (every rank knows it: all rebuild or none), nor once rebuilt.

        The gradients of the old buckets stay where they are (still the ``.grad``); the next backward
        moves them into the new buffers as it fills them.
        """
        if self.ready_order is None or skipped:
            return
        assert self.rebuild_limits is not None
        arrived = set(self.ready_order)
        order = self.ready_order + [i for i in range(len(self.params) - 1, -1, -1) if i not in arrived]
        agreed = torch.tensor(order, dtype=torch.int64).to(self.comm_device)
        dist.broadcast(agreed, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        self.buckets = self.make_buckets(
            assign_buckets_in_order(self.params, agreed.tolist(), self.rebuild_limits))
        self.ready_order = None

    # --- the round's agreement ----------------------------------------------------------------

    def open_round(self, taking_part: bool) -> None:
        """The round's first collective (asynchronous): which ranks begin this backward."""
        flags = self.rank_flags([], taking_part)
        self.opened = flags, dist.all_reduce(flags, group=self.process_group, async_op=True)

    def read_open(self) -> list[int]:
        assert self.opened is not None
        flags, work = self.opened
        work.wait()
        return flags.tolist()

    def close_round(self, completed: bool, local_used: list[bool] | None = None
                    ) -> tuple[list[bool] | None, set[int]]:
        """The round's last collective: which ranks completed it and, with ``find_unused_parameters``, which
        parameters some rank has a gradient for (``local_used``: those with one here; ``None``: none).
        Returns (the parameters used anywhere, or None without find_unused_parameters; the ranks that
        skipped the round)."""
        used = (local_used or [False] * len(self.params)) if self.find_unused_parameters else []
        flags = self.rank_flags(used, completed)
        dist.all_reduce(flags, group=self.process_group)
        counts = flags.tolist()
        closed, opened = counts[len(used):], self.read_open()
        skipped = {r for r in range(self.world_size) if not (opened[r] and closed[r])}
        return ([c > 0 for c in counts[:len(used)]] if self.find_unused_parameters else None), skipped

    def rank_flags(self, used: list[bool], flag: bool) -> torch.Tensor:
        """``used``, then one slot per rank, this rank's holding ``flag``: summed over the ranks."""
        slots = [False] * self.world_size
        slots[self.rank] = flag
        return torch.tensor(used + slots, dtype=torch.int32).to(self.comm_device, non_blocking=True)

    # --- communication ----------------------------------------------------------------------

    def communicate(self, bucket: Bucket, flat: torch.Tensor) -> torch.futures.Future | dist.Work:
        """Start averaging ``flat``: the registered communication hook, or an all-reduce of the mean."""
        if self.comm_hook is not None:
            is_last = bucket.index == len(self.buckets) - 1
            future = self.comm_hook(self.comm_hook_state, bucket.for_hook(flat, is_last))
            if not isinstance(future, torch._C.Future):  # what torch.futures.Future and get_future() share
                raise TypeError(
                    f"the communication hook {_name_of(self.comm_hook)} returned a {type(future).__name__} "
                    f"for bucket {bucket.index}; a hook must return a torch.futures.Future of the reduced "
                    "flat tensor, e.g. dist.all_reduce(buffer, async_op=True).get_future(), or a future made "
                    "with torch.futures.Future() and set_result(tensor)")
            if not future.done():
                # A hook may chain collectives on its future (PowerSGD's run in its callbacks). NCCL
                # completes futures at launch, so those run here, in order; gloo completes them on its own
                # threads, where they would race with this thread's next collective, in a different order
                # on each rank.
                future.wait()
            return future
        if self.divisor == 1:
            # The sum is the average. NCCL's AVG would still run a scaling kernel over the bucket on its
            # own stream, while an in-place SUM over one rank launches nothing at all.
            return dist.all_reduce(flat, group=self.process_group, async_op=True)
        if self.average_in_collective and self.divisor == self.world_size:
            return dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)
        flat.div_(self.divisor)
        return dist.all_reduce(flat, group=self.process_group, async_op=True)

    def wait(self, pending: torch.futures.Future | dist.Work, flat: torch.Tensor) -> torch.Tensor:
        """The averaged tensor, once ``pending`` (a hook's future or an all-reduce of ``flat``) is done."""
        if self.comm_hook is None:
            pending.wait()
            return flat
        result = pending.wait()
        if not isinstance(result, torch.Tensor):
            raise TypeError("a communication hook must return a torch.futures.Future whose value is the "
                            f"bucket's reduced tensor; its future gave {type(result).__name__}")
        return result



_SKIP_ADVICE = ("Catch it on every rank and skip the optimizer step, as the rank(s) that raised first "
                "did; the next step works. To skip a batch on one rank, skip its forward as well, or give "
                "that rank zero loss.")


def _name_of(hook: CommHook) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def _ranks(ranks: set[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _grad_ready_hook(reducer: weakref.ref[Reducer], index: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``index``'s post-accumulate-grad hook: counts its gradient in, launches what that completes.

    It runs once per parameter per backward pass, so it does as little as it can: after the
    pass's first gradient (:meth:`Reducer.first_gradient`), a flag, a store and a counter (and,
    until the buckets are rebuilt, the gradient's place in the order).
    """
    def grad_ready(_param: torch.Tensor) -> None:
        alive = reducer()
        if alive is None or not (alive.finish_queued or alive.first_gradient(index)):
            return
        alive.arrived[index] = True
        if alive.ready_order is not None:
            alive.ready_order.append(index)
        bucket = alive.bucket_of[index]
        bucket.remaining -= 1
        if bucket.remaining == 0 and alive.overlap and bucket.index == alive.next_to_launch:
            alive.launch_ready()

    return grad_ready


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
