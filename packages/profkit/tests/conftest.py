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
