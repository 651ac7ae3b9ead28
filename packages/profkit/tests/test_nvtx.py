import sys
import types

import pytest
import torch
from torch import nn

from profkit import nvtx


def test_no_ranges_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert not nvtx.enabled()
    with nvtx.range("anything"):
        pass  # must not touch torch.cuda.nvtx, which a CPU build cannot use

    @nvtx.range("decorated")
    def f(x):
        return x + 1

    assert f(1) == 2


def test_range_as_context_manager_and_decorator(nvtx_sink):
    @nvtx.range("loss")
    def loss(x):
        """Doc."""
        return x * 2

    with nvtx.range("outer"):
        assert loss(3) == 6
    assert nvtx_sink.calls == [("push", "outer"), ("push", "loss"), ("pop", None), ("pop", None)]
    assert loss.__name__ == "loss" and loss.__doc__ == "Doc."
    with pytest.raises(ValueError, match="name="):
        nvtx.range("")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.ffn = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return self.ffn(self.attn(x))


def test_annotate_modules_nests_ranges_and_removes_hooks(nvtx_sink):
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 4)
    with nvtx.annotate_modules(model, lambda name, m: name.count(".") <= 1, prefix="model.") as names:
        model(x)
    assert names == ["0", "0.attn", "0.ffn", "1", "1.attn", "1.ffn"]
    assert nvtx_sink.pushed() == [f"model.{name}" for name in names]
    assert nvtx_sink.calls[:4] == [("push", "model.0"), ("push", "model.0.attn"), ("pop", None),
                                   ("push", "model.0.ffn")]
    assert nvtx_sink.balanced()
    before = len(nvtx_sink.calls)
    model(x)
    assert len(nvtx_sink.calls) == before  # hooks removed


def test_annotate_modules_by_name_and_unknown_name(nvtx_sink):
    model = Block()
    with nvtx.annotate_modules(model, ["ffn.1"]):
        model(torch.randn(1, 4))
    assert nvtx_sink.pushed() == ["ffn.1"]
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        with nvtx.annotate_modules(model, ["nope"]):
            pass


def test_annotate_modules_pops_when_forward_raises(nvtx_sink):
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(Boom())
    with nvtx.annotate_modules(model), pytest.raises(RuntimeError):
        model(torch.zeros(1))
    assert nvtx_sink.balanced()


@pytest.fixture
def fake_module(monkeypatch):
    """A module 'fakemodel' whose attention() calls its scores() and softmax() through globals."""
    module = types.ModuleType("fakemodel")
    exec(
        "def scores(q, k):\n    return q * k\n"
        "def softmax(s):\n    return s + 1\n"
        "def attention(q, k):\n    return softmax(scores(q, k))\n"
        "class Helper:\n"
        "    @staticmethod\n    def static(x):\n        return x - 1\n"
        "    @classmethod\n    def klass(cls, x):\n        return (cls.__name__, x)\n"
        "    def method(self, x):\n        return x * 10\n"
        "class Child(Helper):\n    pass\n",
        module.__dict__,
    )
    monkeypatch.setitem(sys.modules, "fakemodel", module)
    return module


def test_annotate_functions_wraps_calls_through_module_globals_and_restores(nvtx_sink, fake_module):
    original = fake_module.scores
    with nvtx.annotate_functions("fakemodel.scores", "fakemodel.softmax", names={"fakemodel.softmax": "sm"}):
        assert fake_module.attention(2, 3) == 7
    assert nvtx_sink.calls == [("push", "scores"), ("pop", None), ("push", "sm"), ("pop", None)]
    assert fake_module.scores is original
    fake_module.attention(2, 3)
    assert len(nvtx_sink.calls) == 4


def test_annotate_functions_restores_after_an_error(nvtx_sink, fake_module):
    original = fake_module.softmax
    with pytest.raises(KeyError), nvtx.annotate_functions("fakemodel.softmax"):
        raise KeyError("inside")
    assert fake_module.softmax is original


def test_annotate_methods_static_class_and_inherited(nvtx_sink, fake_module):
    Helper, Child = fake_module.Helper, fake_module.Child
    methods = ("fakemodel.Helper.static", "fakemodel.Helper.klass", "fakemodel.Child.method")
    with nvtx.annotate_functions(*methods):
        assert Helper.static(5) == 4
        assert Helper().static(5) == 4
        assert Child.klass(1) == ("Child", 1)
        assert Child().method(2) == 20
        assert "method" in vars(Child)
    assert nvtx_sink.pushed() == ["static", "static", "klass", "method"]
    assert "method" not in vars(Child)  # the override is gone, the base method shows through
    assert isinstance(vars(Helper)["static"], staticmethod)


def test_bad_dotted_names_are_named(fake_module):
    with pytest.raises(ValueError, match="'fakemodel.missing'"):
        with nvtx.annotate_functions("fakemodel.missing"):
            pass
    with pytest.raises(ValueError, match="not a dotted name"):
        with nvtx.annotate_functions("scores"):
            pass
    with pytest.raises(ValueError, match="no importable module"):
        with nvtx.annotate_functions("no_such_package_xyz.f"):
            pass
    with pytest.raises(ValueError, match="names has labels"):
        with nvtx.annotate_functions("fakemodel.scores", names={"fakemodel.softmax": "x"}):
            pass
    assert "scores" in vars(fake_module)
