"""The hf engine's sampler means what vLLM's knobs mean (pure units on hand-made logits)."""

from __future__ import annotations

import torch

from common.wire.http import SamplingParams
from common.generation.sampling import VLLMSampler, finish_row


def choose(sampler: VLLMSampler, ids: list[list[int]], logits: list[list[float]]) -> list[int]:
    out = sampler(torch.tensor(ids), torch.tensor(logits))
    assert ((out == 0) | torch.isinf(out)).all() and ((out == 0).sum(-1) == 1).all()  # one-hot choice
    return out.argmax(-1).tolist()


def test_temperature_zero_is_greedy_and_ignores_top_k_and_top_p():
    s = SamplingParams(temperature=0, top_k=1, top_p=0.1, max_tokens=1)
    assert choose(VLLMSampler(s, [0], 1, torch.device("cpu")), [[0]], [[0.1, 3.0, 2.9, -1.0]]) == [1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_but_not_padding():
    s = SamplingParams(temperature=0, repetition_penalty=2.0, max_tokens=1)
    # row 0: token 1 was seen -> 3.0/2 = 1.5 < 2.0: token 2 wins. Row 1: token 1 only in the padding -> unpenalised.
    sampler = VLLMSampler(s, pads=[0, 1], batch=2, device=torch.device("cpu"))
    assert choose(sampler, [[1, 0], [1, 0]], [[0.0, 3.0, 2.0, -5.0], [0.0, 3.0, 2.0, -5.0]]) == [2, 1]
    sampler = VLLMSampler(s, pads=[0], batch=1, device=torch.device("cpu"))
    assert choose(sampler, [[3]], [[-2.0, -2.5, -9.0, -1.5]]) == [0]  # -1.5 * 2 = -3.0 < -2.0


def test_top_k_and_top_p_keep_only_the_allowed_tokens_and_a_seed_fixes_the_draw():
    logits = [[5.0, 4.9, 1.0, 0.0, -1.0]]
    for k in range(30):
        top_k = VLLMSampler(SamplingParams(temperature=1.0, top_k=2, seed=k, max_tokens=1), [0], 1, torch.device("cpu"))
        assert choose(top_k, [[0]], logits)[0] in (0, 1)
        top_p = VLLMSampler(SamplingParams(temperature=1.0, top_p=0.5, seed=k, max_tokens=1), [0], 1, torch.device("cpu"))
        assert choose(top_p, [[0]], logits)[0] == 0  # token 0 alone holds > 50% of the mass
    a = [choose(VLLMSampler(SamplingParams(temperature=1.0, seed=7, max_tokens=1), [0], 1, torch.device("cpu")),
                [[0]], [[0.0] * 50]) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_top_k_zero_or_negative_is_off():
    seen = set()
    for k in range(200):
        s = SamplingParams(temperature=1.0, top_k=-1, seed=k, max_tokens=1)
        seen |= set(choose(VLLMSampler(s, [0], 1, torch.device("cpu")), [[0]], [[0.0, 0.0, 0.0, 0.0]]))
    assert seen == {0, 1, 2, 3}


class _Tok:
    """decode = one character per id (chr(96 + id)); id 0 = turn end."""

    def decode(self, ids, **_):
        return "".join("<E>" if i == 0 else chr(96 + i) for i in ids)


def test_finish_row_keeps_the_turn_end_token_cuts_stop_strings_and_reports_length():
    tok = _Tok()
    stop = finish_row(tok, [1], [1, 2, 0, 5, 5], [0], SamplingParams(max_tokens=5), pad_id=5)
    assert (stop.token_ids, stop.text, stop.finish_reason) == ([1, 2, 0], "ab", "stop")
    cut = finish_row(tok, [1], [1, 2, 3, 4], [0], SamplingParams(max_tokens=4, stop=["bc"]), pad_id=5)
    assert (cut.token_ids, cut.text, cut.finish_reason) == ([1, 2, 3], "a", "stop")
    length = finish_row(tok, [1], [1, 2, 3], [0], SamplingParams(max_tokens=3), pad_id=5)
    assert (length.token_ids, length.text, length.finish_reason) == ([1, 2, 3], "abc", "length")
