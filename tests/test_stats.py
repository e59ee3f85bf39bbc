from hetero_sd.decoding.stats import Stats


def test_acceptance_statistics_from_known_steps():
    s = Stats(block_size=4)
    for accepted in [3, 0, 1, 3]:
        s.record_step(3, accepted)
    assert s.tau == (7 + 4) / 4  # accepted drafts plus one bonus token per step
    assert s.draft_acceptance_rate == 7 / 12
    assert s.acceptance_rate_per_position == [3 / 4, 2 / 4, 2 / 4]
    assert s.acceptance_length_histogram == {1: 1, 2: 1, 3: 0, 4: 2}
    d = s.to_dict()
    assert d["mean_acceptance_length"] == s.tau and "accepted_per_step" not in d


def test_autoregressive_tau_is_one():
    assert Stats(mode="autoregressive", block_size=1).tau == 1.0


def test_time_per_output_token_leaves_out_the_first_token():
    s = Stats(num_generated_tokens=11, ttft_s=0.5, total_s=1.5)
    assert s.tpot_s == 0.1  # ten tokens after the first, in the second after it
    assert s.to_dict()["tpot_s"] == s.tpot_s
    assert Stats(num_generated_tokens=1, ttft_s=0.5, total_s=0.5).tpot_s == 0.0  # no token after the first
