"""Perplexity of a model on a few ordinary English paragraphs: a loader check in one number.

A checkpoint loaded wrong in a small way (q/k rows left in llama.cpp's interleaved RoPE order,
a transposed tensor, a wrong dequantisation) often still writes fluent short text, but its
perplexity on plain prose rises several-fold. A 135M-parameter model scores roughly 7-30 here.

The paragraphs were written for this project (no data set is downloaded).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

PARAGRAPHS = (
    "The village library opens at nine in the morning and closes at six in the evening. On Saturdays "
    "it stays open until noon, and a volunteer reads stories to the children who gather on the carpet "
    "near the window. Most people come to borrow novels or to use the computers, but a few older "
    "residents visit every day simply to read the newspaper and talk with their neighbours.",
    "To make a simple vegetable soup, start by chopping an onion, two carrots and a few sticks of "
    "celery. Warm some olive oil in a large pot, add the vegetables and cook them slowly for about ten "
    "minutes, until they are soft. Then pour in enough water or stock to cover them, add a pinch of salt, "
    "and let the soup simmer for half an hour before you serve it with fresh bread.",
    "Rain had been falling since the early afternoon, and by the time the train reached the city the "
    "streets were shining under the lights. She pulled her coat tighter, picked up her small suitcase "
    "and stepped onto the platform. Nobody was waiting for her, but she had expected that. She checked "
    "the address on the letter one more time and walked towards the exit.",
    "Regular exercise is one of the best things you can do for your health. Even a short walk every day "
    "can improve your mood, help you sleep better and lower the risk of heart disease. Doctors usually "
    "recommend at least two and a half hours of moderate activity each week, such as brisk walking, "
    "cycling or swimming, spread over several days.",
)


@torch.inference_mode()
def perplexity(model, token_sequences: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each sequence, with the
    model's no-cache reference forward (``forward_full``), log-softmax in float64."""
    total_nll, count = 0.0, 0
    for ids in token_sequences:
        ids = torch.tensor(list(ids), dtype=torch.long, device=model.device)  # (L,)
        logits = model.forward_full(ids).double()  # (L, vocab)
        log_probs = torch.log_softmax(logits[:-1], dim=-1)  # (L-1, vocab): position t predicts token t+1
        total_nll -= float(log_probs.gather(1, ids[1:, None]).sum())
        count += len(ids) - 1
    return math.exp(total_nll / count)


def paragraph_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(paragraph) for paragraph in PARAGRAPHS]
