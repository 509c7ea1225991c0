"""The one CUDA-graph wrapper (`flashrt_core.engine.graphs`): keyed captures replay what the body computes,
one pool, a moved buffer caught in debug, a failed capture cleaned up so the next one works."""
from __future__ import annotations

import pytest
import torch

from flashrt_core.engine.graphs import GraphSet, capture, warm_up

pytestmark = pytest.mark.gpu


def _buffers(seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"x": torch.randn(64, 96, device="cuda", generator=g) + 0.5,
            "w": torch.randn(96, 48, device="cuda", generator=g) + 0.5,
            "y": torch.zeros(64, 48, device="cuda")}


def _run(graphs: GraphSet, key, body) -> None:
    """Replay `key`, warmed up and captured on first use (what the engine and the runtime do)."""
    if key not in graphs:
        warm_up(body)
        graphs.capture(key, body)
    graphs.replay(key)


def test_keyed_graphs_replay_the_body_over_new_inputs_and_share_one_pool():
    buf = _buffers()
    graphs = GraphSet("cuda", addresses=lambda: {k: t.data_ptr() for k, t in buf.items()})

    def matmul():
        torch.matmul(buf["x"], buf["w"], out=buf["y"])

    def scaled():
        torch.mul(buf["x"][:, :48], 3.0, out=buf["y"])
    _run(graphs, "matmul", matmul)
    _run(graphs, "scaled", scaled)
    assert graphs.captures == 2 and set(graphs.keys()) == {"matmul", "scaled"}
    buf["x"].copy_(torch.randn(64, 96, device="cuda") - 0.25)  # new contents, same address
    _run(graphs, "matmul", matmul)  # (a replay: no new capture)
    torch.testing.assert_close(buf["y"], buf["x"] @ buf["w"], rtol=1e-4, atol=1e-4)
    graphs.replay("scaled")
    torch.testing.assert_close(buf["y"], buf["x"][:, :48] * 3.0, rtol=0, atol=0)
    assert graphs.captures == 2
    graphs.clear()
    assert len(graphs) == 0 and "matmul" not in graphs


def test_debug_replay_names_a_buffer_that_moved_since_capture():
    buf = _buffers(1)
    graphs = GraphSet("cuda", addresses=lambda: {k: t.data_ptr() for k, t in buf.items()}, debug=True)
    _run(graphs, "matmul", lambda: torch.matmul(buf["x"], buf["w"], out=buf["y"]))
    buf["w"] = buf["w"].clone()  # the graph still reads the old tensor
    with pytest.raises(RuntimeError, match="graph matmul: buffer 'w' moved since capture"):
        graphs.replay("matmul")
    graphs.debug = False  # (without debug the check is not made)
    graphs.replay("matmul")


def test_a_failed_capture_leaves_the_pool_usable():
    buf = _buffers(2)
    graphs = GraphSet("cuda")

    def fails():  # a body that raises part-way, after a kernel was recorded (a host sync inside a capture
        torch.add(buf["x"], 1.0, out=buf["y"])  # invalidates the CUDA context itself: torch cannot recover from
        raise RuntimeError("a body that fails part-way")  # that one, which is why the engines check first)
    with pytest.raises(RuntimeError, match="fails part-way"):
        graphs.capture("bad", fails)
    assert "bad" not in graphs and graphs.captures == 0
    _run(graphs, "good", lambda: torch.matmul(buf["x"], buf["w"], out=buf["y"]))
    torch.testing.assert_close(buf["y"], buf["x"] @ buf["w"], rtol=1e-4, atol=1e-4)


def test_capture_on_a_caller_stream_with_a_private_pool():
    buf = _buffers(3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.add(buf["x"], 1.0, out=buf["x"])  # warm-up
        graph = capture(lambda: torch.add(buf["x"], 1.0, out=buf["x"]), stream=side)
        before = buf["x"].clone()
        graph.replay()
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(buf["x"], before + 1.0, rtol=0, atol=0)
