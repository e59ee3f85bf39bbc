"""Schedules (overlap, pipeline), timelines and the draft-fault fallback: all must keep the target's
output exactly (T=0), and the machinery must actually run (hits, interleaving, fallbacks recorded)."""

from __future__ import annotations

import json

import pytest
import torch

from hetero_sd.cli import main
from hetero_sd.decoding.controller import Memory
from hetero_sd.decoding.loop import hypotheses
from hetero_sd.decoding.timeline import Timeline, chrome_trace

from .doubles import FaultyDraft, OracleDraft, with_draft

PROMPTS = ["Write a haiku about the sea.", "Give three tips for learning Python.", "What is 12 times 7?"]
MAX_NEW = 40


@pytest.fixture(scope="module")
def baselines(smollm_random):
    return {p: smollm_random.generate(p, max_new_tokens=MAX_NEW, speculative=False) for p in PROMPTS}


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_overlap_schedule_is_lossless(smollm_random, baselines, prompt):
    out = smollm_random.generate(prompt, max_new_tokens=MAX_NEW, schedule="overlap")
    assert out.stats.schedule == "overlap" and out.stats.predraft_steps > 0
    assert out.token_ids == baselines[prompt].token_ids


@pytest.mark.slow
def test_overlap_uses_a_right_guess_at_the_right_position(smollm_random, baselines):
    """The oracle is right for 5 tokens and has the truth as its second choice at the 6th, so the outcome
    (5 accepted, bonus = truth) is among the guesses. A pre-draft at a wrong position or for the wrong
    outcome would propose a misaligned block and accept fewer than 5."""
    base = baselines[PROMPTS[1]]
    oracle = OracleDraft(base.prompt_ids + base.token_ids, 16, smollm_random.target.config.vocab_size, correct=5)
    out = with_draft(smollm_random, oracle, "overlap").generate(PROMPTS[1], max_new_tokens=MAX_NEW)
    assert out.token_ids == base.token_ids
    assert out.stats.predraft_hits > 0
    assert set(out.stats.accepted_per_step[:-1]) == {5}


@pytest.mark.slow
def test_pipeline_matches_one_at_a_time_and_interleaves(smollm_random, baselines):
    outs = smollm_random.generate_many(PROMPTS, max_new_tokens=MAX_NEW, schedule="pipeline")
    assert [o.token_ids for o in outs] == [baselines[p].token_ids for p in PROMPTS]
    assert {o.stats.schedule for o in outs} == {"pipeline"}
    timeline = outs[0].stats.timeline
    assert all(o.stats.timeline is timeline for o in outs)
    spans = {r: [s for s in timeline.spans if s.request == r] for r in (0, 1)}
    # the second request started before the first ended: two requests in flight at once
    assert spans[1][0].start < spans[0][-1].end


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_draft_fault_finishes_on_the_target_without_losing_tokens(smollm_random, baselines, schedule, kind):
    prompt = PROMPTS[0]
    faulty = FaultyDraft(smollm_random.draft, at=4, kind=kind)
    out = with_draft(smollm_random, faulty, schedule).generate(prompt, max_new_tokens=MAX_NEW)
    assert out.token_ids == baselines[prompt].token_ids
    assert out.stats.fallback and ("injected" in out.stats.fallback or "non-finite" in out.stats.fallback)
    assert any("finishing this generation autoregressively" in n for n in out.stats.notes)
    assert 0 < out.stats.num_drafts < len(out.token_ids)


def test_hypotheses_rank_outcomes_by_the_drafts_probabilities():
    logits = torch.full((3, 6), -10.0)
    logits[0, 1], logits[0, 2] = 5.0, 4.0  # drafted 1; 2 is a close second
    logits[1, 3], logits[1, 4] = 5.0, -1.0
    logits[2, 5] = 5.0
    guesses = hypotheses(logits, [1, 3, 5], limit=3)
    assert guesses[0] == (0, 2)  # first draft rejected, bonus = its runner-up
    assert all(bonus != [1, 3, 5][j] for j, bonus in guesses)  # a rejected draft is never the bonus
    assert len(guesses) == 3


def test_timeline_overlap_and_trace():
    t = Timeline(origin=0.0)
    t.record("target", "verify", 0.0, 1.0)
    t.record("draft", "predraft", 0.5, 1.5)
    t.record("draft", "draft", 2.0, 2.5)
    assert t.concurrent_s() == pytest.approx(0.5)
    assert t.overlap_fraction == pytest.approx(0.5 / 1.5)
    assert t.wall_s() == pytest.approx(2.5)
    assert sum(t.sparkline("draft", width=5)) == pytest.approx(1.5 / 0.5)
    events = chrome_trace([("run", t)])["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {1, 2} and spans[1]["ts"] == pytest.approx(0.5e6)


def test_bench_schedules_and_trace(tmp_path, tiny_llama, tiny_draft):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["t5 t9 t12", "t20 t7", "t33"]))
    out, trace = tmp_path / "bench.json", tmp_path / "trace.json"
    code = main(["bench", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--schedule", "sequential,overlap,pipeline", "--json", str(out),
                 "--trace", str(trace), "--block-size", "4"])  # a fixed block: the controller may decode plainly
    assert code == 0
    res = json.loads(out.read_text())
    rows = {r["schedule"]: r for r in res["schedules"]}
    assert set(rows) == {"sequential", "overlap", "pipeline"}
    for r in rows.values():
        assert {"schedule", "wall_s", "tau", "spec_tokens_per_s", "overlap_fraction", "lossless"} <= set(r)
        assert r["lossless"] is True
    assert rows["sequential"]["overlap_fraction"] == 0.0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"prefill", "verify", "draft", "predraft"}


def test_unknown_schedule_is_a_clear_error(tiny_llama, tiny_draft, capsys):
    code = main(["generate", "hi", "--target", str(tiny_llama), "--draft", str(tiny_draft), "--schedule", "fast"])
    assert code == 2
    assert "unknown schedule 'fast'" in capsys.readouterr().err


def test_placement_sweep_gives_one_row_per_placement_and_schedule(tiny_llama, tiny_draft, tmp_path):
    from hetero_sd.bench.experiments import placement_sweep

    table = placement_sweep(targets=[str(tiny_llama)], drafts=[str(tiny_draft), "random:1"], devices=["cpu/cpu"],
                            schedules=["sequential", "overlap"], prompts=["t5 t9 t12", "t20 t7"], max_new_tokens=8)
    assert [(r["draft"], r["schedule"]) for r in table.rows] == [
        (str(tiny_draft), "sequential"), (str(tiny_draft), "overlap"), ("random:1", "sequential"), ("random:1", "overlap")]
    assert all(r["lossless"] is True and r["tokens_per_s"] > 0 for r in table.rows)
    table.print()
    table.save(str(tmp_path / "sweep.json"))
    assert len(json.loads((tmp_path / "sweep.json").read_text())["rows"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sequential", "overlap", "pipeline"])
def test_the_controller_is_lossless_in_every_schedule(smollm_random, baselines, schedule):
    """block 'auto' with an untrained draft: the controller leaves speculation for plain decoding (and
    probes back now and then); the tokens stay the target's in every schedule."""
    # given costs, not measured ones: under a loaded machine a noisy measurement can make a verify look
    # cheaper than a decode step, and the controller would then (rightly) never decode plainly
    memory = Memory(given_costs(), smollm_random.draft.block_size, learn_costs=False)
    rt = with_draft(smollm_random, smollm_random.draft, "overlap" if schedule == "overlap" else "sequential",
                    "auto", memory)
    if schedule == "pipeline":
        outs = rt.generate_many(PROMPTS, max_new_tokens=MAX_NEW, schedule="pipeline")
    else:
        outs = [rt.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS[:2]]
    assert [o.token_ids for o in outs] == [baselines[p].token_ids for p in PROMPTS[:len(outs)]]
    assert all(o.stats.controller is not None for o in outs)
    assert sum(o.stats.plain_steps for o in outs) > 0 and sum(o.stats.num_drafts for o in outs) > 0


def given_costs():
    from hetero_sd.decoding.costs import Costs

    decode = 0.02  # a verify of k costs a little more than a decode step, a draft a fifth of one
    return Costs(decode_s=decode, verify_s={k: decode * (1 + 0.05 * k) for k in (2, 4, 8, 16)},
                 draft_s={b: 0.2 * decode for b in (2, 4, 8, 16)})

def test_cpu_lanes_run_waited_jobs_in_the_calling_thread(tiny_llama, tiny_draft):
    """The sequential schedule on CPU lanes keeps torch in the caller's thread (one OpenMP team: a team per
    lane thread throttles libgomp's spin-waits); overlap still uses the lane threads; the outputs agree."""
    import threading

    import hetero_sd
    from hetero_sd.decoding.lanes import Lane

    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft))
    lanes = (rt.target_lane, rt.draft_lane)
    before = [dict(lane.ran) for lane in lanes]
    seq = rt.generate([5, 6, 7, 8], max_new_tokens=24, schedule="sequential", block="fixed")
    assert all(lane.ran["thread"] == b["thread"] for lane, b in zip(lanes, before))
    assert all(lane.ran["inline"] > b["inline"] for lane, b in zip(lanes, before))
    ovl = rt.generate([5, 6, 7, 8], max_new_tokens=24, schedule="overlap", block="fixed")
    assert sum(lane.ran["thread"] - b["thread"] for lane, b in zip(lanes, before)) > 0
    assert ovl.token_ids == seq.token_ids

    lane, seen = Lane("x", "cpu"), []
    from hetero_sd.decoding.timeline import Timeline
    gate = threading.Event()
    first = lane.submit(lambda: (gate.wait(5), seen.append("first")), Timeline(), "a", 0, 0)
    second = lane.submit(lambda: seen.append("second"), Timeline(), "b", 0, 0)
    caller = threading.Thread(target=lambda: lane.submit(lambda: seen.append(threading.current_thread().name),
                                                         Timeline(), "c", 0, 0, wait=True).result())
    caller.start()
    gate.set()
    caller.join(), first.result(), second.result()
    # with jobs queued on the lane's thread, a waited job joins that queue: it cannot overtake them
    assert seen[:2] == ["first", "second"] and seen[2].startswith("hetero-sd-x"), seen
    lane.close()
    with pytest.raises(hetero_sd.errors.RuntimeClosedError):
        lane.submit(lambda: None, Timeline(), "d", 0, 0, wait=True)
