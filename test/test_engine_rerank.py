"""flashrt_core.engine.rerank: the act stage's deferred GEMMs ranked again by the act graph's own time, on a stand-in picker
whose "act graph" cost disagrees with its isolated timings (as the down projection's did on the H200)."""
import torch

from flashrt_core.engine import rerank as R
from flashrt_core.engine.tuning import TuningCache

A, B, C, D, E = (64, 512, 0, 8, 1), (64, 128, 4, 4, 4), (32, 128, 8, 4, 4), (32, 512, 0, 4, 1), (16, 128, 0, 4, 1)
DOWN = (50, (1024, 4096), False, False, torch.bfloat16, "defer")
O = (50, (1024, 2048), False, False, torch.bfloat16, "defer")
GATE_UP = (50, (8192, 1024), False, True, torch.bfloat16)  # not deferred: never re-ranked


class Picker:
    cache_name = "linear"

    def __init__(self):
        self.choices = {DOWN: A, O: A, GATE_UP: C}
        self.timings = {
            DOWN: {"(64, 512, 0, 8, 1)": 5.21e-3, "(64, 128, 4, 4, 4)": 5.74e-3, "(32, 128, 8, 4, 4)": 5.21e-3,
                   "(32, 512, 0, 4, 1)": 5.31e-3, "(16, 128, 0, 4, 1)": 9.9e-3, "cublas": 8.5e-3,
                   "(8, 8, 8, 8, 8)": 1e-3, "(16, 256, 1, 4, 4)": "mismatch: disagrees with cuBLAS"},
            O: {"(64, 512, 0, 8, 1)": 3.23e-3, "(32, 128, 8, 4, 4)": 3.6e-3, "cublas": 7.1e-3},
            GATE_UP: {"(32, 128, 8, 4, 4)": 7.6e-3}}

    def candidates_for(self, fusion, kdim=None):
        assert fusion.defer and kdim in (2048, 4096)
        return [A, B, C, D, E, (16, 256, 1, 4, 4)]  # (8, 8, 8, 8, 8) is no longer offered


# the act graph's ms for each shape's configuration (the others add a constant)
GRAPH = {DOWN: {A: 6.06, B: 5.87, C: 5.96, D: 6.17, None: 6.6}, O: {A: 6.05, C: 6.32, None: 6.7}}


def graph_ms(picker, calls):
    def run():
        calls.append(dict(picker.choices))
        return sum(GRAPH[k][picker.choices[k]] for k in (DOWN, O)) - 6.0
    return run


def test_candidates_start_with_the_own_choice_then_the_isolated_ranking():
    p = Picker()
    assert R.deferred_keys(p) == [DOWN, O]
    assert R.candidates(p, DOWN, 4) == [A, C, D, B]  # (8, 8, ...) not offered, the mismatch never counts
    assert R.candidates(p, O, 4) == [A, C, None]


def test_rerank_keeps_the_fastest_act_graph_and_the_cache_replays_it(tmp_path):
    p, calls = Picker(), []
    cache = TuningCache(tmp_path / "t.json", {"gpu": "stand-in"})
    timed = R.rerank(p, cache, graph_ms(p, calls), top=4)
    assert p.choices == {DOWN: B, O: A, GATE_UP: C}  # down: 4 splits beat its isolated pick in the graph
    assert set(timed) == {DOWN, O} and len(calls) == 4 + 3
    assert timed[DOWN][str(B)] < timed[DOWN][str(A)]
    # a restarted engine: the cache decides, nothing is timed again
    q, again = Picker(), []
    assert R.rerank(q, TuningCache(tmp_path / "t.json", {"gpu": "stand-in"}), graph_ms(q, again)) == {}
    assert again == [] and q.choices == p.choices
    # a cached choice the picker no longer offers is timed again
    cache.put(R.cache_name(p), DOWN, (8, 8, 8, 8, 8), {})
    r, third = Picker(), []
    R.rerank(r, cache, graph_ms(r, third), top=4)
    assert r.choices[DOWN] == B and len(third) == 4


def test_a_shape_without_isolated_timings_is_left_alone():
    p, calls = Picker(), []
    p.timings[O] = {"from_cache": True}  # (nothing to rank the o projection's candidates by)
    timed = R.rerank(p, None, graph_ms(p, calls), top=4)
    assert set(timed) == {DOWN} and len(calls) == 4 and p.choices[O] == A


def test_a_failing_candidate_is_skipped_and_all_failing_keeps_the_own_choice():
    p = Picker()

    def flaky():
        if p.choices[DOWN] == B:
            raise RuntimeError("out of shared memory")
        return sum(GRAPH[k][p.choices[k]] for k in (DOWN, O))
    timed = R.rerank(p, None, flaky, top=4)
    assert p.choices[DOWN] == C and timed[DOWN][str(B)].startswith("failed: RuntimeError")

    q = Picker()

    def broken():
        raise RuntimeError("no graph")
    timed = R.rerank(q, None, broken, top=3)
    assert q.choices == Picker().choices and all(str(t).startswith("failed") for t in timed[DOWN].values())
