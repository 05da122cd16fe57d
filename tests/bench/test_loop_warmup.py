"""Every loop of the train_loop and tiered scenarios starts warm: untimed warm-up steps run before
each loop's timed steps, the first loop (the reference without checkpoints) included. Checked
through the order of the trainer's calls, not through times."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import fastdcp.bench.tiered as tiered
import fastdcp.bench.training_loop as tl
from fastdcp.bench.config import config_from_args
from fastdcp.bench.results import Recorder
from fastdcp.bench.scenarios import Context, Progress
from fastdcp.bench.systems import STANDIN_ENV, resolve_systems

STEPS, EVERY = 3, 3
TINY = ["--size", "1MiB", "--train-steps", str(STEPS), "--train-every", str(EVERY), "--repeats", "2", "--no-shm",
        "--train-batch", "4", "--train-devices", "cpu"]


def _ctx(tmp_path: Path) -> Context:
    cfg = config_from_args([*TINY, "--dir", str(tmp_path), "--systems", "stock"])
    (tmp_path / "t").mkdir()
    return Context(cfg=cfg, systems=resolve_systems(["stock"], notes=[]), targets={"dir": str(tmp_path / "t")},
                   recorder=Recorder(), progress=Progress(io.StringIO()), cold_method=None)


def _record_events(monkeypatch: pytest.MonkeyPatch, module) -> list:
    """Events in call order: ("loop", system) when a loop starts, ("warm-up", n) when its warm-up
    starts, "step" for every forward pass (warm-up or timed), ("timed", n) with the timed steps
    the loop reported when it returned."""
    events: list = []
    real_warm, real_fb, real_loop = tl.SyntheticTraining.warm_up, tl.SyntheticTraining.forward_backward, module.run_loop

    def warm_up(self, n):
        events.append(("warm-up", n))
        return real_warm(self, n)

    def forward_backward(self):
        events.append("step")
        return real_fb(self)

    def run_loop(trainer, steps, every, system, *args, **kwargs):
        events.append(("loop", system.name if system else None))
        run = real_loop(trainer, steps, every, system, *args, **kwargs)
        events.append(("timed", len(run.step_seconds)))
        return run

    monkeypatch.setattr(tl.SyntheticTraining, "warm_up", warm_up)
    monkeypatch.setattr(tl.SyntheticTraining, "forward_backward", forward_backward)
    monkeypatch.setattr(module, "run_loop", run_loop)
    return events


def _loops(events: list) -> list[list]:
    """The events of each loop, from its ("loop", ...) to its ("timed", ...)."""
    out, cur = [], None
    for e in events:
        if isinstance(e, tuple) and e[0] == "loop":
            cur = [e]
        elif cur is not None:
            cur.append(e)
            if isinstance(e, tuple) and e[0] == "timed":
                out.append(cur)
                cur = None
    return out


@pytest.mark.parametrize("scenario", ["train_loop", "tiered"])
def test_every_loop_is_warmed_up_before_its_timed_steps(tmp_path, monkeypatch, scenario):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    module = tl if scenario == "train_loop" else tiered
    events = _record_events(monkeypatch, module)
    ctx = _ctx(tmp_path)
    (tl.run_train_loop if scenario == "train_loop" else tiered.run_tiered)(ctx, ["dir"])
    loops = _loops(events)
    # the reference loop without checkpoints and stock's, interleaved per repeat
    names = [loop[0][1] for loop in loops]
    assert names[0] is None and names.count(None) == 2 and len(loops) >= 4, names
    for loop in loops:
        # the warm-up first, before any step of the loop; then the timed steps, which the loop
        # reports without the warm-up's
        assert loop[1][0] == "warm-up" and loop[1][1] >= 1, loop
        warm, timed = loop[1][1], loop[-1][1]
        assert timed == STEPS
        assert loop.count("step") == warm + timed
        assert all(e == "step" for e in loop[2:2 + warm])
    # the first timed step of the run comes after a warm-up
    first_loop = events.index(("loop", None))
    assert events[first_loop + 1][0] == "warm-up"
    rows = [r for r in ctx.recorder.results if r.scenario == scenario]
    field = "warmup_seconds" if scenario == "train_loop" else "warmup_s"
    assert rows and all(x > 0 for r in rows for x in r.extra.get(field, [])), rows
    assert any(r.extra.get(field) for r in rows)
