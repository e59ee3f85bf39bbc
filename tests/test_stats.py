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
