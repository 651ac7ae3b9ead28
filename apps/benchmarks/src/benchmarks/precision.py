"""Mixed precision: what accumulating in low precision costs, and which dtypes autocast produces.

1. Accumulation: sum 0.01 a thousand times (exact answer 10) with float32 and float16 accumulators
   and float16 addends.
2. Autocast: the dtype of the parameters, of each layer's output, of the logits, the loss and the
   gradients of a small Linear-ReLU-LayerNorm-Linear model under float16 and bfloat16 autocast.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from benchmarks.common import device, make_parser, parse_args, print_table, save_results

TOUR_ARGS: list[str] = []


def accumulate(accumulator: torch.dtype, addend: torch.dtype, upcast: bool, steps: int = 1000) -> float:
    """sum of `steps` copies of 0.01 held in `addend`, added into an `accumulator`-typed total."""
    total = torch.tensor(0.0, dtype=accumulator)
    for _ in range(steps):
        x = torch.tensor(0.01, dtype=addend)
        total += x.to(accumulator) if upcast else x
    return total.item()


def accumulation_table() -> pd.DataFrame:
    cases = [
        ("float32", "float32", False),
        ("float16", "float16", False),
        ("float32", "float16", False),
        ("float32", "float16 upcast to float32", True),
    ]
    rows = []
    for acc_name, addend_name, upcast in cases:
        result = accumulate(getattr(torch, acc_name), torch.float16 if "16" in addend_name else torch.float32,
                            upcast)
        rows.append({"accumulator": acc_name, "addend": addend_name, "sum": result,
                     "abs error": abs(result - 10.0)})
    return pd.DataFrame(rows)


class ToyModel(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def autocast_dtypes(dtype: torch.dtype, dev: torch.device) -> dict[str, str]:
    """The dtype of every intermediate of one training step of ToyModel under autocast(dtype)."""
    model = ToyModel(16, 4).to(dev)
    seen: dict[str, str] = {}
    for name in ("fc1", "relu", "ln", "fc2"):
        getattr(model, name).register_forward_hook(
            lambda _m, _i, out, name=name: seen.__setitem__(f"{name} output", str(out.dtype)))
    x = torch.randn(8, 16, device=dev)
    target = torch.randint(0, 4, (8,), device=dev)
    with torch.autocast(device_type=dev.type, dtype=dtype):
        seen["parameters (inside autocast)"] = str(model.fc1.weight.dtype)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, target)
    loss.backward()
    seen["logits"] = str(logits.dtype)
    seen["loss"] = str(loss.dtype)
    seen["gradients"] = ", ".join(sorted({str(p.grad.dtype) for p in model.parameters()}))
    return seen


def autocast_table(dev: torch.device) -> pd.DataFrame:
    columns = {str(dtype).removeprefix("torch."): autocast_dtypes(dtype, dev)
               for dtype in (torch.float16, torch.bfloat16)}
    df = pd.DataFrame(columns)
    return df.rename_axis("tensor").reset_index()


def main(argv: list[str] | None = None) -> None:
    parser = make_parser("precision", __doc__)
    args = parse_args(parser, argv)
    acc = accumulation_table()
    print_table(acc, "Summing 0.01 one thousand times (exact: 10)", float_format="{:.6f}")
    save_results(acc, "precision_accumulation", args)
    dev = device()
    dtypes = autocast_table(dev)
    print_table(dtypes, f"dtypes under autocast on {dev.type}")
    save_results(dtypes, "precision_autocast", args)


if __name__ == "__main__":
    main()
