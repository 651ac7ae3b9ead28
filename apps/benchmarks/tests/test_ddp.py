import argparse
import math

import pytest

from benchmarks.common import read_results
from benchmarks.ddp import float_list, main, runs_from


def test_bucket_sizes_make_one_bucketed_run_each_in_strategy_order():
    runs = runs_from(["naive", "bucketed", "torch"], [1.0, 10.0])
    assert runs == (("naive", None), ("bucketed", 1.0), ("bucketed", 10.0), ("torch", None))


@pytest.mark.parametrize("bad", ["", "a", "-1", "inf"])
def test_bucket_sizes_must_be_non_negative_numbers(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        float_list(bad)


def test_every_strategy_trains_on_two_ranks_and_is_compared_with_one(tmp_path):
    main(["--strategy", "all", "--bucket-mb", "0,1", "--size", "tiny", "--batch", "2", "--context", "32",
          "--warmup", "1", "--steps", "2", "--nproc", "2", "--results-dir", str(tmp_path)])
    df, meta = read_results(next(tmp_path.glob("*/ddp.csv")))
    assert list(df["strategy"]) == ["single", "naive", "flat", "overlap", "bucketed", "bucketed", "torch"]
    assert df["bucket MiB"].tolist()[4:] == [0.0, 1.0, 25.0]
    assert (df["step ms"] > 0).all()
    single = df["step ms"][0]
    assert df["x single"].tolist() == pytest.approx((df["step ms"] / single).tolist())
    assert df["exposed comm ms"][1:].tolist() == pytest.approx((df["step ms"][1:] - single).tolist())
    ours = df["strategy"].isin(["naive", "flat", "overlap", "bucketed"])
    assert (df["finish wait ms"][ours] >= 0).all()
    assert df["finish wait ms"][~ours].apply(math.isnan).all()  # single and torch have no finish step
    assert meta["ranks"] == "2" and meta["model"] == "tiny"


def test_nproc_must_be_positive():
    with pytest.raises(SystemExit):
        main(["--nproc", "0", "--no-save"])
