"""Run a function when the backward pass now running has computed every gradient."""

from __future__ import annotations

from collections.abc import Callable

from torch.autograd import Variable


def queue_at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has computed every gradient, before it returns.

    Call it from code that autograd runs during backward (a tensor hook, a post-accumulate-grad
    hook, a custom Function's backward). The engine runs queued callbacks after the last
    gradient of the graph, with the current stream synchronized with the streams that produced
    the gradients (this is how torch DDP finishes its reduction inside ``loss.backward()``). An
    exception raised by ``callback`` comes out of ``backward()``; if backward itself fails first,
    the callback does not run.
    """
    Variable._execution_engine.queue_callback(callback)
