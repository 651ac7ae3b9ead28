import pytest

from profkit import nvtx


class RecordingSink:
    """Stands in for torch.cuda.nvtx: records pushes and pops."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def range_push(self, msg: str) -> None:
        self.calls.append(("push", msg))

    def range_pop(self) -> None:
        self.calls.append(("pop", None))

    def pushed(self) -> list[str]:
        return [name for op, name in self.calls if op == "push"]

    def balanced(self) -> bool:
        depth = 0
        for op, _ in self.calls:
            depth += 1 if op == "push" else -1
            if depth < 0:
                return False
        return depth == 0


@pytest.fixture
def nvtx_sink(monkeypatch):
    sink = RecordingSink()
    monkeypatch.setattr(nvtx, "_sink", lambda: sink)
    return sink


def _chrome_event(name, start_ms, end_ms, tid=1, cat="cpu_op", **args):
    """A complete ("X") Chrome trace event from start to end, in ms."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 10, "tid": tid, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


@pytest.fixture
def chrome_event():
    return _chrome_event


def _training_step(model, optimizer, x):
    """step(phase): forward, backward and optimizer phases of a mean-square loss."""

    def step(phase):
        optimizer.zero_grad()
        with phase("forward"):
            loss = model(x).square().mean()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()

    return step


@pytest.fixture
def training_step():
    return _training_step
