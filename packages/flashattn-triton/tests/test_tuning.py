"""Planning and the tuning cache on the CPU: candidates as a pure function, choices kept on disk across
processes, tuning off, and never inside a CUDA graph capture or a compile trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flashattn_triton import _configs, _dispatch, _tuning
from flashattn_triton._configs import ForwardConfig, Problem, candidates

pytest.importorskip("triton")

CPU = torch.device("cpu")
CANDIDATES = [ForwardConfig(64, 64, 4, 3), ForwardConfig(64, 128, 4, 3), ForwardConfig(128, 64, 8, 2)]
PROBLEM = Problem("fwd", 8, 2048, 2048, 64, torch.bfloat16, True, "tf32", 132)


class Timings:
    """A stand-in for TuningCache._time: fixed times per candidate index, and a count of the tunings."""

    def __init__(self, *times: float) -> None:
        self.times = times
        self.tunings = 0

    def __call__(self, run, listed):
        self.tunings += 1
        return {c: t for c, t in zip(listed, self.times, strict=True)}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHATTN_TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "1")
    return tmp_path


def choose(cache: _tuning.TuningCache, timings: Timings, monkeypatch, problem: Problem = PROBLEM):
    monkeypatch.setattr(cache, "_time", timings)
    return cache.choose(lambda config: None, CANDIDATES, problem, CPU)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHATTN_TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert _tuning.cache_dir() == tmp_path / "mine" / f"v{_tuning.FORMAT}"
    monkeypatch.delenv("FLASHATTN_TRITON_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _tuning.cache_dir() == tmp_path / "xdg" / "flashattn_triton" / f"v{_tuning.FORMAT}"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _tuning.cache_dir() == tmp_path / "home" / ".cache" / "flashattn_triton" / f"v{_tuning.FORMAT}"


def test_the_fastest_is_chosen_and_a_fresh_process_reuses_it_without_timing(cache_dir, monkeypatch):
    first = Timings(3.0, 1.0, 2.0)
    assert choose(_tuning.TuningCache(), first, monkeypatch) == CANDIDATES[1]
    (path,) = cache_dir.glob("v*/*.json")
    entries = json.loads(path.read_text())
    assert [entry["config"]["block_n"] for entry in entries.values()] == [128]
    fresh = Timings(1.0, 3.0, 2.0)  # another process would time them otherwise
    assert choose(_tuning.TuningCache(), fresh, monkeypatch) == CANDIDATES[1]
    assert fresh.tunings == 0


def test_near_ties_go_to_the_earlier_candidate(cache_dir, monkeypatch):
    """Timings within TIE of the fastest are noise: the default order decides, the same in every process."""
    assert choose(_tuning.TuningCache(), Timings(1.005, 1.0, 2.0), monkeypatch) == CANDIDATES[0]
    other = Problem("fwd", 8, 8192, 8192, 64, torch.bfloat16, True, "tf32", 132)
    assert choose(_tuning.TuningCache(), Timings(1.05, 1.0, 2.0), monkeypatch, other) == CANDIDATES[1]


def test_one_choice_serves_a_size_class(cache_dir, monkeypatch):
    cache = _tuning.TuningCache()
    timings = Timings(3.0, 1.0, 2.0)
    choose(cache, timings, monkeypatch)
    same_class = Problem("fwd", 7, 1500, 1500, 64, torch.bfloat16, True, "tf32", 132)
    assert choose(cache, timings, monkeypatch, same_class) == CANDIDATES[1] and timings.tunings == 1
    assert candidates(same_class) == candidates(PROBLEM)


def test_tuning_off_runs_the_default_and_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "0")
    timings = Timings(3.0, 1.0, 2.0)
    assert choose(_tuning.TuningCache(), timings, monkeypatch) == CANDIDATES[0]
    assert timings.tunings == 0 and not list(cache_dir.rglob("*.json"))


@pytest.mark.parametrize("where", ["cuda-graph-capture", "compile-trace"])
def test_no_tuning_inside_a_capture_or_a_trace(cache_dir, monkeypatch, where):
    if where == "cuda-graph-capture":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    cache = _tuning.TuningCache()
    timings = Timings(3.0, 1.0, 2.0)
    assert choose(cache, timings, monkeypatch) == CANDIDATES[0]
    assert timings.tunings == 0 and not list(cache_dir.rglob("*.json"))
    monkeypatch.undo()
    monkeypatch.setenv("FLASHATTN_TRITON_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "1")
    assert choose(cache, timings, monkeypatch) == CANDIDATES[1] and timings.tunings == 1  # later, outside


def test_calls_never_tune_unless_asked(cache_dir, monkeypatch):
    """Unset, FLASHATTN_TRITON_AUTOTUNE leaves an unknown class on its default (a first call never waits for
    tuning); a choice an earlier tuning kept is still used."""
    monkeypatch.delenv("FLASHATTN_TRITON_AUTOTUNE")
    timings = Timings(3.0, 1.0, 2.0)
    assert choose(_tuning.TuningCache(), timings, monkeypatch) == CANDIDATES[0] and timings.tunings == 0
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "1")
    assert choose(_tuning.TuningCache(), timings, monkeypatch) == CANDIDATES[1] and timings.tunings == 1
    monkeypatch.delenv("FLASHATTN_TRITON_AUTOTUNE")
    assert choose(_tuning.TuningCache(), Timings(1.0, 3.0, 2.0), monkeypatch) == CANDIDATES[1]


def test_entries_of_other_processes_are_kept_and_stale_ones_ignored(cache_dir, monkeypatch):
    cache = _tuning.TuningCache()
    path = cache.file(CPU)
    path.parent.mkdir(parents=True)
    stale = {"config": {"block_m": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}, "times_ms": {}}
    name = "|".join(map(str, PROBLEM.size_key))
    path.write_text(json.dumps({"another|problem": {"config": {}}, name: stale}))
    assert choose(cache, Timings(3.0, 2.0, 1.0), monkeypatch) == CANDIDATES[2]
    entries = json.loads(path.read_text())
    assert set(entries) == {"another|problem", name} and entries[name]["config"]["block_m"] == 128
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_a_choice_made_among_other_candidates_is_tuned_again(cache_dir, monkeypatch):
    """A cached choice holds only for the candidates it was chosen among: one that a later release adds
    (as a faster kernel) is timed, not skipped for the old choice."""
    assert choose(_tuning.TuningCache(), Timings(3.0, 1.0, 2.0), monkeypatch) == CANDIDATES[1]
    more = [*CANDIDATES, ForwardConfig(64, 64, 4, 2)]
    for tunings_expected in (1, 0):  # a fresh process: tuned again; the next one reuses that choice
        cache, timings = _tuning.TuningCache(), Timings(3.0, 1.0, 2.0, 0.5)
        monkeypatch.setattr(cache, "_time", timings)
        assert cache.choose(lambda config: None, more, PROBLEM, CPU) == more[3]
        assert timings.tunings == tunings_expected


def test_a_torn_file_is_tuned_again_and_rewritten(cache_dir, monkeypatch):
    cache = _tuning.TuningCache()
    path: Path = cache.file(CPU)
    path.parent.mkdir(parents=True)
    path.write_text('{"half a')
    assert choose(cache, Timings(3.0, 1.0, 2.0), monkeypatch) == CANDIDATES[1]
    assert len(json.loads(path.read_text())) == 1


def test_deterministic_backward_candidates_have_no_atomics():
    problem = Problem("bwd", 64, 8192, 8192, 64, torch.bfloat16, True, "tf32", 132, hopper=True)
    assert any(c.atomic_dq for c in candidates(problem)) and any(c.hopper for c in candidates(problem))
    exact = dataclasses.replace(problem, deterministic=True, hopper=False)  # (the table's: SM90_BACKWARD)
    assert candidates(exact) and not any(c.atomic_dq or c.hopper for c in candidates(exact))
    assert exact.size_key != problem.size_key
    assert _dispatch.why_not(_dispatch.GLUON, dataclasses.replace(SM90_BACKWARD, deterministic=True))


# The Description of a large causal bf16 backward on an sm_90 GPU, in (B, H, T, d) memory.
SM90_BACKWARD = _dispatch.Description("bwd", (9, 0), True, True, torch.bfloat16, 64, 8192, 8192,
                                      ("bhtd",) * 5, window=(-1, 0))


def test_dropout_problems_run_no_gluon_kernels_and_small_ones_add_no_dq_atomically():
    """The Gluon kernels have no dropout; a small problem with dropout, like one without, adds dQ up without
    atomics (so its gradients repeat bitwise under torch.manual_seed), and a deterministic one never."""
    for pass_name in ("fwd", "bwd"):
        described = dataclasses.replace(SM90_BACKWARD, pass_name=pass_name, layouts=("bhtd",) * 3)
        assert _dispatch.choose(described) == _dispatch.GLUON
        assert _dispatch.why_not(_dispatch.GLUON, dataclasses.replace(described, dropout=True)) == "dropout"
        large = Problem(pass_name, 64, 8192, 8192, 64, torch.bfloat16, True, "tf32", 132, hopper=True)
        dropout = dataclasses.replace(large, dropout=True, hopper=False)
        assert not any(c.hopper for c in candidates(dropout)) and dropout.size_key != large.size_key
    small = Problem("bwd", 8, 4096, 4096, 64, torch.bfloat16, True, "tf32", 132, dropout=True)
    assert small.small and not any(c.atomic_dq for c in candidates(small))
    assert any(c.atomic_dq for c in candidates(dataclasses.replace(small, batch_heads=64)))
    assert not any(c.atomic_dq for c in candidates(dataclasses.replace(small, deterministic=True)))


def test_hopper_backward_candidates_follow_the_default_with_the_head_dims_own():
    """The Gluon backward's candidates come after the Triton-language default, those of its head dim: at
    d = 128 32-row steps (transposed scores) and 64-row ones (query-major), below it 64-row steps (d <= 64
    shares 64's)."""
    for head_dim, steps in ((128, {32, 64}), (64, {64}), (32, {64}), (16, {64})):
        problem = Problem("bwd", 32, 4096, 4096, head_dim, torch.bfloat16, True, "tf32", 132, hopper=True,
                          group=8)  # fmt: skip
        listed = candidates(problem)
        gluon = [c for c in listed if c.hopper]
        assert not listed[0].hopper and gluon == listed[-len(gluon):], head_dim
        assert {c.block_m for c in gluon} == steps and all(c.block_n == 128 for c in gluon), head_dim
        assert not any(c.hopper for c in candidates(dataclasses.replace(problem, hopper=False)))


def test_programs_a_kv_head_are_offered_to_grouped_problems_without_causal_masks():
    """A program a K/V head's key tile runs its group's query heads in turn: offered (the query-major
    d = 128 kernels) where every key tile has the same work, so grouped-query attention without a causal
    mask or band, and never with groups of one."""
    full = Problem("bwd", 32, 4096, 4096, 128, torch.bfloat16, False, "tf32", 132, hopper=True, group=8)
    per_kv_head = [c for c in candidates(full) if c.per_kv_head]
    assert per_kv_head and all(c.hopper and not c.persistent and c.block_m == 64 for c in per_kv_head)
    for other in (dict(is_causal=True), dict(band_span=1024), dict(group=1), dict(head_dim=64)):
        assert not any(c.per_kv_head for c in candidates(dataclasses.replace(full, **other))), other


def test_grouped_problems_are_offered_hopper_kernels_where_supported_and_tune_apart():
    """Grouped-query attention (K/V heads shared by a group of query heads) is offered the Gluon kernels
    where _dispatch takes it (Problem.hopper), and keeps its tuned choice apart from
    attention without groups, by the group's size class."""
    problem = Problem("bwd", 64, 8192, 8192, 64, torch.bfloat16, True, "tf32", 132, hopper=True)
    grouped = dataclasses.replace(problem, group=8)
    assert any(c.hopper for c in candidates(grouped))
    assert not any(c.hopper for c in candidates(dataclasses.replace(grouped, hopper=False)))
    assert problem.size_key != grouped.size_key
    assert dataclasses.replace(grouped, group=5).size_key == grouped.size_key
    assert dataclasses.replace(grouped, group=2).size_key != grouped.size_key


def test_small_problems_are_offered_split_key_tiles_by_size_class():
    one_head = Problem("fwd", 1, 4000, 4000, 64, torch.bfloat16, True, "tf32", 132)
    assert one_head.small and any(c.kv_splits > 1 for c in candidates(one_head))
    many_heads = Problem("fwd", 64, 4000, 4000, 64, torch.bfloat16, True, "tf32", 132)
    assert not any(c.kv_splits > 1 for c in candidates(many_heads))
    assert _configs.size_class(4000) == 4096 and _configs.size_class(4096) == 4096


def test_bands_tune_apart_and_get_split_key_tiles_only_where_their_span_is_long():
    """A band (sliding window) is tuned apart from the full problem and by its span's size class; the
    Gluon kernels are its candidates where _dispatch takes it (a causal window); split key tiles
    are offered by the keys a query tile walks, its band's span rather than Tk."""
    full = Problem("fwd", 64, 8192, 8192, 64, torch.bfloat16, True, "tf32", 132, hopper=True)
    band = dataclasses.replace(full, band_span=1025)
    assert any(c.hopper for c in candidates(band))
    assert not any(c.hopper for c in candidates(dataclasses.replace(band, hopper=False)))
    assert band.size_key != full.size_key
    assert band.size_key != dataclasses.replace(full, band_span=4097).size_key
    assert band.size_key == dataclasses.replace(full, band_span=2000).size_key
    one_head = Problem("fwd", 1, 8192, 8192, 64, torch.bfloat16, True, "tf32", 132)
    assert any(c.kv_splits > 1 for c in candidates(dataclasses.replace(one_head, band_span=4096)))
    assert not any(c.kv_splits > 1 for c in candidates(dataclasses.replace(one_head, band_span=200)))


def test_candidates_are_timed_in_interleaved_rounds_and_keep_their_best(monkeypatch):
    """Round after round over every candidate (not one candidate's runs after another's, which let the GPU's
    clock ramp decide), each keeping its fastest GPU time; one that fails is dropped with a warning."""
    order = []
    scripted = {0: iter([5.0, 1.0, 1.0]), 1: iter([2.0, 2.0, 2.0])}

    def gpu_milliseconds(fn, rep_ms):
        index = fn()
        order.append(index)
        if index == 2:
            raise RuntimeError("this build is broken")
        return next(scripted[index])

    monkeypatch.setattr(_tuning, "gpu_milliseconds", gpu_milliseconds)
    with pytest.warns(RuntimeWarning, match="failed while tuning"):
        times = _tuning.TuningCache._time(CANDIDATES.index, CANDIDATES)
    assert order == [0, 1, 2] + [0, 1] * (_tuning.ROUNDS - 1)
    assert times == {CANDIDATES[0]: 1.0, CANDIDATES[1]: 2.0}


def test_an_unwritable_cache_warns_and_the_choice_still_holds(cache_dir, monkeypatch):
    def replace(source, destination):
        raise PermissionError("a read-only file system")

    monkeypatch.setattr(_tuning.os, "replace", replace)
    cache = _tuning.TuningCache()
    timings = Timings(3.0, 1.0, 2.0)
    with pytest.warns(RuntimeWarning, match="could not write the tuning cache"):
        assert choose(cache, timings, monkeypatch) == CANDIDATES[1]
    assert choose(cache, timings, monkeypatch) == CANDIDATES[1] and timings.tunings == 1
    assert not list(cache_dir.rglob("*.tmp"))


def test_bands_dropout_and_groups_each_tune_apart():
    """The size key holds a band's span class, dropout and the group's class side by side: each, and all
    three together, keep a tuned choice of their own."""
    problem = Problem("fwd", 64, 4096, 4096, 64, torch.bfloat16, True, "tf32", 132)
    variants = ({}, {"band_span": 256}, {"dropout": True}, {"group": 4},
                {"band_span": 256, "dropout": True, "group": 4})  # fmt: skip
    assert len({dataclasses.replace(problem, **v).size_key for v in variants}) == len(variants)
